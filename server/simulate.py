"""In-process federation: ``python -m server.simulate``.

The round engine (``server.engine.round_engine``) with every device in this process and no transport: each device gets
its plan, answers each task with the same local round a real device runs (``device_runtime.local_round``),
and keeps its personal tensors (its head; for local training its whole model). ``--backend torch`` trains with
the PyTorch reference, ``--backend ort`` with the device runtime's onnxruntime trainer. The run folder is the
MQTT server's: metrics.jsonl, metrics.csv, checkpoint.npz (``--resume``), report.md with plots.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator

from device_runtime.artifact_contract import PORTABLE_KIND, TRAINING_KIND
from server.cli import (check_args, check_before_loading, check_inputs, console_logging, fail, new_parser, parse,
                        run_folder)
from server.engine.device_trace import Availability, SpeedModel

log = logging.getLogger("fedara.simulate")
BACKENDS = {"torch": None, "ort": TRAINING_KIND, "portable": PORTABLE_KIND}
"""--backend -> the artifact kind its devices run: the PyTorch reference (none), onnxruntime's training API, or
the portable step graph on stock onnxruntime (what MQTT devices run by default)."""
DEVICE_PREFIX = "device/"
TRAIN_DEVICES = ("cpu", "cuda")
NO_DEADLINE_S = 1e9


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("python -m server.simulate", __doc__.split("\n\n")[0])
    sim = p.add_argument_group("in-process devices")
    sim.add_argument("--clients", type=int, default=20, help="number of in-process devices")
    sim.add_argument("--backend", choices=tuple(BACKENDS), default="torch",
                     help="train with the PyTorch reference, the device runtime's onnxruntime-training trainer (ort) "
                          "or its portable step graph on stock onnxruntime (portable, what devices run by default)")
    sim.add_argument("--workers", type=int, default=1,
                     help="train a round's devices in this many worker processes (each owns a share of the devices); "
                          "the model is bit-identical to --workers 1")
    sim.add_argument("--device", choices=TRAIN_DEVICES, default="cpu",
                     help="where --backend torch trains the devices' models (cuda: an NVIDIA GPU)")
    clock = p.add_argument_group("virtual clock (every metrics row's sim_time: the cost model's step time per tier)")
    clock.add_argument("--device-speed", default=None, metavar="lognormal:SIGMA",
                       help="each device's step time is its tier's times a seeded factor exp(SIGMA·z) (default: all 1)")
    clock.add_argument("--availability", default=None, metavar="P,MEAN_S",
                       help="each device online a fraction P of the time, in online periods of mean MEAN_S virtual "
                            "seconds; away devices are not given training (default: always online)")
    clock.add_argument("--virtual-deadline", type=float, default=None, metavar="SECONDS",
                       help="sync: a round closes this many virtual seconds after it opens; trainers not done by then "
                            "are dropped, their work lost (default: a round waits for its slowest trainer)")
    return p


def check_simulate_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first in-process flag out of range."""
    if args.clients < 1:
        raise ValueError(f"--clients must be >= 1, got {args.clients}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.mode == "async" and args.workers != 1:
        raise ValueError(f"--mode async trains each device when its task ends on the virtual clock: use --workers 1 "
                         f"(got {args.workers})")
    if args.virtual_deadline is not None and not args.virtual_deadline > 0:
        raise ValueError(f"--virtual-deadline must be positive virtual seconds, got {args.virtual_deadline:g}")
    if args.virtual_deadline is not None and args.mode == "async":
        raise ValueError("--virtual-deadline closes sync rounds; --mode async has none (--max-staleness bounds it)")
    if args.device_speed:
        SpeedModel.parse(args.device_speed)
    if args.availability:
        Availability.parse(args.availability)
    if args.device == "cuda":
        if args.backend != "torch":
            raise ValueError(f"--device cuda trains with PyTorch: use --backend torch (got --backend {args.backend}; "
                             "the ONNX backends run on the CPU)")
        import torch  # only when asked: flag checks otherwise answer before torch loads
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use --device cpu")


if __name__ == "__main__":  # --help and a mistake in the flags answer before torch and the data load
    check_before_loading(build_parser(), check_simulate_args)

# The run's imports load torch (seconds, tens under load): after the flags are checked.
import torch  # noqa: E402

from device_runtime.messages import Join, ShardInfo, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Task, Update
from server.in_process import InProcessDevice, Trainers
from server.outputs.checkpoint import CheckpointError
from server.parallel_devices import DevicePool, WorkerError, WorkerSettings
from server.outputs.progress import Progress, final_line, print_and_log
from server.engine.rank_assignment import OverrideError
from server.engine.run_config import RunError
from server.run_setup import Deployment, PlanArtifacts, RunFolder, assemble
from server.virtual_clock import VirtualFleet


class Simulation:
    """The engine and its in-process devices for one run."""

    def __init__(self, args: argparse.Namespace, out: RunFolder, progress: Progress | None = None):
        self.args, self.out = args, out
        self.config = check_args(args)
        check_simulate_args(args)
        trace_keys = tuple(k for k in ("device_speed", "availability", "virtual_deadline") if getattr(args, k))
        deployment = Deployment(devices=args.clients, min_devices=1, round_deadline_s=NO_DEADLINE_S,
                                onnx=args.backend != "torch", budgets=False, settings_keys=("clients", *trace_keys))
        run = assemble(args, self.config, out, deployment, emit=print_and_log)
        self.fleet = self._fleet(args, tuple(next(iter(run.shards.values())).x_train.shape[1:]))
        self.clock = 0.0  # virtual seconds
        self.engine, self.settings, self.saved, self.run_id = run.engine, run.settings, run.saved, run.run_id
        self.by_hash: dict[str, PlanArtifacts] = {}
        self.trainers = Trainers(args.backend, self.by_hash, args.threads, args.device)
        self.devices = {d: InProcessDevice(d, shard, self.trainers, args.threads) for d, shard in run.shards.items()}
        self.pool: DevicePool | None = None
        self.first_round = run.first_round()
        if self.saved:
            self._restore()
        self.progress = progress or Progress(self.config.rounds)
        self._admit()

    @staticmethod
    def _fleet(args: argparse.Namespace, input_shape: tuple[int, ...]) -> VirtualFleet | None:
        """The virtual clock's fleet; None (no sim_time) where the cost model lacks the model and no trace flag asks
        for one."""
        try:
            return VirtualFleet.from_flags(args.seed, args.device_speed, args.availability, args.model.split(",")[0],
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

    def _answers(self, tasks: dict[str, Task]) -> Iterator[tuple[str, Update]]:
        """Each device's update, in the order of ``tasks``: trained here one after another, or by the --workers
        pool (started at the first round; the devices' personal tensors here follow the workers')."""
        if self.args.workers == 1:
            yield from ((device_id, self.devices[device_id].answer(task)) for device_id, task in tasks.items())
            return
        if self.pool is None:
            self.pool = DevicePool(self.devices, self.by_hash,
                                   WorkerSettings(self.args.backend, self.args.threads, self.args.device),
                                   self.args.workers)
        for device_id, update, personal in self.pool.answer(tasks):
            self.devices[device_id].personal = personal
            yield device_id, update

    def close(self) -> None:
        """Stop the --workers pool, if one runs."""
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
        for device_id, update in self._answers(tasks):
            msg = update_message(update, plan_hash=self.devices[device_id].plan_hash, device_id=device_id,
                                 run_id=self.run_id)
            verdict = engine.receive(device_id, msg, time.monotonic())
            if not verdict.accepted:
                log.warning("dropped %s's update (round %d): %s", device_id, round_index, verdict.reason)
        self.clock = max(ends.values(), default=self.clock)
        _, completed = engine.close_round(time.monotonic(), sim_time=self.clock if fleet else None)
        self.progress.evaluated(completed)

    def run(self) -> list[dict]:
        """Rounds up to --rounds, then the evaluation of the final model; a checkpoint after each round."""
        try:
            for t in range(self.first_round, self.config.rounds + 1):
                self._round(t)
                self.progress.trained(self.engine.pending)
                self._checkpoint(t, finished=False)
            if self.engine.pending is not None:
                self._round(self.config.rounds + 1, train=False)
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


def summary(records: list[dict]) -> dict:
    accuracies = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    return {"final_accuracy": accuracies[-1] if accuracies else None,
            "best_accuracy": max(accuracies) if accuracies else None}


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    console_logging()
    out = RunFolder(run_folder(args, "simulate"))
    try:
        check_inputs(args)
        if args.mode == "async":
            from server.async_simulation import AsyncSimulation  # it builds on this module's Simulation
            simulation = AsyncSimulation(args, out)
        else:
            simulation = Simulation(args, out)
        out.path.mkdir(parents=True, exist_ok=True)
        print(f"run folder: {out.path}", flush=True)
        records = simulation.run()
    except (ValueError, OSError, RunError, CheckpointError, OverrideError, WorkerError) as exc:
        return fail(str(exc))
    settings = dict(simulation.settings, run_id=simulation.run_id, driver="simulate", backend=args.backend)
    print(final_line(records, out.path, out.report(records, settings)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
