"""A device waiting for its plan's payload: when to ask the server to publish it again (a pure state machine, no
I/O: ``now`` given).

A TASK that names a payload (device_runtime/payload.py) runs once the payload is whole and its SHA-256 is the one the
TASK names. The device relies on the broker's retained copy, which comes when the broker grants the device's
subscription to the payload's topic. So it asks nothing while that subscription is not granted (a cluster node that
lost a peer refuses subscriptions for a while; a connection is gone): a publish could not reach it then. Once it is
granted, the device asks the server again when nothing whole came for ``ASK_AGAIN_S`` (the copy was lost: a broker
restarted, a node of a cluster went down), or soon after it refused a payload that did not match (junk or a replay
published by anyone on an open broker), but never more often than every ``MIN_ASK_S``: a flood of junk costs the
server one small request a second per device, not a model each.
"""
from __future__ import annotations

from dataclasses import dataclass

from device_runtime.envelope import Message
from device_runtime.payload import PayloadRef

ASK_AGAIN_S = 5.0
"""Seconds without the whole payload, its subscription granted, before the device asks for it again."""
MIN_ASK_S = 1.0
"""Seconds between two requests for a payload, at least."""


@dataclass
class PayloadWait:
    """The TASK waiting for payload ``ref`` since ``since``; ``refused`` after a payload that did not match."""

    ref: PayloadRef
    task: Message
    since: float
    asked_at: float | None = None
    refused: bool = False

    def ask_now(self, now: float, granted_at: float | None) -> bool:
        """Whether to ask the server for the payload again now (and note that it asks). ``granted_at``: when the
        broker granted the subscription to the payload's topic on the current connection, None while it is not
        granted (then nothing is asked: the retained copy comes with the grant)."""
        if granted_at is None:
            return False
        last = self.since if self.asked_at is None else self.asked_at
        if self.refused:
            due = now - last >= MIN_ASK_S
        else:
            due = now - max(last, granted_at) >= ASK_AGAIN_S
        if not due:
            return False
        self.asked_at, self.refused = now, False
        return True
