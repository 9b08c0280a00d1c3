"""An in-process federation: the round engine (``server.engine.round_engine``) with every device in this process and no
transport. Each device gets its plan, answers each task with the same local round a real device runs
(``device_runtime.local_round``), and keeps its personal tensors; a device's training time is the virtual clock's
(``server.virtual_clock``). The async mode's run builds on it (``server.async_simulation``)."""
from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from collections.abc import Iterator

import torch

import numpy as np

from device_runtime.messages import Join, ShardInfo, update_message
from device_runtime.secagg_client import SecAggClient, secure_answer
from device_runtime.secagg_noise import secure_generator
from device_runtime.profile import ResourceProfile
from device_runtime.task import Task, Update, non_finite
from server.in_process import InProcessDevice, Trainers
from server.parallel_devices import DevicePool, WorkerSettings
from server.ray_devices import RayDevicePool
from server.outputs.progress import Progress, print_and_log
from server.engine.run_config import RunError
from fedcore.models import ARCHITECTURES
from server.run_setup import Deployment, PlanArtifacts, PlanBook, RunFolder, assemble
from server.virtual_clock import VirtualFleet


from device_runtime.artifact_contract import PORTABLE_KIND
from server.cli import check_args
from server.simulator_flags import BACKENDS, DEVICE_PREFIX, NO_DEADLINE_S, check_simulate_args

log = logging.getLogger("fedara.simulate")


class Simulation:
    """The engine and its in-process devices for one run."""

    def __init__(self, args: argparse.Namespace, out: RunFolder, progress: Progress | None = None):
        self.args, self.out = args, out
        self.config = check_args(args)
        check_simulate_args(args)
        trace_keys = tuple(k for k in ("device_speed", "availability", "virtual_deadline") if getattr(args, k))
        if args.secure_aggregation:  # who drops and how devices round are the run's math too
            trace_keys += ("secagg_drop", "secagg_test_seed")
        deployment = Deployment(devices=args.clients, min_devices=1, round_deadline_s=NO_DEADLINE_S,
                                onnx=args.backend != "torch", budgets=False, settings_keys=("clients", *trace_keys))
        run = assemble(args, self.config, out, deployment, emit=print_and_log)
        self.fleet = self._fleet(args, tuple(next(iter(run.shards.values())).x_train.shape[1:]), run.engine.plans)
        self.clock = 0.0  # virtual seconds
        self.engine, self.settings, self.saved, self.run_id = run.engine, run.settings, run.saved, run.run_id
        self.by_hash: dict[str, PlanArtifacts] = {}
        self.trainers = Trainers(args.backend, self.by_hash, args.threads, args.device)
        self.devices = {d: InProcessDevice(d, shard, self.trainers, args.threads) for d, shard in run.shards.items()}
        self.pool: DevicePool | RayDevicePool | None = None
        self._dropped: set[str] = set()  # --secagg-drop: the round's devices that dropped after sharing
        self._shares: dict[str, dict[str, bytes]] = {}
        self.first_round = run.first_round()
        if self.saved:
            self._restore()
        self.progress = progress or Progress(self.config.rounds)
        self._admit()

    @staticmethod
    def _fleet(args: argparse.Namespace, input_shape: tuple[int, ...], plans: PlanBook) -> VirtualFleet | None:
        """The virtual clock's fleet; None (no sim_time) where the cost model lacks the model and no trace flag asks
        for one (a user's model is measured only when a trace flag asks: ``server.tier_measurement``)."""
        asked = args.device_speed or args.availability
        if not asked and plans.model.name not in ARCHITECTURES:
            return None
        try:
            return VirtualFleet.from_flags(args.seed, args.device_speed, args.availability, plans.cost_key(),
                                           input_shape, args.batch_size)
        except ValueError:
            if args.device_speed or args.availability:
                raise
            return None

    def _task_end(self, device_id: str, task: Task) -> float:
        """When the device, starting now on the virtual clock, has trained ``task``."""
        record = self.engine.registry()[device_id]
        seconds = self.fleet.task_seconds(device_id, record.ratio, task, record.num_train)
        return self.fleet.finish(device_id, self.clock, seconds)

    def _restore(self) -> None:
        """The devices' personal tensors from the checkpoint (the engine restored its own), and the virtual clock."""
        self.clock = self.saved.state.get("clock", {}).get("now", 0.0)
        for key, value in self.saved.tensors.items():
            if key.startswith(DEVICE_PREFIX):
                device_id, name = key[len(DEVICE_PREFIX):].split("/", 1)
                self.devices[device_id].personal[name] = value

    def _admit(self) -> None:
        """Every device joins and installs its plan (a resumed device keeps its personal tensors)."""
        profile = ResourceProfile(None, self.args.threads, 1, "in-process", sys.platform, None, 1.0,
                                  runtime=BACKENDS[self.args.backend] or PORTABLE_KIND)
        for device_id, device in self.devices.items():
            admission = self.engine.join(device_id, Join(profile, ShardInfo.of(device.shard), ()))
            if admission.refusal:
                raise RunError(f"{device_id}: {admission.refusal}")
            self.by_hash[admission.plan.plan_hash] = self.engine.plan_info(device_id)
            device.install(admission.plan)
            self.engine.acknowledge(device_id, admission.plan.plan_hash)

    def _workers(self) -> DevicePool | RayDevicePool:
        """The --workers pool or the --ray tasks' (started at the first round: the plans are known then)."""
        if self.pool is None:
            settings = WorkerSettings(self.args.backend, self.args.threads, self.args.device,
                                      tuple(self.args.model.split(",")))
            if self.args.ray is not None:
                self.pool = RayDevicePool(self.devices, self.by_hash, settings, self.args.ray_gpus, print_and_log)
            else:
                self.pool = DevicePool(self.devices, self.by_hash, settings, self.args.workers)
        return self.pool

    def _answers(self, tasks: dict[str, Task]) -> Iterator[tuple[str, Update]]:
        """Each device's update, in the order of ``tasks``: trained here one after another, or by the --workers
        pool or the --ray tasks (the devices' personal tensors here follow theirs)."""
        if self.args.workers == 1 and self.args.ray is None:
            yield from ((device_id, self.devices[device_id].answer(task)) for device_id, task in tasks.items())
            return
        for device_id, update, personal in self._workers().answer(tasks):
            self.devices[device_id].personal = personal
            yield device_id, update

    def close(self) -> None:
        """Stop the --workers pool or drop the --ray tasks' objects, if either runs."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _round(self, round_index: int, train: bool = True) -> None:
        """One round; on the virtual clock it lasts until its slowest trainer is done, or its --virtual-deadline
        (trainers not done by then are not heard from; devices away when it opens only evaluate, which takes no
        virtual time)."""
        engine, fleet = self.engine, self.fleet
        away = frozenset(d for d in self.devices if not fleet.online(d, self.clock)) if fleet else frozenset()
        tasks = engine.open_round(round_index, time.monotonic(), train=train, away=away)
        ends = {d: self._task_end(d, t) for d, t in tasks.items() if not t.evaluate_only} if fleet else {}
        deadline = self.args.virtual_deadline
        if deadline is not None and fleet is not None:
            late = {d for d, end in ends.items() if end > self.clock + deadline}
            tasks = {d: t for d, t in tasks.items() if d not in late}
            ends = {d: min(end, self.clock + deadline) for d, end in ends.items()}
        secure = engine.secure_round
        clients = self._share_keys(round_index, tasks) if secure is not None else {}
        tasks = {d: t for d, t in tasks.items() if d not in self._dropped}
        for device_id, update in self._answers(tasks):
            problem = non_finite(update)
            if problem is not None:  # the device says so instead of answering, as a device process does
                verdict = engine.decline(device_id, round_index, problem)
                log.warning("%s has no answer to round %d: %s", device_id, round_index, verdict.reason)
                continue
            if device_id in clients:  # its change goes masked; the update keeps its count, loss and metrics
                update, x = secure_answer(update, tasks[device_id], self._rounding(round_index, device_id))
                refusal = secure.receive_masked(device_id, clients[device_id].masked_input(x, self._shares[device_id]))
                if refusal:
                    log.warning("secure aggregation refused %s: %s", device_id, refusal)
            msg = update_message(update, plan_hash=self.devices[device_id].plan_hash, device_id=device_id,
                                 run_id=self.run_id)
            verdict = engine.receive(device_id, msg, time.monotonic())
            if not verdict.accepted:
                log.warning("dropped %s's update (round %d): %s", device_id, round_index, verdict.reason)
        if secure is not None:
            self._unmask(clients)
        self.clock = max(ends.values(), default=self.clock)
        _, completed = engine.close_round(time.monotonic(), sim_time=self.clock if fleet else None)
        self.progress.evaluated(completed)

    def _rounding(self, round_index: int, device_id: str) -> np.random.Generator:
        """A device's generator for its rounding and noise: the OS's, or --secagg-test-seed's (reproducible: a
        function of the seed, the round and the device, so a resumed run draws what the uninterrupted one did)."""
        if self.args.secagg_test_seed is None:
            return secure_generator()
        device = int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big")
        return np.random.default_rng([self.args.secagg_test_seed, round_index, device])

    def _share_keys(self, round_index: int, tasks: dict[str, Task]) -> dict[str, SecAggClient]:
        """SecAgg+'s first two exchanges for the round's trainers, relayed by the engine's secure round; then
        --secagg-drop's devices (seeded by --seed and the round) drop: they answer nothing more."""
        secure = self.engine.secure_round
        clients = {d: SecAggClient(d, t.secure) for d, t in tasks.items() if t.secure is not None}
        for device_id, client in clients.items():
            secure.receive_keys(device_id, client.advertise())
        keys = secure.close_keys(time.monotonic())
        for device_id, client in clients.items():
            secure.receive_shares(device_id, client.share_keys(keys[device_id]))
        self._shares = secure.close_shares(time.monotonic())
        draws = np.random.default_rng([self.args.seed, round_index, 0x5ECA]).random(len(clients))
        self._dropped = {d for d, u in zip(sorted(clients), draws) if u < self.args.secagg_drop}
        return clients

    def _unmask(self, clients: dict[str, SecAggClient]) -> None:
        """The last exchange: the survivors' shares of the dropped devices' mask keys and of their own seeds."""
        secure = self.engine.secure_round
        survivors = secure.close_masked(time.monotonic())
        for device_id in survivors:
            secure.receive_unmasking(device_id, clients[device_id].unmask(survivors))
        self._dropped = set()

    def run(self) -> list[dict]:
        """Rounds up to --rounds (fewer where the privacy budget ends the run first), then the evaluation of the
        final model; a checkpoint after each round."""
        last = self.first_round - 1
        try:
            for t in range(self.first_round, self.config.rounds + 1):
                stop = self.engine.budget_refusal()
                if stop is not None:
                    print_and_log(stop)
                    break
                self._round(t)
                self.progress.trained(self.engine.pending)
                self._checkpoint(t, finished=False)
                last = t
            if self.engine.pending is not None:
                self._round(last + 1, train=False)
        finally:
            self.close()
        self._checkpoint(self.config.rounds, finished=True)
        return self.engine.records

    def _checkpoint(self, round_index: int, *, finished: bool) -> None:
        tensors = dict(self.engine.global_arrays(), **self.engine.state_tensors())
        for device_id, device in self.devices.items():
            tensors.update({f"{DEVICE_PREFIX}{device_id}/{k}": v for k, v in device.personal.items()})
        state = {"run_id": self.run_id, "settings": self.settings, "engine": self.engine.to_state(),
                 "finished": finished, "clock": self._clock_state()}
        self.out.save(round_index, tensors, state, self.engine.records)

    def _clock_state(self) -> dict:
        """The virtual clock, for --resume."""
        return {"now": self.clock}

    def final_global(self) -> dict[str, torch.Tensor]:
        return self.engine.global_state
