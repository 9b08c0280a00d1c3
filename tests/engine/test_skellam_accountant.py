"""The distributed mechanism's budget (``server.engine.accountant.SkellamAccountant``): never below what an
independent computation gives for the same noise, tighter as the noise grows, and stopping a run at its target."""
from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from server.engine.accountant import SkellamAccountant, poisson_subsampled_rdp, skellam_epsilon, skellam_rdp

D = 100_000


def gaussian_epsilon(q: float, z: float, rounds: int, delta: float, pld: bool) -> float:
    """dp-accounting's ε for a Poisson-sampled Gaussian of multiplier z: the Skellam sum's noise, were it Gaussian."""
    accountant = (pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4) if pld else rdp_privacy_accountant.RdpAccountant())
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("q,z,rounds", [(1.0, 1.0, 10), (0.1, 1.0, 100), (0.1, 0.8, 300), (0.01, 1.5, 200)])
def test_the_skellam_epsilon_is_never_below_the_gaussian_one_at_the_same_variance(q, z, rounds):
    l2 = 2 ** 16 + math.sqrt(D)
    mu = (z * l2) ** 2 / 2
    ours = skellam_epsilon(q, mu, l2, min(math.sqrt(D) * l2, l2 ** 2), rounds, 1e-5)
    assert ours >= gaussian_epsilon(q, z, rounds, 1e-5, pld=False) - 1e-9
    assert ours >= gaussian_epsilon(q, z, rounds, 1e-5, pld=True) - 1e-9


def test_unsampled_skellam_rdp_is_the_gaussian_rdp_plus_its_correction():
    l2, mu = 1000.0, 1e6
    assert skellam_rdp(4, mu, l2, l2 ** 2) == pytest.approx(4 * l2 ** 2 / (4 * mu) + min(
        (7 * l2 ** 2 + 6 * l2 ** 2) / (16 * mu ** 2), 3 * l2 ** 2 / (4 * mu)))
    assert poisson_subsampled_rdp(1.0, 4, lambda a: skellam_rdp(a, mu, l2, l2 ** 2)) == skellam_rdp(4, mu, l2, l2 ** 2)


def test_subsampling_never_costs_more_than_the_full_round():
    rdp = lambda a: skellam_rdp(a, 1e6, 1000.0, 1e6)  # noqa: E731
    assert all(poisson_subsampled_rdp(0.05, a, rdp) <= rdp(a) for a in range(2, 64))


def test_the_accountant_refuses_the_round_past_its_target():
    l2 = 2 ** 16 + math.sqrt(D)
    accountant = SkellamAccountant(0.1, (1.0 * l2) ** 2 / 2, l2, D, 1e-5, target_epsilon=2.0)
    while accountant.refusal() is None:
        accountant.charge()
    assert accountant.spent <= 2.0 < accountant.epsilon_after(accountant.rounds + 1)
    assert "--dp-target-epsilon 2" in accountant.refusal()
