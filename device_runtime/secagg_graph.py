"""SecAgg+'s communication graph (Bell et al., CCS 2020, section 3): a random k-regular graph on a round's
participants, k = O(log n), so a device shares its secrets with k neighbours instead of all n − 1.

The graph is a Harary graph H(k, n) (each device joined to the k/2 nearest on either side of a ring) over a random
order of the participants, as Bell et al. construct it; the order comes from a seed the server announces, so every
device computes the same graph from the round's participant list. k is even (or n − 1: the complete graph).
"""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence


def default_neighbors(n: int) -> int:
    """k = 2⌈log2 n⌉ (even; capped at n − 1): O(log n), as SecAgg+ takes it."""
    return min(n - 1, 2 * math.ceil(math.log2(max(n, 2))))


def default_threshold(k: int) -> int:
    """t: a majority of the neighbourhood."""
    return k // 2 + 1


def check_graph(n: int, k: int, t: int) -> str | None:
    """Why (k, t) cannot serve a round of n participants (None: they can): 1 <= k <= n − 1, k even unless k = n − 1,
    and k/2 < t <= k (a minority of a neighbourhood never holds a secret; a majority can rebuild it)."""
    if n < 3:
        return f"a secure round needs at least 3 participants, it has {n}"
    if not 2 <= k <= n - 1:
        return f"--secagg-neighbors {k} must be between 2 and n − 1 = {n - 1} for {n} participants"
    if k % 2 and k != n - 1:
        return f"--secagg-neighbors {k} must be even (a Harary graph) or n − 1 = {n - 1}"
    if not k / 2 < t <= k:
        return f"--secagg-threshold {t} must be above k/2 = {k / 2:g} and at most k = {k}"
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
