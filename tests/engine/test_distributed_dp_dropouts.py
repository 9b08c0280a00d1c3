"""Distributed DP when devices drop after sharing (``server.engine.secure_rounds`` with the devices' own
``secagg_client``): each device adds Sk(μ/s), s the round's minimum of survivors, so a round unmasked from any s to
n survivors carries at least the Skellam parameter μ the accountant charges, and a round with fewer is not unmasked.

The devices send zero changes, so the unmasked sum is the noise alone (stochastic rounding of 0 is exactly 0):
its per-coordinate variance is survivors · 2μ/s. The sample variance of d coordinates has a relative standard
error of about √(2/d) (Skellam of this μ is Gaussian to within 1/μ in its kurtosis), so 6√(2/d) is the tolerance."""
from __future__ import annotations

import math

import numpy as np
import pytest

from device_runtime.secagg_client import SecAggClient, secure_input
from server.engine.privacy import DpFedAvg
from server.engine.run_config import DpSettings, SecureSettings
from server.engine.secure_rounds import SecureRounds, dp_scale

IDS = tuple(f"dev_{i:02d}" for i in range(10))
D = 4000
SHAPES = {"w": (D,)}
PRIVACY = DpSettings(noise_multiplier=1.0, join_ratio=1.0, population=len(IDS), clip=0.5)
TOLERANCE = 6 * math.sqrt(2 / D)


def secure_round(dropped: frozenset[str]) -> tuple[SecureRounds, np.ndarray | None]:
    """One round of SecAgg+ under DP over IDS, the devices ``dropped`` lost after sharing; the noise the
    unmasked sum carries, in integer units (None: not aggregated)."""
    rounds = SecureRounds(SecureSettings(), SHAPES, "run", PRIVACY)
    rounds.open(1, list(IDS), dict.fromkeys(IDS, 50))
    server = rounds.server
    clients = {d: SecAggClient(d, rounds.spec_for(d)) for d in IDS}
    for d, c in clients.items():
        assert server.receive_keys(d, c.advertise()) is None
    keys = server.close_keys(1.0)
    for d, c in clients.items():
        assert server.receive_shares(d, c.share_keys(keys[d])) is None
    shares = server.close_shares(2.0)
    zero = {"w": np.zeros(D, dtype=np.float32)}
    rng = np.random.default_rng(7)
    for d, c in clients.items():
        y = c.masked_input(secure_input(zero, zero, c.spec, rng), shares[d])
        if d not in dropped:
            assert server.receive_masked(d, y) is None
    survivors = server.close_masked(3.0)
    for d in survivors:
        assert server.receive_unmasking(d, clients[d].unmask(survivors)) is None
    step = rounds.step(4.0, PRIVACY.expected)
    return rounds, None if step is None else step["w"] * PRIVACY.expected * dp_scale(PRIVACY.clip, D)


def test_the_noise_share_is_sized_for_the_rounds_minimum_of_survivors_and_charged_as_their_sum():
    rounds, _ = secure_round(frozenset())
    s, per_device = rounds.spec_for(IDS[0]).min_survivors, rounds.summary()["noise_mu_per_device"]
    accountant = DpFedAvg(PRIVACY, SHAPES, distributed=True).accountant
    assert 1 < s < len(IDS)  # the rule's s for 10 devices: some may drop
    assert s * per_device == pytest.approx(accountant.mu)  # what s shares guarantee is what is charged
    assert 2 * accountant.mu == pytest.approx((PRIVACY.noise_multiplier * accountant.l2) ** 2)  # z on Δ₂


@pytest.mark.parametrize("lost", [0, 2, 4])
def test_a_round_unmasked_from_s_to_n_survivors_carries_at_least_the_charged_noise(lost):
    """n = 10: the rule's s is 6, so losing 4 leaves exactly s survivors, whose sum carries exactly μ."""
    rounds, noise = secure_round(frozenset(IDS[:lost]))
    s, survivors = rounds.spec_for(IDS[0]).min_survivors, len(IDS) - lost
    mu = DpFedAvg(PRIVACY, SHAPES, distributed=True).accountant.mu
    assert s == 6 and survivors >= s and rounds.summary()["recovered"] == lost
    expected = survivors / s * 2 * mu  # the variance of Sk(survivors · μ/s): at least 2μ
    assert abs(float(noise.mean())) < 6 * math.sqrt(expected / D)
    assert float(noise.var()) / expected == pytest.approx(1.0, abs=TOLERANCE)


def test_one_survivor_below_s_unmasks_nothing():
    rounds, _ = secure_round(frozenset())
    s = rounds.spec_for(IDS[0]).min_survivors
    rounds, noise = secure_round(frozenset(IDS[:len(IDS) - s + 1]))
    assert noise is None and rounds.server.revealed == {}
    assert f"{s - 1} of {len(IDS)} devices survived, below the {s} the round needs" in rounds.failure
