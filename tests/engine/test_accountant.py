"""The privacy budget (server/engine/accountant.py): ε from Google's dp-accounting checked against independent
computations of the same mechanism, and the budget's rules (stop before overspending, resume keeps what was spent)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from server.engine.accountant import Accountant, budget_plan, epsilon, noise_multiplier_for, rounds_within

DESIGN = dict(join_ratio=0.2, noise_multiplier=1.0, rounds=20, delta=1e-5)
"""DESIGN.md's reference point: RDP ε = 7.52, PLD ε = 6.62."""


def pld_reference(q: float, sigma: float, rounds: int, delta: float, step: float = 1e-3) -> float:
    """ε of ``rounds`` Poisson-subsampled Gaussians, from the privacy loss distribution built here with numpy alone:
    the loss log(P/Q) of P = (1−q)·N(0,σ²) + q·N(1,σ²) against Q = N(0,σ²) (removing a device; adding one: Q
    against P) on a fine grid, rounded to ``step``, composed by FFT; δ(ε) = E[(1 − e^(ε−L))₊], ε by bisection,
    the larger of both directions. Mass beyond 12σ is counted in δ whole (pessimistic)."""
    xs = np.linspace(-12 * sigma, 1 + 12 * sigma, 400_001)
    mid = (xs[:-1] + xs[1:]) / 2
    ratio = np.log1p(q * np.expm1((2 * mid - 1) / (2 * sigma ** 2)))  # log P/Q at mid
    worst = 0.0
    for cdf, loss in (((1 - q) * stats.norm.cdf(xs, 0, sigma) + q * stats.norm.cdf(xs, 1, sigma), ratio),
                      (stats.norm.cdf(xs, 0, sigma), -ratio)):
        bins = np.rint(loss / step).astype(np.int64)
        pmf = np.bincount(bins - bins.min(), weights=np.diff(cdf))
        size = 1 << math.ceil(math.log2(len(pmf) * rounds))
        composed = np.clip(np.fft.irfft(np.fft.rfft(pmf, size) ** rounds, size)[:(len(pmf) - 1) * rounds + 1], 0, None)
        losses = (np.arange(len(composed)) + bins.min() * rounds) * step
        lost = 1 - (1 - (1 - cdf[-1])) ** rounds

        def delta_at(eps: float) -> float:
            above = losses > eps
            return lost + float(np.sum(composed[above] * -np.expm1(eps - losses[above])))
        low, high = 0.0, 100.0
        for _ in range(50):
            low, high = ((low + high) / 2, high) if delta_at((low + high) / 2) > delta else (low, (low + high) / 2)
        worst = max(worst, high)
    return worst


def rdp_integer_reference(q: float, sigma: float, rounds: int, delta: float) -> float:
    """ε from the closed form of the subsampled Gaussian's Rényi DP at integer orders α = 2..256 (Mironov, Talwar,
    Zhang 2019: A_α = Σ_k C(α,k)(1−q)^(α−k) q^k e^((k²−k)/2σ²)), converted as ε = RDP + log(1−1/α) − log(δα)/(α−1)."""
    best = math.inf
    for a in range(2, 257):
        k = np.arange(a + 1)
        log_terms = (special.gammaln(a + 1) - special.gammaln(k + 1) - special.gammaln(a - k + 1)
                     + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma ** 2))
        rdp = rounds * special.logsumexp(log_terms) / (a - 1)
        best = min(best, rdp + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
    return best


@pytest.mark.parametrize("q, z, rounds, delta", [(0.2, 1.0, 20, 1e-5), (0.1, 0.8, 30, 500 ** -1.1)])
def test_pld_epsilon_matches_an_independent_privacy_loss_distribution(q, z, rounds, delta):
    # measured: the two agree to 2e-5 relative; the tolerance is 1 %
    reported, reference = epsilon(q, z, rounds, delta, "pld"), pld_reference(q, z, rounds, delta)
    assert reported == pytest.approx(reference, rel=0.01)


@pytest.mark.parametrize("q, z, rounds, delta", [(0.2, 1.0, 20, 1e-5), (0.1, 0.8, 30, 500 ** -1.1)])
def test_the_reported_epsilon_is_never_below_the_independent_one(q, z, rounds, delta):
    """The run reports an upper bound: dp-accounting's PLD is a pessimistic estimate, so it may not fall below the
    independent PLD. Measured 3.8e-7 and 3.0e-7 relative above it (2.5e-6 and 1.2e-6 in ε), six orders above the FFT's
    float rounding."""
    assert epsilon(q, z, rounds, delta, "pld") >= pld_reference(q, z, rounds, delta)


def test_rdp_epsilon_matches_its_closed_form_at_integer_orders():
    """The library also tries fractional orders, so it may only be lower; at DESIGN.md's point it is 0.5 % lower."""
    library = epsilon(*DESIGN.values(), "rdp")
    reference = rdp_integer_reference(*DESIGN.values())
    assert library <= reference + 1e-9
    assert library == pytest.approx(reference, rel=0.01)


def test_design_reference_values():
    assert epsilon(*DESIGN.values(), "rdp") == pytest.approx(7.52, abs=0.005)
    assert epsilon(*DESIGN.values(), "pld") == pytest.approx(6.62, abs=0.005)


def test_no_round_spends_nothing():
    assert Accountant(0.1, 1.0, 1e-5).spent == 0.0


def test_the_round_that_would_exceed_the_target_is_refused():
    probe = Accountant(0.1, 1.0, 1e-5, "rdp")
    target = (probe.epsilon_after(3) + probe.epsilon_after(4)) / 2
    accountant = Accountant(0.1, 1.0, 1e-5, "rdp", target_epsilon=target)
    for _ in range(3):
        assert accountant.refusal() is None
        accountant.charge()
    assert accountant.spent <= target
    reason = accountant.refusal()
    assert reason is not None and "--dp-target-epsilon" in reason and "round 4" in reason


def test_a_restored_accountant_keeps_the_spent_budget():
    before = Accountant(0.1, 1.0, 1e-5, "rdp", target_epsilon=2.0)
    for _ in range(5):
        before.charge()
    after = Accountant(0.1, 1.0, 1e-5, "rdp", target_epsilon=2.0)
    after.restore(before.to_state())
    assert after.spent == before.spent > 0
    after.charge()
    assert after.spent == before.epsilon_after(6)


def test_the_calibrated_noise_multiplier_is_the_smallest_within_the_target():
    z = noise_multiplier_for(2.0, 50, 0.05, 1e-5, "rdp")
    assert epsilon(0.05, z, 50, 1e-5, "rdp") <= 2.0 < epsilon(0.05, z * 0.99, 50, 1e-5, "rdp")


def test_the_rounds_within_a_target_are_those_whose_epsilon_fits_and_no_more():
    q, z, delta = 0.2, 1.0, 1e-5
    fits = rounds_within(4.0, q, z, delta, "rdp", 100)
    assert 0 < fits < 100
    assert epsilon(q, z, fits, delta, "rdp") <= 4.0 < epsilon(q, z, fits + 1, delta, "rdp")
    assert rounds_within(1e6, q, z, delta, "rdp", 30) == 30 and rounds_within(1e-6, q, z, delta, "rdp", 30) == 0


def test_the_plan_names_the_round_the_target_stops_the_run_before():
    line = budget_plan(0.2, 1.0, 1e-5, "rdp", 4.0, 100)
    fits = rounds_within(4.0, 0.2, 1.0, 1e-5, "rdp", 100)
    assert line.startswith(f"privacy: --dp-target-epsilon 4 stops the run after round {fits} of 100")
    assert "all 3 version(s) fit" in budget_plan(0.2, 1.0, 1e-5, "rdp", 4.0, 3, "version")
