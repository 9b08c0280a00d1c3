"""An endpoint's queue of complete inbound messages, bounded whatever arrives.

While a device trains, its main loop takes nothing from the queue, and on an open broker anyone can publish
complete messages meanwhile. Each message is screened as it completes (``screen``, on the MQTT network thread: the
device checks tag, counter and session without changing its state, and drops at once, with its logged reason,
what it would refuse anyway). What passes is queued under its kind: a newer message of a kind replaces the one
queued (a device uses only the newest PLAN, TASK or ERROR). The queue also holds at most ``budget_bytes``; past
that, the oldest queued messages are dropped. Every drop is counted (``dropped``) and logged.

A server must lose no update, so its queue (``wait=True``) drops nothing: a message that does not fit waits in
``put`` (on the MQTT network thread) until the reader took enough. paho then reads no more from the socket and
acknowledges nothing more, so the broker holds the rest: backpressure instead of an unbounded queue. One message
larger than the budget still passes once the queue is empty; ``release`` ends every wait for good (on stop).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

LOG = logging.getLogger("fedara.transport")

Screen = Callable[[str, bytes], "Hashable | None"]
"""(topic, payload) -> the kind to queue the payload under, or None to drop it (the screen logs why)."""


class Inbox:
    """A FIFO of (topic, payload), at most one per kind and at most ``budget_bytes`` in all (see the module
    docstring); without a screen every payload is its own kind."""

    def __init__(self, budget_bytes: int | None = None, screen: Screen | None = None, *, wait: bool = False) -> None:
        if wait and screen is not None:
            raise ValueError("an Inbox that waits keeps every message: it takes no screen")
        self.budget_bytes, self.screen, self.wait = budget_bytes, screen, wait
        self.dropped = 0
        self.peak_bytes = 0  # the most the queue held at once
        self._released = False
        self._queue: list[tuple[Hashable, str, bytes]] = []
        self._held = 0
        self._ready = threading.Condition()

    @property
    def held_bytes(self) -> int:
        """Bytes of the payloads queued now."""
        return self._held

    def put(self, topic: str, payload: bytes) -> bool:
        """Queue ``payload`` unless the screen drops it (False), dropping what it supersedes or pushes out; with
        ``wait``, once it fits (see the module docstring)."""
        if self.screen is None:
            kind: Hashable = object()  # a kind of its own: nothing supersedes it
        else:
            kind = self.screen(topic, payload)
            if kind is None:
                self.dropped += 1
                return False
        with self._ready:
            if self.wait:
                self._ready.wait_for(lambda: self._fits(len(payload)))
            elif self.budget_bytes is not None and len(payload) > self.budget_bytes:
                self.dropped += 1
                LOG.warning("dropped a %d-byte message on %s before it was handled: over the %d-byte queue",
                            len(payload), topic, self.budget_bytes)
                return False
            for entry in [e for e in self._queue if e[0] == kind]:
                self._drop(entry, "a newer one of its kind arrived")
            while not self.wait and self.budget_bytes is not None and self._held + len(payload) > self.budget_bytes:
                self._drop(self._queue[0], f"the queue holds {self.budget_bytes} bytes at most")
            self._queue.append((kind, topic, payload))
            self._held += len(payload)
            self.peak_bytes = max(self.peak_bytes, self._held)
            self._ready.notify_all()
        return True

    def set_budget(self, budget_bytes: int | None) -> None:
        """Hold at most ``budget_bytes`` from now on (what is queued stays; a waiting ``put`` that fits now goes on)."""
        with self._ready:
            self.budget_bytes = budget_bytes
            self._ready.notify_all()

    def _fits(self, size: int) -> bool:
        """Whether a waiting ``put`` of ``size`` bytes may queue now."""
        return self._released or not self._queue or self.budget_bytes is None or self._held + size <= self.budget_bytes

    def release(self) -> None:
        """End every wait in ``put`` for good (the endpoint stops: its network thread must not hang)."""
        with self._ready:
            self._released = True
            self._ready.notify_all()

    def _drop(self, entry: tuple[Hashable, str, bytes], why: str) -> None:
        self._queue.remove(entry)
        self._held -= len(entry[2])
        self.dropped += 1
        LOG.warning("dropped a queued message on %s before it was handled (%d so far): %s", entry[1], self.dropped,
                    why)

    def get(self, timeout: float | None = None) -> tuple[str, bytes] | None:
        """The oldest queued (topic, payload), or None when none arrives within ``timeout`` seconds."""
        with self._ready:
            if not self._queue and not self._ready.wait_for(lambda: bool(self._queue), timeout):
                return None
            _, topic, payload = self._queue.pop(0)
            self._held -= len(payload)
            self._ready.notify_all()  # a put waiting for room
            return topic, payload
