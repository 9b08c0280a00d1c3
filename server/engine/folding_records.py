"""The round engine's records of remote folding: the brief an aggregator process gets for a round, the receipt it
sends for an update it verified, the partial sum it answers a close with, and which member takes which device.

They are the engine's own vocabulary; ``server.mqtt.aggregation_wire`` only encodes them for the broker.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.engine.aggregate import PartialSum
from server.engine.privacy import ClippedSum
from server.engine.update_rule import Answer, Asked


def route(device_id: str, members: Iterable[str]) -> str | None:
    """The member that takes ``device_id``'s updates: the highest SHA-256 of (member, device) over ``members``
    (rendezvous hashing: the same member every round while it is alive; a lost member's devices spread over the
    others, no other device moves). None without members."""
    def score(member: str) -> bytes:
        return hashlib.sha256(f"{member}\n{device_id}".encode()).digest()
    return max(sorted(set(members)), key=score, default=None)


@dataclass(frozen=True)
class Brief:
    """What an aggregator needs to check and fold round ``round``'s updates."""

    run_id: str
    round: int
    dense_shapes: dict[str, tuple[int, ...]]
    plan_shapes: dict[str, dict[str, tuple[int, ...]]]  # plan hash -> tensors of a training update
    devices: dict[str, Asked]
    max_inbound: int
    dp_clip: float | None = None
    """With DP: the round's clip C; the member then folds Σ clip_C(Δ_i) (``privacy.RoundChanges``), not a mean."""
    sent: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """With DP: plan hash -> the weights its devices were sent (each Δ_i is taken against them)."""


@dataclass(frozen=True)
class Receipt:
    """An update an aggregator verified: the device's header (run, round, msg id, meta), its counter and the bytes
    of its tensors. The engine judges it as it would the update itself, without the tensors."""

    device_id: str
    run_id: str
    round: int
    msg_id: str
    counter: int
    meta: dict[str, Any]
    nbytes: int

    def answer(self) -> Answer:
        """The update as the engine judges it: the device's header and fields, its tensors held by the aggregator."""
        return Answer(self.device_id, self.run_id, self.round, dict(self.meta), None)


@dataclass(frozen=True)
class Partial:
    """One aggregator's share of a round: its PartialSum (with DP: its ClippedSum) and the devices behind it."""

    round: int
    sum: PartialSum | ClippedSum
    devices: tuple[str, ...]
