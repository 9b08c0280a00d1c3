"""The in-process devices of ``server.simulate --workers N``: a round's devices train in N worker processes.

Each worker owns a fixed share of the devices (device i of the sorted ids goes to worker i mod N) with their
shards and personal tensors, sent once when the pool starts; a round sends each worker its devices' tasks and
gets back, per device, the update and the personal tensors it now holds (the server's checkpoint keeps them).
A worker answers a task with the very ``InProcessDevice.answer`` of the sequential run, at the same torch and
BLAS thread counts (``server.compute_threads``), and the updates are handed back in the order of the tasks, so
the engine sees what it sees with ``--workers 1``, bit for bit. Workers are started with the 'spawn' context
(torch and fork do not mix); an error in a worker comes back as a ``WorkerError`` naming the worker and device.
"""
from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

START_METHOD = "spawn"


class WorkerError(RuntimeError):
    """A worker failed (its traceback's last line in the message) or exited before it answered."""


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker needs to build trainers the way the sequential run does."""

    backend: str
    threads: int
    device: str = "cpu"
    models: tuple[str, ...] = ()  # --model's specs: a user's model code is imported before any plan is unpickled


@dataclass
class DeviceState:
    """One device as a worker receives it: its shard, plan and personal tensors."""

    device_id: str
    shard: Any
    plan_hash: str
    personal: dict[str, np.ndarray]


def assign(device_ids: Iterable[str], workers: int) -> dict[str, int]:
    """Device -> worker index: the i-th of the sorted ids goes to worker i mod ``workers``."""
    return {d: i % workers for i, d in enumerate(sorted(device_ids))}


def import_user_models(models: tuple[str, ...]) -> None:
    """Import the code of every --model file or module in this process (a worker's, a Ray task's): a model file's
    classes are found by the name the server imported it under, before any plan is unpickled."""
    from fedcore.model_spec import parse_model_spec
    from fedcore.models import ARCHITECTURES, import_model_code

    for spec in (parse_model_spec(text, tuple(ARCHITECTURES)) for text in models):
        if not spec.is_zoo:
            import_model_code(spec)


def _worker_main(conn: Connection, settings: WorkerSettings) -> None:
    """A worker's loop: 'adopt' devices and plans once, then answer 'tasks' until 'stop' (or the pipe closes)."""
    # Imported here: a spawned worker loads torch and the trainers only once it runs.
    from server.compute_threads import use_server_threads
    from server.in_process import InProcessDevice, Trainers

    use_server_threads(settings.threads)
    import_user_models(settings.models)
    plans: dict[str, Any] = {}
    trainers = Trainers(settings.backend, plans, settings.threads, settings.device)
    devices: dict[str, InProcessDevice] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        kind = message[0]
        if kind == "stop":
            return
        current = None
        try:
            if kind == "adopt":
                _, states, new_plans = message
                plans.update(new_plans)
                for state in states:
                    device = InProcessDevice(state.device_id, state.shard, trainers, settings.threads)
                    device.plan_hash, device.personal = state.plan_hash, state.personal
                    devices[state.device_id] = device
                conn.send(("ok", None))
            elif kind == "tasks":
                answers = []
                for device_id, task in message[1]:
                    current = device_id
                    update = devices[device_id].answer(task)
                    answers.append((device_id, update, devices[device_id].personal))
                conn.send(("ok", answers))
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as exc:  # the parent names the worker and device and stops the run
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            conn.send(("error", (current, last)))


class DevicePool:
    """N worker processes answering the tasks of a round for the devices they own."""

    def __init__(self, devices: dict[str, Any], plans: dict[str, Any], settings: WorkerSettings, workers: int):
        """Start ``workers`` processes (at most one per device) and send each its devices: ``devices`` maps id to an
        object with ``shard``, ``plan_hash`` and ``personal`` (the simulator's ``InProcessDevice``); ``plans``
        maps plan hash to its ``PlanArtifacts``."""
        workers = max(1, min(workers, len(devices)))
        self.owner = assign(devices, workers)
        context = multiprocessing.get_context(START_METHOD)
        self._conns: list[Connection] = []
        self._processes = []
        for index in range(workers):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(child, settings), daemon=True,
                                      name=f"simulate-worker-{index}")
            process.start()
            child.close()
            self._conns.append(parent)
            self._processes.append(process)
        shipped = {h: replace(p, files={}) for h, p in plans.items()}  # the files are for MQTT devices
        try:
            for index, conn in enumerate(self._conns):
                states = [DeviceState(d, devices[d].shard, devices[d].plan_hash, devices[d].personal)
                          for d, w in self.owner.items() if w == index]
                conn.send(("adopt", states, shipped))
            for index in range(workers):
                self._receive(index)
        except BaseException:
            self.close()
            raise

    def _receive(self, index: int) -> Any:
        try:
            status, payload = self._conns[index].recv()
        except (EOFError, ConnectionError, OSError):
            process = self._processes[index]
            process.join(timeout=5)
            raise WorkerError(f"simulate worker {index} exited before it answered (exit code {process.exitcode})") \
                from None
        if status == "error":
            device_id, last = payload
            where = f" on {device_id}" if device_id else ""
            raise WorkerError(f"simulate worker {index} failed{where}: {last}")
        return payload

    def answer(self, tasks: dict[str, Any]) -> list[tuple[str, Any, dict[str, np.ndarray]]]:
        """(device id, update, its personal tensors now) for every task, in the order of ``tasks``."""
        per_worker: list[list[tuple[str, Any]]] = [[] for _ in self._conns]
        for device_id, task in tasks.items():
            per_worker[self.owner[device_id]].append((device_id, task))
        busy = [i for i, share in enumerate(per_worker) if share]
        for index in busy:
            self._conns[index].send(("tasks", per_worker[index]))
        answered: dict[str, tuple[str, Any, dict[str, np.ndarray]]] = {}
        error: WorkerError | None = None
        for index in busy:  # collect every reply before raising, so no worker is left mid-message
            try:
                answered.update((a[0], a) for a in self._receive(index))
            except WorkerError as exc:
                error = error or exc
        if error:
            raise error
        return [answered[device_id] for device_id in tasks]

    def close(self) -> None:
        """Stop the workers (they also exit with this process: daemons)."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
            conn.close()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        self._conns, self._processes = [], []
