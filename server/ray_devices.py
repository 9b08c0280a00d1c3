"""The simulator's devices as Ray tasks (``server.simulate --ray [ADDRESS]``): the ``--workers`` pool's interface
(``server.parallel_devices``), on a Ray cluster.

Each device's shard and each plan (with its ONNX files, for the onnxruntime backends) go into Ray's object store
once, put there by this process (the driver), which owns them: Ray copies them to the nodes that run the device's
tasks and keeps them there between rounds. A task takes a device's personal tensors (its head; for local
training its whole model) and its task from the driver (the task's global weights, the same for a round's devices
of one plan, go into the object store once a round), which holds them between rounds (the checkpoint writes
them), trains with the very ``InProcessDevice.answer`` of the sequential run at the same torch and BLAS thread
counts, and returns the update and the personal tensors it now holds. A task on a node that dies is run again
elsewhere by Ray (``MAX_RETRIES``) from the same inputs, which the driver's node still holds, so it returns the same
bits: the run's result does not change. Updates are handed to the engine in the order of the tasks (sync) or of
the virtual clock (async), so the engine sees what it sees with ``--workers 1``.

Each task asks Ray for ``--threads`` CPUs and, with ``--device cuda``, ``--ray-gpus`` of a GPU. A worker process
keeps the plans and trainers it has built (per plan, as a ``--workers`` worker does). What goes to the tasks and
back is counted as Ray serializes it (pickle protocol 5, buffers out of band) and printed after each round.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from server.parallel_devices import WorkerError, WorkerSettings, import_user_models
from server.ray_cluster import alive_nodes, ray_module, require_resources

MAX_RETRIES = 5
"""Ray re-runs a device task this many times when its worker or node dies (an error in the task itself is not
retried: it would fail again)."""

WEIGHTS_KEPT = 64
"""The global weights (per plan and version) kept in the object store for async tasks yet to be handed out."""

_PLANS: dict[str, Any] = {}
_TRAINERS: dict[WorkerSettings, Any] = {}
"""A Ray worker process's plans (by hash) and trainers (by settings), built once and kept between tasks."""


def local_plan(plan: Any) -> Any:
    """The plan with its artifact directory on this node: where the driver built it when this node sees that
    folder, else the plan's files written once under this node's temp folder."""
    if plan.artifacts is None or Path(plan.artifacts.directory).is_dir():
        return plan
    folder = Path(tempfile.gettempdir()) / "fedara-ray-plans" / plan.hash
    if not folder.is_dir():
        partial = folder.with_name(f"{plan.hash}.{os.getpid()}.partial")
        partial.mkdir(parents=True, exist_ok=True)
        for name, data in plan.files.items():
            (partial / name).write_bytes(data)
        try:
            partial.rename(folder)
        except OSError:  # another worker on this node wrote it first
            pass
    return replace(plan, artifacts=replace(plan.artifacts, directory=folder))


def _train(settings: WorkerSettings, device_id: str, plan_ref: list, plan_hash: str, shard: Any,
           personal: dict[str, np.ndarray], task: Any, weights_ref: list) -> tuple[Any, dict[str, np.ndarray], str]:
    """One device's task in a Ray worker: (update, its personal tensors now, the node it ran on). The task comes
    without its weights, which the round's devices of a plan share: ``weights_ref`` holds them (none: no weights)."""
    from server.compute_threads import use_server_threads
    from server.in_process import InProcessDevice, Trainers

    ray = ray_module()
    # A shard from the object store is read-only (no copy); training reads it, and torch warns of that once.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    if settings not in _TRAINERS:
        use_server_threads(settings.threads)
        import_user_models(settings.models)  # a model file is read at the same path on every node
        _TRAINERS[settings] = Trainers(settings.backend, _PLANS, settings.threads, settings.device)
    try:
        if plan_hash not in _PLANS:
            _PLANS[plan_hash] = local_plan(ray.get(plan_ref[0]))
        if weights_ref:
            task = replace(task, weights=ray.get(weights_ref[0]))
        device = InProcessDevice(device_id, shard, _TRAINERS[settings], settings.threads)
        device.plan_hash, device.personal = plan_hash, personal
        update = device.answer(task)
    except Exception as exc:  # one line for the driver's error (the whole traceback is in the worker's log)
        raise WorkerError(traceback.format_exception_only(type(exc), exc)[-1].strip()) from None
    return update, device.personal, ray.get_runtime_context().get_node_id()


def serialized_bytes(value: Any) -> int:
    """The bytes Ray moves for ``value``: its pickle (protocol 5) with the array buffers out of band, counted
    without copying them."""
    sizes: list[int] = []
    head = pickle.dumps(value, protocol=5, buffer_callback=lambda b: sizes.append(b.raw().nbytes))
    return len(head) + sum(sizes)


@dataclass
class Traffic:
    """What moved between the driver and the device tasks since the last line."""

    tasks: int = 0
    sent: int = 0
    returned: int = 0
    nodes: set[str] | None = None

    def line(self) -> str:
        return (f"ray: {self.tasks} device task(s) on {len(self.nodes or ())} node(s): {self.sent / 1e6:.3f} MB to "
                f"them, {self.returned / 1e6:.3f} MB back (object store and task arguments)")


class RayDevicePool:
    """The devices' tasks on a Ray cluster (see the module docstring); ``answer`` as ``DevicePool.answer``, and
    ``submit``/``result`` for tasks that train while the driver's virtual clock runs (async)."""

    def __init__(self, devices: dict[str, Any], plans: dict[str, Any], settings: WorkerSettings, gpus: float,
                 emit: Callable[[str], None] = print):
        """``devices``: id -> the driver's ``InProcessDevice`` (shard, plan hash, personal tensors, which this
        pool keeps current); ``plans``: hash -> ``PlanArtifacts``; the caller is connected to Ray
        (``server.ray_cluster.connected``)."""
        ray = ray_module()
        self._ray, self.devices, self.settings, self.emit = ray, devices, settings, emit
        task_gpus = gpus if settings.device == "cuda" else 0
        require_resources(settings.threads, task_gpus)
        self._remote = ray.remote(_train).options(num_cpus=settings.threads, num_gpus=task_gpus,
                                                  max_retries=MAX_RETRIES, retry_exceptions=False)
        self._plans = {h: ray.put(p) for h, p in plans.items()}
        self._shards = {d: ray.put(device.shard) for d, device in devices.items()}
        once = sum(serialized_bytes(p) for p in plans.values()) + sum(
            serialized_bytes(device.shard) for device in devices.values())
        self.emit(f"ray: {len(self._shards)} shards and {len(self._plans)} plan(s) put in the object store once "
                  f"({once / 1e6:.2f} MB); {len(alive_nodes())} node(s), "
                  f"{ray.cluster_resources().get('CPU', 0):g} CPUs")
        self.traffic = Traffic(nodes=set())
        self._weights: dict[int, tuple[dict, Any]] = {}

    def _weights_ref(self, weights: dict[str, np.ndarray]) -> list:
        """The object holding ``weights`` (the engine hands a round's devices of one plan the same dict: it goes
        into the object store once); [] for none."""
        if not weights:
            return []
        key = id(weights)
        if key not in self._weights:
            while len(self._weights) >= WEIGHTS_KEPT:  # the oldest first (async keeps dispatching new versions)
                del self._weights[next(iter(self._weights))]
            self._weights[key] = (weights, self._ray.put(weights))  # the dict kept: its id stays its own
            self.traffic.sent += serialized_bytes(weights)
        return [self._weights[key][1]]

    def submit(self, device_id: str, task: Any) -> Any:
        """Start the device's task on the cluster with its personal tensors as the driver holds them now."""
        device = self.devices[device_id]
        weights = self._weights_ref(task.weights)
        bare = replace(task, weights={}) if weights else task
        self.traffic.tasks += 1
        self.traffic.sent += serialized_bytes((device.personal, bare))
        return self._remote.remote(self.settings, device_id, [self._plans[device.plan_hash]], device.plan_hash,
                                   self._shards[device_id], device.personal, bare, weights)

    def result(self, device_id: str, handle: Any) -> Any:
        """The task's update, once it is done; the device's personal tensors here become the task's."""
        try:
            update, personal, node = self._ray.get(handle)
        except self._ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, WorkerError) else str(exc).strip().splitlines()[-1]
            raise WorkerError(f"ray task of {device_id} failed: {cause}") from None
        except self._ray.exceptions.RayError as exc:  # its worker or node died more than MAX_RETRIES times
            raise WorkerError(f"ray task of {device_id} was lost: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]}") from None
        self.traffic.returned += serialized_bytes((update, personal))
        self.traffic.nodes.add(node)
        self.devices[device_id].personal = personal
        return update

    def answer(self, tasks: dict[str, Any]) -> list[tuple[str, Any, dict[str, np.ndarray]]]:
        """(device id, update, its personal tensors now) for every task, in the order of ``tasks``; then the line of
        what moved since the last one."""
        handles = {device_id: self.submit(device_id, task) for device_id, task in tasks.items()}
        answers = [(d, self.result(d, h), self.devices[d].personal) for d, h in handles.items()]
        self.emit(self.traffic.line())
        self.traffic = Traffic(nodes=set())
        self._weights.clear()  # a sync round's weights are done with
        return answers

    def close(self) -> None:
        """Drop this run's objects (Ray frees them once no task needs them)."""
        self._plans, self._shards = {}, {}
