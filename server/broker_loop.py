"""The MQTT driver of the round engine: ``python -m server.broker_loop``.

    python -m server.broker_loop --dataset fmnist --local-devices 5 --rounds 5 --local-epochs 1 --max-samples 6000

One process. paho's network thread fills the endpoint's inbox; the main loop takes messages from it, decodes
them, hands them to the round engine (``server.engine.round_engine``: every decision of the run lives there) and
publishes what the engine answers: plans (artifact files only to devices that lack them), tasks, refusals.
After every round it writes OUT/metrics.jsonl, metrics.csv and OUT/checkpoint.npz (``--resume`` continues
from the last completed round); at the end OUT/report.md with its plots. While it runs, OUT/spill holds the
authenticated updates half-received past its reassembly memory budget (``SPILL_DIR``). Without ``--broker`` an embedded
broker serves 127.0.0.1 on a free port. ``--local-devices N`` writes N shards of the dataset to OUT/shards
and runs ``python -m device_runtime`` on each (workdirs and logs in OUT/devices), ended with SIGTERM at the
end. ``--broker`` may list several nodes of a clustered broker (``mqtt://h1:1883,mqtt://h2:1883``): every process
moves to the next on a lost connection, and local device i starts on node i. ``--aggregators N`` starts N
aggregator processes (``server.aggregator``): each round the engine routes every device's update to one of them by
topic, and they send the engine their partial sums; without it the server reads every update itself.
The flags are the simulator's (``server.cli``), plus the broker's, the local devices' and the aggregators'.
``--mode async`` drives the async engine instead (``AsyncFederation``: tasks as devices come free, a version every
--buffer-size updates; docs/async.md); ``--local-cpu-limit`` puts local device i in a CPU cgroup of that many cores.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from device_runtime.broker_wait import BrokerUnreachableError, wait_for_broker
from device_runtime.spill import FileSpill
from device_runtime.transport import MqttEndpoint, TransportError, rotate_brokers, speaks_mqtt5
from server.mqtt import cgroups
from server.broker_flags import build_parser, check_broker_args, check_broker_reachable, local_budgets
from server.cli import (PASSWORD_ENV, STATUS_HOST, check_args, check_before_loading, check_inputs,
                        console_logging, fail, parse, run_folder, say_before_run)

LOG = logging.getLogger("fedara.server")
POLL_S = 0.2
AGGREGATORS_DIR = "aggregators"
INBOUND_SLACK_BYTES = 1 << 20
"""Room for headers, metadata and the small messages (JOIN, ACK, ERROR) above the largest update."""
SHARDS_DIR, DEVICES_DIR = "shards", "devices"
SERVER_LOG = "server.log"
STATUS_EVERY_S = 0.5
"""How often the run loop publishes a new snapshot to --status-port while it waits (and after every round)."""


if __name__ == "__main__":  # --help and a mistake in the flags answer before torch and the data load
    check_before_loading(build_parser(), check_broker_args, check_broker_reachable)

# The run's imports load torch (seconds, tens under load): after the flags are checked.
import numpy as np  # noqa: E402
import torch  # noqa: E402

from device_runtime.messages import (ErrorCode, MessageError, error_message, new_msg_id, parse_ack, parse_error,
                                     parse_join, parse_payload_request, plan_message, receipt_message,
                                     task_message)
from device_runtime.payload import PayloadRef
from device_runtime.link import Link, Refused
from device_runtime.envelope import Message, MessageType
from device_runtime.protocol import ProtocolError
from device_runtime.topics import Topics, device_id_from_topic, payload_topic, server_subscriptions
from device_runtime.status import Status
from device_runtime.task import Task
from server.outputs.checkpoint import CheckpointError
from server.mqtt.embedded_broker import EmbeddedBroker
from server.engine.async_engine import AsyncEngine
from server.engine.round_engine import RoundEngine
from server.outputs.refusals import count_refusal, update_refusal
from server.outputs.status_server import StatusServer
from server.outputs.status_snapshot import fleet_snapshot
from server.mqtt import aggregation_wire as wire
from server.mqtt.enrollment import LOCAL_ENROLLMENT, LOCAL_KEYS_DIR, load_server_key, run_key_ring
from server.data.partition import write_shards
from server.outputs.progress import SHARED_DOWN, Progress, final_line, print_and_log
from server.engine.rank_assignment import OverrideError
from server.engine.run_config import FederationConfig, RunError
from server.run_setup import Deployment, RunFolder, assemble
from server.data.shards import DEVICE_SHARD_FILENAME
from server.mqtt.aggregator_channel import AggregatorChannel
from server.mqtt.admission import server_admission, server_filters
from server.mqtt.read_budgets import SPILL_DIR, reader_budgets
from server.mqtt.lost_updates import LostUpdates
from server.mqtt.secagg_relay import SecureRelay
from server.mqtt.local_processes import LocalDevices, aggregator_command, device_command

FederationError = RunError


BROKER_SETTINGS = ("local_devices", "local_memory_mb", "local_memory_limit_mb", "prefix", "aggregators")
"""The broker loop's own settings a resumed run must match."""


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
        self.settings = settings
        self.max_inbound = max_inbound
        self.sessions_lost = 0  # the endpoint's count when the open round's tasks were last re-sent for it
        self.started = time.monotonic()  # reset when run() begins: sim_time counts from there
        self._wire = (0, 0)
        self.status, self._status_at = status, float("-inf")
        self.refusals: Counter[str] = Counter()  # refused inbound messages by kind (bounded: refusals.count_refusal)
        self.lost_updates = LostUpdates()  # updates pushed out half-received (here or at a member): asked again
        self.channel = AggregatorChannel(engine, endpoint, aggregator_link, prefix=args.prefix, names=aggregators,
                                         timeout_s=args.aggregator_timeout, join_timeout_s=args.join_timeout,
                                         max_inbound=max_inbound, logs=out.path / AGGREGATORS_DIR, pump=self._pump,
                                         send_task=self._send_task, lost=self.lost_updates.lost,
                                         refusals=self.refusals)
        self.retained: dict[str, int] = {}  # payload topic -> frames retained there, this round
        self.relay = SecureRelay(engine, self._send, args.secagg_phase_timeout, self.refusals)  # secure rounds

    def publish_status(self, *, force: bool = False, finished: bool = False) -> None:
        """Hand --status-port a fresh snapshot of the run (at most every STATUS_EVERY_S unless ``force``; ``finished``:
        the run's last)."""
        now = time.monotonic()
        if self.status is None or (not force and now - self._status_at < STATUS_EVERY_S):
            return
        self._status_at = now
        self.status.publish(fleet_snapshot(self.engine, now=now, wall=time.time(), transport=self.endpoint.stats,
                                           refusals=self.refusals, aggregators=self.channel.at,
                                           rounds=self.engine.config.rounds, previous=self.status.latest(),
                                           finished=finished))

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
            self._ask_again_lost()
            self.channel.tend(time.monotonic())
            self._ask_unjoined_to_join(time.monotonic())
            self.publish_status()
            if self.local.processes and not self.local.check() and not self.engine.ready_devices():
                if self.local.out_of_memory == set(self.local.processes):
                    raise RunError("every local device was killed at its --local-memory-limit-mb limit before it "
                                   "could train at any tier: raise --local-memory-limit-mb")
                raise RunError(f"every local device exited; see {self.out.path / DEVICES_DIR}/*.log")
        return True

    def _after_reconnect(self) -> None:
        """After the server reconnected to a broker that held no session of it, what the devices sent meanwhile is
        lost (and a broker that lost it may have lost the tasks too): the open round's task goes again to every
        device it awaits, which re-sends its saved answer. A kept session queued what came for the server while it
        was away, and paho re-sends its own unacknowledged publishes: then nothing is sent again (each reconnect to
        a NATS cluster that lost a node had re-sent ~900 tasks into its struggling JetStream at K = 1,000)."""
        if not self._session_lost_since_checked():
            return
        awaited = self.engine.awaited()
        LOG.info("reconnected to a broker that held no session of the server; re-sending the open round's task to "
                 "%d device(s)", len(awaited))
        for device_id in awaited:
            self._send_task(device_id)

    def _session_lost_since_checked(self) -> bool:
        """Whether the endpoint reconnected to a broker that held no session of the server since the last call."""
        lost = self.endpoint.stats["sessions_lost"]
        if lost == self.sessions_lost:
            return False
        self.sessions_lost = lost
        return True

    def _ask_again_lost(self) -> None:
        """An update pushed out of the reassembly budget half-received is lost (nothing else brings it back): the
        device, while the round awaits it, gets its task again and re-sends its saved answer, a few at a time
        (server/mqtt/lost_updates.py). So are those an aggregator process lost (its channel hands them to
        ``lost_updates``): the re-sent update goes to that member again (its route is the device's)."""
        lost = []
        for topic in self.endpoint.take_lost():
            try:
                lost.append(device_id_from_topic(self.args.prefix, topic)[0])
            except ProtocolError:
                continue  # an aggregator's message: its channel asks again on its own clock
        self.lost_updates.lost(lost)
        for device_id in self.lost_updates.to_ask(self.engine.awaits):
            LOG.info("%s: its update was pushed out half-received; sending its task again", device_id)
            self._send_task(device_id)

    def _ask_unjoined_to_join(self, now: float) -> None:
        for device_id in self.engine.to_ask_to_join(now):
            LOG.info("%s is online but has not joined: asking it to", device_id)
            self._send(device_id, error_message(ErrorCode.REJOIN, "join this run", device_id=device_id,
                                                run_id=self.engine.run_id))

    # -- inbound ----------------------------------------------------------------------------

    def _handle(self, topic: str, payload: bytes) -> None:
        aggregator = self.channel.sender(topic)
        if aggregator is not None:
            self.channel.handle(aggregator, payload)
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
        if msg.type == MessageType.SECAGG:
            self.relay.on_message(device_id, msg)
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

    def _acknowledge(self, device_id: str, msg: Message) -> bool:
        """Whether the engine takes ``device_id``'s ACK (the device is ready); logged either way."""
        problem = self.engine.acknowledge(device_id, parse_ack(msg))
        if problem is not None:
            LOG.warning("ignored an ACK from %s: %s", device_id, problem)
            return False
        LOG.info("%s is ready", device_id)
        return True

    def _on_ack(self, device_id: str, msg: Message) -> None:
        if not self._acknowledge(device_id, msg):
            return
        if self.engine.awaits(device_id):
            if self.channel.names:  # its plan may be new (it rejoined at a lower tier): the aggregators must know it
                self.channel.send_brief()
            self._send_task(device_id)

    def _on_error(self, device_id: str, msg: Message) -> None:
        report = parse_error(msg)
        if report.code == ErrorCode.PAYLOAD_WANTED:
            ref = parse_payload_request(msg)
            data = self.engine.payload_wanted(device_id, ref, time.monotonic())
            LOG.info("%s asks for payload %s again (%s): %s", device_id, ref.sha256[:12], report.detail,
                     "published again" if data is not None else "not now (published moments ago, or not this round's)")
            if data is not None:
                self._publish_payload(ref, data)
            return
        LOG.warning("%s reports %s: %s", device_id, report.code.value, report.detail)
        if report.code == ErrorCode.NON_FINITE:
            verdict = self.engine.decline(device_id, msg.round, report.detail)
            LOG.warning("%s's answer to round %d is refused: %s", device_id, msg.round, verdict.reason)
            count_refusal(self.refusals, update_refusal(verdict.reason))
            return
        if report.code in (ErrorCode.ARTIFACTS_MISSING, ErrorCode.ARTIFACTS_CORRUPT):
            plan = self.engine.artifacts_lost(device_id)
            if plan is not None:
                self._send(device_id, plan_message(plan, device_id=device_id, run_id=self.engine.run_id))

    def _on_update(self, device_id: str, msg: Message) -> None:
        if self.relay.takes_masked(device_id, msg):  # a secure round's answer: its masked input counts first
            if not self.relay.on_masked(device_id, msg):
                return
            msg.blobs = {}
        verdict = self.engine.receive(device_id, msg, time.monotonic())
        if not verdict.accepted:
            LOG.warning("dropped an update from %s (round %d): %s", device_id, msg.round, verdict.reason)
            count_refusal(self.refusals, update_refusal(verdict.reason))
            return
        self._send_receipt(device_id, msg.round)

    def _send_receipt(self, device_id: str, round_index: int) -> None:
        """Tell the device its answer to ``round_index`` is counted: a re-ask that crossed that answer is not
        answered with it again (device_runtime/answer_receipt.py)."""
        self._send(device_id, receipt_message(device_id=device_id, run_id=self.engine.run_id, round_index=round_index))

    # -- outbound ---------------------------------------------------------------------------

    def _send_task(self, device_id: str) -> None:
        self._send_built_task(device_id, self.engine.task(device_id, now=time.monotonic(), wall=time.time()))

    def _send_built_task(self, device_id: str, task: Task) -> None:
        """The TASK, naming its plan's payload (published first, once per plan and round) instead of carrying it."""
        ref = None
        if task.weights and self.engine.shares_payloads:
            ref, data = self.engine.payload(device_id, task, time.monotonic())
            if data is not None:
                self._publish_payload(ref, data)
        self._send(device_id, task_message(task, plan_hash=self.engine.plan_info(device_id).hash,
                                           device_id=device_id, run_id=self.engine.run_id, payload=ref))

    def _publish_payload(self, ref: PayloadRef, data: bytes) -> None:
        """A plan's payload, retained (a device that subscribes later gets it), in frames of --max-message-bytes."""
        topic = payload_topic(self.args.prefix, self.engine.run_id, ref.sha256)
        self.retained[topic] = self.endpoint.publish_retained(topic, data, new_msg_id(MessageType.TASK))
        LOG.info("published payload %s (%d bytes, %d frames)", ref.sha256[:12], len(data), self.retained[topic])

    def clear_payloads(self) -> None:
        """Delete the closed round's retained payloads from the broker."""
        for topic, frames in self.retained.items():
            self.endpoint.clear_retained(topic, frames)
        self.retained = {}

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
        held_before = (stats["messages_spilled"], stats["messages_evicted"])
        tasks = self.engine.open_round(round_index, time.monotonic(), train=train, wall=time.time())
        LOG.info("round %d opened: %d device(s) asked", round_index, len(tasks))
        if self.channel.names:
            self.channel.brief_members()
        for device_id, task in tasks.items():
            task.aggregator = self.engine.route(device_id)  # over the members that took the brief
            self._send_built_task(device_id, task)
        self.relay.open(round_index, time.monotonic())
        self.gather(round_index)
        stats = self.endpoint.stats  # a snapshot: read it again
        LOG.info("round %d: %d incomplete message(s) kept in the spill past the memory budget, %d pushed out",
                 round_index, stats["messages_spilled"] - held_before[0], stats["messages_evicted"] - held_before[1])
        now = time.monotonic()
        _, completed = self.engine.close_round(now, wire=(stats["bytes_out"] - wire_before[0],
                                                          stats["bytes_in"] - wire_before[1]),
                                               sim_time=now - self.started)
        self.clear_payloads()
        return completed

    def gather(self, round_index: int) -> None:
        """Take answers until every asked device answered or the round's deadline passed, then the aggregators'
        partial sums (and back to the answers when a member was lost meanwhile: its devices answer again). A secure
        round waits for its SecAgg+ exchanges (``SecureRelay``) and for the other devices' evaluations."""
        if self.engine.secure_round is not None:
            self._pump(lambda: self._secure_round_over(time.monotonic()))
            return
        while True:
            self._pump(lambda: self.engine.closing(time.monotonic()) is not None)
            if not self.channel.names:
                return
            self.channel.collect_partials(round_index)
            if self.engine.closing(time.monotonic()) is not None:
                return

    def _secure_round_over(self, now: float) -> bool:
        """The secure exchanges are over and every device that is not a secure participant answered (or the
        round's deadline passed): the round closes, the engine unmasks."""
        if not self.relay.tend(now):
            return False
        participants = set(self.engine.secure_round.spec.participants)
        return self.engine.closing(now) is not None or all(d in participants for d in self.engine.awaited())

    def run(self, first_round: int, progress: Progress) -> None:
        """Rounds first_round..rounds (fewer where the privacy budget ends the run first), then the evaluation of the
        final model; checkpoint after each."""
        rounds = self.engine.config.rounds
        self.started = time.monotonic()  # every row's sim_time: the wall clock since the run (or its resume) began
        if self.channel.names:
            self.channel.wait_for_start()
        last = first_round - 1
        for t in range(first_round, rounds + 1):
            stop = self.engine.budget_refusal()
            if stop is not None:
                print_and_log(stop)
                break
            self.wait_for_devices()
            progress.evaluated(self.run_round(t))
            progress.trained(self.engine.pending)
            self.checkpoint(t, finished=False)
            self.publish_status(force=True)
            last = t
        if self.engine.pending is not None:
            progress.evaluated(self.run_round(last + 1, train=False))
        self.checkpoint(rounds, finished=True)
        self.publish_status(force=True, finished=True)

    def checkpoint(self, round_index: int, *, finished: bool) -> None:
        self.link.persist()  # what the checkpoint folds was accepted: durable first, so no resume takes it twice
        self.channel.persist()
        state = {"run_id": self.engine.run_id, "settings": self.settings, "engine": self.engine.to_state(),
                 "finished": finished}
        self.out.save(round_index, dict(self.engine.global_arrays(), **self.engine.state_tensors()), state,
                      self.engine.records)


class AsyncFederation(Federation):
    """``--mode async`` over MQTT: the same loop and messages, tasks given on device events instead of round opens.

    A ready device (joined, online) that is not training gets a task at the current version as soon as a slot is
    free (``AsyncEngine.dispatch``: up to --concurrency, a seeded choice): when it acknowledges its plan, comes
    online, or any update comes in. Every update goes to ``AsyncEngine.receive``; each new version is evaluated by
    the ready devices not training then (evaluation tasks: a device that trains evaluates the version its task
    carries first: a row waits for those until the version after next), checkpointed and published on --status-port.
    --task-timeout ends tasks whose devices went silent (``AsyncEngine.expire``, from the run's clock). After the
    last version every ready device evaluates it (at most --task-timeout, else --round-deadline, seconds); the
    tasks still in flight are abandoned (a resumed run gives fresh ones). With DP the run ends early, as the
    simulator's does, once the next version would pass --dp-target-epsilon (``engine.budget_refusal``): one line,
    no further task or update taken (``AsyncEngine.makes_no_more``), the last version evaluated and checkpointed.
    The engine's clock here is the wall clock since the run (or its resume) began: every row's sim_time."""

    engine: AsyncEngine

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._evaluations_asked: dict[str, int] = {}  # device -> the evaluation task it was sent last, unanswered
        self._acknowledged: set[str] = set()  # devices that acknowledged their plan to this process (a resumed
        # run's registry says ready for devices whose new processes have not loaded their plans yet)
        self.progress: Progress | None = None  # run()'s

    def clock(self) -> float:
        """Seconds since the run (or its resume) began: the async engine's ``now``."""
        return time.monotonic() - self.started

    def _dispatch(self) -> None:
        engine = self.engine
        for device_id, task in engine.dispatch(self._ready(), now=self.clock()).items():
            self._send_built_task(device_id, task)
        self._clear_unused_payloads()

    def _clear_unused_payloads(self) -> None:
        """Delete the retained payloads of versions no task in flight or evaluation asked uses any more."""
        for ref in self.engine.unused_payloads():
            topic = payload_topic(self.args.prefix, self.engine.run_id, ref.sha256)
            frames = self.retained.pop(topic, None)
            if frames is not None:
                self.endpoint.clear_retained(topic, frames)

    def _resend(self, device_id: str) -> None:
        LOG.info("sending %s its task in flight again", device_id)
        self._send_built_task(device_id, self.engine.resend(device_id))

    def _evaluate(self, device_ids: list[str]) -> None:
        for device_id, task in self.engine.evaluation_tasks(device_ids).items():
            self._evaluations_asked[device_id] = task.round
            self._send_built_task(device_id, task)

    def _ready(self) -> list[str]:
        return [d for d in self.engine.ready_devices() if d in self._acknowledged]

    def _idle(self) -> list[str]:
        training = set(self.engine.training())
        return [d for d in self._ready() if d not in training]

    def _after_reconnect(self) -> None:
        """Tasks in flight may have been lost with a broker that held no session of the server: re-send them (the
        synchronous loop's rule)."""
        if not self._session_lost_since_checked():
            return
        for device_id in self.engine.training():
            self._resend(device_id)

    def _on_status(self, device_id: str, status: Status) -> None:
        change = self.engine.status(device_id, status.online, status.nonce, time.monotonic())
        if change.ignored:
            return
        if change.known:
            LOG.info("%s is %s", device_id, "online" if status.online else "offline")
        if status.online and device_id in self.engine.training() and device_id in self._ready():
            self._resend(device_id)  # it may have missed its task while away
        self._dispatch()

    def _on_ack(self, device_id: str, msg: Message) -> None:
        if not self._acknowledge(device_id, msg):
            return
        self._acknowledged.add(device_id)
        if device_id in self.engine.training():  # a resumed run's task, or one it lost restarting
            self._resend(device_id)
        self._dispatch()

    def _on_update(self, device_id: str, msg: Message) -> None:
        asked = self._evaluations_asked.get(device_id) == msg.round
        if asked:
            del self._evaluations_asked[device_id]
        elif self.engine.makes_no_more():  # --rounds reached, or the privacy budget
            LOG.info("%s's update of task %d came after the last version: not counted", device_id, msg.round)
            return
        verdict = self.engine.receive(device_id, msg, self.clock())
        self._follow()
        if not verdict.accepted:
            LOG.warning("dropped an update from %s (task %d): %s", device_id, msg.round, verdict.reason)
            count_refusal(self.refusals, update_refusal(verdict.reason))
        else:
            self._send_receipt(device_id, msg.round)
        self._dispatch()

    def _follow(self) -> None:
        """The progress lines of the versions made and the rows completed since the last call: after every update
        (one makes at most one version), so none is lost, the versions made while devices still join included."""
        if self.progress is not None:
            self.progress.follow(self.engine.version, self.engine.pending, self.engine.records)

    def _wait(self, until: Callable[[], bool], deadline: float | None) -> bool:
        """Pump until ``until()`` or ``deadline`` (monotonic), ending the tasks --task-timeout ends on the way."""
        engine = self.engine
        while True:
            expiry = engine.next_expiry()
            stops = [t for t in (deadline, None if expiry is None else self.started + expiry) if t is not None]
            if self._pump(until, min(stops) if stops else None):
                return True
            if engine.expire(self.clock()):
                self._follow()  # a row that waited on an ended task may be complete
                self._dispatch()
            if deadline is not None and time.monotonic() >= deadline:
                return until()

    def run(self, first_round: int, progress: Progress) -> None:
        """Versions up to --rounds (fewer where the privacy budget ends the run first; ``first_round``: the next
        version to make), each checkpointed; then the final version's evaluations."""
        engine = self.engine
        rounds = engine.config.rounds
        self.started = time.monotonic()
        self.progress = progress
        progress.begin(engine.version, engine.records)
        self.wait_for_devices()
        self._dispatch()
        while engine.version < rounds:
            stop = engine.budget_refusal()  # DP: the next version would overspend; what is buffered stays unsent
            if stop is not None:
                print_and_log(stop)
                break
            before = engine.version
            self._wait(lambda: engine.version > before, None)
            if not engine.makes_no_more():  # the last version: below, once the tasks in flight are in
                self._evaluate(self._idle())
            self.checkpoint(engine.version, finished=False)
            self.publish_status(force=True)
        # Every ready device evaluates the last version (one still training, after its task: what it trains is not
        # counted); a device silent for --task-timeout (or --round-deadline) is not waited for.
        self._evaluate(self._ready())
        self._wait(lambda: not self._evaluations_asked,
                   time.monotonic() + (self.args.task_timeout or self.args.round_deadline))
        LOG.info("the run is over: %d task(s) in flight abandoned", len(engine.abandon()))
        engine.finish()
        self.clear_payloads()
        self._follow()
        self.checkpoint(rounds, finished=True)
        self.publish_status(force=True, finished=True)


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
    return _limits_here("--local-memory-limit-mb", args.local_memory_limit_mb, cgroups.available,
                        cgroups.parse_limits, "memory")


def local_cpu_limits(args: argparse.Namespace) -> list[float]:
    """--local-cpu-limit where CPU cgroups can be made here, else [] and one line saying why not."""
    return _limits_here("--local-cpu-limit", args.local_cpu_limit, cgroups.cpu_available, cgroups.parse_cpu_limits,
                        "CPU")


def _limits_here(flag: str, value: str | None, available: Callable[[], str | None],
                 parse: Callable[[str], list[float]], what: str) -> list[float]:
    """``flag``'s limits where such cgroups can be made here, else [] and one line saying why not."""
    if not value:
        return []
    why = available()
    if why is not None:
        print(f"{flag} ignored: {why}; the local devices run without a {what} limit", flush=True)
        return []
    return parse(value)


def linger(status: StatusServer, seconds: float) -> None:
    """Keep the status page up ``seconds`` after the run (its last snapshot, marked finished); Ctrl-C ends it."""
    print(f"status: the run has ended; {status.url} stays up {seconds:g} s (--status-linger; Ctrl-C ends it)",
          flush=True)
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


def run(args: argparse.Namespace, config: FederationConfig, out: RunFolder) -> None:
    """Set the run up (or resume it), connect, spawn the local devices, federate, report (flags checked: ``config``
    is check_args')."""
    args.password = args.password or os.environ.get(PASSWORD_ENV)
    budgets = local_budgets(args.local_memory_mb)
    assembly = assemble(args, config, out, Deployment(
        devices=args.local_devices, min_devices=args.min_devices or args.local_devices or 1,
        round_deadline_s=args.round_deadline, remote=args.aggregators > 0,
        shared_payloads=True,  # a task names its payload (sync: the round's, async: its version's) at each plan
        settings_keys=BROKER_SETTINGS),
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
    subscriptions = server_filters(args.prefix, keys)  # with aggregators: the updates when no member is left
    subscriptions += [wire.engine_filter(args.prefix)] if aggregators else []
    anything_a_server_held = [*server_subscriptions(args.prefix), wire.engine_filter(args.prefix)]
    admit, vouch = server_admission(args.prefix, keys, aggregators)  # frames of enrolled senders only, bounded each
    spill = FileSpill(out.path / SPILL_DIR)  # updates half-received past the memory budget (removed after the run)
    local, local_aggregators = LocalDevices(on_oom=engine.demote), LocalDevices("aggregator")
    with contextlib.ExitStack() as status_stack:  # the page outlives the broker and the devices by --status-linger
        status = None
        if args.status_port is not None:
            status = status_stack.enter_context(StatusServer(args.status_host or STATUS_HOST, args.status_port))
            print(f"status: {status.url} (/metrics for Prometheus, /api/status), read-only, until the run ends"
                  + (f" and {args.status_linger:g} s after" if args.status_linger else ""), flush=True)
        with broker_url(args) as url, contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, spill.folder, ignore_errors=True)  # after the endpoint stopped
            mqtt5 = speaks_mqtt5(url, username=args.username, password=args.password, tls_ca=args.tls_ca,
                                 tls_cert=args.tls_cert, tls_key=args.tls_key)
            LOG.info("the broker %s MQTT 5: connecting with MQTT %s", "speaks" if mqtt5 else "does not speak (or "
                     "was not reachable yet)", "5 and a Maximum Packet Size" if mqtt5 else "3.1.1")
            endpoint = MqttEndpoint(f"fedara-server-{args.prefix.replace('/', '_')}", url,
                                    subscriptions=subscriptions, unsubscriptions=anything_a_server_held,
                                    username=args.username, password=args.password, tls_ca=args.tls_ca,
                                    tls_cert=args.tls_cert, tls_key=args.tls_key,
                                    max_frame_bytes=args.max_message_bytes, admit=admit, vouch=vouch,
                                    **reader_budgets(max_inbound, len(keys.device_ids)), spill=spill,
                                    backpressure=True, clean_session=False, mqtt5=mqtt5)
            endpoint.start()
            stack.callback(endpoint.stop)
            wait_for_broker(endpoint, threading.Event(), args.broker_connect_timeout, flag="--broker-connect-timeout",
                            log=LOG, final_at_once=True)
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
                shard_paths = write_shards(list(shards.values()), out.path / SHARDS_DIR, filename=DEVICE_SHARD_FILENAME,
                                           cache=Path(args.cache_dir) / SHARDS_DIR)  # one copy for runs of one partition
                stack.callback(local.stop)
                limits, cores = local_limits(args), local_cpu_limits(args)
                for i, (device_id, shard_path) in enumerate(zip(shards, shard_paths)):
                    workdir = out.path / DEVICES_DIR / device_id
                    workdir.mkdir(parents=True, exist_ok=True)
                    group = cgroups.create_group(device_id, limits[i % len(limits)]) if limits else None
                    cpu_group = cgroups.create_cpu_group(device_id, cores[i % len(cores)]) if cores else None
                    budget = None if group is not None else budgets[i % len(budgets)]
                    # device i starts on node i of a --broker list: a local run spreads over every node
                    local.spawn(device_id, device_command(args, rotate_brokers(url, i), device_id, shard_path, workdir,
                                                          budget, out.path / LOCAL_KEYS_DIR / f"{device_id}.key",
                                                          args.max_message_bytes),
                                out.path / DEVICES_DIR / f"{device_id}.log", group, cpu_group=cpu_group)
            kind = AsyncFederation if isinstance(engine, AsyncEngine) else Federation
            federation = kind(args, engine, endpoint, out, local, settings, max_inbound, link, aggregators,
                              aggregator_link, status)
            if saved and saved.state["finished"] and saved.round >= config.rounds:
                LOG.info("the run in %s is finished; rewriting its report", out.path)
                federation.publish_status(force=True, finished=True)
            else:
                federation.run(assembly.first_round(), Progress(config.rounds, unit=(
                    "version" if isinstance(engine, AsyncEngine) else "round"), shared_down=engine.shares_payloads))
        report = out.report(engine.records, dict(settings, run_id=run_id, broker=args.broker or "embedded",
                                                 driver="broker_loop", **({"down_mb": SHARED_DOWN.strip(" ()")}
                                                                          if engine.shares_payloads else {})))
        print(final_line(engine.records, out.path, report), flush=True)
        if status is not None and args.status_linger:
            linger(status, args.status_linger)


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    console_logging()
    out = RunFolder(run_folder(args, "broker_loop"))
    try:
        config = check_args(args)
        check_inputs(args)
        check_broker_args(args)
    except ValueError as exc:
        return fail(str(exc))
    say_before_run(args, args.local_devices or None)
    out.path.mkdir(parents=True, exist_ok=True)
    file_log = logging.FileHandler(out.path / SERVER_LOG)
    file_log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    fedara_log = logging.getLogger("fedara")
    fedara_log.addHandler(file_log)
    fedara_log.setLevel(logging.INFO)
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run(args, config, out)
    except (RunError, CheckpointError, OverrideError, TransportError, BrokerUnreachableError, ValueError,
            OSError) as exc:
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
