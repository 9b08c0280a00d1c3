"""The round's tensors once per plan: each plan's payload of the open round, content-addressed, published once
(no I/O: ``now`` given).

Devices of one plan get the same tensors in a round. So a TASK names its plan's payload by SHA-256 and size
(device_runtime/payload.py) and the driver publishes each payload once, retained, for every device of the plan: a
round of K devices at P plans sends P payloads and K small TASKs instead of K models. A device that did not get it
whole, or got one that did not match, asks again; one publish serves every device subscribed, so however many ask, a
payload is published again only while its round is open and with a back-off within the round: ``REPUBLISH_MIN_S``
after its first publish, then twice as long after each publish again, at most ``REPUBLISH_MAX_S``. The async mode
keys payloads by (version, plan) and keeps those of the versions its tasks in flight use (``keep_only``). A device asks
only while its subscription is granted (device_runtime/payload_wait.py), so the asks that remain mean the broker
lost its retained copy or someone overwrote it; a fleet asking at staggered times costs a few publishes, not one a
second for as long as the asks come.
"""
from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from device_runtime.payload import PayloadRef, encode_payload, payload_ref

REPUBLISH_MIN_S = 1.0
"""Seconds between a payload's first publish and its first publish again, at least."""
REPUBLISH_MAX_S = 16.0
"""The back-off between two publishes again of one payload stops growing here: a device whose copy was lost late in
a long round waits at most this long (and its own ``ASK_AGAIN_S``) for it."""


class PlanPayloads:
    """The open round's payload of each plan: encoded once, its bytes handed out to publish once, and again on
    request (with the back-off of ``republish_gap``)."""

    def __init__(self) -> None:
        self._refs: dict[Hashable, PayloadRef] = {}
        self._data: dict[str, bytes] = {}
        self._published_at: dict[str, float] = {}
        self._republished: dict[str, int] = {}  # sha256 -> publishes again this round

    def open_round(self) -> None:
        """Forget the last round's payloads (their devices' tasks are closed)."""
        self._refs, self._data, self._published_at, self._republished = {}, {}, {}, {}

    def get(self, key: Hashable, tensors: dict[str, np.ndarray], now: float) -> tuple[PayloadRef, bytes | None]:
        """The reference of plan ``key``'s payload (``tensors``, encoded on first use in the round) and its bytes when
        they are yet to be published this round (once: None afterwards)."""
        ref = self._refs.get(key)
        if ref is None:
            data = encode_payload(tensors)
            ref = self._refs[key] = payload_ref(data)
            self._data[ref.sha256] = data
        if ref.sha256 in self._published_at:
            return ref, None
        self._published_at[ref.sha256] = now
        return ref, self._data[ref.sha256]

    def keep_only(self, keys: set[Hashable]) -> list[PayloadRef]:
        """Forget every payload but those of ``keys`` (the async mode's versions still in use): returns the forgotten
        ones that were published, whose retained copies the driver deletes."""
        kept = {key: ref for key, ref in self._refs.items() if key in keys}
        held = {ref.sha256 for ref in kept.values()}  # two keys may name one payload (equal tensors)
        dropped = list({ref.sha256: ref for ref in self._refs.values() if ref.sha256 not in held}.values())
        self._refs = kept
        for ref in dropped:
            self._data.pop(ref.sha256, None)
            self._republished.pop(ref.sha256, None)
        return [ref for ref in dropped if self._published_at.pop(ref.sha256, None) is not None]

    def ref_of(self, key: Hashable) -> PayloadRef | None:
        """The reference of plan ``key``'s payload this round, None before its first task."""
        return self._refs.get(key)

    def requested(self, ref: PayloadRef, now: float) -> bytes | None:
        """The bytes of payload ``ref`` to publish again for a device that asks, or None: not a payload of the open
        round, or published less than ``republish_gap`` ago (that publish serves this device too)."""
        data = self._data.get(ref.sha256)
        if data is None or len(data) != ref.nbytes:
            return None
        again = self._republished.get(ref.sha256, 0)
        if now - self._published_at.get(ref.sha256, float("-inf")) < republish_gap(again):
            return None
        self._published_at[ref.sha256] = now
        self._republished[ref.sha256] = again + 1
        return data


def republish_gap(again: int) -> float:
    """Seconds after a payload's last publish before it is published once more, when it was published again
    ``again`` times this round: REPUBLISH_MIN_S, doubling, at most REPUBLISH_MAX_S."""
    return min(REPUBLISH_MAX_S, REPUBLISH_MIN_S * 2.0 ** again)
