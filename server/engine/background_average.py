"""A StreamingAverage whose arithmetic runs on a worker thread: the read path opens the next update while the last
one is folded.

Folding (torch: concatenations, one matrix product per full factor buffer, dense adds) releases the GIL, and on the
server it is most of a round's CPU; opening an update (SHA-256, JSON, checks) is the rest. In one thread they take
turns; here ``add`` checks the update at once (a malformed one raises ValueError in the caller, as
``StreamingAverage.add`` does, and nothing of it counts) and hands the arithmetic to one worker thread, which adds
the updates in the order ``add`` was called. One thread, one order, the same operations: the sums are the in-line
average's bit for bit (the fold order stays the caller's: ``server.engine.fold_order``). Every read (``partial``,
``result``, ``merge``) waits for the updates handed over so far. At most ``max_queued_bytes`` of tensors wait for the
worker (``add`` blocks past it): the server's memory stays bounded. An error in the worker (a bug, or memory) is
kept and raised as FoldFailed by the next ``add`` or read, never a hang; the average is unusable from then on.
The worker thread exists only while updates wait: it ends when the queue is empty, so nothing needs closing.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from server.engine.aggregate import CheckedUpdate, PartialSum, StreamingAverage

MAX_QUEUED_BYTES = 32 << 20
"""Tensor bytes handed to the worker and not yet added (about ten of FedAvgCNN's largest updates): room to overlap
opening with folding, a small bound on the memory it adds."""
WAIT_POLL_S = 1.0
"""How often a waiting caller checks that the worker thread is still alive (it ends only by finishing or failing)."""


class FoldFailed(RuntimeError):
    """The worker thread could not add an update: the round's sums are incomplete."""


class BackgroundAverage:
    """``StreamingAverage``'s interface (add, partial, merge, result), folded on a worker thread (module docstring)."""

    def __init__(self, average: StreamingAverage, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.average = average
        self.max_queued_bytes = max_queued_bytes
        self._jobs: deque[CheckedUpdate] = deque()
        self._queued_bytes = 0
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._cond = threading.Condition()

    @property
    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.average.dense_shapes

    def add(self, client_fe: dict[str, torch.Tensor], num_samples: int) -> None:
        """Check ``client_fe`` now (ValueError, nothing counted) and queue its arithmetic for the worker."""
        update = self.average.check(client_fe, num_samples)
        with self._cond:
            self._wait(lambda: not self._jobs or self._queued_bytes + update.nbytes <= self.max_queued_bytes)
            self._jobs.append(update)
            self._queued_bytes += update.nbytes
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="fold", daemon=True)
                self._worker.start()

    def drain(self) -> None:
        """Wait until every update handed over so far is added; FoldFailed if the worker failed."""
        with self._cond:
            self._wait(lambda: self._worker is None)

    def partial(self) -> PartialSum:
        self.drain()
        return self.average.partial()

    def merge(self, other: PartialSum) -> None:
        self.drain()
        self.average.merge(other)

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        self.drain()
        return self.average.result(dtype)

    def _wait(self, done: Callable[[], bool]) -> None:
        """Under the lock: wait until ``done()``, raising FoldFailed once the worker failed or vanished."""
        while True:
            if self._failure is not None:
                raise FoldFailed(f"folding an update on the worker thread failed: {self._failure!r}") \
                    from self._failure
            if done():
                return
            worker = self._worker
            if worker is not None and not worker.is_alive() and self._worker is worker:
                self._failure = RuntimeError("the fold thread ended with updates still queued")
                continue
            self._cond.wait(WAIT_POLL_S)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._worker = None
                    self._cond.notify_all()
                    return
                update = self._jobs[0]
            try:
                self.average.accumulate(update)
            except BaseException as exc:  # kept for the caller: a worker must not die silently
                with self._cond:
                    self._failure = exc
                    self._jobs.clear()
                    self._queued_bytes = 0
                    self._worker = None
                    self._cond.notify_all()
                return
            with self._cond:
                self._jobs.popleft()
                self._queued_bytes -= update.nbytes
                self._cond.notify_all()
