"""The neighbours k and threshold t of a SecAgg+ round, from what SecAgg+ proves (Bell, Bonawitz, Gascón, Lepoint,
Raykova, CCS 2020, section 4; the same three bounds as Google's open-source parameter search for its
subgraph secure aggregation).

A round has n participants. Each device drops (after sharing) independently with probability δ
(``--secagg-dropout-rate``); at most a fraction γ of the participants are corrupt and collude with the server
(``--secagg-corrupt-rate``). A device's secrets are Shamir-shared among its k neighbours in a random Harary graph
and itself (k + 1 holders; ``device_runtime.secagg_graph``). Security is statistical with σ = 40 bits, correctness
η = 20 bits, each split evenly over its two bad events (union bounds over the n devices):

- **dropouts**: at most D devices drop, D the smallest count with P(Binomial(n, δ) > D) <= 2^-(η+1);
- **connectivity** (security): the honest survivors' graph stays connected, so the server learns only the sum of
  all of them: removing nodes disconnects a Harary graph only if two runs of k/2 consecutive nodes go, so
  P <= n(n − k − 1)/2 · C(B, k)/C(n, k) <= 2^-(σ+1), B = ⌊γn⌋ + D;
- **secrecy** (security): no honest device has t corrupt neighbours, n·P(Hyp(n − 1, ⌊γn⌋, k) >= t) <= 2^-(σ+1);
- **recovery** (correctness): every device keeps t surviving holders, n·P(Hyp(n − 1, D, k) > k − t) <= 2^-(η+1)
  (its surviving neighbours alone, the conservative count);
- and t is a majority of the k + 1 holders (``secagg_graph.check_graph``).

The rule: the smallest even k < n − 1 for which some t meets all of them, with the smallest such t (the most
dropouts tolerated); where no k does, the complete graph k = n − 1 (classic SecAgg, Bonawitz et al., CCS 2017),
whose secrecy and recovery are exact: t = max(⌊γn⌋ + 1, ⌊n/2⌋ + 1), and a round is unmasked exactly when at least
t devices survive. Small rounds always get the complete graph (at δ = 0.1 every n up to a few hundred).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from device_runtime.secagg_graph import check_graph

SECURITY_BITS = 40
"""σ: the server learns more than the survivors' sum with probability below 2^-40."""
CORRECTNESS_BITS = 20
"""η: a round meant to be unmasked fails with probability below 2^-20."""
DEFAULT_DROPOUT_RATE = 0.1
DEFAULT_CORRUPT_RATE = 0.1


@dataclass(frozen=True)
class GraphParameters:
    """A round's k and t (``complete``: k = n − 1), chosen for at most D drops (P(more) <= 2^-(η+1))."""

    neighbors: int
    threshold: int
    complete: bool
    dropouts: int

    def min_survivors(self, n: int) -> int:
        """The fewest survivors with which every secret can be rebuilt: each of n devices needs t surviving holders
        and a survivor holds shares of k + 1 devices' secrets, so at least max(t, ⌈n·t/(k + 1)⌉) (t: complete)."""
        return min(n, max(self.threshold, math.ceil(n * self.threshold / (self.neighbors + 1))))


def _tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P(X >= at_least) for X hypergeometric: ``draws`` of ``population`` of which ``marked`` are marked (exact
    integers, one rounding at the end)."""
    top = min(marked, draws)
    if at_least <= max(0, draws - (population - marked)):
        return 1.0
    if at_least > top:
        return 0.0
    hits = sum(math.comb(marked, j) * math.comb(population - marked, draws - j) for j in range(at_least, top + 1))
    return hits / math.comb(population, draws)


def _log2(p: float) -> float:
    return math.log2(p) if p > 0 else -math.inf


def dropout_bound(n: int, rate: float) -> int:
    """D: the smallest count with P(Binomial(n, rate) > D) <= 2^-(η+1) (the tail summed from the top, in logs)."""
    if rate <= 0:
        return 0
    limit, above = 2.0 ** -(CORRECTNESS_BITS + 1), 0.0
    for d in range(n, 0, -1):  # above = P(X > d − 1) after adding P(X = d)
        above += math.exp(math.lgamma(n + 1) - math.lgamma(d + 1) - math.lgamma(n - d + 1)
                          + d * math.log(rate) + (n - d) * math.log1p(-rate))
        if above > limit:
            return d
    return 0


def _bounds(n: int, k: int, t: int, dropouts: int, corrupt: int) -> tuple[float, float, float]:
    """log2 of the three union bounds (connectivity, secrecy, recovery) of a subgraph round."""
    bad = min(n, corrupt + dropouts)
    disconnected = -math.inf if bad < k else (
        math.log2(n * (n - k - 1) / 2) + math.log2(math.comb(bad, k)) - math.log2(math.comb(n, k)))
    exposed = math.log2(n) + _log2(_tail(n - 1, corrupt, k, t))
    unrecoverable = math.log2(n) + _log2(_tail(n - 1, min(dropouts, n - 1), k, k - t + 1))
    return disconnected, exposed, unrecoverable


def _meets(bounds: tuple[float, float, float]) -> bool:
    disconnected, exposed, unrecoverable = bounds
    return (disconnected <= -(SECURITY_BITS + 1) and exposed <= -(SECURITY_BITS + 1)
            and unrecoverable <= -(CORRECTNESS_BITS + 1))


def _majority(k: int) -> int:
    return max(2, (k + 1) // 2 + 1)


def complete_threshold(n: int, corrupt_rate: float) -> int:
    """t of the complete graph: more than the corrupt devices and a majority of the n holders."""
    return max(math.floor(corrupt_rate * n) + 1, n // 2 + 1)


def _subgraph_threshold(n: int, k: int, dropouts: int, corrupt: int) -> int | None:
    """The smallest t that meets every bound at k (None: none does)."""
    for t in range(_majority(k), k + 1):
        bounds = _bounds(n, k, t, dropouts, corrupt)
        if bounds[0] > -(SECURITY_BITS + 1) or bounds[2] > -(CORRECTNESS_BITS + 1):
            return None  # neither improves as t grows
        if _meets(bounds):
            return t
    return None


@lru_cache(maxsize=256)
def choose(n: int, dropout_rate: float = DEFAULT_DROPOUT_RATE,
           corrupt_rate: float = DEFAULT_CORRUPT_RATE) -> GraphParameters:
    """The rule (module docstring) for a round of n >= 3 participants."""
    dropouts, corrupt = dropout_bound(n, dropout_rate), math.floor(corrupt_rate * n)
    for k in range(2, n - 1, 2):
        t = _subgraph_threshold(n, k, dropouts, corrupt)
        if t is not None:
            return GraphParameters(k, t, False, dropouts)
    return GraphParameters(n - 1, complete_threshold(n, corrupt_rate), True, dropouts)


def violation(n: int, k: int, t: int, dropout_rate: float, corrupt_rate: float) -> str | None:
    """Why an explicit (k, t) does not meet the bounds for a round of n (None: it does)."""
    problem = check_graph(n, k, t)
    if problem is not None:
        return problem
    corrupt, dropouts = math.floor(corrupt_rate * n), dropout_bound(n, dropout_rate)
    if k == n - 1:
        if t <= corrupt:
            return (f"--secagg-threshold {t}: the {corrupt} corrupt devices that --secagg-corrupt-rate "
                    f"{corrupt_rate:g} allows among {n} would hold t shares of every device's secrets")
        return None
    disconnected, exposed, unrecoverable = _bounds(n, k, t, dropouts, corrupt)
    rates = f"--secagg-dropout-rate {dropout_rate:g} and --secagg-corrupt-rate {corrupt_rate:g}"
    if disconnected > -(SECURITY_BITS + 1):
        return (f"--secagg-neighbors {k}: with {n} devices at {rates} the honest survivors' graph is disconnected "
                f"with probability up to 2^{disconnected:.1f} (SecAgg+ needs below 2^-{SECURITY_BITS + 1})")
    if exposed > -(SECURITY_BITS + 1):
        return (f"--secagg-threshold {t}: with {n} devices at {rates} some device has t corrupt neighbours with "
                f"probability up to 2^{exposed:.1f} (SecAgg+ needs below 2^-{SECURITY_BITS + 1})")
    if unrecoverable > -(CORRECTNESS_BITS + 1):
        return (f"--secagg-neighbors {k} --secagg-threshold {t}: with {n} devices at {rates} some device keeps "
                f"fewer than t surviving neighbours with probability up to 2^{unrecoverable:.1f} (SecAgg+ needs below "
                f"2^-{CORRECTNESS_BITS + 1})")
    return None


def parameters(n: int, neighbors: int | None, threshold: int | None, dropout_rate: float,
               corrupt_rate: float) -> GraphParameters:
    """The round's k and t: the rule's, or the explicit ones (each flag alone takes the rule's other value at the
    given one); ValueError naming the flag when they do not meet the bounds."""
    if n < 3:
        raise ValueError(f"a secure round needs at least 3 participants, it has {n}")
    if neighbors is None and threshold is None:
        return choose(n, dropout_rate, corrupt_rate)
    ruled = choose(n, dropout_rate, corrupt_rate)
    k = ruled.neighbors if neighbors is None else neighbors
    if threshold is not None:
        t = threshold
    elif k == n - 1:
        t = complete_threshold(n, corrupt_rate)
    else:
        t = _subgraph_threshold(n, k, dropout_bound(n, dropout_rate), math.floor(corrupt_rate * n)) or _majority(k)
    problem = violation(n, k, t, dropout_rate, corrupt_rate)
    if problem is not None:
        raise ValueError(f"{problem}; leave it out (the rule gives k = {ruled.neighbors}, t = {ruled.threshold} for "
                         f"{n} devices)")
    return GraphParameters(k, t, k == n - 1, ruled.dropouts)
