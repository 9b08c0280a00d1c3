"""The privacy budget of a run: ε spent so far at the run's δ, from Google's ``dp-accounting`` (a maintained library),
and the check that stops a run before a round that would overspend it.

Each training round is one Poisson-sampled Gaussian mechanism (rate q = --join-ratio, noise multiplier z, the
add-or-remove-one-device relation): the events of DP-FedAvg as ``server.engine.privacy`` runs them. The PLD
accountant (privacy loss distributions, pessimistic discretization: an upper bound) is the default and the
tighter; the RDP accountant is the classic, looser one (q = 0.2, z = 1, 20 rounds, δ = 1e-5: PLD 6.62, RDP 7.52).
The state is the number of rounds charged: ε is recomputed from it, so a resumed run keeps what it spent.
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

PLD_DISCRETIZATION = 1e-4
"""The PLD accountant's value discretization per unit of ε (its default at ε = 1): the grid is scaled with the RDP
bound so that its cost stays flat (a fixed grid took 68 s at z = 0.05); pessimistic rounding keeps ε an upper bound."""
WEAK_DELTA = 1e-2
"""A δ above this is named weak in the plan line (the default 1/N^1.1 is 0.299 for 3 devices)."""
PLD_USEFUL_UP_TO = 64.0
"""Above this RDP ε no guarantee is meaningful: the (fast) RDP bound is reported instead of a slow PLD."""


def round_event(join_ratio: float, noise_multiplier: float) -> dp_event.DpEvent:
    """One round of DP-FedAvg: a Gaussian mechanism on a Poisson sample of the devices."""
    return dp_event.PoissonSampledDpEvent(join_ratio, dp_event.GaussianDpEvent(noise_multiplier))


@functools.lru_cache(maxsize=4096)
def epsilon(join_ratio: float, noise_multiplier: float, rounds: int, delta: float, kind: str = "pld") -> float:
    """ε after ``rounds`` rounds at ``delta`` (0 before the first)."""
    if rounds == 0:
        return 0.0
    if kind == "pld":
        rough = epsilon(join_ratio, noise_multiplier, rounds, delta, "rdp")
        if rough > PLD_USEFUL_UP_TO:
            return rough
        accountant = pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=PLD_DISCRETIZATION * max(1.0, rough))
    elif kind == "rdp":
        accountant = rdp_privacy_accountant.RdpAccountant()
    else:
        raise ValueError(f"unknown accountant {kind!r}; choose pld or rdp")
    absl = logging.getLogger("absl")  # RDP warns about orders near 1 it skips at large q: not the user's concern
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        accountant.compose(round_event(join_ratio, noise_multiplier), rounds)
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def noise_multiplier_for(target_epsilon: float, rounds: int, join_ratio: float, delta: float,
                         kind: str = "pld") -> float:
    """The smallest noise multiplier (to 0.1 %, by bisection on a log scale) whose ``rounds`` rounds stay within
    ``target_epsilon``: what a schedule of that many rounds must use."""
    low, high = 1e-2, 1e3
    if epsilon(join_ratio, high, rounds, delta, kind) > target_epsilon:
        raise ValueError(f"no noise multiplier up to {high:g} keeps {rounds} rounds within ε = {target_epsilon:g}")
    while high - low > 1e-3 * high:
        mid = math.sqrt(low * high)
        if epsilon(join_ratio, mid, rounds, delta, kind) > target_epsilon:
            low = mid
        else:
            high = mid
    return high


def rounds_within(target_epsilon: float, join_ratio: float, noise_multiplier: float, delta: float, kind: str,
                  most: int) -> int:
    """The most rounds, up to ``most``, whose ε stays within ``target_epsilon`` (ε grows with the rounds: a
    bisection, about log2(most) accountant calls): the round after it is the one the budget stops the run before."""
    return _rounds_within(lambda rounds: epsilon(join_ratio, noise_multiplier, rounds, delta, kind), target_epsilon,
                          most)


def _rounds_within(spent: Callable[[int], float], target_epsilon: float, most: int) -> int:
    if spent(most) <= target_epsilon:
        return most
    low, high = 0, most  # spent(low) <= target < spent(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if spent(mid) <= target_epsilon else (low, mid)
    return low


def budget_plan(join_ratio: float, noise_multiplier: float, delta: float, kind: str, target_epsilon: float | None,
                rounds: int, unit: str = "round") -> str:
    """The line a private run prints before it trains: where --dp-target-epsilon stops it, or the ε its --rounds
    will spend. ``unit``: what --rounds counts ("round", or "version" in async mode)."""
    return _plan_line(lambda r: epsilon(join_ratio, noise_multiplier, r, delta, kind), delta, kind, target_epsilon,
                      rounds, unit)


def _plan_line(spent_after: Callable[[int], float], delta: float, kind: str, target_epsilon: float | None,
               rounds: int, unit: str) -> str:
    at = f"δ = {delta:.3g}, {kind} accountant" + (": a δ this large is a weak guarantee (few devices)"
                                                   if delta > WEAK_DELTA else "")
    if target_epsilon is None:
        return (f"privacy: {rounds} {unit}(s) will spend ε = {spent_after(rounds):.4g} ({at}); no --dp-target-epsilon "
                "stops the run")
    fits = _rounds_within(spent_after, target_epsilon, rounds)
    spent = spent_after(fits)
    if fits == rounds:
        return (f"privacy: all {rounds} {unit}(s) fit --dp-target-epsilon {target_epsilon:g}: they spend ε = "
                f"{spent:.4g} ({at})")
    after = spent_after(fits + 1)
    return (f"privacy: --dp-target-epsilon {target_epsilon:g} stops the run after {unit} {fits} of {rounds} "
            f"(ε = {spent:.4g}; {unit} {fits + 1} would spend {after:.4g}; {at})")


class Accountant:
    """A run's spent budget: rounds charged, ε at δ, and whether one more round stays within the target."""

    def __init__(self, join_ratio: float, noise_multiplier: float, delta: float, kind: str = "pld",
                 target_epsilon: float | None = None):
        self.join_ratio, self.noise_multiplier, self.delta, self.kind = join_ratio, noise_multiplier, delta, kind
        self.target_epsilon = target_epsilon
        self.rounds = 0

    def epsilon_after(self, rounds: int) -> float:
        return epsilon(self.join_ratio, self.noise_multiplier, rounds, self.delta, self.kind)

    @property
    def spent(self) -> float:
        """ε spent by the rounds charged so far."""
        return self.epsilon_after(self.rounds)

    def refusal(self) -> str | None:
        """Why the next round may not open (it would take ε past the target), or None."""
        if self.target_epsilon is None:
            return None
        after = self.epsilon_after(self.rounds + 1)
        if after <= self.target_epsilon:
            return None
        return (f"privacy budget: round {self.rounds + 1} would spend ε = {after:.4g} > --dp-target-epsilon "
                f"{self.target_epsilon:g} (δ = {self.delta:.3g}); the run stops with ε = {self.spent:.4g} "
                f"after {self.rounds} private round(s)")

    def plan(self, rounds: int, unit: str = "round") -> str:
        """The line a private run prints before it trains (``budget_plan``), from this accountant's ε."""
        return _plan_line(self.epsilon_after, self.delta, self.kind, self.target_epsilon, rounds, unit)

    def charge(self) -> None:
        """A training round opened: its release counts, whatever it delivers."""
        self.rounds += 1

    def to_state(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def restore(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])


# -- distributed DP under secure aggregation: the Skellam mechanism ---------------------------------------------

SKELLAM_ORDERS = tuple(range(2, 257))
"""The Rényi orders the distributed mechanism is accounted at (integers: the subsampling bound below needs them)."""


def skellam_rdp(order: int, mu: float, l2: float, l1: float) -> float:
    """The RDP of adding Sk(μ) to each coordinate of an integer vector whose neighbours differ by at most ``l2`` in
    L2 and ``l1`` in L1 norm (Agarwal, Kairouz, Liu, NeurIPS 2021, Theorem 3.5): αΔ₂²/(4μ) (a Gaussian of variance
    2μ) + min(((2α − 1)Δ₂² + 6Δ₁)/(16μ²), 3Δ₁/(4μ))."""
    return order * l2 ** 2 / (4 * mu) + min(((2 * order - 1) * l2 ** 2 + 6 * l1) / (16 * mu ** 2), 3 * l1 / (4 * mu))


def poisson_subsampled_rdp(rate: float, order: int, rdp) -> float:
    """An upper bound on the RDP at integer ``order`` >= 2 of a mechanism of RDP ``rdp(α)`` run on a Poisson sample
    of rate q, for any mechanism (Zhu & Wang, ICML 2019, Theorem 6): 1/(α−1) · log((1−q)^(α−1)(αq − q + 1)
    + C(α,2) q² (1−q)^(α−2) e^(ε(2)) + 3 Σ_{l=3..α} C(α,l) q^l (1−q)^(α−l) e^((l−1)ε(l))), and never above ε(α)."""
    if rate >= 1.0:
        return rdp(order)
    logs = [(order - 1) * math.log1p(-rate) + math.log(order * rate - rate + 1),
            math.log(math.comb(order, 2)) + 2 * math.log(rate) + (order - 2) * math.log1p(-rate) + rdp(2)]
    logs += [math.log(3 * math.comb(order, l)) + l * math.log(rate) + (order - l) * math.log1p(-rate)
             + (l - 1) * rdp(l) for l in range(3, order + 1)]
    top = max(logs)
    return min(rdp(order), (top + math.log(sum(math.exp(x - top) for x in logs))) / (order - 1))


def rdp_to_epsilon(orders: tuple[int, ...], rdps: list[float], delta: float) -> float:
    """(ε, δ) from RDP (Canonne, Kamath, Steinke 2020, Proposition 12, the conversion dp-accounting uses):
    min over α of ε(α) + log((α−1)/α) − (log δ + log α)/(α − 1)."""
    return max(0.0, min(r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
                        for a, r in zip(orders, rdps)))


@functools.lru_cache(maxsize=4096)
def skellam_epsilon(join_ratio: float, mu: float, l2: float, l1: float, rounds: int, delta: float) -> float:
    """ε after ``rounds`` Poisson-sampled rounds of the Skellam mechanism (total parameter μ, sensitivities Δ₂, Δ₁),
    at ``delta``: RDP composed over the rounds, then converted."""
    if rounds == 0:
        return 0.0
    per_order = {}

    def rdp(order: int) -> float:
        if order not in per_order:
            per_order[order] = skellam_rdp(order, mu, l2, l1)
        return per_order[order]
    rdps = [rounds * poisson_subsampled_rdp(join_ratio, a, rdp) for a in SKELLAM_ORDERS]
    return rdp_to_epsilon(SKELLAM_ORDERS, rdps, delta)


class SkellamAccountant(Accountant):
    """The budget of distributed DP (``device_runtime.secagg_noise``): each round a Poisson sample whose sum
    carries Skellam noise of total parameter at least μ (at least the round's minimum of survivors each added
    μ/s), on integers of L2 sensitivity Δ₂ = γC + √d (stochastic rounding's worst case) and L1 sensitivity
    Δ₁ <= min(√d·Δ₂, Δ₂²). Modular wrap-around is post-processing of the noised sum (it costs no privacy; the
    modulus leaves room for the noise's tail, ``device_runtime.secagg_quantize``)."""

    def __init__(self, join_ratio: float, mu: float, l2: float, dimension: int, delta: float,
                 target_epsilon: float | None = None):
        super().__init__(join_ratio, math.sqrt(2 * mu) / l2, delta, "skellam", target_epsilon)
        self.mu, self.l2, self.l1 = mu, l2, min(math.sqrt(dimension) * l2, l2 ** 2)

    def epsilon_after(self, rounds: int) -> float:
        return skellam_epsilon(self.join_ratio, self.mu, self.l2, self.l1, rounds, self.delta)
