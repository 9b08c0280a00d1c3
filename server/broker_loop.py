"""The MQTT driver of the round engine: ``python -m server.broker_loop``.

    python -m server.broker_loop --dataset fmnist --local-devices 5 --rounds 5 --local-epochs 1 --max-samples 6000

One process. paho's network thread fills the endpoint's inbox; the main loop takes messages from it, decodes
them, hands them to the round engine (``server.engine``: every decision of the run lives there) and
publishes what the engine answers: plans (artifact files only to devices that lack them), tasks, refusals.
After every round it writes OUT/metrics.jsonl, metrics.csv and OUT/checkpoint.npz (``--resume`` continues
from the last completed round); at the end OUT/report.md with its plots. Without ``--broker`` an embedded
broker serves 127.0.0.1 on a free port. ``--local-devices N`` writes N shards of the dataset to OUT/shards
and runs ``python -m device_runtime`` on each (workdirs and logs in OUT/devices), ended with SIGTERM at the
end. ``--broker`` may list several nodes of a clustered broker (``mqtt://h1:1883,mqtt://h2:1883``): every process
moves to the next on a lost connection, and local device i starts on node i. ``--aggregators N`` starts N
aggregator processes (``server.aggregator``): each round the engine routes every device's update to one of them by
topic, and they send the engine their partial sums; without it the server reads every update itself.
The flags are the simulator's (``server.cli``), plus the broker's, the local devices' and the aggregators'.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from device_runtime.transport import MqttEndpoint, TransportError, parse_brokers, rotate_brokers
from server import cgroups
from server.cli import (PASSWORD_ENV, STATUS_HOST, add_broker_flags, add_status_flags, check_args,
                        check_before_loading, check_status_args, console_logging, fail, new_parser, parse, run_folder)
from server.enrollment import ENROLL_OPEN

LOG = logging.getLogger("fedara.server")
POLL_S = 0.2
CONNECT_TIMEOUT_S = 30.0
DEVICE_STOP_TIMEOUT_S = 10.0
DEFAULT_ROUND_DEADLINE_S = 300.0
DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_AGGREGATOR_TIMEOUT_S = 60.0
PROBE_MAX_S = 5.0
"""At most this long between two messages the server sends a silent aggregator (its brief, or a partial request)."""
AGGREGATORS_DIR = "aggregators"
INBOUND_SLACK_BYTES = 1 << 20
"""Room for headers, metadata and the small messages (JOIN, ACK, ERROR) above the largest update."""
PENDING_UPDATES_BUDGETED = 4
"""Total reassembly budget of the server, in largest inbound messages (over all topics together)."""
SHARDS_DIR, DEVICES_DIR = "shards", "devices"
SERVER_LOG = "server.log"
PR_SET_PDEATHSIG = 1
MAX_OOM_RESTARTS = 2
STATUS_EVERY_S = 0.5
"""How often the run loop publishes a new snapshot to --status-port while it waits (and after every round)."""


# -- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("python -m server.broker_loop", __doc__.split("\n\n")[0])
    add_broker_flags(p, "default: an embedded broker on 127.0.0.1, free port")
    run = p.add_argument_group("devices and rounds")
    run.add_argument("--local-devices", type=int, default=0,
                     help="spawn this many device processes on shards of --dataset (0: devices come from outside)")
    run.add_argument("--local-memory-limit-mb", default=None,
                     help="start each local device in a memory cgroup of this many MiB (comma-separated, "
                          "round-robin by device id): the device reads its limit and gets the largest tier whose "
                          "measured memory floor fits (needs root and a writable memory controller; without them "
                          "the devices run unconfined and the server says so)")
    run.add_argument("--local-memory-mb", default=None,
                     help="memory budgets the local devices report in MiB (no real limit), comma-separated, "
                          "round-robin")
    run.add_argument("--min-devices", type=int, default=None,
                     help="devices a round needs ready (default: --local-devices, or 1)")
    run.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S,
                     help="seconds to wait for --min-devices before giving up (the time the server spends "
                          "building their artifacts does not count)")
    run.add_argument("--round-deadline", type=float, default=DEFAULT_ROUND_DEADLINE_S,
                     help="seconds a round waits for answers")
    agg = p.add_argument_group("aggregation (see server/aggregator.py)")
    agg.add_argument("--aggregators", type=int, default=0,
                     help="start this many aggregator processes; each device's updates go to one of them, named in "
                          "its task (needs --broker: any MQTT 3.1.1 broker or cluster; 0: the server folds every "
                          "update itself)")
    agg.add_argument("--aggregator-timeout", type=float, default=DEFAULT_AGGREGATOR_TIMEOUT_S,
                     help="seconds the server waits for the aggregators: to start, to take a round's brief, to send "
                          "their partial sums at the round's close; a member silent this long in a round is lost: its "
                          "devices are asked again, for the others")
    auth = p.add_argument_group("enrollment (see server/enrollment.py)")
    auth.add_argument("--enroll", default=None, metavar="FILE|open",
                      help="admit the devices of this enrollment file, or any id holding --run-key (open; lab use); "
                           "default: only the --local-devices, enrolled in OUT/enrollment.json")
    auth.add_argument("--run-key", default=None, metavar="FILE", help="the shared key of --enroll open")
    add_status_flags(p)
    return p


def _budgets(text: str | None) -> list[float | None]:
    if not text:
        return [None]
    try:
        budgets = [float(b) for b in text.split(",")]
    except ValueError:
        raise ValueError(f"--local-memory-mb wants comma-separated MiB such as 128,96, got {text!r}") from None
    if any(not b > 0 for b in budgets):
        raise ValueError(f"--local-memory-mb budgets must be positive, got {text!r}")
    return budgets


def check_broker_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first broker/device flag out of range (before anything heavy starts)."""
    if args.broker:
        parse_brokers(args.broker)
    for flag, value, low in (("--local-devices", args.local_devices, 0), ("--min-devices", args.min_devices or 1, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not args.local_devices and not args.broker:
        raise ValueError("--local-devices 0 with the embedded broker: no device could ever join; pass "
                         "--local-devices N, or --broker mqtt://HOST:PORT for devices that connect from outside")
    for flag, value in (("--join-timeout", args.join_timeout), ("--round-deadline", args.round_deadline)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive seconds, got {value:g}")
    _budgets(args.local_memory_mb)
    if args.aggregators < 0:
        raise ValueError(f"--aggregators must be >= 0, got {args.aggregators}")
    if not args.aggregator_timeout > 0:
        raise ValueError(f"--aggregator-timeout must be positive seconds, got {args.aggregator_timeout:g}")
    if args.aggregators and not args.broker:
        raise ValueError(f"--aggregators {args.aggregators} needs --broker mqtt://HOST:PORT (mosquitto, or the nodes of "
                         "a cluster); aggregator processes are not run on the embedded broker")
    if args.aggregators and args.enroll == ENROLL_OPEN:
        raise ValueError(f"--aggregators {args.aggregators} needs --enroll FILE: with --enroll open every device "
                         "holds the run key, so nothing could seal what the server and its aggregators say")
    check_status_args(args)
    if args.local_memory_limit_mb:
        try:
            cgroups.parse_limits(args.local_memory_limit_mb)
        except ValueError as exc:
            raise ValueError(f"--local-memory-limit-mb: {exc}") from None


if __name__ == "__main__":  # --help and a mistake in the flags answer before torch and the data load
    check_before_loading(build_parser(), check_broker_args)

# The run's imports load torch (seconds, tens under load): after the flags are checked.
import numpy as np  # noqa: E402
import torch  # noqa: E402

from device_runtime.messages import (ErrorCode, MessageError, error_message, parse_ack,
                                     parse_error, parse_join, plan_message, task_message)
from device_runtime.link import Link, Refused
from device_runtime.envelope import Message, MessageType
from device_runtime.protocol import ProtocolError
from device_runtime.topics import Topics, device_id_from_topic, server_subscriptions
from device_runtime.status import Status
from device_runtime.task import Task
from server.checkpoint import CheckpointError
from server.embedded_broker import EmbeddedBroker
from server.engine import RoundEngine
from server.live_status import StatusServer, count_refusal, fleet_snapshot, update_refusal
from server import aggregation_wire as wire
from server.enrollment import LOCAL_ENROLLMENT, LOCAL_KEYS_DIR, load_server_key, run_key_ring
from server.partition import write_shards
from server.progress import Progress, print_and_log
from server.rank_assignment import OverrideError
from server.run_config import FederationConfig
from server.run_setup import Deployment, RunError, RunFolder, assemble
from server.shards import DEVICE_SHARD_FILENAME

FederationError = RunError


BROKER_SETTINGS = ("local_devices", "local_memory_mb", "local_memory_limit_mb", "prefix", "aggregators")
"""The broker loop's own settings a resumed run must match."""


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
    """Device processes spawned on this machine, one per shard, each in its memory cgroup where it has one
    (``what="aggregator"``: the local aggregator processes, no cgroups).

    A device the kernel killed for memory is started again (as systemd's Restart= would on a board), at most
    ``MAX_OOM_RESTARTS`` times: it rejoins, and ``on_oom`` (the engine's demote) gives it a lower tier than the one
    it died at."""

    def __init__(self, what: str = "device", on_oom: Callable[[str, str], None] | None = None) -> None:
        self.what = what
        self.on_oom = on_oom
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.groups: dict[str, cgroups.MemoryGroup] = {}
        self._commands: dict[str, list[str]] = {}
        self._restarts: dict[str, int] = {}
        self._reported: set[str] = set()
        self._pre_exec = _parent_death_signal()

    def spawn(self, device_id: str, command: list[str], log_path: Path,
              group: cgroups.MemoryGroup | None = None, env: dict[str, str] | None = None) -> None:
        repo = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        if group is not None:
            self.groups[device_id] = group
        group = self.groups.get(device_id)
        pre_exec = self._pre_exec if group is None else cgroups.enter_hook(group, self._pre_exec)
        with open(log_path, "ab") as log:
            self.processes[device_id] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=pre_exec)
        self.logs[device_id], self._commands[device_id] = log_path, command

    def check(self) -> bool:
        """Log each device that exited (once), restart one killed for memory; returns whether any runs."""
        for device_id, proc in list(self.processes.items()):
            if proc.poll() is None or device_id in self._reported:
                continue
            group = self.groups.get(device_id)
            evidence = group.evidence() if group is not None else None
            if evidence is not None and evidence.oom_killed and self._restarts.get(device_id, 0) < MAX_OOM_RESTARTS:
                self._restarts[device_id] = self._restarts.get(device_id, 0) + 1
                LOG.warning("local device %s was killed at its %g MiB memory limit (peak %s MiB): starting it "
                            "again; it gets a lower tier", device_id, group.limit_mb, evidence.peak_mb)
                if self.on_oom is not None:
                    self.on_oom(device_id, f"was killed at its {group.limit_mb:g} MiB memory limit")
                group.remove()  # a fresh group: nothing the killed process left is charged to its successor
                self.groups[device_id] = cgroups.create_group(f"{device_id}-{self._restarts[device_id]}", group.limit_mb)
                self.spawn(device_id, self._commands[device_id], self.logs[device_id])
                continue
            self._reported.add(device_id)
            LOG.warning("local %s %s exited with status %s (log: %s)", self.what, device_id, proc.returncode,
                        self.logs[device_id])
        return any(proc.poll() is None for proc in self.processes.values())

    def stop(self, timeout: float = DEVICE_STOP_TIMEOUT_S) -> None:
        """SIGTERM every device, then SIGKILL those still running after ``timeout`` seconds; remove their groups."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for device_id, proc in self.processes.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                LOG.warning("local %s %s ignored SIGTERM; killing it", self.what, device_id)
                proc.kill()
                proc.wait()
        for group in self.groups.values():
            try:
                group.remove()
            except cgroups.CgroupError as exc:
                LOG.warning("%s", exc)


def device_command(args: argparse.Namespace, url: str, device_id: str, shard: Path, workdir: Path,
                   budget: float | None, key_file: Path, max_message_bytes: int) -> list[str]:
    command = [sys.executable, "-m", "device_runtime", "--broker", url, "--device-id", device_id, "--data", str(shard),
               "--workdir", str(workdir), "--threads", str(args.threads), "--prefix", args.prefix,
               "--max-message-bytes", str(max_message_bytes),
               "--key-file", str(key_file)]
    if budget is not None:
        command += ["--memory-budget-mb", str(budget)]
    if args.tls_ca:
        command += ["--tls-ca", args.tls_ca]
    return command


def aggregator_command(args: argparse.Namespace, url: str, name: str, enrollment: Path, workdir: Path) -> list[str]:
    """A local aggregator process (its MQTT password, if any, goes through the environment)."""
    command = [sys.executable, "-m", "server.aggregator", "--broker", url, "--prefix", args.prefix, "--name", name,
               "--enroll", str(enrollment), "--workdir", str(workdir),
               "--max-message-bytes", str(args.max_message_bytes)]
    for flag, value in (("--username", args.username), ("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key)):
        if value:
            command += [flag, value]
    return command


# -- the driver ---------------------------------------------------------------------------------


def inbound_limit(shared: dict[str, torch.Tensor], personal: dict[str, dict[str, np.ndarray]]) -> int:
    """Largest message the server accepts: twice the dense shared model or the largest personal model (no
    plan's update is larger) plus slack, so a hostile device cannot make the server buffer more than that per
    message."""
    shared_bytes = sum(v.numel() * v.element_size() for v in shared.values())
    personal_bytes = max((sum(v.nbytes for v in p.values()) for p in personal.values()), default=0)
    return 2 * max(shared_bytes, personal_bytes) + INBOUND_SLACK_BYTES


class Federation:
    """The server's main loop over one MqttEndpoint: transport in, engine decisions out."""

    def __init__(self, args: argparse.Namespace, engine: RoundEngine, endpoint: MqttEndpoint, out: RunFolder,
                 local: LocalDevices, settings: dict[str, Any], max_inbound: int, link: Link,
                 aggregators: tuple[str, ...] = (), aggregator_link: Link | None = None,
                 status: StatusServer | None = None):
        self.args, self.engine, self.endpoint, self.out, self.local = args, engine, endpoint, out, local
        self.link = link
        self.aggregators, self.aggregator_link = aggregators, aggregator_link
        self.aggregators_at: dict[str, int] = {}  # aggregator -> the round whose brief it holds (0: started)
        self.heard: dict[str, float] = {}  # aggregator -> when it last said anything (monotonic)
        self.asked: dict[str, float] = {}  # aggregator -> when it was last sent its brief or asked for its partial
        self.brief: wire.Brief | None = None  # the open round's, as last sent
        self.merged: set[tuple[str, int]] = set()  # (aggregator, round) of every partial taken
        self.probe_s = min(PROBE_MAX_S, args.aggregator_timeout / 4)
        self.settings = settings
        self.max_inbound = max_inbound
        self.reconnects = 0
        self._wire = (0, 0)
        self.status, self._status_at = status, float("-inf")
        self.refusals: Counter[str] = Counter()  # refused inbound messages by kind (bounded: live_status.count_refusal)

    def publish_status(self, *, force: bool = False) -> None:
        """Hand --status-port a fresh snapshot of the run (at most every STATUS_EVERY_S unless ``force``)."""
        now = time.monotonic()
        if self.status is None or (not force and now - self._status_at < STATUS_EVERY_S):
            return
        self._status_at = now
        self.status.publish(fleet_snapshot(self.engine, now=now, wall=time.time(), transport=self.endpoint.stats,
                                           refusals=self.refusals, aggregators=self.aggregators_at,
                                           rounds=self.engine.config.rounds, previous=self.status.latest()))

    def _send(self, device_id: str, msg: Message) -> None:
        self.endpoint.publish(Topics(self.args.prefix, device_id).down, self.link.seal(msg), msg.msg_id)

    def _pump(self, until: Callable[[], bool], deadline: float | None = None, *,
              handling_counts: bool = True) -> bool:
        """Handle arriving messages until ``until()`` holds (True) or ``deadline`` passes (False). With
        ``handling_counts=False`` the time spent handling messages moves the deadline on: a wait for devices
        measures the devices, not the server building their artifacts on a loaded machine."""
        while not until():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            item = self.endpoint.get(POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - now)))
            if item is not None:
                started = time.monotonic()
                self._handle(*item)
                if deadline is not None and not handling_counts:
                    deadline += time.monotonic() - started
            self._after_reconnect()
            self._tend_aggregators(time.monotonic())
            self._ask_unjoined_to_join(time.monotonic())
            self.publish_status()
            if self.local.processes and not self.local.check() and not self.engine.ready_devices():
                raise RunError(f"every local device exited; see {self.out.path / DEVICES_DIR}/*.log")
        return True

    def _after_reconnect(self) -> None:
        """After the server reconnected, tasks of the open round may have been lost with the broker: re-send."""
        reconnects = self.endpoint.stats["reconnects"]
        if reconnects == self.reconnects:
            return
        self.reconnects = reconnects
        awaited = self.engine.awaited()
        LOG.info("reconnected to the broker; re-sending the open round's task to %d device(s)", len(awaited))
        for device_id in awaited:
            self._send_task(device_id)

    def _ask_unjoined_to_join(self, now: float) -> None:
        for device_id in self.engine.to_ask_to_join(now):
            LOG.info("%s is online but has not joined: asking it to", device_id)
            self._send(device_id, error_message(ErrorCode.REJOIN, "join this run", device_id=device_id,
                                                run_id=self.engine.run_id))

    # -- inbound ----------------------------------------------------------------------------

    def _handle(self, topic: str, payload: bytes) -> None:
        aggregator = wire.aggregator_from_topic(self.args.prefix, topic) if self.aggregators else None
        if aggregator is not None:
            self._on_aggregator(aggregator, payload)
            return
        try:
            device_id, kind = device_id_from_topic(self.args.prefix, topic)
        except ProtocolError as exc:
            LOG.warning("dropped a message on %s: %s", topic, exc)
            count_refusal(self.refusals, "bad topic")
            return
        try:  # authenticated before anything else looks at it
            msg, status = self.link.open_with_status(payload, self.engine.run_id, device_id=device_id, kind=kind)
        except Refused as exc:
            LOG.warning("dropped a message on %s: %s", topic, exc)
            count_refusal(self.refusals, f"link {getattr(exc.reason, 'value', 'other')}")
            return
        if status is not None:
            self._on_status(device_id, status)
            return
        if msg.type == MessageType.UPDATE:
            self._on_update(device_id, msg)
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

    def _on_status(self, device_id: str, status: Status) -> None:
        """A device's connection opened or closed: the engine decides what changes (see RoundEngine.status)."""
        change = self.engine.status(device_id, status.online, status.nonce, time.monotonic())
        if change.ignored:
            LOG.debug("%s: online again for its current connection: nothing changes", device_id)
            return
        if change.known:
            LOG.info("%s is %s", device_id, "online" if status.online else "offline")
        if change.resend_task:
            # It may have missed its task while away (a restarted broker drops what it had not delivered). A
            # device says online once subscribed; one that already answered re-sends its answer, counted once.
            LOG.info("%s is online while round %d awaits it: sending its task again", device_id,
                     self.engine.opened.round)
            self._send_task(device_id)

    def _on_join(self, device_id: str, msg: Message) -> None:
        try:
            join = parse_join(msg)
        except MessageError as exc:
            self._refuse(device_id, f"malformed join: {exc}")
            return
        admission = self.engine.join(device_id, join)
        if admission.refusal is not None:
            self._refuse(device_id, admission.refusal)
            return
        self._send(device_id, plan_message(admission.plan, device_id=device_id, run_id=self.engine.run_id))

    def _refuse(self, device_id: str, reason: str) -> None:
        LOG.warning("refused %s: %s", device_id, reason)
        count_refusal(self.refusals, "join refused")
        self._send(device_id, error_message(ErrorCode.REFUSED, reason, device_id=device_id,
                                            run_id=self.engine.run_id))

    def _on_ack(self, device_id: str, msg: Message) -> None:
        problem = self.engine.acknowledge(device_id, parse_ack(msg))
        if problem is not None:
            LOG.warning("ignored an ACK from %s: %s", device_id, problem)
            return
        LOG.info("%s is ready", device_id)
        if self.engine.awaits(device_id):
            if self.aggregators:  # its plan may be new (it rejoined at a lower tier): the aggregators must know it
                self._send_brief()
            self._send_task(device_id)

    def _on_error(self, device_id: str, msg: Message) -> None:
        report = parse_error(msg)
        LOG.warning("%s reports %s: %s", device_id, report.code.value, report.detail)
        if report.code in (ErrorCode.ARTIFACTS_MISSING, ErrorCode.ARTIFACTS_CORRUPT):
            plan = self.engine.artifacts_lost(device_id)
            if plan is not None:
                self._send(device_id, plan_message(plan, device_id=device_id, run_id=self.engine.run_id))

    def _on_update(self, device_id: str, msg: Message) -> None:
        verdict = self.engine.receive(device_id, msg, time.monotonic())
        if not verdict.accepted:
            LOG.warning("dropped an update from %s (round %d): %s", device_id, msg.round, verdict.reason)
            count_refusal(self.refusals, update_refusal(verdict.reason))

    def _on_aggregator(self, aggregator: str, payload: bytes) -> None:
        """A sealed message from an aggregator: started or briefed, a receipt to judge, or its partial sums."""
        if aggregator not in self.aggregators:
            LOG.warning("dropped a message from %s: not an aggregator of this run", aggregator)
            return
        try:
            msg = self.aggregator_link.open(payload, self.engine.run_id, device_id=aggregator)
            kind = wire.kind_of(msg)
            self.heard[aggregator] = time.monotonic()
            if kind == wire.READY:
                self.aggregators_at[aggregator] = msg.round
                if msg.meta.get("reconnected") is True and self.engine.opened is not None:
                    self._ask_again(aggregator)
            elif kind == wire.RECEIPT:
                receipt = wire.parse_receipt(msg)
                verdict = self.engine.receive_receipt(aggregator, receipt, time.monotonic())
                if not verdict.accepted:
                    LOG.warning("dropped an update from %s (round %d, via %s): %s", receipt.device_id, receipt.round,
                                aggregator, verdict.reason)
                    count_refusal(self.refusals, update_refusal(verdict.reason))
                self._to_aggregator(aggregator, wire.verdict_message(aggregator, receipt.round, receipt.device_id,
                                                                     verdict.accepted, verdict.reason))
            elif kind == wire.PARTIAL:
                partial = wire.parse_partial(msg)
                problem = self.engine.receive_partial(aggregator, partial)
                if problem is None:
                    self.merged.add((aggregator, partial.round))
                    LOG.info("round %d: partial sums of %s over %d update(s)", partial.round, aggregator,
                             len(partial.devices))
                elif (aggregator, partial.round) in self.merged:  # it answered a request sent again, too
                    LOG.info("round %d: the partial sums of %s came again; taken once", partial.round, aggregator)
                else:
                    LOG.warning("round %d: refused the partial sums of %s: %s", partial.round, aggregator, problem)
            else:
                LOG.warning("dropped a %s message from aggregator %s", kind, aggregator)
        except (Refused, wire.WireError) as exc:
            LOG.warning("dropped a message from aggregator %s: %s", aggregator, exc)
            count_refusal(self.refusals, "aggregator message")

    def _to_aggregator(self, aggregator: str, msg: Message) -> None:
        self.endpoint.publish(wire.down_topic(self.args.prefix, aggregator), self.aggregator_link.seal(msg),
                              msg.msg_id)

    def wait_for_aggregators(self) -> None:
        """Every aggregator subscribed, before any device gets a task (an update no member reads is lost)."""
        if not self._pump(lambda: set(self.aggregators) <= set(self.aggregators_at),
                          time.monotonic() + self.args.join_timeout):
            missing = sorted(set(self.aggregators) - set(self.aggregators_at))
            raise RunError(f"aggregators {missing} did not start within --join-timeout {self.args.join_timeout:g} s; "
                           f"see {self.out.path / AGGREGATORS_DIR}/*.log")

    def _send_brief(self) -> wire.Brief:
        """The open round's brief to every aggregator (the members, and the others: they may take it and join)."""
        self.brief = self.engine.brief(self.max_inbound)
        now = time.monotonic()
        for aggregator in self.aggregators:
            self._to_aggregator(aggregator, wire.brief_message(self.brief, aggregator))
            self.asked[aggregator] = now
        return self.brief

    def brief_aggregators(self) -> None:
        """Send every aggregator the open round's brief; wait (bounded) until each member of the last round holds
        it. Those that hold it are this round's members: the devices are routed over them."""
        expected = set(self.engine.members) or set(self.aggregators)
        self.engine.set_members(())  # until they hold it: a task sent meanwhile names none (the engine reads it)
        brief = self._send_brief()
        briefed = lambda: {a for a in self.aggregators if self.aggregators_at.get(a) == brief.round}  # noqa: E731
        if not self._pump(lambda: expected <= briefed(), time.monotonic() + self.args.aggregator_timeout):
            LOG.warning("round %d: aggregators %s did not take its brief within --aggregator-timeout %g s: their "
                        "devices go to the others", brief.round, sorted(expected - briefed()),
                        self.args.aggregator_timeout)
        members = briefed()
        if not members:
            LOG.warning("round %d: no aggregator holds its brief: the server reads the updates itself", brief.round)
        self.engine.set_members(members)
        self.heard.update(dict.fromkeys(members, time.monotonic()))

    def _collect_partials(self, round_index: int) -> None:
        """Ask each aggregator told to fold updates for its partial sums; wait for them (bounded), or until a lost
        member's devices are awaited again."""
        for aggregator in self.engine.partials_missing():
            self._to_aggregator(aggregator, wire.close_message(aggregator, round_index, self.engine.fold_list(aggregator)))
            self.asked[aggregator] = time.monotonic()
        reopened = lambda: self.engine.closing(time.monotonic()) is None  # noqa: E731 (a lost member's devices)
        if not self._pump(lambda: not self.engine.partials_missing() or reopened(),
                          time.monotonic() + self.args.aggregator_timeout):
            LOG.warning("round %d: no partial sums from %s within --aggregator-timeout %g s (their logs: %s)",
                        round_index, self.engine.partials_missing(), self.args.aggregator_timeout,
                        self.out.path / AGGREGATORS_DIR)

    def _tend_aggregators(self, now: float) -> None:
        """While a round is open: a member silent for --aggregator-timeout is lost (its devices are asked again, to
        the others); one silent for a while is sent what it should answer (the brief, or the request for its
        partial: either may have been lost while it or the server changed broker)."""
        if self.brief is None or self.engine.opened is None or self.brief.round != self.engine.opened.round:
            return
        missing = self.engine.partials_missing()
        for aggregator in self.aggregators:
            member = aggregator in self.engine.members
            if member and now - self.heard.get(aggregator, now) > self.args.aggregator_timeout:
                for device_id in self.engine.member_lost(aggregator):
                    self._send_task(device_id)
                continue
            if now - max(self.heard.get(aggregator, 0.0), self.asked.get(aggregator, 0.0)) < self.probe_s:
                continue
            if aggregator in missing and self.engine.closing(now) is not None:
                self._to_aggregator(aggregator, wire.close_message(aggregator, self.brief.round,
                                                                     self.engine.fold_list(aggregator)))
            elif member or self.aggregators_at.get(aggregator) != self.brief.round:
                self._to_aggregator(aggregator, wire.brief_message(self.brief, aggregator))
            self.asked[aggregator] = now

    def _ask_again(self, aggregator: str) -> None:
        """``aggregator`` connected again: what its devices sent while it was away is lost; send them their task again
        (a device that answered re-sends its answer)."""
        devices = self.engine.routed_to(aggregator)
        if devices:
            LOG.info("aggregator %s connected again: asking %s again", aggregator, ", ".join(devices))
        for device_id in devices:
            self._send_task(device_id)

    # -- outbound ---------------------------------------------------------------------------

    def _send_task(self, device_id: str) -> None:
        self._send_built_task(device_id, self.engine.task(device_id, now=time.monotonic(), wall=time.time()))

    def _send_built_task(self, device_id: str, task: Task) -> None:
        self._send(device_id, task_message(task, plan_hash=self.engine.plan_info(device_id).hash,
                                           device_id=device_id, run_id=self.engine.run_id))

    # -- rounds -----------------------------------------------------------------------------

    def wait_for_devices(self) -> None:
        need = self.engine.min_devices
        if self.engine.can_start():
            return
        LOG.info("waiting for %d ready device(s) (%d now)", need, len(self.engine.ready_devices()))
        if not self._pump(self.engine.can_start, time.monotonic() + self.args.join_timeout, handling_counts=False):
            raise RunError(f"only {len(self.engine.ready_devices())} of --min-devices {need} devices "
                           f"ready after --join-timeout {self.args.join_timeout:g} s")

    def run_round(self, round_index: int, *, train: bool = True) -> dict[str, Any] | None:
        """Open a round, send its tasks, gather answers until all are in or the deadline passes, close it;
        returns the record the round's evaluations completed."""
        stats = self.endpoint.stats
        wire_before = (stats["bytes_out"], stats["bytes_in"])
        tasks = self.engine.open_round(round_index, time.monotonic(), train=train, wall=time.time())
        if self.aggregators:
            self.brief_aggregators()
        for device_id, task in tasks.items():
            task.aggregator = self.engine.route(device_id)  # over the members that took the brief
            self._send_built_task(device_id, task)
        self.gather(round_index)
        stats = self.endpoint.stats  # a snapshot: read it again
        _, completed = self.engine.close_round(time.monotonic(), wire=(stats["bytes_out"] - wire_before[0],
                                                                       stats["bytes_in"] - wire_before[1]))
        return completed

    def gather(self, round_index: int) -> None:
        """Take answers until every asked device answered or the round's deadline passed, then the aggregators'
        partial sums (and back to the answers when a member was lost meanwhile: its devices answer again)."""
        while True:
            self._pump(lambda: self.engine.closing(time.monotonic()) is not None)
            if not self.aggregators:
                return
            self._collect_partials(round_index)
            if self.engine.closing(time.monotonic()) is not None:
                return

    def run(self, first_round: int, progress: Progress) -> None:
        """Rounds first_round..rounds, then the evaluation of the final model; checkpoint after each."""
        rounds = self.engine.config.rounds
        if self.aggregators:
            self.wait_for_aggregators()
        for t in range(first_round, rounds + 1):
            self.wait_for_devices()
            progress.evaluated(self.run_round(t))
            progress.trained(self.engine.pending)
            self.checkpoint(t, finished=False)
            self.publish_status(force=True)
        if self.engine.pending is not None:
            progress.evaluated(self.run_round(rounds + 1, train=False))
        self.checkpoint(rounds, finished=True)
        self.publish_status(force=True)

    def checkpoint(self, round_index: int, *, finished: bool) -> None:
        state = {"run_id": self.engine.run_id, "settings": self.settings, "engine": self.engine.to_state(),
                 "finished": finished}
        self.out.save(round_index, self.engine.global_arrays(), state, self.engine.records)


# -- wiring ------------------------------------------------------------------------------------


@contextlib.contextmanager
def broker_url(args: argparse.Namespace) -> Iterator[str]:
    """--broker, or an embedded broker for as long as the block runs."""
    if args.broker:
        yield args.broker
        return
    with EmbeddedBroker() as broker:
        yield broker.url


def local_limits(args: argparse.Namespace) -> list[float]:
    """--local-memory-limit-mb where memory cgroups can be made here, else [] and one line saying why not."""
    if not args.local_memory_limit_mb:
        return []
    why = cgroups.available()
    if why is not None:
        print(f"--local-memory-limit-mb ignored: {why}; the local devices run without a memory limit", flush=True)
        return []
    return cgroups.parse_limits(args.local_memory_limit_mb)


def run(args: argparse.Namespace, config: FederationConfig, out: RunFolder) -> None:
    """Set the run up (or resume it), connect, spawn the local devices, federate, report (flags checked: ``config``
    is check_args')."""
    args.password = args.password or os.environ.get(PASSWORD_ENV)
    budgets = _budgets(args.local_memory_mb)
    assembly = assemble(args, config, out, Deployment(
        devices=args.local_devices, min_devices=args.min_devices or args.local_devices or 1,
        round_deadline_s=args.round_deadline, remote=args.aggregators > 0, settings_keys=BROKER_SETTINGS),
        emit=print_and_log)
    engine, shards, settings, saved = assembly.engine, assembly.shards, assembly.settings, assembly.saved
    run_id = assembly.run_id
    max_inbound = inbound_limit(engine.global_state, engine.initial_personal)
    out.path.mkdir(parents=True, exist_ok=True)
    keys, auth_state = run_key_ring(args.enroll, args.run_key, list(shards), out.path)
    link = Link.server(keys, auth_state, max_inbound)
    enrollment = Path(args.enroll) if args.enroll else out.path / LOCAL_ENROLLMENT
    aggregators = tuple(f"agg-{i}" for i in range(args.aggregators))
    aggregator_link = (wire.engine_link(load_server_key(enrollment), auth_state / AGGREGATORS_DIR, max_inbound)
                       if aggregators else None)
    subscriptions = server_subscriptions(args.prefix)  # with aggregators: the updates when no member is left
    subscriptions += [wire.engine_filter(args.prefix)] if aggregators else []
    anything_a_server_held = [*server_subscriptions(args.prefix), wire.engine_filter(args.prefix)]
    local, local_aggregators = LocalDevices(on_oom=engine.demote), LocalDevices("aggregator")
    with broker_url(args) as url, contextlib.ExitStack() as stack:
        status = None
        if args.status_port is not None:
            status = stack.enter_context(StatusServer(args.status_host or STATUS_HOST, args.status_port))
            print(f"status: {status.url} (/metrics for Prometheus, /api/status), read-only, until the run ends",
                  flush=True)
        endpoint = MqttEndpoint(f"fedara-server-{args.prefix.replace('/', '_')}", url,
                                subscriptions=subscriptions, unsubscriptions=anything_a_server_held,
                                username=args.username, password=args.password, tls_ca=args.tls_ca,
                                tls_cert=args.tls_cert, tls_key=args.tls_key, max_frame_bytes=args.max_message_bytes,
                                max_message_bytes=max_inbound, max_pending_bytes=PENDING_UPDATES_BUDGETED * max_inbound,
                                clean_session=False)
        endpoint.start()
        stack.callback(endpoint.stop)
        endpoint.wait_connected(CONNECT_TIMEOUT_S)
        LOG.info("run %s on %s, prefix %s, algorithm %s", run_id, url, args.prefix, config.algo)
        print(f"run {run_id}: {config.algo} on {url}, run folder {out.path}", flush=True)
        if aggregators:
            stack.callback(local_aggregators.stop)
            (out.path / AGGREGATORS_DIR).mkdir(exist_ok=True)
            for i, name in enumerate(aggregators):
                # A member's counters live with the deployment's (like a device's workdir): kept across runs. Member
                # i starts on node i + 1 of a --broker list (the server on node 0).
                local_aggregators.spawn(name, aggregator_command(args, rotate_brokers(url, i + 1), name, enrollment,
                                                                 auth_state / AGGREGATORS_DIR / name),
                                        out.path / AGGREGATORS_DIR / f"{name}.log",
                                        env={PASSWORD_ENV: args.password} if args.password else None)
        if shards:
            shard_paths = write_shards(list(shards.values()), out.path / SHARDS_DIR, filename=DEVICE_SHARD_FILENAME)
            stack.callback(local.stop)
            limits = local_limits(args)
            for i, (device_id, shard_path) in enumerate(zip(shards, shard_paths)):
                workdir = out.path / DEVICES_DIR / device_id
                workdir.mkdir(parents=True, exist_ok=True)
                group = cgroups.create_group(device_id, limits[i % len(limits)]) if limits else None
                budget = None if group is not None else budgets[i % len(budgets)]
                # device i starts on node i of a --broker list: a local run spreads over every node
                local.spawn(device_id, device_command(args, rotate_brokers(url, i), device_id, shard_path, workdir,
                                                      budget, out.path / LOCAL_KEYS_DIR / f"{device_id}.key",
                                                      args.max_message_bytes),
                            out.path / DEVICES_DIR / f"{device_id}.log", group)
        federation = Federation(args, engine, endpoint, out, local, settings, max_inbound, link, aggregators,
                                aggregator_link, status)
        if saved and saved.state["finished"] and saved.round >= config.rounds:
            LOG.info("the run in %s is finished; rewriting its report", out.path)
        else:
            federation.run(assembly.first_round(), Progress(config.rounds))
    report = out.report(engine.records, dict(settings, run_id=run_id, broker=args.broker or "embedded",
                                             driver="broker_loop"))
    print(f"wrote {out.path / 'metrics.jsonl'}, metrics.csv and {report}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    console_logging()
    out = RunFolder(run_folder(args, "broker_loop"))
    try:
        config = check_args(args)
        check_broker_args(args)
    except ValueError as exc:
        return fail(str(exc))
    out.path.mkdir(parents=True, exist_ok=True)
    file_log = logging.FileHandler(out.path / SERVER_LOG)
    file_log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    fedara_log = logging.getLogger("fedara")
    fedara_log.addHandler(file_log)
    fedara_log.setLevel(logging.INFO)
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run(args, config, out)
    except (RunError, CheckpointError, OverrideError, TransportError, ValueError, OSError) as exc:
        file_log.handle(LOG.makeRecord(LOG.name, logging.ERROR, __file__, 0, "%s", (exc,), None))  # not twice on screen
        return fail(str(exc))
    except KeyboardInterrupt:
        print("interrupted; the last completed round is in the checkpoint (--resume continues)", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        fedara_log.removeHandler(file_log)
        file_log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
