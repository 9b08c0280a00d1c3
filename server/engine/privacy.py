"""User-level differential privacy of the shared model: DP-FedAvg on the reconstructed update (McMahan et al.,
ICLR 2018), with a fixed or an adaptive clip (Andrew et al., NeurIPS 2021). Central DP: the server is trusted.

What a round releases is ω + (Σ_i clip_C(Δ_i) + N(0, (z_Δ·C)²·I)) / E, where Δ_i = reconstruct(what device i
returned) − reconstruct(what it was sent), taken over every shared tensor as one vector (low-rank factors are
multiplied back first: noise on U and on V would multiply in U·Vᵀ, so the guarantee is put on the reconstructed
update), clip_C scales it onto the L2 ball of radius C, and E = q·N is the expected number of participants, a fixed
denominator (each participant counts once, whatever its sample count: a sample-weighted mean would let one device
weigh more than C/E). The devices are drawn by Poisson sampling with probability q: the sampling is part of the
mechanism (amplification), so it draws from the same secure generator as the noise, never from --seed.

The adaptive clip follows C towards the q_γ quantile of the update norms: C ← C·exp(−η·(b̄ − γ)), b̄ the noised share
of participants within the clip (its count gets noise of std σ_b = E/20 with sensitivity ½, Flower's default), and
the update's noise multiplier z_Δ = (z⁻² − (2σ_b)⁻²)^(−½) so that both releases together cost what one Gaussian
mechanism of multiplier z costs: the accountant (``server.engine.accountant``) charges z per round.

The guarantee covers what leaves the server: the shared model. Personal tensors (FedARA's and FedRep's heads)
never leave their device and are outside it, as is anything a device itself reveals. Noise comes from numpy's PCG64
seeded with 256 bits of ``secrets`` (the OS's generator); ``--dp-test-seed`` makes noise and sampling reproducible
and voids the guarantee (tests only). Floating-point Gaussian sampling has known side channels (Mironov, CCS 2012)
that this module does not address.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcore.lowrank import reconstruct_state
from device_runtime.dense_delta import dimension
from server.engine.accountant import Accountant, SkellamAccountant
from server.engine.run_config import DpSettings
from server.engine.secure_rounds import dp_noise


def noise_generator(test_seed: int | None = None) -> np.random.Generator:
    """The generator of a run's sampling and noise: seeded from the OS's secure source, unless a test fixes it."""
    return np.random.default_rng(secrets.randbits(256) if test_seed is None else [test_seed, 0x5EC])


def poisson_sample(ids: Sequence[str], rate: float, rng: np.random.Generator) -> list[str]:
    """Each id independently with probability ``rate`` (in the given order): the sampling the accountant charges."""
    draws = rng.random(len(ids))
    return [device_id for device_id, u in zip(ids, draws) if u < rate]


def l2_norm(tensors: dict[str, torch.Tensor]) -> float:
    """‖·‖₂ of every tensor taken as one vector, in float64."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def clip_factor(norm: float, clip: float) -> float:
    """The scale that brings a vector of L2 norm ``norm`` within ``clip`` (1 when it is within already)."""
    return 1.0 if norm <= clip else clip / norm


@dataclass
class ClippedSum:
    """One round's Σ clip_C(Δ_i) in float64, with the participants counted and those within the clip (what the
    adaptive clip learns from). Memory: one dense copy of the shared model, whatever the participant count."""

    clip: float
    sums: dict[str, torch.Tensor]
    count: int = 0
    within: int = 0

    @classmethod
    def zeros(cls, clip: float, shapes: dict[str, tuple[int, ...]]) -> ClippedSum:
        return cls(clip, {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()})

    def add(self, delta: dict[str, torch.Tensor]) -> float:
        """Add one participant's update, clipped to the round's clip; returns its norm before clipping."""
        if delta.keys() != self.sums.keys():
            raise ValueError(f"an update over {sorted(delta)} cannot add to a sum over {sorted(self.sums)}")
        norm = l2_norm(delta)
        scale = clip_factor(norm, self.clip)
        for key, value in delta.items():
            self.sums[key].add_(value.double(), alpha=scale)
        self.count += 1
        self.within += norm <= self.clip
        return norm

    def merge(self, other: ClippedSum) -> None:
        """Add another sum of the same round (an aggregator's partial: other participants, the same clip)."""
        if other.clip != self.clip or other.sums.keys() != self.sums.keys():
            raise ValueError(f"a clipped sum at clip {other.clip:g} over {sorted(other.sums)} cannot merge into one at "
                             f"clip {self.clip:g} over {sorted(self.sums)}")
        for key, value in other.sums.items():
            self.sums[key].add_(value.double())
        self.count += other.count
        self.within += other.within


class RoundChanges:
    """One round's Σ clip_C(Δ_i) with Δ_i = reconstruct(returned) − reconstruct(sent): the one per-device rule, run
    by the engine (``DpFedAvg``) and by each aggregator process over its share of the round (its partial)."""

    def __init__(self, clip: float, shapes: dict[str, tuple[int, ...]]):
        self.shapes = dict(shapes)
        self.total = ClippedSum.zeros(clip, self.shapes)
        self._sent: dict[Any, dict[str, torch.Tensor]] = {}

    def add(self, returned: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], plan: Any) -> float:
        """Add one accepted update: Δ = reconstruct(returned) − reconstruct(sent) (``sent`` reconstructed once per
        ``plan``), clipped; returns ‖Δ‖ before clipping."""
        if plan not in self._sent:
            self._sent[plan] = reconstruct_state(sent, self.shapes)
        before = self._sent[plan]
        dense = reconstruct_state(returned, self.shapes)
        return self.total.add({k: dense[k].double() - before[k].double() for k in self.shapes})


@dataclass(frozen=True)
class Release:
    """What a round releases: the noised mean update to add to the global model, and the clip it used."""

    delta: dict[str, torch.Tensor]
    clip: float
    participants: int


@dataclass
class Privacy:
    """A run's DP mechanism (see the module docstring): the sampling, the current clip, the noise."""

    settings: DpSettings
    shapes: dict[str, tuple[int, ...]]
    rng: np.random.Generator
    clip: float = field(init=False)

    def __post_init__(self) -> None:
        self.clip = self.settings.clip

    @classmethod
    def of(cls, settings: DpSettings, shapes: dict[str, tuple[int, ...]]) -> Privacy:
        return cls(settings, dict(shapes), noise_generator(settings.test_seed))

    def sample(self, ready: Sequence[str]) -> list[str]:
        """The round's participants among the ready devices (in their order): Poisson, rate --join-ratio."""
        return poisson_sample(ready, self.settings.join_ratio, self.rng)

    def open_round(self) -> ClippedSum:
        return ClippedSum.zeros(self.clip, self.shapes)

    def release(self, total: ClippedSum) -> Release:
        """The round's noised mean update, Σ clip(Δ_i)/E + N(0, (z_Δ·C/E)²), then the adaptive clip's step."""
        s = self.settings
        std = s.update_noise_multiplier * total.clip
        delta = {k: (v + torch.from_numpy(self.rng.normal(0.0, std, size=tuple(v.shape)))) / s.expected
                 for k, v in sorted(total.sums.items())}
        if s.clip_quantile is not None:
            noised = (total.within - total.count / 2 + self.rng.normal(0.0, s.count_stddev)) / s.expected + 0.5
            self.clip = total.clip * math.exp(-s.clip_lr * (noised - s.clip_quantile))
        return Release(delta, total.clip, total.count)

    def to_state(self) -> dict[str, Any]:
        """What a resumed run needs to go on with the same mechanism (the generator is re-seeded, securely)."""
        return {"clip": self.clip}

    def restore(self, state: dict[str, Any]) -> None:
        self.clip = float(state["clip"])


def noise_cause(settings: DpSettings, clip: float) -> str:
    """What the DP noise does to the model each round, named for a user whose run it wrecked: its std per
    coordinate z·C/E against the clip C that bounds a whole update, and what to change."""
    std = settings.update_noise_multiplier * clip / settings.expected
    return (f"the DP noise added to the model each round has std z·C/E = {settings.update_noise_multiplier:g}·{clip:g}/"
            f"{settings.expected:g} = {std:.3g} per coordinate, against updates clipped to norm C = {clip:g} in all: it "
            "swamps them; use more devices per round (E: --join-ratio, more devices), a smaller --dp-noise-multiplier "
            "(ε grows) or a smaller --dp-clip")


def finite(state: dict[str, torch.Tensor]) -> bool:
    """Whether every number of a model is finite."""
    return all(bool(torch.isfinite(t).all()) for t in state.values())


class DpFedAvg:
    """The round engine's one handle on DP: who a round samples, each accepted update clipped into the round's sum,
    the noised release that becomes the next global model, and the budget it spends (one round charged when it
    opens, whatever it then delivers)."""

    def __init__(self, settings: DpSettings, shapes: dict[str, tuple[int, ...]], distributed: bool = False):
        """``distributed``: under secure aggregation the devices add the noise (``server.engine.secure_rounds``) and
        the Skellam mechanism is charged; the server only samples, counts the budget and applies the noised sum."""
        self.settings = settings
        self.mechanism = Privacy.of(settings, shapes)
        if distributed:
            mu, l2 = dp_noise(settings, dimension(shapes))
            self.accountant: Accountant = SkellamAccountant(settings.join_ratio, mu, l2, dimension(shapes),
                                                            settings.run_delta, settings.target_epsilon)
        else:
            self.accountant = Accountant(settings.join_ratio, settings.noise_multiplier, settings.run_delta,
                                         settings.accountant, settings.target_epsilon)
        self._changes: RoundChanges | None = None

    def refusal(self) -> str | None:
        """Why the next training round may not open (the budget), or None."""
        return self.accountant.refusal()

    def sample(self, ready: Sequence[str]) -> list[str]:
        return self.mechanism.sample(ready)

    def open_round(self) -> None:
        self.accountant.charge()
        self._changes = RoundChanges(self.mechanism.clip, self.mechanism.shapes)

    @property
    def round_clip(self) -> float:
        """The open round's clip C (what aggregator processes clip to, in their brief)."""
        return self._changes.total.clip

    def add(self, returned: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], plan: Any) -> float:
        """Add one accepted update (``RoundChanges.add``); returns ‖Δ‖ before clipping."""
        return self._changes.add(returned, sent, plan)

    def merge(self, partial: ClippedSum) -> None:
        """Add an aggregator's partial Σ clip_C(Δ_i) over its share of the round's updates."""
        self._changes.total.merge(partial)

    def aggregate(self, global_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The next global model: ω + the round's noised mean update."""
        release = self.mechanism.release(self._changes.total)
        return {k: (v.double() + release.delta[k]).to(v.dtype) for k, v in global_state.items()}

    @property
    def epsilon(self) -> float:
        """ε spent so far, at the run's δ."""
        return self.accountant.spent

    def to_state(self) -> dict[str, Any]:
        return {"accountant": self.accountant.to_state(), "mechanism": self.mechanism.to_state()}

    @property
    def expected(self) -> float:
        """E, the fixed denominator of a round's mean change."""
        return self.settings.expected

    def restore(self, state: dict[str, Any]) -> None:
        self.accountant.restore(state["accountant"])
        self.mechanism.restore(state["mechanism"])


class BufferDp:
    """DP in the asynchronous mode (``server.engine.async_engine``): each buffer flush is one Gaussian mechanism.

    A version releases v + η_g·(Σ_{i in buffer} clip_C(Δ_i) + N(0, (z·C)²·I)) / K: at most K clipped changes, each
    device at most once per buffer (``add`` refuses a second; the engine gives no task to a device whose update
    waits in the buffer), a fixed denominator K (``settings.expected``: the engine builds the settings with rate 1
    and population K), noise once per flush. There is no sampling to amplify with: which devices fill a buffer
    depends on who is online and how fast they train, not on a random draw the accountant could charge, so each
    flush is charged as a plain Gaussian mechanism of multiplier z (``settings.join_ratio`` = 1) and ε composes over
    the versions released. The neighbouring relation is zero-out (one device's data replaced by data whose updates
    are zero, its participation unchanged; Kairouz et al. 2021): who trains when, and how often, is outside the
    guarantee. The clip is fixed (the flags refuse the adaptive one: its count assumes a sampled round)."""

    def __init__(self, settings: DpSettings, shapes: dict[str, tuple[int, ...]]):
        self.settings = settings
        self.mechanism = Privacy.of(settings, shapes)
        self.accountant = Accountant(settings.join_ratio, settings.noise_multiplier, settings.run_delta,
                                     settings.accountant, settings.target_epsilon)
        self._sum = self.mechanism.open_round()
        self.members: list[str] = []

    def refusal(self) -> str | None:
        """Why the next version may not be released (the budget), or None."""
        return self.accountant.refusal()

    def holds(self, device_id: str) -> bool:
        """Whether the device's update waits in the buffer (it may not add another before the flush)."""
        return device_id in self.members

    def add(self, device_id: str, delta: dict[str, torch.Tensor]) -> float:
        """Add one device's change Δ, clipped to C; returns ‖Δ‖ before clipping. A device counts once per buffer."""
        if self.holds(device_id):
            raise ValueError(f"{device_id} has an update in this buffer already: a device counts once per flush")
        norm = self._sum.add(delta)
        self.members.append(device_id)
        return norm

    def release(self) -> dict[str, torch.Tensor]:
        """The flush: (Σ clip(Δ_i) + N(0, (z·C)²)) / K, charged to the budget; the buffer starts empty again."""
        refusal = self.accountant.refusal()
        if refusal is not None:
            raise RuntimeError(refusal)
        self.accountant.charge()
        step = self.mechanism.release(self._sum).delta
        self._sum, self.members = self.mechanism.open_round(), []
        return step

    @property
    def epsilon(self) -> float:
        """ε spent so far (by the versions released), at the run's δ."""
        return self.accountant.spent

    def to_state(self) -> dict[str, Any]:
        return {"accountant": self.accountant.to_state(), "members": list(self.members), "count": self._sum.count,
                "within": self._sum.within}

    def sum_tensors(self) -> dict[str, np.ndarray]:
        """The buffer's clipped sum (float64), saved beside the model so a run resumed mid-buffer continues it."""
        return {k: v.numpy() for k, v in self._sum.sums.items()}

    def restore(self, state: dict[str, Any], sums: dict[str, np.ndarray] | None = None) -> None:
        self.accountant.restore(state["accountant"])
        self.members = list(state.get("members", []))
        self._sum.count, self._sum.within = state.get("count", 0), state.get("within", 0)
        for key, value in (sums or {}).items():
            self._sum.sums[key] = torch.from_numpy(np.array(value, dtype=np.float64))
