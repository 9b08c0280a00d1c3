"""The MQTT federation server: ``python -m server.broker_loop``.

    python -m server.broker_loop --dataset fmnist --local-devices 5 --rounds 5 --out runs/demo

One process. paho's network thread fills the endpoint's inbox; the main loop takes messages from it,
decodes them, lets the Coordinator decide, and acts: it sends plans (artifact files only to devices that
lack them) and tasks, folds every accepted update into the running average as it arrives, and after every
round writes OUT/metrics.jsonl and OUT/checkpoint.npz (``--resume`` continues from the last completed round).
At the end it writes OUT/report.md with its plots. Without ``--broker`` an embedded broker serves
127.0.0.1 on a free port. ``--local-devices N`` writes N shards of the dataset to OUT/shards and runs
``python -m device_runtime`` on each (workdirs and logs in OUT/devices), ended with SIGTERM at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_runtime.messages import (DEFAULT_TOPIC_PREFIX, ErrorCode, MessageError, Plan, error_message, parse_ack,
                                     parse_error, parse_join, plan_message, task_message)
from device_runtime.profile import ResourceProfile
from device_runtime.protocol import (DEFAULT_MAX_FRAME_BYTES, Message, MessageType, ProtocolError, TopicKind, Topics,
                                     decode, device_id_from_topic, encode, server_subscriptions)
from device_runtime.shard import Shard
from device_runtime.task import Task, Update, tensor_bytes
from device_runtime.artifact_contract import MANIFEST_NAME, PORTABLE_KIND
from device_runtime.transport import STATUS_ONLINE, MqttEndpoint, TransportError
from export.artifacts import ArtifactSet, build_artifacts_of_kind
from server.aggregate import StreamingAverage
from server.checkpoint import CHECKPOINT_NAME, Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from server.coordinator import NO_ANSWER, Coordinator, CoordinatorConfig, RoundOpen, RoundResult
from server.cost_model import CostModelError, peak_predictor
from server.data import DATASETS, load_dataset
from server.embedded_broker import EmbeddedBroker
from server.lowrank import RankPlan, ResolvedPlan, fe_state, resolve_plan
from server.models import MODELS, SplitModel, build_model
from server.partition import write_shards
from server.rank_assignment import (DEFAULT_TIERS, OverrideError, check_tiers, choose_ratio, load_overrides,
                                    tier_predictor)
from server.report import METRICS_FILE, evaluation_summary, write_metrics, write_report
from server.robust import add_norm_bound_arguments, bound_update, norm_bound_from_args, rejection_reason
from server.simulate import config_from_args, parse_tiers, prepare
from server.strategy import FederationConfig, configure_fit, factorize_per_plan, plan_key, to_numpy, to_torch

LOG = logging.getLogger("fedara.server")
PASSWORD_ENV = "FEDARA_MQTT_PASSWORD"
POLL_S = 0.2
CONNECT_TIMEOUT_S = 30.0
DEVICE_STOP_TIMEOUT_S = 10.0
MAX_PLAN_RESENDS = 3
REJOIN_GRACE_S = 3.0
"""An online device that has not joined within this long (it joined before the server listened) is asked to."""
DEFAULT_ROUND_DEADLINE_S = 300.0
DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_MIN_COMPLETION = 0.5
DEFAULT_MAX_SAMPLES = 6000
DEFAULT_LOCAL_EPOCHS = 1
INBOUND_SLACK_BYTES = 1 << 20
"""Room for headers, metadata and the small messages (JOIN, ACK, ERROR) above the largest update."""
SHARDS_DIR, DEVICES_DIR = "shards", "devices"
SERVER_LOG = "server.log"
DEVICE_ID = "dev_{:03d}"
PR_SET_PDEATHSIG = 1
RESUME_IGNORED = ("rounds",)
"""Settings a resumed run may change (a run can be extended); every other setting must match."""


class FederationError(RuntimeError):
    """The run cannot go on: not enough devices, every local device died, a bad resume."""


# -- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.broker_loop", description=__doc__.splitlines()[0])
    data = p.add_argument_group("data and model (as server.simulate)")
    data.add_argument("--dataset", choices=DATASETS, default="fmnist")
    data.add_argument("--data-dir", default=None, help="dataset folder (default: the dataset's standard place)")
    data.add_argument("--partition", choices=("dirichlet", "pathological"), default="dirichlet")
    data.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    data.add_argument("--classes-per-client", type=int, default=2, help="pathological partition")
    data.add_argument("--min-samples", type=int, default=40, help="redraw the partition until every shard has this many")
    data.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                      help="use a seeded subset of the dataset (0: all of it)")
    data.add_argument("--model", choices=MODELS, default="fedavgcnn")
    algo = p.add_argument_group("algorithm (as server.simulate)")
    d = FederationConfig()
    algo.add_argument("--algo", choices=("fedara",), default="fedara", help="devices run FedARA")
    tiers = algo.add_mutually_exclusive_group()
    tiers.add_argument("--rank-ratio", type=float, default=None, help="one ratio for every device (homogeneous)")
    tiers.add_argument("--rank-tiers", default=None,
                       help="resource-adaptive: each device gets the largest of these ratios predicted to fit its "
                            f"memory budget (default {','.join(map(str, DEFAULT_TIERS))})")
    algo.add_argument("--rank-overrides", default=None, help="JSON file {device_id: ratio}, taking precedence")
    algo.add_argument("--lam", type=float, default=d.lam, help="anchor-loss weight λ")
    algo.add_argument("--lam-warmup", type=int, default=d.lam_warmup)
    algo.add_argument("--frob", type=float, default=d.mu, help="Frobenius decay μ on factorized layers")
    algo.add_argument("--rounds", type=int, default=d.rounds)
    algo.add_argument("--local-epochs", type=int, default=DEFAULT_LOCAL_EPOCHS)
    algo.add_argument("--batch-size", type=int, default=d.batch_size)
    algo.add_argument("--lr", type=float, default=d.lr)
    algo.add_argument("--join-ratio", type=float, default=d.join_ratio)
    algo.add_argument("--seed", type=int, default=d.seed)
    algo.add_argument("--threads", type=int, default=1, help="compute threads, of the server and of each local device")
    algo.add_argument("--cache-dir", default="artifacts_cache", help="ONNX artifact cache")
    add_norm_bound_arguments(algo)
    mqtt = p.add_argument_group("broker")
    mqtt.add_argument("--broker", default=None,
                      help="mqtt://host:port or mqtts://... (default: an embedded broker on 127.0.0.1, free port)")
    mqtt.add_argument("--prefix", default=DEFAULT_TOPIC_PREFIX, help="MQTT topic prefix")
    mqtt.add_argument("--username", default=None)
    mqtt.add_argument("--password", default=os.environ.get(PASSWORD_ENV), help=f"default: ${PASSWORD_ENV}")
    mqtt.add_argument("--tls-ca", default=None, help="CA certificate to verify an mqtts:// broker")
    mqtt.add_argument("--tls-cert", default=None, help="client certificate (with --tls-key)")
    mqtt.add_argument("--tls-key", default=None)
    mqtt.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                      help="largest MQTT publish (keep under the broker's limit); longer messages go as chunks")
    run = p.add_argument_group("devices and rounds")
    run.add_argument("--local-devices", type=int, default=0,
                     help="spawn this many device processes on shards of --dataset")
    run.add_argument("--local-memory-mb", default=None,
                     help="memory budgets of the local devices, comma-separated, assigned round-robin")
    run.add_argument("--min-devices", type=int, default=None,
                     help="devices a round needs ready (default: --local-devices, or 1)")
    run.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S,
                     help="seconds to wait for --min-devices before giving up")
    run.add_argument("--round-deadline", type=float, default=DEFAULT_ROUND_DEADLINE_S,
                     help="seconds a round waits for answers")
    run.add_argument("--min-completion", type=float, default=DEFAULT_MIN_COMPLETION,
                     help="fraction of a round's training devices that must deliver for it to be aggregated")
    run.add_argument("--out", required=True, help="output folder: metrics.jsonl, checkpoint.npz, report.md, logs")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its last completed round")
    return p


def _budgets(text: str | None) -> list[float | None]:
    if not text:
        return [None]
    try:
        budgets = [float(b) for b in text.split(",")]
    except ValueError:
        raise ValueError(f"--local-memory-mb wants comma-separated MiB, got {text!r}") from None
    if any(b <= 0 for b in budgets):
        raise ValueError(f"--local-memory-mb budgets must be positive, got {text!r}")
    return budgets


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first flag out of range (the rest is checked where it is used)."""
    for flag, value, low in (("--local-devices", args.local_devices, 0), ("--threads", args.threads, 1),
                             ("--min-devices", args.min_devices or 1, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not args.join_timeout > 0:
        raise ValueError(f"--join-timeout must be positive, got {args.join_timeout}")
    norm_bound_from_args(args)


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that defines the run's math; a resumed run must match (except RESUME_IGNORED)."""
    keys = ("dataset", "partition", "alpha", "classes_per_client", "min_samples", "max_samples", "model",
            "rank_ratio", "rank_tiers", "local_devices", "local_memory_mb", "prefix")
    rule = norm_bound_from_args(args)
    return dict(config_from_args(args).to_dict(), **{k: getattr(args, k) for k in keys},
                update_norm=None if rule is None else [rule.bound, rule.action.value])


# -- data, model and plans --------------------------------------------------------------------


def prepare_data(args: argparse.Namespace) -> tuple[SplitModel, tuple[int, ...], list[Shard]]:
    """The initial global model, its input shape and, with --local-devices, the shards (made exactly as
    server.simulate makes them, so both runs start from the same data and weights)."""
    if args.local_devices:
        sim_args = argparse.Namespace(**{**vars(args), "clients": args.local_devices, "rank_ratio": 1.0,
                                         "rank_tiers": None})
        clients, model = prepare(sim_args)
        return model, tuple(clients[0].shard.input_shape), [c.shard for c in clients]
    data = load_dataset(args.dataset, args.data_dir, seed=args.seed)
    return build_model(args.model, data.input_shape, data.num_classes, seed=args.seed), data.input_shape, []


@dataclass(frozen=True)
class PlanArtifacts:
    """A rank tier resolved on the model, its artifact set and the files a device is sent."""

    ratio: float
    resolved: ResolvedPlan
    artifacts: ArtifactSet
    files: dict[str, bytes]

    @property
    def hash(self) -> str:
        return self.artifacts.hash


class PlanBook:
    """Artifacts per (rank ratio, runtime kind), built (or found in the cache) the first time a device needs them."""

    def __init__(self, model: SplitModel, input_shape: tuple[int, ...], cache_dir: Path):
        self.model, self.input_shape, self.cache_dir = model, input_shape, cache_dir
        self._plans: dict[tuple[float, str], PlanArtifacts] = {}

    def get(self, ratio: float, kind: str = PORTABLE_KIND) -> PlanArtifacts:
        if (ratio, kind) not in self._plans:
            resolved = resolve_plan(self.model, RankPlan(ratio))
            built = build_artifacts_of_kind(kind, self.model, resolved.ranks, self.input_shape,
                                            self.model.num_classes, self.cache_dir)
            paths = [*built.files.values(), built.directory / MANIFEST_NAME]
            self._plans[ratio, kind] = PlanArtifacts(ratio, resolved, built, {p.name: p.read_bytes() for p in paths})
            LOG.info("plan ratio %g (%s): %s, artifacts %s (%d bytes)", ratio, kind, resolved.describe(),
                     built.hash[:12], built.total_bytes)
        return self._plans[ratio, kind]


# -- local device processes --------------------------------------------------------------------


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that makes the child get SIGTERM when the server dies, even by SIGKILL (Linux only).

    prctl is looked up here, in the parent: the hook runs between fork and exec, where loading a library
    could deadlock on a lock another thread held at fork time."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalDevices:
    """Device processes spawned on this machine, one per shard."""

    def __init__(self) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._reported: set[str] = set()
        self._pre_exec = _parent_death_signal()

    def spawn(self, device_id: str, command: list[str], log_path: Path) -> None:
        repo = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        with open(log_path, "ab") as log:
            self.processes[device_id] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=self._pre_exec)
        self.logs[device_id] = log_path

    def check(self) -> bool:
        """Log each device that exited (once); returns whether any is still running."""
        for device_id, proc in self.processes.items():
            if proc.poll() is not None and device_id not in self._reported:
                self._reported.add(device_id)
                LOG.warning("local device %s exited with status %s (log: %s)", device_id, proc.returncode,
                            self.logs[device_id])
        return any(proc.poll() is None for proc in self.processes.values())

    def stop(self, timeout: float = DEVICE_STOP_TIMEOUT_S) -> None:
        """SIGTERM every device, then SIGKILL those still running after ``timeout`` seconds."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for device_id, proc in self.processes.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                LOG.warning("local device %s ignored SIGTERM; killing it", device_id)
                proc.kill()
                proc.wait()


def device_command(args: argparse.Namespace, url: str, device_id: str, shard: Path, workdir: Path,
                   budget: float | None) -> list[str]:
    command = [sys.executable, "-m", "device_runtime", "--broker", url, "--device-id", device_id, "--data", str(shard),
               "--workdir", str(workdir), "--threads", str(args.threads), "--prefix", args.prefix,
               "--max-message-bytes", str(args.max_message_bytes)]
    if budget is not None:
        command += ["--memory-budget-mb", str(budget)]
    if args.tls_ca:
        command += ["--tls-ca", args.tls_ca]
    return command


# -- the event loop -----------------------------------------------------------------------------


@dataclass
class RoundBook:
    """What a round moved and how its training went, gathered while it runs."""

    started: float
    wire_out: int
    wire_in: int
    bytes_down: int = 0
    bytes_down_eval: int = 0
    bytes_up: int = 0
    bytes_artifacts: int = 0
    by_tier: dict[str, dict[str, int]] = field(default_factory=dict)
    samples: int = 0
    loss_sum: float = 0.0
    accuracy_sum: float = 0.0

    def count(self, tier: str, direction: str, nbytes: int) -> None:
        bucket = self.by_tier.setdefault(tier, {"down": 0, "up": 0, "artifacts": 0})
        bucket[direction] += nbytes


def tier_label(ratio: float) -> str:
    return f"{ratio:g}"


def inbound_limit(global_fe: dict[str, torch.Tensor]) -> int:
    """Largest message the server accepts: twice the dense FE (no plan's update is larger) plus slack, so a
    hostile device cannot make the server buffer more than that per message."""
    return 2 * sum(v.numel() * v.element_size() for v in global_fe.values()) + INBOUND_SLACK_BYTES


class Federation:
    """The server's main loop over one MqttEndpoint (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, config: FederationConfig, coordinator: Coordinator,
                 endpoint: MqttEndpoint, plans: PlanBook, global_fe: dict[str, torch.Tensor], out_dir: Path,
                 local: LocalDevices, overrides: dict[str, float], tiers: tuple[float, ...]):
        self.args, self.config, self.coordinator, self.endpoint = args, config, coordinator, endpoint
        self.plans, self.global_fe, self.out_dir, self.local = plans, global_fe, out_dir, local
        self.overrides, self.tiers = overrides, tiers
        self.norm_bound = norm_bound_from_args(args)
        self.dense_shapes = {k: tuple(v.shape) for k, v in global_fe.items()}
        self.max_inbound = inbound_limit(global_fe)
        self.predict = tier_predictor(plans.model, plans.input_shape, config.batch_size)
        self.records: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None  # round t's training record, awaiting round t+1's evaluations
        self.book = self._new_book()
        self.average: StreamingAverage | None = None
        self.round_fe: dict[tuple, dict[str, np.ndarray]] = {}
        self.plan_resends: dict[str, int] = {}
        self.files_sent: dict[str, str] = {}  # device -> the plan hash whose files it was last sent
        self.runtimes: dict[str, str] = {}  # device -> the artifact kind its JOIN profile named
        self.unjoined: dict[str, float] = {}  # online devices without a plan -> when their status said online
        self.reconnects = 0

    # -- helpers ----------------------------------------------------------------------------

    def _new_book(self) -> RoundBook:
        stats = self.endpoint.stats
        return RoundBook(time.monotonic(), stats["bytes_out"], stats["bytes_in"])

    def _send(self, device_id: str, msg: Message) -> None:
        self.endpoint.publish(Topics(self.args.prefix, device_id).down, encode(msg), msg.msg_id)

    def _plan_of(self, device_id: str) -> PlanArtifacts:
        return self.plans.get(self.coordinator.devices[device_id].ratio, self.runtimes.get(device_id, PORTABLE_KIND))

    def _pump(self, until: Callable[[], bool], deadline: float | None = None) -> bool:
        """Handle arriving messages until ``until()`` holds (True) or ``deadline`` passes (False)."""
        while not until():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            item = self.endpoint.get(POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - now)))
            if item is not None:
                self._handle(*item)
            self._after_reconnect()
            self._ask_unjoined_to_join(time.monotonic())
            if self.local.processes and not self.local.check() and not self.coordinator.ready_devices():
                raise FederationError(f"every local device exited; see {self.out_dir / DEVICES_DIR}/*.log")
        return True

    def _after_reconnect(self) -> None:
        """After the server reconnected, tasks of the open round may have been lost with the broker: re-send."""
        reconnects = self.endpoint.stats["reconnects"]
        if reconnects == self.reconnects:
            return
        self.reconnects = reconnects
        awaited = [d for d in self.coordinator.devices if self.coordinator.awaits(d)]
        LOG.info("reconnected to the broker; re-sending the open round's task to %d device(s)", len(awaited))
        for device_id in awaited:
            self._send_task(device_id)

    def _ask_unjoined_to_join(self, now: float) -> None:
        for device_id, since in list(self.unjoined.items()):
            if now - since >= REJOIN_GRACE_S:
                del self.unjoined[device_id]
                LOG.info("%s is online but has not joined: asking it to", device_id)
                self._send(device_id, error_message(ErrorCode.REJOIN, "join this run", device_id=device_id,
                                                    run_id=self.coordinator.run_id))

    # -- inbound ----------------------------------------------------------------------------

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            device_id, kind = device_id_from_topic(self.args.prefix, topic)
        except ProtocolError as exc:
            LOG.warning("dropped a message on %s: %s", topic, exc)
            return
        if kind == TopicKind.STATUS:
            self._on_status(device_id, payload == STATUS_ONLINE)
            return
        try:
            msg = decode(payload, max_bytes=self.max_inbound, allow_nonfinite=True)
        except ProtocolError as exc:
            LOG.warning("dropped a message from %s: %s", device_id, exc)
            return
        if msg.type == MessageType.UPDATE:
            self._on_update(device_id, msg)
            return
        if msg.device_id != device_id:
            LOG.warning("dropped a %s on %s's topic claiming to be from %s", msg.type.value, device_id, msg.device_id)
            return
        handlers = {MessageType.JOIN: self._on_join, MessageType.ACK: self._on_ack, MessageType.ERROR: self._on_error}
        handler = handlers.get(msg.type)
        if handler is None:
            LOG.warning("dropped an unexpected %s from %s", msg.type.value, device_id)
            return
        try:
            handler(device_id, msg)
        except MessageError as exc:
            LOG.warning("dropped a malformed %s from %s: %s", msg.type.value, device_id, exc)

    def _on_status(self, device_id: str, online: bool) -> None:
        now = time.monotonic()
        if self.coordinator.set_online(device_id, online, now):
            LOG.info("%s is %s", device_id, "online" if online else "offline")
        record = self.coordinator.devices.get(device_id)
        if online and (record is None or record.plan_hash is None):
            self.unjoined.setdefault(device_id, now)
        else:
            self.unjoined.pop(device_id, None)
        if online and self.coordinator.awaits(device_id):
            # It may have missed its task while away (a restarted broker drops what it had not delivered). A
            # device says online once subscribed; one that already answered re-sends its answer, counted once.
            LOG.info("%s is online while round %d awaits it: sending its task again", device_id,
                     self.coordinator.open.round)
            self._send_task(device_id)

    def _predictor(self, profile: ResourceProfile) -> Callable[[float], float]:
        """ratio -> predicted peak MiB on this device: the measured cost model (device_runtime/cost_model.json,
        scaled by the device's probe) where it has the model and input, else the analytic footprint."""
        predict = peak_predictor(self.plans.model.name, self.plans.input_shape, self.config.batch_size, profile)
        try:
            predict(self.tiers[0])
        except CostModelError as exc:
            LOG.info("cost model: %s; using the analytic footprint", exc)
            return self.predict
        return predict

    def _on_join(self, device_id: str, msg: Message) -> None:
        self.unjoined.pop(device_id, None)
        try:
            join = parse_join(msg)
        except MessageError as exc:
            self._refuse(device_id, f"malformed join: {exc}")
            return
        refusal = self.coordinator.join(device_id, join, time.monotonic())
        if refusal is not None:
            self._refuse(device_id, refusal)
            return
        record = self.coordinator.devices[device_id]
        self.runtimes[device_id] = join.profile.runtime
        if record.ratio is None:
            predict = self._predictor(join.profile)
            ratio = choose_ratio(device_id, record.budget_mb, self.tiers, predict, self.overrides)
            plan = self.plans.get(ratio, join.profile.runtime)
            self.coordinator.assign_plan(device_id, ratio, plan.hash, plan.artifacts.fe_shapes)
            predicted = predict(ratio)
            if record.budget_mb is not None and predicted > record.budget_mb and device_id not in self.overrides:
                LOG.warning("%s: no tier fits its %.0f MiB budget; smallest tier %g (predicted %.1f MiB)",
                            device_id, record.budget_mb, ratio, predicted)
        plan = self._plan_of(device_id)
        # Files already on their way are not sent twice for a repeated JOIN; a device that lost them says so.
        send_files = plan.hash not in record.artifacts and self.files_sent.get(device_id) != plan.hash
        LOG.info("%s joined: index %d, budget %s MiB, ratio %g, %d train / %d test samples, artifacts %s",
                 device_id, record.index, record.budget_mb, record.ratio, record.num_train, record.num_test,
                 "sent" if send_files else "not sent (held or on their way)")
        self._send_plan(device_id, plan, send_files)

    def _refuse(self, device_id: str, reason: str) -> None:
        LOG.warning("refused %s: %s", device_id, reason)
        self._send(device_id, error_message(ErrorCode.REFUSED, reason, device_id=device_id,
                                            run_id=self.coordinator.run_id))

    def _send_plan(self, device_id: str, plan: PlanArtifacts, send_files: bool) -> None:
        files = plan.files if send_files else {}
        if send_files:
            self.files_sent[device_id] = plan.hash
        self._send(device_id, plan_message(Plan(plan.hash, plan.ratio, plan.resolved.describe(), files),
                                           device_id=device_id, run_id=self.coordinator.run_id))
        nbytes = sum(len(f) for f in files.values())
        self.book.bytes_artifacts += nbytes
        self.book.count(tier_label(self.coordinator.devices[device_id].ratio), "artifacts", nbytes)

    def _on_ack(self, device_id: str, msg: Message) -> None:
        problem = self.coordinator.acknowledge(device_id, parse_ack(msg), time.monotonic())
        if problem is not None:
            LOG.warning("ignored an ACK from %s: %s", device_id, problem)
            return
        LOG.info("%s is ready", device_id)
        self.plan_resends.pop(device_id, None)
        if self.coordinator.awaits(device_id):
            self._send_task(device_id)

    def _on_error(self, device_id: str, msg: Message) -> None:
        report = parse_error(msg)
        LOG.warning("%s reports %s: %s", device_id, report.code.value, report.detail)
        record = self.coordinator.devices.get(device_id)
        if record is None or record.plan_hash is None:
            return
        if report.code in (ErrorCode.ARTIFACTS_MISSING, ErrorCode.ARTIFACTS_CORRUPT):
            record.artifacts.discard(record.plan_hash)
            sent = self.plan_resends.get(device_id, 0)
            if sent < MAX_PLAN_RESENDS:
                self.plan_resends[device_id] = sent + 1
                self._send_plan(device_id, self._plan_of(device_id), send_files=True)

    def _on_update(self, device_id: str, msg: Message) -> None:
        verdict = self.coordinator.judge(device_id, msg, time.monotonic(),
                                         screen=self._screen if self.norm_bound else None)
        if not verdict.accepted:
            LOG.warning("dropped an update from %s (round %d): %s", device_id, msg.round, verdict.reason)
            return
        update = verdict.update
        if update.fe:
            self.average.add(to_torch(update.fe), update.num_samples)
            nbytes = tensor_bytes(msg.tensors)  # as sent: a clipped update is aggregated dense
            self.book.bytes_up += nbytes
            self.book.count(tier_label(self.coordinator.devices[device_id].ratio), "up", nbytes)
            self.book.samples += update.num_samples
            self.book.loss_sum += update.train_loss * update.num_samples
            self.book.accuracy_sum += update.train_accuracy * update.num_samples

    def _screen(self, device_id: str, update: Update) -> Update | str:
        """--update-norm-bound: the update to aggregate (clipped where it clips), or why it does not count."""
        bounded, distance = bound_update(update, self.global_fe, self.norm_bound)
        LOG.info("%s: update %.6g from the global FE (bound %g, %s)", device_id, distance, self.norm_bound.bound,
                 self.norm_bound.action.value)
        return rejection_reason(distance, self.norm_bound) if bounded is None else bounded

    # -- outbound ---------------------------------------------------------------------------

    def _task(self, device_id: str, opened: RoundOpen) -> Task:
        record = self.coordinator.devices[device_id]
        plan = self._plan_of(device_id)
        fe = self.round_fe[plan_key(plan.resolved)]
        deadline = time.time() + max(0.0, opened.deadline - time.monotonic())
        if device_id in opened.train:
            task = configure_fit(fe, bool(plan.resolved.ranks), self.config, opened.round, record.index)
            return dataclasses.replace(task, deadline=deadline)
        return Task(round=opened.round, fe=fe, lam=0.0, mu=0.0, lr=self.config.lr, epochs=0,
                    batch_size=self.config.batch_size, seed=0, deadline=deadline)

    def _send_task(self, device_id: str) -> None:
        opened = self.coordinator.open
        task = self._task(device_id, opened)
        plan = self._plan_of(device_id)
        self._send(device_id, task_message(task, plan_hash=plan.hash, device_id=device_id,
                                           run_id=self.coordinator.run_id))
        nbytes = tensor_bytes(task.fe)
        if task.epochs:
            self.book.bytes_down += nbytes
        else:
            self.book.bytes_down_eval += nbytes
        self.book.count(tier_label(plan.ratio), "down", nbytes)

    # -- rounds -----------------------------------------------------------------------------

    def wait_for_devices(self) -> None:
        need = self.coordinator.config.min_devices
        if self.coordinator.can_start():
            return
        LOG.info("waiting for %d ready device(s) (%d now)", need, len(self.coordinator.ready_devices()))
        if not self._pump(self.coordinator.can_start, time.monotonic() + self.args.join_timeout):
            raise FederationError(f"only {len(self.coordinator.ready_devices())} of --min-devices {need} devices "
                                  f"ready after {self.args.join_timeout:g} s")

    def run_round(self, round_index: int, *, train: bool = True) -> RoundResult:
        """Open a round, send its tasks, gather answers until all are in or the deadline passes, close it."""
        opened = self.coordinator.open_round(round_index, time.monotonic(), train=train)
        self.book.started = time.monotonic()
        plans = [self._plan_of(d).resolved for d in opened.train + opened.evaluate]
        self.round_fe = factorize_per_plan(self.global_fe, plans)
        self.average = StreamingAverage(self.dense_shapes)
        for device_id in opened.train + opened.evaluate:
            self._send_task(device_id)
        self._pump(lambda: self.coordinator.closing(time.monotonic()) is not None)
        result = self.coordinator.close_round(time.monotonic())
        for device_id, reason in result.dropped.items():
            if reason == NO_ANSWER:
                LOG.warning("round %d closed at its deadline without %s's answer", round_index, device_id)
        return result

    def _close_training(self, result: RoundResult) -> dict[str, Any]:
        """Aggregate if enough delivered, and the round's training record (accuracy comes a round later)."""
        if result.enough:
            self.global_fe = self.average.result()
        else:
            LOG.warning("round %d: %d of %d updates, below --min-completion %g: the global model is kept",
                        result.round, len(result.accepted), len(result.train), self.coordinator.config.min_completion)
        book, stats = self.book, self.endpoint.stats
        return {"round": result.round, "participants": len(result.accepted), "selected": len(result.train),
                "dropped": result.dropped, "aggregated": result.enough, "closed_by": result.closed_by,
                "train_loss": book.loss_sum / book.samples if book.samples else None,
                "train_accuracy": book.accuracy_sum / book.samples if book.samples else None,
                "bytes_down": book.bytes_down, "bytes_up": book.bytes_up, "bytes_artifacts": book.bytes_artifacts,
                "bytes_down_eval": book.bytes_down_eval, "bytes_by_tier": book.by_tier,
                "wire_bytes_out": stats["bytes_out"] - book.wire_out, "wire_bytes_in": stats["bytes_in"] - book.wire_in,
                "seconds": time.monotonic() - book.started}

    def _complete_previous(self, result: RoundResult) -> None:
        """The evaluations that came with this round measure the previous round's model: finish its record."""
        if self.pending is None:
            return
        record = dict(self.pending, **evaluation_summary(result.evaluations.values()))
        self.records.append(record)
        self.pending = None
        accuracy = "–" if record["accuracy"] is None else f"{record['accuracy']:.4f} ±{record['accuracy_std']:.4f}"
        print(f"  accuracy after round {record['round']}: {accuracy} ({record['evaluated']} devices)", flush=True)

    def run(self, first_round: int) -> None:
        """Rounds first_round..rounds, then the evaluation of the final model; checkpoint after each."""
        for t in range(first_round, self.config.rounds + 1):
            self.wait_for_devices()
            result = self.run_round(t)
            self._complete_previous(result)
            self.pending = self._close_training(result)
            self.book = self._new_book()
            self._progress(self.pending)
            self.checkpoint(t, finished=False)
        if self.pending is not None:
            result = self.run_round(self.config.rounds + 1, train=False)
            self.pending["bytes_down_eval"] += self.book.bytes_down_eval
            for tier, counts in self.book.by_tier.items():
                for direction, nbytes in counts.items():
                    self.pending["bytes_by_tier"].setdefault(tier, dict.fromkeys(counts, 0))[direction] += nbytes
            self._complete_previous(result)
            self.book = self._new_book()
        self.checkpoint(self.config.rounds, finished=True)

    def _progress(self, record: dict[str, Any]) -> None:
        loss = record["train_loss"]
        print(f"round {record['round']}/{self.config.rounds}  loss {'–' if loss is None else f'{loss:.4f}'}  "
              f"participants {record['participants']}/{record['selected']}  dropped {len(record['dropped'])}  "
              f"down {record['bytes_down'] / 1e6:.2f} MB  up {record['bytes_up'] / 1e6:.2f} MB  "
              f"artifacts {record['bytes_artifacts'] / 1e6:.2f} MB  {record['seconds']:.1f}s", flush=True)

    def checkpoint(self, round_index: int, *, finished: bool) -> None:
        write_metrics(self.out_dir / METRICS_FILE, self.records)
        state = {"run_id": self.coordinator.run_id, "settings": run_settings(self.args),
                 "registry": self.coordinator.to_state(), "records": self.records, "pending": self.pending,
                 "finished": finished}
        save_checkpoint(self.out_dir / CHECKPOINT_NAME, Checkpoint(round_index, to_numpy(self.global_fe), state))


# -- wiring ------------------------------------------------------------------------------------


@contextlib.contextmanager
def broker_url(args: argparse.Namespace) -> Iterator[str]:
    """--broker, or an embedded broker for as long as the block runs."""
    if args.broker:
        yield args.broker
        return
    with EmbeddedBroker() as broker:
        yield broker.url


def _check_resume(saved: dict[str, Any], current: dict[str, Any]) -> None:
    differing = sorted(k for k in set(saved) | set(current)
                       if k not in RESUME_IGNORED and saved.get(k) != current.get(k))
    if differing:
        raise FederationError(f"--resume with other settings than the checkpoint's: {differing} "
                              f"(checkpoint: {[saved.get(k) for k in differing]}, now: {[current.get(k) for k in differing]})")


def run(args: argparse.Namespace) -> None:
    """Set the run up (or resume it), connect, spawn the local devices, federate, report."""
    check_args(args)
    out_dir = Path(args.out)
    config = config_from_args(args)
    if args.rank_ratio is not None:
        tiers = check_tiers([args.rank_ratio])
    else:
        tiers = check_tiers(parse_tiers(args.rank_tiers) or DEFAULT_TIERS)
    overrides = load_overrides(args.rank_overrides) if args.rank_overrides else {}
    budgets = _budgets(args.local_memory_mb)
    model, input_shape, shards = prepare_data(args)
    global_fe = fe_state(model)
    checkpoint_path = out_dir / CHECKPOINT_NAME
    saved = None
    if checkpoint_path.exists():
        if not args.resume:
            raise FederationError(f"{out_dir} holds a run ({CHECKPOINT_NAME}); pass --resume or choose another --out")
        saved = load_checkpoint(checkpoint_path)
        _check_resume(saved.state["settings"], run_settings(args))
    elif args.resume:
        LOG.warning("--resume: no checkpoint in %s; starting the run from round 1", out_dir)
    run_id = saved.state["run_id"] if saved else uuid.uuid4().hex[:16]
    coordinator = Coordinator(CoordinatorConfig(
        input_shape=input_shape, num_classes=model.num_classes,
        min_devices=args.min_devices or args.local_devices or 1, join_ratio=config.join_ratio, seed=config.seed,
        round_deadline_s=args.round_deadline, min_completion=args.min_completion), run_id)
    device_ids = [DEVICE_ID.format(i) for i in range(args.local_devices)]
    for device_id in device_ids:
        coordinator.register(device_id)
    if saved:
        coordinator.restore(saved.state["registry"])
        global_fe = to_torch(saved.tensors)
    plans = PlanBook(model, input_shape, Path(args.cache_dir))
    local = LocalDevices()
    with broker_url(args) as url, contextlib.ExitStack() as stack:
        endpoint = MqttEndpoint(f"fedara-server-{args.prefix.replace('/', '_')}", url,
                                subscriptions=server_subscriptions(args.prefix), username=args.username,
                                password=args.password, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                                tls_key=args.tls_key, max_frame_bytes=args.max_message_bytes,
                                max_message_bytes=inbound_limit(global_fe), clean_session=False)
        endpoint.start()
        stack.callback(endpoint.stop)
        endpoint.wait_connected(CONNECT_TIMEOUT_S)
        LOG.info("run %s on %s, prefix %s", run_id, url, args.prefix)
        if shards:
            shard_paths = write_shards(shards, out_dir / SHARDS_DIR)
            stack.callback(local.stop)
            for i, (device_id, shard_path) in enumerate(zip(device_ids, shard_paths)):
                workdir = out_dir / DEVICES_DIR / device_id
                workdir.mkdir(parents=True, exist_ok=True)
                local.spawn(device_id, device_command(args, url, device_id, shard_path, workdir,
                                                      budgets[i % len(budgets)]),
                            out_dir / DEVICES_DIR / f"{device_id}.log")
        federation = Federation(args, config, coordinator, endpoint, plans, global_fe, out_dir, local, overrides, tiers)
        if saved:
            federation.records, federation.pending = saved.state["records"], saved.state["pending"]
        if saved and saved.state["finished"] and saved.round >= config.rounds:
            LOG.info("the run in %s is finished; rewriting its report", out_dir)
        else:
            federation.run(saved.round + 1 if saved else 1)
    settings = dict(run_settings(args), run_id=run_id, broker=args.broker or "embedded")
    report = write_report(out_dir, federation.records, settings)
    print(f"wrote {out_dir / METRICS_FILE} and {report}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    file_log = logging.FileHandler(out_dir / SERVER_LOG)
    file_log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    fedara_log = logging.getLogger("fedara")
    fedara_log.addHandler(file_log)
    fedara_log.setLevel(logging.INFO)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run(args)
    except (FederationError, CheckpointError, OverrideError, TransportError, ValueError, OSError) as exc:
        LOG.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the last completed round is in the checkpoint (--resume continues)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        fedara_log.removeHandler(file_log)
        file_log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
