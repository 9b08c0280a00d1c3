"""Authenticated status frames: a device's online/offline, bound to one MQTT connection by a nonce.

A device mints a fresh nonce for every CONNECT: its last will is an ``offline`` frame with that nonce
(registered at CONNECT), and its first publication on the connection is an ``online`` frame with the same
nonce. The server believes an ``offline`` only for the nonce of the device's current connection
(auth.Verifier, ``Direction.STATUS``), so a captured will or offline frame replayed later marks nobody offline.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from device_runtime.auth import NONCE_BYTES, SESSION_KEY, STATUS_OFFLINE, STATUS_ONLINE, CounterSource, Direction
from device_runtime.envelope import Message, MessageType, seal
from device_runtime.messages import NO_RUN

_NONCE_RE = re.compile(r"[0-9a-f]{%d}" % (2 * NONCE_BYTES))


class StatusError(ValueError):
    """A STATUS message whose state or nonce is missing or malformed."""


@dataclass(frozen=True)
class Status:
    online: bool
    nonce: str

    @property
    def state(self) -> str:
        return STATUS_ONLINE if self.online else STATUS_OFFLINE


def status_message(status: Status, *, device_id: str, session: str | None = None) -> Message:
    """The STATUS message saying ``status`` for ``device_id``; of no run, as a connection outlives runs. A device
    names its ``session`` (auth.SESSION_KEY), so the server knows it before any JOIN arrives."""
    meta = {"state": status.state, "nonce": status.nonce}
    return Message(MessageType.STATUS, NO_RUN, 0, device_id, f"status-{status.state}-{status.nonce}",
                   meta if session is None else {**meta, SESSION_KEY: session})


def parse_status(msg: Message) -> Status:
    """The Status of a decoded STATUS message; raises StatusError naming the bad field."""
    if msg.type != MessageType.STATUS:
        raise StatusError(f"expected a status message, got {MessageType(msg.type).value}")
    state, nonce = msg.meta.get("state"), msg.meta.get("nonce")
    if state not in (STATUS_ONLINE, STATUS_OFFLINE):
        raise StatusError(f"status state must be {STATUS_ONLINE!r} or {STATUS_OFFLINE!r}, got {state!r:.30}")
    if not isinstance(nonce, str) or _NONCE_RE.fullmatch(nonce) is None:
        raise StatusError(f"status nonce must be {2 * NONCE_BYTES} lowercase hex digits, got {nonce!r:.40}")
    return Status(state == STATUS_ONLINE, nonce)


class StatusSigner:
    """Mints a device's sealed status frames: ``signer(online, nonce) -> envelope bytes``."""

    def __init__(self, device_id: str, key: bytes, counters: CounterSource, session: str | None = None) -> None:
        self.device_id, self._key, self._counters, self._session = device_id, key, counters, session

    def __call__(self, online: bool, nonce: str) -> bytes:
        msg = status_message(Status(online, nonce), device_id=self.device_id, session=self._session)
        return seal(msg, self._key, Direction.STATUS, self._counters.next())
