"""An aggregator process: ``python -m server.aggregator``, one of N that share the round's updates.

    python -m server.aggregator --broker mqtt://HOST:1883[,mqtt://HOST2:1883...] --name agg-0 --enroll enrollment.json

The engine routes each device's updates to one member by topic (``folding_records.route``, named in the device's
TASK); member ``NAME`` subscribes only to ``PREFIX/dev/+/update/NAME``, so every frame of a chunked update reaches
it, on any MQTT broker, and an outsider subscribing there gets a copy and takes nothing. The member authenticates it
(the device's key from ``--enroll``, the same file the server reads), checks it against the round's brief (run,
round, asked, plan, tensors, sample count) and sends the engine a sealed receipt; it folds the update into its
own float64 ``StreamingAverage`` only when the engine answers "fold" (with DP, by the brief's clip C and sent
weights: Σ clip_C(reconstruct(returned) − reconstruct(sent)), the engine's own rule, ``privacy.RoundChanges``).
The engine stays the one authority on what counts (one update per device and round, the deadline, freshness), so
an update replayed to two members is folded once. At the round's close the member sends its partial sums and the
devices behind them (``server.mqtt.aggregation_wire``).

It reads the updates as the server does (``server.mqtt.read_budgets``, for the brief's largest update): a few largest
updates half-received in memory, past that the authenticated ones in files of WORKDIR/spill (removed when it exits)
instead of pushed out, complete ones in a bounded queue with backpressure. An update lost half-received all the same
(pushed out or expired where the spill could not take it: a full disk, its budget used up) is named to the engine
(``Shell.report_lost``), which asks its device again as it does for its own: the device re-sends it here. The updates
it verified await the engine's verdict (``server.awaiting_updates``): a few largest in memory
(``AWAITING_UPDATES_BUDGETED``), past that each in a file of WORKDIR/spill/awaiting, read back on its verdict, so a
member's memory does not grow with the fleet. At each round's close it logs what its endpoint took in, kept in the
spill and pushed out since the last close, and how many awaiting updates went to files.

``Aggregator`` is the core (no network, no clock: deadlines are the engine's; its awaiting updates past the budget go
to files); ``main`` is the thin shell.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from device_runtime.auth import Direction, KeyRing, Verifier
from device_runtime.envelope import Message, MessageType, decode
from device_runtime.help_format import CommandParser, DefaultsHelpFormatter
from device_runtime.link import Link, Refused
from device_runtime.log_budget import hold_back_floods
from device_runtime.messages import MessageError
from device_runtime.protocol import ProtocolError
from device_runtime.task import tensor_bytes
from device_runtime.topics import check_topic_device
from device_runtime.broker_wait import BrokerUnreachableError, wait_for_broker
from device_runtime.spill import FileSpill
from device_runtime.transport import MqttEndpoint, TransportError, parse_brokers, speaks_mqtt5
from server.engine import folding_records as folding
from server.mqtt import aggregation_wire as wire
from server.engine.aggregate import StreamingAverage
from server.engine.privacy import RoundChanges
from server.cli import PASSWORD_ENV, add_broker_flags, check_broker_connect_timeout, fail
from server.mqtt.admission import aggregator_admission
from server.mqtt.enrollment import EnrollmentError, load_enrollment, load_server_key
from server.mqtt.read_budgets import AWAITING_UPDATES_BUDGETED, SPILL_DIR, reader_budgets
from server.awaiting_updates import AWAITING_DIR, AwaitingUpdates
from server.engine.sampling import as_torch
from server.engine.update_rule import Answer, body_problem, header_problem

LOG = logging.getLogger("fedara.aggregator")
BRIEF_BYTES = 16 << 20
"""The largest message an aggregator takes (the engine's brief carries, with DP, each plan's sent weights); the
updates are bounded by the brief's ``max_inbound``."""
POLL_S = 0.2
READ_COUNTERS = ("bytes_in", "messages_spilled", "messages_evicted")
"""The endpoint's counters a member logs at each round's close (``Shell.log_reads``)."""


def member_budgets(senders: int, brief: folding.Brief | None) -> dict[str, int]:
    """The endpoint's budgets for ``senders`` enrolled devices: the server's rule (``read_budgets``) for the brief's
    largest update, any message up to BRIEF_BYTES; before the first brief no update is awaited (none spills)."""
    return reader_budgets(brief.max_inbound if brief is not None else 0, senders, largest=BRIEF_BYTES)


class Aggregator:
    """One member's state: the round's brief, the updates awaiting the engine's verdict, the folded sum.

    Each method returns what to send (or why nothing) and logs every refusal with its reason."""

    def __init__(self, name: str, device_keys: KeyRing, spill: FileSpill | None = None):
        """``spill``: where the updates awaiting a verdict past ``AWAITING_UPDATES_BUDGETED`` largest updates wait
        (None: all in memory)."""
        self.name, self.spill = name, spill
        self.verifier = Verifier(device_keys, {Direction.UP})
        self.brief: folding.Brief | None = None
        self.average: StreamingAverage | None = None
        self.changes: RoundChanges | None = None  # with DP: the round's Σ clip_C(Δ_i), instead of the average
        self.forwarded: set[str] = set()  # devices of this round whose update this member sent a receipt for
        self.awaiting = AwaitingUpdates(0, spill)  # device -> training update, until its verdict
        self.folded: list[str] = []
        self.last_partial: folding.Partial | None = None

    def on_brief(self, brief: folding.Brief) -> None:
        """A new round: what came before it is dropped (its partial was sent or is lost with it). The open round's
        brief again (a device rejoined with a new plan): the round's devices and plans change, nothing folded does."""
        same_round = self.brief is not None and (self.brief.run_id, self.brief.round) == (brief.run_id, brief.round)
        self.brief = brief
        if same_round:
            return
        # with DP the engine's own per-device rule: each Δ against what its device was sent, clipped to the round's C
        self.average = None if brief.dp_clip is not None else StreamingAverage(brief.dense_shapes)
        self.changes = None if brief.dp_clip is None else RoundChanges(brief.dp_clip, brief.dense_shapes)
        self.awaiting.clear()
        self.awaiting = AwaitingUpdates(AWAITING_UPDATES_BUDGETED * brief.max_inbound, self.spill)
        self.forwarded, self.folded = set(), []

    def on_update(self, topic_device: str, msg: Message) -> folding.Receipt | str:
        """A receipt for the engine, or why this update is refused here (logged)."""
        answer = self._check(topic_device, msg)
        if isinstance(answer, str):
            LOG.warning("%s refused an update from %s (round %d): %s", self.name, topic_device, msg.round, answer)
        return answer

    def _check(self, topic_device: str, msg: Message) -> folding.Receipt | str:
        brief = self.brief
        if msg.type != MessageType.UPDATE:
            return f"a {msg.type.value} on the update topic of {topic_device!r}"
        try:
            check_topic_device(topic_device, msg.device_id)
        except ProtocolError as exc:
            return str(exc)
        if brief is None:
            return "no round brief yet"
        verdict = self.verifier.check(msg, {brief.run_id})
        if not verdict.accepted:
            return f"{verdict.detail} [{verdict.reason.value}]"
        answer = Answer.of_message(msg)
        asked = brief.devices.get(topic_device)
        problem = header_problem(topic_device, answer, brief.round, asked is not None, topic_device in self.forwarded)
        if problem is not None:
            return problem
        try:
            plan_hash, update = answer.parse()
        except MessageError as exc:
            return f"malformed update: {exc}"
        problem = body_problem(plan_hash, update, asked, brief.plan_shapes.get(plan_hash), tensors_checked=False)
        if problem is not None:
            return problem
        self.forwarded.add(topic_device)
        if asked.trains:
            self.awaiting.put(topic_device, update.weights, update.num_samples)
        return folding.Receipt(topic_device, msg.run_id, msg.round, msg.msg_id, msg.counter, dict(msg.meta),
                            tensor_bytes(msg.tensors))

    def lost(self, device_ids: Iterable[str]) -> list[str]:
        """Of the devices whose updates this member's endpoint lost half-received, those the engine should ask again
        (sorted): the open round asks them and this member sent no receipt for their update (one it forwarded was a
        copy); none before a brief."""
        if self.brief is None:
            return []
        return sorted({d for d in device_ids if d in self.brief.devices and d not in self.forwarded})

    def on_verdict(self, round_index: int, device_id: str, fold: bool, reason: str) -> None:
        """Fold the update the engine accepted; drop one it refused (logged)."""
        if self.brief is None or round_index != self.brief.round:
            LOG.warning("%s ignored a verdict on %s for round %d, not the open round", self.name, device_id,
                        round_index)
            return
        held = self.awaiting.take(device_id)
        if not fold:
            LOG.warning("%s dropped %s's update of round %d: the engine refused it (%s)", self.name, device_id,
                        round_index, reason)
            return
        if held is None:  # an evaluation (nothing to fold), or a verdict on an update this member does not hold
            asked = self.brief.devices.get(device_id)
            if asked is not None and asked.trains:
                LOG.warning("%s holds no update of %s to fold", self.name, device_id)
            return
        weights, num_samples = held
        if self.changes is not None:
            plan = self.brief.devices[device_id].plan_hash
            norm = self.changes.add(as_torch(weights), as_torch(self.brief.sent[plan]), plan)
            LOG.info("%s: %s's update norm %.6g (DP clip %g)", self.name, device_id, norm, self.changes.total.clip)
        else:
            self.average.add(as_torch(weights), num_samples)
        self.folded.append(device_id)
        LOG.info("%s folded %s's update of round %d", self.name, device_id, round_index)

    def on_close(self, round_index: int, fold: tuple[str, ...]) -> folding.Partial | str:
        """This member's partial for the round the engine closed, over the updates ``fold`` names (what the engine
        told it to fold), or why it has none. An update named here whose verdict never came (lost while this member
        was away from the broker) is folded now; asked again, the same partial."""
        if self.brief is None or self.brief.round != round_index:
            return f"asked for round {round_index}'s partial, holds round {self.brief.round if self.brief else 'none'}"
        late = [d for d in fold if d in self.awaiting]
        for device_id in late:
            LOG.info("%s: the close of round %d names %s, whose verdict never came: folding it", self.name,
                     round_index, device_id)
            self.on_verdict(round_index, device_id, True, "named by the close")
        if self.last_partial is not None and self.last_partial.round == round_index and not late:
            return self.last_partial
        lacking = sorted(set(fold) - set(self.folded))
        if lacking:
            LOG.warning("%s: round %d's close names %s, whose update this member does not hold", self.name,
                        round_index, lacking)
        if self.awaiting:
            LOG.warning("%s: round %d closed without folding %s (the engine did not name them)", self.name,
                        round_index, sorted(self.awaiting))
        total = self.changes.total if self.changes is not None else self.average.partial()
        self.last_partial = folding.Partial(round_index, total, tuple(self.folded))
        LOG.info("%s: round %d partial over %d update(s): %s", self.name, round_index, len(self.folded),
                 ",".join(self.folded))
        return self.last_partial


# -- the process shell -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m server.aggregator", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    add_broker_flags(p)
    p.add_argument("--name", required=True,
                   help="this member's name: agg-0 .. agg-N-1 for the server's --aggregators N ([A-Za-z0-9_.-])")
    p.add_argument("--enroll", required=True, metavar="FILE",
                   help="the server's enrollment file: the devices' keys and the server key")
    p.add_argument("--workdir", default=None,
                   help="where its counter state lives; keep it across runs (default: aggregators/NAME)")
    return p


class Shell:
    """The member's loop over one MqttEndpoint: updates and engine messages in, receipts and partials out."""

    def __init__(self, args: argparse.Namespace, core: Aggregator, endpoint: MqttEndpoint, link: Link, senders: int):
        self.args, self.core, self.endpoint, self.link, self.senders = args, core, endpoint, link, senders
        self.counted = dict.fromkeys(READ_COUNTERS, 0)  # the endpoint's counters at the last ``log_reads``

    def send(self, msg: Message) -> None:
        self.endpoint.publish(wire.up_topic(self.args.prefix, self.core.name), self.link.seal(msg), msg.msg_id)

    def handle(self, topic: str, payload: bytes) -> None:
        if topic == wire.down_topic(self.args.prefix, self.core.name):
            self._from_engine(payload)
            return
        try:
            device_id = wire.device_from_member_topic(self.args.prefix, self.core.name, topic)
            limit = self.core.brief.max_inbound if self.core.brief else BRIEF_BYTES
            msg = decode(payload, max_bytes=limit, allow_nonfinite=True)
        except ProtocolError as exc:
            LOG.warning("%s dropped a message on %s: %s", self.core.name, topic, exc)
            return
        receipt = self.core.on_update(device_id, msg)
        if not isinstance(receipt, str):
            self.send(wire.receipt_message(receipt, self.core.name))

    def report_lost(self) -> None:
        """Tell the engine which of the open round's updates the endpoint lost half-received since the last call
        (``MqttEndpoint.take_lost``): it asks their devices again. A lost message of the engine's is not named: the
        engine sends it again on its own clock."""
        devices = []
        for topic in self.endpoint.take_lost():
            try:
                devices.append(wire.device_from_member_topic(self.args.prefix, self.core.name, topic))
            except ProtocolError:
                continue
        lost, brief = self.core.lost(devices), self.core.brief
        if lost:
            LOG.info("%s: round %d: lost %d update(s) half-received, asking the engine to ask again: %s",
                     self.core.name, brief.round, len(lost), ", ".join(lost))
            self.send(wire.lost_message(self.core.name, brief.run_id, brief.round, lost))

    def ready(self, *, reconnected: bool = False) -> None:
        """Tell the engine which round's brief this member holds (0: none yet); ``reconnected``: it connected again,
        so what was published to it meanwhile is lost."""
        brief = self.core.brief
        self.send(wire.message(wire.READY, self.core.name, run_id=brief.run_id if brief else wire.NO_RUN,
                               round_index=brief.round if brief else 0, reconnected=reconnected))

    def log_reads(self, round_index: int) -> None:
        """Log what the endpoint took in, kept in the spill and pushed out since the last call (the server logs the
        same of its own at each round's end), and the round's awaiting updates: the most bytes held in memory, how many
        went to files (scripts/fleet_load.py sums them)."""
        stats = self.endpoint.stats
        new = {key: stats[key] - self.counted[key] for key in READ_COUNTERS}
        self.counted = {key: stats[key] for key in READ_COUNTERS}
        LOG.info("%s: round %d: %d bytes in, %d incomplete message(s) kept in the spill past the memory budget, %d "
                 "pushed out", self.core.name, round_index, new["bytes_in"], new["messages_spilled"],
                 new["messages_evicted"])
        awaiting = self.core.awaiting
        LOG.info("%s: round %d: awaiting updates at most %d bytes in memory, %d kept in files past that budget",
                 self.core.name, round_index, awaiting.peak_in_memory, awaiting.spilled)

    def _from_engine(self, payload: bytes) -> None:
        try:
            msg = self.link.open(payload, wire.NO_RUN, device_id=self.core.name)
            kind = wire.kind_of(msg)
            if kind == wire.ROUND:
                brief = wire.parse_brief(msg)
                self.core.on_brief(brief)
                self.endpoint.set_budgets(**member_budgets(self.senders, brief))
                self.ready()
            elif kind == wire.VERDICT:
                self.core.on_verdict(msg.round, *wire.parse_verdict(msg))
            elif kind == wire.CLOSE:
                self.log_reads(msg.round)
                partial = self.core.on_close(msg.round, wire.parse_close(msg))
                if isinstance(partial, str):
                    LOG.warning("%s: %s", self.core.name, partial)
                else:
                    self.send(wire.partial_message(partial, self.core.name))
            else:
                LOG.warning("%s ignored a %s message from the engine", self.core.name, kind)
        except (Refused, wire.WireError) as exc:
            LOG.warning("%s dropped a message from the engine: %s", self.core.name, exc)


def run(args: argparse.Namespace) -> None:
    keys = load_enrollment(args.enroll)
    server_key = load_server_key(args.enroll)
    workdir = Path(args.workdir or Path("aggregators") / args.name)
    workdir.mkdir(parents=True, exist_ok=True)
    link = wire.aggregator_link(server_key, workdir, BRIEF_BYTES)
    ring = KeyRing(keys)
    spill = FileSpill(workdir / SPILL_DIR)  # updates half-received past the memory budget (removed at exit)
    core = Aggregator(args.name, ring, FileSpill(spill.folder / AWAITING_DIR))  # awaiting ones past theirs
    try:
        serve(args, core, link, len(ring.device_ids), member_endpoint(args, ring, server_key, spill))
    finally:
        shutil.rmtree(spill.folder, ignore_errors=True)  # after the endpoint stopped


def member_endpoint(args: argparse.Namespace, ring: KeyRing, server_key: bytes, spill: FileSpill) -> MqttEndpoint:
    """Member ``args.name``'s endpoint (not started): the updates routed to it and the engine's messages, read under
    ``member_budgets`` (before the first brief) with ``spill`` and backpressure."""
    subscriptions = [wire.member_update_filter(args.prefix, args.name), wire.down_topic(args.prefix, args.name)]
    admit, vouch = aggregator_admission(args.prefix, args.name, ring, server_key)  # enrolled senders, bounded each
    return MqttEndpoint(f"fedara-aggregator-{args.name}", args.broker, subscriptions=subscriptions,
                        username=args.username, password=args.password, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, max_frame_bytes=args.max_message_bytes, admit=admit, vouch=vouch,
                        **member_budgets(len(ring.device_ids), None), spill=spill, backpressure=True,
                        clean_session=True,
                        mqtt5=speaks_mqtt5(args.broker, username=args.username, password=args.password,
                                           tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key))


def serve(args: argparse.Namespace, core: Aggregator, link: Link, senders: int, endpoint: MqttEndpoint) -> None:
    """The member's loop over ``endpoint`` until SIGTERM or Ctrl-C (KeyboardInterrupt); the endpoint stopped after."""
    endpoint.start()
    try:
        wait_for_broker(endpoint, threading.Event(), args.broker_connect_timeout, flag="--broker-connect-timeout",
                        log=LOG)
        shell = Shell(args, core, endpoint, link, senders)
        shell.ready()
        LOG.info("%s: aggregator on %s", args.name, endpoint.url)
        reconnects = 0
        while True:
            item = endpoint.get(POLL_S)
            if item is not None:
                shell.handle(*item)
            shell.report_lost()
            if endpoint.stats["reconnects"] != reconnects and endpoint.connected.is_set():
                reconnects = endpoint.stats["reconnects"]
                LOG.info("%s: connected again, to %s", args.name, endpoint.url)
                shell.ready(reconnected=True)
    finally:
        endpoint.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # its log: what it folded, refused
    hold_back_floods()
    args.password = args.password or os.environ.get(PASSWORD_ENV)
    if args.broker is None:
        return fail("--broker is required: the mqtt://HOST:PORT of the broker the server and devices use")
    try:
        parse_brokers(args.broker)
        check_broker_connect_timeout(args)
    except ValueError as exc:
        return fail(str(exc))
    try:
        wire.member_update_filter(args.prefix, args.name)
    except ProtocolError as exc:
        return fail(f"--prefix/--name: {exc}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run(args)
    except (EnrollmentError, TransportError, BrokerUnreachableError, OSError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
