"""The benchmarks' sweeps (scripts/bench_accuracy.py, bench_privacy.py, bench_async.py): every run of a sweep in
this process (``--jobs 1``), in ``--jobs`` worker processes, or as Ray tasks on a cluster (``--ray [ADDRESS]``,
each asking Ray for the run's CPUs and GPUs).

A run that raises is run once more; one that fails again is reported (``SweepResult.failures``: its item, error
and attempts), never dropped. A run on a Ray node that dies is run again elsewhere by Ray itself, from the same
item, so it returns what it would have. After each run ends a progress line says how many are done, running and
queued. Results come back in the items' order. The run function must be picklable: a module-level function (a
script's functions go to Ray workers by value, so the worker needs only the project's installed packages)."""
from __future__ import annotations

import math
import multiprocessing
import sys
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

ATTEMPTS = 2
"""A run is tried this often before it is reported as failed."""


@dataclass(frozen=True)
class Resources:
    """What one run asks of a Ray node."""

    cpus: float = 1.0
    gpus: float = 0.0


@dataclass(frozen=True)
class Failure:
    """A run that failed every attempt: its item's label, the last error's line, the attempts."""

    label: str
    error: str
    attempts: int


@dataclass
class SweepResult:
    """Each item's result in order (None where it failed) and the failures."""

    results: list[Any]
    failures: list[Failure] = field(default_factory=list)

    @property
    def finished(self) -> list[Any]:
        return [r for r in self.results if r is not None]


_READY: set[tuple] = set()
"""The initializers this worker process has run (a Ray worker runs each once, as a pool's worker does)."""


def _initialized(initializer: Callable[..., None] | None, init_args: tuple) -> None:
    key = (getattr(initializer, "__qualname__", None), init_args)
    if initializer is not None and key not in _READY:
        initializer(*init_args)
        _READY.add(key)


def _call(run: Callable[[Any], Any], initializer: Callable[..., None] | None, init_args: tuple, item: Any) -> Any:
    """One run in a worker (a pool's or Ray's): the worker's initializer once, then the run."""
    _initialized(initializer, init_args)
    return run(item)


def _error_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # Ray's RayTaskError carries the run's own exception
    return traceback.format_exception_only(type(cause or exc), cause or exc)[-1].strip()


class _Deferred:
    """A run of a one-job sweep: run in this process when the sweep waits for it."""

    def __init__(self, call: Callable[[], Any]):
        self.call, self.outcome, self.error = call, None, None

    def run(self) -> None:
        try:
            self.outcome = self.call()
        except Exception as exc:
            self.error = exc


class _Local:
    """Runs in this process (jobs = 1) or in a pool of spawned worker processes."""

    def __init__(self, run: Callable, jobs: int, initializer: Callable | None, init_args: tuple):
        self.run, self.jobs, self.initializer, self.init_args = run, jobs, initializer, init_args
        self.pool: ProcessPoolExecutor | None = None

    def capacity(self) -> int:
        return self.jobs

    def submit(self, item: Any) -> Future | _Deferred:
        if self.jobs == 1:
            return _Deferred(lambda: _call(self.run, self.initializer, self.init_args, item))
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
        return self.pool.submit(_call, self.run, self.initializer, self.init_args, item)

    def wait(self, handles: list) -> list:
        if self.jobs == 1:
            handles[0].run()
            return handles[:1]
        return list(wait(handles, return_when=FIRST_COMPLETED).done)

    def result(self, handle: Future | _Deferred) -> Any:
        if isinstance(handle, _Deferred):
            if handle.error is not None:
                raise handle.error
            return handle.outcome
        try:
            return handle.result()
        except BrokenProcessPool:  # a worker died: a new pool for what runs next
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class _Ray:
    """Runs as Ray tasks, as many at once as the cluster's CPUs (and GPUs) hold (more wait in this queue)."""

    def __init__(self, run: Callable, resources: Resources, initializer: Callable | None, init_args: tuple):
        from server.ray_cluster import ray_module, require_resources

        ray = ray_module()
        self.ray, self.resources = ray, resources
        require_resources(resources.cpus, resources.gpus)
        module = sys.modules.get(getattr(run, "__module__", ""), None)
        if module is not None and module.__name__ != "__main__" and module.__name__.split(".")[0] not in (
                "server", "export", "fedcore", "device_runtime"):  # a script's module: its code goes along
            ray.cloudpickle.register_pickle_by_value(module)
        self.task = ray.remote(_call).options(num_cpus=resources.cpus, num_gpus=resources.gpus)
        self.run = ray.put(run)
        self.initializer, self.init_args = initializer, init_args

    def capacity(self) -> int:
        have = self.ray.cluster_resources()  # the nodes alive now: fewer runs at once after one is lost
        fits = [math.floor(have.get("CPU", 0) / self.resources.cpus)] if self.resources.cpus else []
        fits += [math.floor(have.get("GPU", 0) / self.resources.gpus)] if self.resources.gpus else []
        return max(1, min(fits, default=1))

    def submit(self, item: Any) -> Any:
        return self.task.remote(self.run, self.initializer, self.init_args, item)

    def wait(self, handles: list[Any]) -> list[Any]:
        done, _ = self.ray.wait(handles, num_returns=1)
        return done

    def result(self, handle: Any) -> Any:
        return self.ray.get(handle)

    def close(self) -> None:
        pass


def run_sweep(run: Callable[[Any], Any], items: Sequence[Any], *, jobs: int = 1, ray: str | None = None,
              resources: Resources = Resources(), initializer: Callable[..., None] | None = None,
              init_args: tuple = (), label: Callable[[Any], str] = str,
              on_result: Callable[[int, Any], None] | None = None, emit: Callable[[str], None] = print,
              attempts: int = ATTEMPTS) -> SweepResult:
    """``run(item)`` for every item (see the module docstring): here or in ``jobs`` processes, or on the Ray
    cluster at ``ray`` (``server.cli.LOCAL_RAY``: this machine's); ``on_result(index, result)`` as each succeeds."""
    if ray is not None:
        from server.ray_cluster import connected

        with connected(ray):
            return _sweep(_Ray(run, resources, initializer, init_args), items, label, on_result, emit, attempts)
    return _sweep(_Local(run, jobs, initializer, init_args), items, label, on_result, emit, attempts)


def _sweep(runner: _Local | _Ray, items: Sequence[Any], label: Callable[[Any], str],
           on_result: Callable[[int, Any], None] | None, emit: Callable[[str], None], attempts: int) -> SweepResult:
    outcome = SweepResult([None] * len(items))
    queued = deque(range(len(items)))
    tries = [0] * len(items)
    running: dict[Any, int] = {}
    done, report = 0, False
    try:
        while queued or running:
            while queued and len(running) < runner.capacity():
                index = queued.popleft()
                tries[index] += 1
                running[runner.submit(items[index])] = index
            if report:  # after the next runs started: what runs now
                emit(_progress(done, len(items), len(running), len(queued), len(outcome.failures)))
            for handle in runner.wait(list(running)):
                index = running.pop(handle)
                try:
                    outcome.results[index] = runner.result(handle)
                except Exception as exc:
                    error = _error_line(exc)
                    if tries[index] < attempts:
                        emit(f"sweep: {label(items[index])} failed ({error}); running it once more")
                        queued.appendleft(index)
                        continue
                    outcome.failures.append(Failure(label(items[index]), error, tries[index]))
                    emit(f"sweep: {label(items[index])} failed {tries[index]} times, reported: {error}")
                else:
                    if on_result is not None:
                        on_result(index, outcome.results[index])
                done += 1
            report = True
        emit(_progress(done, len(items), 0, 0, len(outcome.failures)))
    finally:
        runner.close()
    return outcome


def _progress(ended: int, total: int, running: int, queued: int, failed: int) -> str:
    return (f"sweep: {ended - failed}/{total} done, {running} running, {queued} queued"
            + (f", {failed} failed" if failed else ""))


def failure_lines(failures: list[Failure]) -> list[str]:
    """One line per failed run, for a script's closing report."""
    return [f"FAILED after {f.attempts} attempts: {f.label}: {f.error}" for f in failures]
