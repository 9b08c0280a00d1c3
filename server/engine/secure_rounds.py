"""The round engine's one handle on secure aggregation: each training round's SecAgg+ parameters (who takes part,
the graph, the threshold, the integers' scale, the clip, each device's weight and DP noise share), the server's
state machine of the round (``server.engine.secure_aggregation``), and the step its unmasked sum makes.

Without DP a device sends p_i·clip_∞(Δ_i, R) with p_i its share of the round's samples (the server knows each
device's count from its JOIN); the step is Σ_{survivors} p_i·Δ_i / Σ_{survivors} p_i, the plain engine's
sample-weighted mean of the survivors' changes within n/(γ·Σp) a coordinate (``Quantizer.sum_error``). With DP
(``--dp-noise-multiplier z``) a device sends clip_2(Δ_i, C) plus Skellam noise of parameter μ/s, s the round's
minimum of survivors, max(t, ⌈n·t/(k + 1)⌉) (``GraphParameters.min_survivors``): the sum of at least s survivors
carries Sk(μ) with 2μ = (z·(γC + √d))², and the step is that sum / E (the fixed denominator of DP-FedAvg), charged
by ``accountant.SkellamAccountant``.
"""
from __future__ import annotations

import hashlib
import logging
import math
from typing import Any

import numpy as np

from device_runtime.dense_delta import dimension, unflatten
from device_runtime.secagg_client import SecureSpec
from device_runtime.secagg_noise import sensitivity, total_mu
from device_runtime.secagg_quantize import DP_UNITS, QuantizeError, dp_quantizer, plain_quantizer
from server.engine.accountant import SkellamAccountant
from server.engine.run_config import DpSettings, SecureSettings
from server.engine.secagg_parameters import parameters
from server.engine.secure_aggregation import SecAggServer

LOG = logging.getLogger("fedara.engine")


def dp_scale(clip: float, d: int) -> float:
    """γ under DP: C is max(DP_UNITS, 100·√d) integer units (``secagg_quantize.dp_quantizer``)."""
    return max(DP_UNITS, 100 * math.sqrt(d)) / clip


def dp_noise(privacy: DpSettings, d: int) -> tuple[float, float]:
    """(μ, Δ₂): the Skellam parameter the round's sum carries at least, and the integers' L2 sensitivity."""
    scale = dp_scale(privacy.clip, d)
    return total_mu(privacy.noise_multiplier, scale, privacy.clip, d), sensitivity(scale, privacy.clip, d)


def skellam_noise_multiplier_for(target_epsilon: float, rounds: int, join_ratio: float, delta: float,
                                 d: int) -> float:
    """The smallest z (to 0.1 %) whose ``rounds`` distributed rounds (``SkellamAccountant``) stay within the target:
    distributed DP's counterpart of ``accountant.noise_multiplier_for`` (μ does not depend on the clip: γC is fixed
    in units)."""
    def spent(z: float) -> float:
        mu, l2 = dp_noise(DpSettings(z, join_ratio, 2, 1.0), d)
        return SkellamAccountant(join_ratio, mu, l2, d, delta).epsilon_after(rounds)
    low, high = 1e-3, 1.0
    while spent(high) > target_epsilon:
        low, high = high, 2 * high
    while high - low > 1e-3 * high:
        mid = math.sqrt(low * high)
        low, high = (mid, high) if spent(mid) > target_epsilon else (low, mid)
    return high


class SecureRounds:
    """Secure aggregation across a run's rounds (see the module docstring)."""

    def __init__(self, settings: SecureSettings, dense_shapes: dict[str, tuple[int, ...]], run_id: str,
                 privacy: DpSettings | None = None):
        self.settings, self.dense_shapes, self.run_id, self.privacy = settings, dict(dense_shapes), run_id, privacy
        self.dimension = dimension(dense_shapes)
        self.server: SecAggServer | None = None
        self.failure: str | None = None  # why the open round cannot be aggregated securely (before any exchange)
        self._weights: dict[str, float] = {}
        self._spec: SecureSpec | None = None

    def open(self, round_index: int, participants: list[str], samples: dict[str, int]) -> None:
        """Set up a training round over ``participants`` (with their sample counts)."""
        self.server, self._spec, self.failure = None, None, None
        n, settings = len(participants), self.settings
        try:
            graph = parameters(n, settings.neighbors, settings.threshold, settings.dropout_rate, settings.corrupt_rate)
        except ValueError as exc:
            self.failure = f"round {round_index} cannot be aggregated securely: {exc}"
            LOG.warning(self.failure)
            return
        k, t = graph.neighbors, graph.threshold
        context = f"{self.run_id}|{round_index}".encode()
        seed = hashlib.sha256(b"fedara-secagg-round/" + context).digest()
        total = sum(samples[d] for d in participants)
        if self.privacy is None:
            spec_args = dict(min_survivors=t, quantizer=plain_quantizer(self.settings.coordinate_range, n),
                             clip=self.settings.coordinate_range, l2=False, noise_mu=0.0)
            self._weights = {d: samples[d] / total for d in participants}
        else:
            s = graph.min_survivors(n)
            mu, _ = dp_noise(self.privacy, self.dimension)
            clip, z = self.privacy.clip, self.privacy.noise_multiplier
            try:
                quantizer = dp_quantizer(clip, self.dimension, n,
                                         lambda g: n / s * total_mu(z, g, clip, self.dimension))
            except QuantizeError as exc:
                self.failure = f"round {round_index} cannot be aggregated securely: {exc}"
                LOG.warning(self.failure)
                return
            spec_args = dict(min_survivors=s, quantizer=quantizer, clip=clip, l2=True, noise_mu=mu / s)
            self._weights = dict.fromkeys(participants, 1.0)
        self._spec = SecureSpec(context, tuple(sorted(participants)), k, t, graph_seed=seed,
                                dense_shapes=self.dense_shapes, **spec_args)
        self.server = SecAggServer(self._spec, self.dimension)

    def spec_for(self, device_id: str) -> SecureSpec | None:
        """The secure part of a participant's task (None: the round is not secure)."""
        if self._spec is None or device_id not in self._weights:
            return None
        return self._spec.for_device(self._weights[device_id])

    def step(self, now: float, expected: float | None) -> dict[str, np.ndarray] | None:
        """The change to add to the global model from the round's unmasked sum (None: not aggregated, said once):
        the survivors' weighted mean change, or under DP their noised sum / ``expected`` (E)."""
        if self.server is None:
            return None
        total = self.server.finish(now)
        if total is None:
            self.failure = f"round not aggregated: {self.server.failure}"
            LOG.warning(self.failure)
            return None
        decoded = self._spec.quantizer.decode(total)
        if self.privacy is None:
            decoded = decoded / sum(self._weights[d] for d in self.server.masked)
        else:
            decoded = decoded / expected
        return unflatten(decoded, self.dense_shapes)

    def bound(self) -> float | None:
        """The open round's quantization bound on the mean's coordinates (no DP), or None."""
        if self.server is None or self.privacy is not None or not self.server.masked:
            return None
        return self._spec.quantizer.sum_error(len(self.server.masked)) / sum(self._weights[d] for d in self.server.masked)

    def summary(self) -> dict[str, Any]:
        """The metrics row's ``secagg`` object."""
        if self.server is None:
            return {"aggregated": False, "failure": self.failure, "survivors": 0, "dropped": 0, "recovered": 0,
                    "threshold": None}
        out = self.server.summary()
        out["min_survivors"] = self._spec.min_survivors
        if self.privacy is not None:
            out["noise_mu_per_device"] = self._spec.noise_mu
        else:
            out["quantization_bound"] = self.bound()
        return out
