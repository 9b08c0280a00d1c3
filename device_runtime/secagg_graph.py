"""SecAgg+'s communication graph (Bell et al., CCS 2020, section 3): a random k-regular graph on a round's
participants, so a device shares its secrets with k neighbours (and keeps one share itself) instead of all n − 1;
the server chooses k and the threshold t from SecAgg+'s bounds (``server.engine.secagg_parameters``): O(log n) for
large rounds, the complete graph (classic SecAgg) where the bounds give nothing smaller.

The graph is a Harary graph H(k, n) (each device joined to the k/2 nearest on either side of a ring) over a random
order of the participants, as Bell et al. construct it; the order comes from a seed the server announces, so every
device computes the same graph from the round's participant list. k is even (or n − 1: the complete graph).
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence


def check_graph(n: int, k: int, t: int) -> str | None:
    """Why (k, t) cannot serve a round of n participants (None: they can). A device's secrets are shared among its
    k neighbours and itself (k + 1 holders, as classic SecAgg shares among every participant, the sharer
    included): 2 <= k <= n − 1, k even unless k = n − 1 (a Harary graph), and (k + 1)/2 < t <= k (a majority of
    the holders: honest holders each reveal one of a device's two secrets, so no server collects t shares of both;
    at most k: a dropped device's k neighbours can rebuild its key). Whether (k, t) meet SecAgg+'s probabilistic
    bounds for a dropout and corruption rate is the server's check (``server.engine.secagg_parameters``)."""
    if n < 3:
        return f"a secure round needs at least 3 participants, it has {n}"
    if not 2 <= k <= n - 1:
        return f"--secagg-neighbors {k} must be between 2 and n − 1 = {n - 1} for {n} participants"
    if k % 2 and k != n - 1:
        return f"--secagg-neighbors {k} must be even (a Harary graph) or n − 1 = {n - 1}"
    if not (k + 1) / 2 < t <= k:
        return f"--secagg-threshold {t} must be above (k + 1)/2 = {(k + 1) / 2:g} and at most k = {k}"
    return None


def neighbours(participants: Sequence[str], k: int, seed: bytes) -> dict[str, tuple[str, ...]]:
    """Each participant's k neighbours (sorted), in the Harary graph over the order ``seed`` draws."""
    ids = sorted(participants)
    n = len(ids)
    order = list(ids)
    random.Random(hashlib.sha256(b"fedara-secagg-graph/" + seed).digest()).shuffle(order)
    if k >= n - 1:
        return {d: tuple(x for x in ids if x != d) for d in ids}
    position = {d: i for i, d in enumerate(order)}
    half = k // 2
    return {d: tuple(sorted(order[(position[d] + step) % n] for step in range(-half, half + 1) if step))
            for d in ids}
