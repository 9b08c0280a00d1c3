"""The order a round's accepted updates are folded in: device id, never arrival.

Float sums depend on their order, and a run must not depend on which device answered first. An update waits only
for the training devices before it that may still answer; past ``max_held_bytes`` of waiting updates they are
folded at once (in id order among themselves), so a slow low-id device cannot make the server hold the round; an
update that arrives after its turn was passed over is folded at once too, never held.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

MAX_HELD_BYTES = 128 << 20
"""Accepted updates that may wait for a slower, lower-id device before being folded (order-independence): a bound on
the server's memory too (at K = 1,000 it is reached in every round; docs/scale.md)."""

Item = TypeVar("Item")


class FoldOrder(Generic[Item]):
    """The round's training devices in id order, the updates held until their turn, and the next turn."""

    def __init__(self, devices: Iterable[str] = (), max_held_bytes: int = MAX_HELD_BYTES) -> None:
        self.order = sorted(devices)
        self.position = {d: i for i, d in enumerate(self.order)}
        self.next = 0
        self.held: dict[str, tuple[Item, int]] = {}
        self.held_bytes = 0
        self.max_held_bytes = max_held_bytes

    def hold(self, device_id: str, item: Item, nbytes: int) -> None:
        """Keep ``device_id``'s accepted update (``nbytes`` of tensors) until its turn."""
        self.held[device_id] = (item, nbytes)
        self.held_bytes += nbytes

    def ready(self, may_answer: Callable[[str], bool], *, closing: bool = False) -> list[tuple[str, Item]]:
        """The held updates whose turn has come, in id order: each one not preceded by a device that
        ``may_answer`` still (every one when ``closing``, or while more than ``max_held_bytes`` wait). Those whose turn
        was passed over (the device was not expected any more, or past ``max_held_bytes``) come first."""
        out = [(d, self._take(d)) for d in sorted(d for d in self.held if self.position.get(d, -1) < self.next)]
        while self.next < len(self.order):
            device_id = self.order[self.next]
            if device_id in self.held:
                out.append((device_id, self._take(device_id)))
            elif not (closing or self.overflowing) and may_answer(device_id):
                break
            self.next += 1
        return out

    def _take(self, device_id: str) -> Item:
        item, nbytes = self.held.pop(device_id)
        self.held_bytes -= nbytes
        return item

    @property
    def overflowing(self) -> bool:
        """More than ``max_held_bytes`` wait for a slower device."""
        return self.held_bytes > self.max_held_bytes
