"""A device's last answer and the server's receipt of it: whether a re-ask of the round it answered gets the saved
answer again (a pure state machine, no I/O: ``now`` given).

The server acknowledges every update it counts with a RECEIVED message (``ErrorCode.RECEIVED``), sealed to the
device's session like every down message, so a forged or replayed one is refused by the link. A re-ask of the
answered round that the device handles within ``RECEIPT_WAIT_S`` of sending its answer crossed that answer on the way
(the server asked before the answer reached it: a client-id takeover, a reconnect, a task queued while the device
computed): the device holds it until ``RECEIPT_WAIT_S`` after its send; the receipt cancels it, else the saved
answer goes again. A re-ask handled later is answered at once, receipt or not: only a server that lost the answer
asks then (a restart or a resume, whose earlier process's receipt must not silence it).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

RECEIPT_WAIT_S = 5.0
"""Seconds after sending an answer during which a re-ask of its round waits for the answer's receipt."""


class Reask(str, Enum):
    SEND = "send"  # re-send the saved answer now
    HOLD = "hold"  # wait for the receipt until ``AnswerReceipt.due``
    RECEIVED = "received"  # the server counted the answer: send nothing


@dataclass
class AnswerReceipt:
    """The answer to task ``round`` sent at ``sent_at`` to the server process start ``asker`` (its counters' epoch);
    ``received`` once that process's receipt came; ``held_until``: a re-ask waiting for that receipt."""

    round: int
    sent_at: float
    asker: int | None
    received: bool = False
    held_until: float | None = None

    def reask(self, now: float, asker: int | None) -> Reask:
        """What to do with a re-ask of this answer's round handled at ``now``, sealed by the server process start
        ``asker`` (see the module docstring)."""
        if asker != self.asker or now - self.sent_at >= RECEIPT_WAIT_S:
            return Reask.SEND
        if self.received:
            return Reask.RECEIVED
        self.held_until = self.sent_at + RECEIPT_WAIT_S
        return Reask.HOLD

    def receipt(self, round_index: int, sender: int | None) -> bool:
        """A receipt for task ``round_index`` came from the server process start ``sender``: whether it is this
        answer's (then a held re-ask is dropped)."""
        if (round_index, sender) != (self.round, self.asker):
            return False
        self.received, self.held_until = True, None
        return True

    def due(self, now: float) -> bool:
        """Whether a held re-ask's wait is over without its receipt (then the saved answer goes again, once)."""
        if self.held_until is None or now < self.held_until:
            return False
        self.held_until = None
        return True
