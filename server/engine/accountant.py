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
    def spent(rounds: int) -> float:
        return epsilon(join_ratio, noise_multiplier, rounds, delta, kind)

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
    at = f"δ = {delta:.3g}, {kind} accountant" + (": a δ this large is a weak guarantee (few devices)"
                                                   if delta > WEAK_DELTA else "")
    if target_epsilon is None:
        return (f"privacy: {rounds} {unit}(s) will spend ε = {epsilon(join_ratio, noise_multiplier, rounds, delta, kind):.4g} "
                f"({at}); no --dp-target-epsilon stops the run")
    fits = rounds_within(target_epsilon, join_ratio, noise_multiplier, delta, kind, rounds)
    spent = epsilon(join_ratio, noise_multiplier, fits, delta, kind)
    if fits == rounds:
        return (f"privacy: all {rounds} {unit}(s) fit --dp-target-epsilon {target_epsilon:g}: they spend ε = "
                f"{spent:.4g} ({at})")
    after = epsilon(join_ratio, noise_multiplier, fits + 1, delta, kind)
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

    def charge(self) -> None:
        """A training round opened: its release counts, whatever it delivers."""
        self.rounds += 1

    def to_state(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def restore(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])
