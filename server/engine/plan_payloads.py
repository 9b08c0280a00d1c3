"""The round's tensors once per plan: each plan's payload of the open round, content-addressed, published once
(no I/O: ``now`` given).

Devices of one plan get the same tensors in a round. So a TASK names its plan's payload by SHA-256 and size
(device_runtime/payload.py) and the driver publishes each payload once, retained, for every device of the plan: a
round of K devices at P plans sends P payloads and K small TASKs instead of K models. A device that did not get it
whole, or got one that did not match, asks again; a payload is published again at most every ``REPUBLISH_MIN_S``
however many ask (one publish serves every device subscribed), and only while its round is open.
"""
from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from device_runtime.payload import PayloadRef, encode_payload, payload_ref

REPUBLISH_MIN_S = 1.0
"""Seconds between two publishes of one payload, at least."""


class PlanPayloads:
    """The open round's payload of each plan: encoded once, its bytes handed out to publish once, and again on
    request (at most every REPUBLISH_MIN_S)."""

    def __init__(self) -> None:
        self._refs: dict[Hashable, PayloadRef] = {}
        self._data: dict[str, bytes] = {}
        self._published_at: dict[str, float] = {}

    def open_round(self) -> None:
        """Forget the last round's payloads (their devices' tasks are closed)."""
        self._refs, self._data, self._published_at = {}, {}, {}

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

    def ref_of(self, key: Hashable) -> PayloadRef | None:
        """The reference of plan ``key``'s payload this round, None before its first task."""
        return self._refs.get(key)

    def requested(self, ref: PayloadRef, now: float) -> bytes | None:
        """The bytes of payload ``ref`` to publish again for a device that asks, or None: not a payload of the open
        round, or published less than REPUBLISH_MIN_S ago (that publish serves this device too)."""
        data = self._data.get(ref.sha256)
        if data is None or len(data) != ref.nbytes:
            return None
        if now - self._published_at.get(ref.sha256, float("-inf")) < REPUBLISH_MIN_S:
            return None
        self._published_at[ref.sha256] = now
        return data
