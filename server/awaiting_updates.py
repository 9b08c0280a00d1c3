"""An aggregator member's updates awaiting the engine's verdict: a few in memory, the rest in files.

A member sends the engine a receipt for each update it verified and folds the update only when the engine's verdict
says "fold". The verdicts come back on the member's own connection, queued by the broker behind the update frames it
holds for that member, so in a burst most of a member's updates await at once: at K = 1,000 with 2 members, ~500
updates of 2.2 MB (peak RSS 1.2–1.3 GiB). Past ``memory_bytes`` this store writes each awaiting update's tensors to
one file of its ``FileSpill`` (the member's WORKDIR/spill/awaiting, removed when it exits) and reads it back on the
verdict: the page cache holds them, not the process, so what a member holds is bounded by its budgets, not by K. The
bytes read back are the bytes written, so the fold (in verdict order, as before) is bit-identical.

Why files and not a second MQTT connection for the engine's messages (verdicts not queued behind updates, and the
member stopping its reads while too many await): that bound holds only while every verdict comes. A verdict lost
(the member's engine connection dropped; the close makes it good) would leave the member, its awaiting budget full,
reading nothing until the round's deadline, and losing the updates still at the broker. Files change neither the
protocol, nor what the member reads when, nor any check; their cost is a write and a read of each update past the
budget through the page cache (bounded: one update per device a round, as the read spill).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from device_runtime.spill import FileSpill

LOG = logging.getLogger("fedara.aggregator")
AWAITING_DIR = "awaiting"
"""Folder of a member's spill folder where its awaiting updates past the memory budget wait."""


@dataclass(frozen=True)
class Filed:
    """Where an awaiting update's tensors lie in its file: (name, dtype, shape, offset) each, and its sample count."""

    layout: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]
    size: int
    num_samples: int


class AwaitingUpdates:
    """Device -> (tensors, sample count) of the updates awaiting a verdict: up to ``memory_bytes`` of tensors in
    memory, past that each in a file of ``spill`` (None: all in memory)."""

    def __init__(self, memory_bytes: int, spill: FileSpill | None) -> None:
        self.memory_bytes, self.spill = memory_bytes, spill
        self.held: dict[str, tuple[dict[str, np.ndarray], int]] = {}
        self.filed: dict[str, Filed] = {}
        self.in_memory = 0  # bytes of tensors held now
        self.peak_in_memory = 0
        self.spilled = 0  # updates written to files by this store (a member makes one a round: Aggregator.on_brief)

    def __contains__(self, device_id: object) -> bool:
        return device_id in self.held or device_id in self.filed

    def __iter__(self) -> Iterator[str]:
        return iter([*self.held, *self.filed])

    def __len__(self) -> int:
        return len(self.held) + len(self.filed)

    def put(self, device_id: str, weights: dict[str, np.ndarray], num_samples: int) -> None:
        """Keep ``device_id``'s update (replacing any it held): in memory within the budget, else in a file (in
        memory, logged, where the file cannot be written: a full disk loses no update)."""
        self._discard(device_id)
        size = sum(a.nbytes for a in weights.values())
        if self.spill is not None and size and self.in_memory + size > self.memory_bytes:
            try:
                self.filed[device_id] = self._write(device_id, weights, num_samples)
                self.spilled += 1
                return
            except OSError as exc:
                LOG.warning("could not keep %s's awaiting update in a file (%s): holding it in memory", device_id, exc)
        self.held[device_id] = (weights, num_samples)
        self.in_memory += size
        self.peak_in_memory = max(self.peak_in_memory, self.in_memory)

    def take(self, device_id: str) -> tuple[dict[str, np.ndarray], int] | None:
        """``device_id``'s update, no longer held; None where none is (or its file could not be read: logged)."""
        if device_id in self.held:
            held = self.held[device_id]
            self._discard(device_id)
            return held
        filed = self.filed.pop(device_id, None)
        if filed is None:
            return None
        try:
            data = self.spill.take(self._key(device_id), filed.size)
        except OSError as exc:
            LOG.warning("could not read %s's awaiting update back from its file: %s", device_id, exc)
            return None
        weights = {name: np.frombuffer(data, dtype, int(np.prod(shape, dtype=np.int64)), offset).reshape(shape)
                   for name, dtype, shape, offset in filed.layout}
        return weights, filed.num_samples

    def clear(self) -> None:
        """Drop every update held (a new round), their files removed."""
        for device_id in self.filed:
            self.spill.drop(self._key(device_id))
        self.held, self.filed, self.in_memory = {}, {}, 0

    def _discard(self, device_id: str) -> None:
        if device_id in self.held:
            self.in_memory -= sum(a.nbytes for a in self.held.pop(device_id)[0].values())
        elif self.filed.pop(device_id, None) is not None:
            self.spill.drop(self._key(device_id))

    @staticmethod
    def _key(device_id: str) -> tuple[str, str]:
        return AWAITING_DIR, device_id

    def _write(self, device_id: str, weights: dict[str, np.ndarray], num_samples: int) -> Filed:
        layout, offset = [], 0
        try:
            for name, array in weights.items():
                flat = np.ascontiguousarray(array).reshape(-1)
                self.spill.write(self._key(device_id), offset, memoryview(flat.view(np.uint8)))
                layout.append((name, array.dtype, array.shape, offset))
                offset += array.nbytes
        except OSError:
            self.spill.drop(self._key(device_id))
            raise
        return Filed(tuple(layout), offset, num_samples)
