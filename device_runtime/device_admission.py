"""Which frames a device takes, before it buffers any (framing.Admit, framing.Vouch), and which whole payloads it
queues (stdlib only).

A device reads two kinds of stream: its down topic (the server's PLAN, TASK and ERROR, sealed under its key) and,
while a TASK waits for it, the one payload that TASK names (device_runtime/payload.py). Every other frame is dropped
at the frame: a retained message of another topic, an earlier payload still queued in the persistent session of a
restarted device (so the retained copy, re-sent when the device subscribes again, reassembles afresh instead of
being refused as a repeat), and any frame on the awaited payload's topic whose header names another size or hash
than the TASK's: a 50 MB retained junk frame is refused at its first frame by the size the TASK names. Frames that
claim the right size and hash are kept as candidates, each under its own msg_id, within the device's reassembly
budget; a whole candidate is queued only if its SHA-256 is the TASK's (``takes_payload``), so junk that completes
after the genuine payload never replaces it in the inbox. The down topic's messages rank by their tagged header
(``envelope.tagged_counter``): junk there cannot push out the server's genuine PLAN.
"""
from __future__ import annotations

import hashlib
from collections.abc import Hashable

from device_runtime.envelope import tagged_counter
from device_runtime.framing import Frame
from device_runtime.payload import PayloadRef

SERVER, PAYLOAD = "server", "payload"
"""The two senders a device admits frames for."""


class DeviceAdmission:
    """The device's admission (``admit``, ``check``, ``vouch``) and its payload check (``takes_payload``); the agent
    names the payload it waits for (``await_payload``, ``clear``) from its thread, the network thread reads it."""

    def __init__(self, down_topic: str, key: bytes) -> None:
        self.down_topic, self._key = down_topic, key
        self._awaited: tuple[str, bytes, int] | None = None  # (payload topic, SHA-256, size) while a TASK waits

    def await_payload(self, topic: str, ref: PayloadRef) -> None:
        """Take frames of the payload ``ref`` on ``topic`` from now on (and no other payload's)."""
        self._awaited = (topic, bytes.fromhex(ref.sha256), ref.nbytes)

    def clear(self) -> None:
        """No payload awaited: payload frames are dropped at the frame."""
        self._awaited = None

    def admit(self, stream: str) -> Hashable | None:
        """SERVER for the down topic, PAYLOAD for the awaited payload's topic, else None."""
        if stream == self.down_topic:
            return SERVER
        awaited = self._awaited
        return PAYLOAD if awaited is not None and stream == awaited[0] else None

    def check(self, sender: Hashable, frame: Frame) -> bool:
        """Whether a frame's header claims what this device takes: any down frame; of the payload, its size and hash."""
        awaited = self._awaited
        return sender == SERVER or (awaited is not None and frame.digest == awaited[1] and frame.total == awaited[2])

    def vouch(self, sender: Hashable, chunk: memoryview) -> int | None:
        """The counter of a down message whose chunk 0 carries a header tagged under this device's key."""
        return tagged_counter(chunk, self._key) if sender == SERVER else None

    def takes_payload(self, topic: str, payload: bytes) -> bool:
        """Whether ``payload``, whole on ``topic``, is the awaited payload (its size and SHA-256)."""
        awaited = self._awaited
        return (awaited is not None and topic == awaited[0] and len(payload) == awaited[2]
                and hashlib.sha256(payload).digest() == awaited[1])
