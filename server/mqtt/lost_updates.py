"""Updates lost half-received, and which of their devices to ask again now (a pure state machine, no I/O).

Hundreds of devices answering at once have that many updates half-received at the server: the broker interleaves
their frames. The server's reassembly budget is bounded, so past it the oldest incomplete update is pushed out, and
nothing else brings it back: a device sends its answer once unless asked again. Its device is asked again (its
task sent again, and it re-sends its saved answer), but at most ``at_once`` such answers are awaited at a time, in
the order they were lost: the re-sends come at the server's pace and do not push each other out as the first
burst did.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

AT_ONCE = 8
"""Devices asked again whose answer is awaited, at most."""


class LostUpdates:
    """The devices whose update was lost (in order) and those asked again whose answer has not come yet."""

    def __init__(self, at_once: int = AT_ONCE) -> None:
        if at_once < 1:
            raise ValueError(f"at_once must be >= 1, got {at_once}")
        self.at_once = at_once
        self.waiting: dict[str, None] = {}  # lost, not asked again yet (a dict: ordered, no repeats)
        self.asked: set[str] = set()

    def lost(self, device_ids: Iterable[str]) -> None:
        """These devices' updates were pushed out half-received (asked or not before: they are asked again)."""
        for device_id in device_ids:
            self.asked.discard(device_id)
            self.waiting[device_id] = None

    def to_ask(self, awaits: Callable[[str], bool]) -> list[str]:
        """The devices to ask again now: lost ones the round still ``awaits``, while fewer than ``at_once`` asked
        are still awaited. A device no longer awaited (its answer came, or its round closed) is forgotten."""
        self.asked = {d for d in self.asked if awaits(d)}
        out = []
        while self.waiting and len(self.asked) < self.at_once:
            device_id = next(iter(self.waiting))
            del self.waiting[device_id]
            if awaits(device_id):
                self.asked.add(device_id)
                out.append(device_id)
        return out
