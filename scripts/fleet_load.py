"""A fleet of simulated devices against the real server process over a real broker: what one server holds.

    .venv/bin/python scripts/fleet_load.py --devices 100 --rounds 3 --broker mosquitto --aggregators 0 \
        --out fleet_100.json

Starts what it needs: the broker (Debian's mosquitto on a free loopback port, or the 3-node NATS cluster of
scripts/nats_cluster.py), the real ``python -m server.broker_loop`` process (FedAvgCNN 3×32×32 at the five rank tiers
round-robin, FedARA, enrolled devices only) and N simulated devices spread over ``--processes`` processes. A
simulated device speaks the whole device protocol over its own MQTT connection (its own client id, persistent
session, retained status and last will, its own enrolled key): it joins, acknowledges its plan, fetches its plan's
payload once per round and checks its SHA-256 against its sealed TASK, and answers after a delay drawn from an
exponential distribution (``--delay-mean``) with a synthetic update of its plan's exact tensors (random, small),
sealed under its key, in frames of ``--max-message-bytes``. It trains nothing. With ``--churn F`` a share F of the
devices drops its connection after its task came, each round, and comes back 1–3 s later (the server sends its task
again; the payload comes from the broker's retained copy). Device i starts on node i of a cluster's broker list (the
server on node 0); with ``--broker nats --kill-node-mid-round R`` node 1 of the 3-node cluster is SIGKILLed a few
seconds after round R opened, so a third of the devices lose their connection mid-round and move to the next node.

Why threads, not asyncio: every device uses the project's own MqttEndpoint (paho-mqtt, one network thread per
connection), the code a real board runs, so the harness measures the real framing, reassembly and inbox; one handler
thread per process takes every device's complete messages from one queue and does the protocol work, so the Python
work per message is the same as on a device and the threads only wait on sockets. A process holds a few hundred
connections (~0.4 MiB each); ``--processes`` defaults to one per 250 devices.

The broker-only ceiling is measured in the same run on the same broker, before the server starts: the same number
of updates of the same plans published by one process as fast as the broker takes them, taken off by one plain
subscriber that opens none of them (scripts/bench_aggregators.py's ``measure_broker``, at most 200 updates a round:
a rate, not a round). So is the server's in-process read path (scripts/bench_read_path.py's ``run``, the same rounds
and at most 200 updates a round, every message in frames of ``--max-message-bytes``: frames joined, opened, hashed,
folded, the round closed, and apart the round's own TASKs and receipts sealed), the CPU per update the server over the
broker is compared with.

A round's ``seconds`` include the devices' answer delays, so ``update_mb_per_s`` is the fleet's rate, not the
server's. ``--together`` measures the server's read path against that ceiling: every device seals its answer when
its task comes and holds it; once every device of every process holds its answer (a barrier between the device
processes) they all publish at once, as the ceiling's publisher does. ``read_seconds`` is the time from that
release to the round's close (the server's log line of the closed round), ``read_mb_per_s`` the round's update bytes
over it and ``read_to_broker`` its ratio to ``broker_only_mb_per_s``.

Writes ``{"rounds": [...], ...}``: per round ``round``, ``devices`` (that answered), ``updates_folded``, ``lost``,
``seconds`` (the server's round, open to close), ``server_bytes_out``/``in`` (the server's MQTT bytes in the round),
``plan_payload_bytes`` (Σ over the round's plans of one payload), ``payload_publishes`` (the server's payload publishes
in the round, once per plan and again on request: from its log), ``update_mb_per_s`` (update tensor bytes over the
round's seconds), ``broker_only_mb_per_s``, ``server_peak_rss_mb``, ``server_cpu_s`` and ``server_main_thread_cpu_s``
(its main loop's share; the rest is its other threads', paho's network thread above all) (from /proc, sampled as the
server prints each round), ``server_cpu_ms_per_update``, ``read_path_cpu_ms_per_update`` (the same round of the
in-process read path: its CPU with the round's messages, per update) and ``server_to_read_path`` (their ratio),
``spilled``, ``pushed_out`` and ``tasks_sent_again`` (the server's updates kept in its reassembly spill past its
memory budget, pushed out half-received, and tasks sent again: from its log); ``read_path``: that measurement (None,
and the two per-round fields too, with ``--aggregators``: the server then reads no update, so it is not run). With
``--aggregators``: ``aggregators_bytes_in``, ``aggregators_spilled``, ``aggregators_awaiting_filed`` (updates awaiting
the engine's verdict kept in files past a member's memory budget) and ``aggregators_awaiting_peak_bytes`` (the most a
member held of them in memory) (from each member's log lines at the round's close; None where its log has none),
``aggregators_pushed_out`` (its transport's warnings, written in the round) and
``aggregators_peak_rss_mb`` (the largest member's, sampled from /proc as the server prints each round).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import heapq
import json
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_aggregators, imported where it is used

from device_runtime.auth import new_key  # noqa: E402
from device_runtime.envelope import Message, MessageType  # noqa: E402
from device_runtime.link import Link, Refused  # noqa: E402
from device_runtime.messages import (ErrorCode, Join, MessageError, ShardInfo, ack_message, join_message,  # noqa: E402
                                     new_msg_id, parse_error, parse_plan, parse_task, payload_request_message,
                                     task_payload, update_message)
from device_runtime.payload import PayloadRef, check_payload, decode_payload  # noqa: E402
from device_runtime.payload_wait import PayloadWait  # noqa: E402
from device_runtime.profile import ResourceProfile  # noqa: E402
from device_runtime.protocol import ProtocolError  # noqa: E402
from device_runtime.task import Update  # noqa: E402
from device_runtime.topics import Topics, payload_filter, payload_topic  # noqa: E402
from device_runtime.transport import MqttEndpoint, rotate_brokers  # noqa: E402

TIERS = (1.0, 0.75, 0.5, 0.25, 0.125)
SHAPE, CLASSES, SAMPLES = (3, 32, 32), 10, 100
PREFIX = "fleet"
DEVICES_PER_PROCESS = 250
CEILING_UPDATES = 200
RELEASE_TIMEOUT_S = 600.0
"""--together: how long a device process waits at the barrier for the others (then it publishes anyway)."""
KILLED_NODE = 1
"""--kill-node-mid-round: the cluster node killed (the server is on node 0; device i starts on node i mod 3)."""
KILL_AFTER_S = 3.0
"""Seconds after the round opened that the node is killed (its devices are answering by then)."""
MB = 1e6
LOG = logging.getLogger("fleet")

WATCH_S = 0.005
"""How often the server's log is read for its round lines (``watch``): every 0.1 s, a round's CPU could be off by up
to 0.1 CPU s (0.5 ms an update at K = 200)."""


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, required=True, help="simulated devices (each its own MQTT connection)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--broker", choices=("mosquitto", "nats"), default="mosquitto")
    p.add_argument("--aggregators", type=int, default=0, help="aggregator processes of the server (0: it folds)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--processes", type=int, default=None, help=f"device processes (default: one per "
                                                                f"{DEVICES_PER_PROCESS} devices)")
    p.add_argument("--delay-mean", type=float, default=1.0, help="mean seconds a device takes to answer")
    p.add_argument("--churn", type=float, default=0.0, help="share of devices that drop and rejoin each round")
    p.add_argument("--together", action="store_true",
                   help="devices hold their sealed answers and publish them all at once: the server's read rate")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, help="frame size of every process")
    p.add_argument("--round-deadline", type=float, default=600.0)
    p.add_argument("--workdir", default=None, help="keep the run here (default: a temporary folder)")
    p.add_argument("--kill-node-mid-round", type=int, default=0, metavar="R",
                   help=f"with --broker nats: SIGKILL node {KILLED_NODE} of the cluster {KILL_AFTER_S:g} s after round R "
                        "opened (0: never)")
    p.add_argument("--profile-server", default=None, metavar="FILE.prof",
                   help="run the server under cProfile in every thread (scripts/thread_profile.py) and write its "
                        "main thread's profile here, each other thread's beside it (read them with pstats)")
    args = p.parse_args(argv)
    for flag, value in (("--devices", args.devices), ("--rounds", args.rounds)):
        if value < 1:
            raise SystemExit(fail(f"{flag} must be >= 1, got {value}"))
    if args.aggregators < 0 or not 0 <= args.churn <= 1 or args.delay_mean < 0:
        raise SystemExit(fail("--aggregators >= 0, --churn in [0, 1] and --delay-mean >= 0, please"))
    if args.together and (args.churn or args.kill_node_mid_round):
        raise SystemExit(fail("--together: every device answers at one release; drop --churn and "
                              "--kill-node-mid-round"))
    if args.kill_node_mid_round and (args.broker != "nats" or not 1 <= args.kill_node_mid_round <= args.rounds):
        raise SystemExit(fail(f"--kill-node-mid-round {args.kill_node_mid_round}: needs --broker nats and a round in "
                              f"1..--rounds ({args.rounds}); drop it or use --broker nats"))
    return args


# -- simulated devices ------------------------------------------------------------------------------


class Forward:
    """A device endpoint's inbox that hands every complete message to its process's one queue."""

    def __init__(self, device_id: str, sink: queue.Queue) -> None:
        self.device_id, self.sink, self.dropped, self.peak_bytes = device_id, sink, 0, 0

    def release(self) -> None:
        """Nothing waits here (Inbox.release's counterpart)."""

    def put(self, topic: str, payload: bytes) -> bool:
        self.sink.put((self.device_id, topic, payload))
        return True


class SimDevice:
    """One device's protocol, with no training: join, acknowledge, fetch the payload, answer with a synthetic update."""

    def __init__(self, host: "DeviceHost", device_id: str, key: bytes, state_dir: Path) -> None:
        self.host, self.device_id = host, device_id
        self.topics = Topics(PREFIX, device_id)
        self.link = Link.device(device_id, key, state_dir, host.max_inbound)
        self.run_id = "none"
        self.plan_hash: str | None = None
        self.payload: tuple[PayloadRef, dict[str, np.ndarray]] | None = None
        self.waiting: PayloadWait | None = None
        self.answered: dict[tuple[int, bool], bytes] = {}  # (round, evaluation) -> the sealed answer
        self.planned = threading.Event()
        self.endpoint = self._endpoint()
        self.stats = {"payload_bytes": 0, "payloads_refused": 0, "payload_asks": 0, "updates": 0, "tasks": 0,
                      "reconnects": 0}

    def _endpoint(self) -> MqttEndpoint:
        node = int(self.device_id.rsplit("_", 1)[1])  # device i starts on node i of a cluster's list
        return MqttEndpoint(self.device_id, rotate_brokers(self.host.url, node), subscriptions=[self.topics.down],
                            status=(self.topics.status, self.link.status_signer(self.device_id)),
                            max_frame_bytes=self.host.frame_bytes, max_message_bytes=self.host.max_inbound,
                            clean_session=False, inbox=Forward(self.device_id, self.host.inbox))

    def start(self) -> None:
        self.endpoint.start()

    def send(self, msg: Message, topic: str | None = None) -> None:
        self.endpoint.publish(topic or self.topics.up, self.link.seal(msg), msg.msg_id)

    def join(self) -> None:
        profile = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0)
        held = tuple(sorted(self.host.known_plans))  # the artifact sets a device of this process got: not sent again
        self.send(join_message(Join(profile, ShardInfo(SAMPLES, 10, SHAPE, CLASSES), held), device_id=self.device_id,
                               run_id=self.run_id))

    def handle(self, topic: str, data: bytes) -> None:
        if topic != self.topics.down:
            wait = self.waiting
            if wait is not None and topic == payload_topic(PREFIX, wait.task.run_id, wait.ref.sha256):
                self.on_payload(data)
            return
        try:
            msg = self.link.open(data, self.run_id, device_id=self.device_id)
        except Refused as exc:
            LOG.warning("%s dropped a message: %s", self.device_id, exc)
            return
        try:
            if msg.type == MessageType.PLAN:
                plan = parse_plan(msg)
                self.run_id, self.plan_hash = msg.run_id, plan.plan_hash
                self.host.known_plans.add(plan.plan_hash)
                self.send(ack_message(plan.plan_hash, device_id=self.device_id, run_id=self.run_id))
                self.planned.set()
            elif msg.type == MessageType.TASK:
                self.stats["tasks"] += 1
                self.on_task(msg)
            elif msg.type == MessageType.ERROR and parse_error(msg).code == ErrorCode.REJOIN:
                self.join()
        except MessageError as exc:
            LOG.warning("%s dropped a malformed %s: %s", self.device_id, msg.type.value, exc)

    def on_task(self, msg: Message) -> None:
        _, task = parse_task(msg)
        saved = self.answered.get((task.round, task.evaluate_only))
        if saved is not None:  # asked again: the saved answer, resealed
            self.endpoint.publish(self.topics.update_via(task.aggregator), self.link.reseal(saved),
                                  new_msg_id(MessageType.UPDATE))
            return
        ref = task_payload(msg)
        if ref is not None and (self.payload is None or self.payload[0] != ref):
            if self.waiting is None or self.waiting.ref != ref:
                if self.waiting is not None:
                    self.endpoint.unfollow(payload_filter(PREFIX, self.waiting.task.run_id, self.waiting.ref.sha256))
                self.waiting = PayloadWait(ref, msg, time.monotonic())
                self.endpoint.follow(payload_filter(PREFIX, msg.run_id, ref.sha256))
            self.waiting.task = msg
            return
        self.host.later(self.host.delay(), self.device_id, msg)
        self.host.maybe_churn(self)

    def on_payload(self, data: bytes) -> None:
        wait = self.waiting
        try:
            check_payload(data, wait.ref)  # every device checks what it got against its own sealed TASK
            tensors = self.host.decoded.get(wait.ref) or decode_payload(data, wait.ref)
        except ProtocolError as exc:
            LOG.warning("%s refused a payload: %s", self.device_id, exc)
            self.stats["payloads_refused"] += 1
            wait.refused = True
            return
        self.stats["payload_bytes"] += len(data)
        self.payload = (wait.ref, self.host.synthetic(wait.ref, tensors))
        self.endpoint.unfollow(payload_filter(PREFIX, wait.task.run_id, wait.ref.sha256))
        self.waiting = None
        self.on_task(wait.task)

    def tend(self, now: float) -> None:
        """Ask for the awaited payload again when the device's rule says so (PayloadWait), and subscribe again."""
        wait = self.waiting
        if wait is None:
            return
        topic_filter = payload_filter(PREFIX, wait.task.run_id, wait.ref.sha256)
        refused = wait.refused
        if wait.ask_now(now, self.endpoint.granted_at(topic_filter)):
            self.stats["payload_asks"] += 1
            detail = "refused one" if refused else f"not whole after {now - wait.since:.0f} s"
            self.send(payload_request_message(wait.ref, detail, device_id=self.device_id, run_id=self.run_id,
                                              round_index=wait.task.round))
            self.endpoint.follow(topic_filter)

    def answer(self, msg: Message) -> None:
        """The synthetic update of the task ``msg``: the plan's tensors (the payload's), random and small."""
        _, task = parse_task(msg)
        if (task.round, task.evaluate_only) in self.answered:
            return
        weights = {} if task.evaluate_only or self.payload is None else self.payload[1]
        update = Update(task.round, weights, 0 if task.evaluate_only else SAMPLES, 1.0, 0.5,
                        {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0})
        sealed = self.link.seal(update_message(update, plan_hash=self.plan_hash, device_id=self.device_id,
                                               run_id=self.run_id))
        self.answered = {(task.round, task.evaluate_only): sealed}
        self.stats["updates"] += 1
        publish = (self.endpoint, self.topics.update_via(task.aggregator), sealed, new_msg_id(MessageType.UPDATE))
        if self.host.together is not None and not task.evaluate_only:
            self.host.hold(task.round, publish)
        else:
            self.endpoint.publish(*publish[1:])

    def reconnect(self) -> None:
        """Churn: drop the connection (its will says offline) and connect again as a new connection."""
        self.endpoint.stop()
        self.endpoint = self._endpoint()
        wait = self.waiting
        follow = [] if wait is None else [payload_filter(PREFIX, wait.task.run_id, wait.ref.sha256)]
        self.endpoint.subscriptions += tuple(follow)
        self.endpoint.start()
        self.stats["reconnects"] += 1


class DeviceHost:
    """One process's simulated devices and the one thread that does their protocol work."""

    def __init__(self, url: str, frame_bytes: int, max_inbound: int, delay_mean: float, churn: float,
                 seed: int, together: "threading.Barrier | None" = None) -> None:
        self.url, self.frame_bytes, self.max_inbound = url, frame_bytes, max_inbound
        self.together = together  # --together: the barrier every device process meets before a round's release
        self.held: dict[int, list[tuple[MqttEndpoint, str, bytes, str]]] = {}  # round -> sealed answers held
        self.released: dict[int, float] = {}  # round -> wall time this process published its held answers
        self.delay_mean, self.churn = delay_mean, churn
        self.rng = np.random.default_rng(seed)
        self.inbox: queue.Queue = queue.Queue()
        self.timers: list[tuple[float, int, str, object]] = []
        self.devices: dict[str, SimDevice] = {}
        self.known_plans: set[str] = set()
        self._seq = 0
        self.decoded: dict[PayloadRef, dict[str, np.ndarray]] = {}  # the round's payloads, decoded once a process
        self._synthetic: dict[PayloadRef, dict[str, np.ndarray]] = {}
        self._churned: set[tuple[str, int]] = set()

    def synthetic(self, ref: PayloadRef, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A synthetic update of the payload's exact tensors (random, small), drawn once per payload and process: the
        devices of one plan in a process send the same tensors, each sealed under its own key."""
        if ref not in self._synthetic:
            self.decoded[ref] = tensors
            self._synthetic[ref] = {k: self.rng.standard_normal(v.shape, dtype=np.float32) * np.float32(1e-2)
                                    for k, v in tensors.items()}
            for held in (self.decoded, self._synthetic):  # two rounds of plans at most
                while len(held) > 2 * len(TIERS):
                    del held[next(iter(held))]
        return self._synthetic[ref]

    def hold(self, round_index: int, publish: tuple[MqttEndpoint, str, bytes, str]) -> None:
        """--together: keep a sealed answer; once every device of this process holds its own, meet the other
        processes at the barrier and publish them all."""
        held = self.held.setdefault(round_index, [])
        held.append(publish)
        if len(held) < len(self.devices):
            return
        try:
            self.together.wait(RELEASE_TIMEOUT_S)
        except threading.BrokenBarrierError:
            LOG.warning("round %d: not every device process held its answers; publishing anyway", round_index)
        self.released[round_index] = time.time()
        for endpoint, topic, sealed, msg_id in self.held.pop(round_index):
            endpoint.publish(topic, sealed, msg_id)

    def delay(self) -> float:
        return float(min(self.rng.exponential(self.delay_mean), 5 * self.delay_mean)) if self.delay_mean else 0.0

    def later(self, seconds: float, device_id: str, what: object) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (time.monotonic() + seconds, self._seq, device_id, what))

    def maybe_churn(self, device: SimDevice) -> None:
        round_index = device.waiting.task.round if device.waiting else 0
        key = (device.device_id, round_index)
        if self.churn and key not in self._churned and self.rng.random() < self.churn:
            self._churned.add(key)
            self.later(float(self.rng.uniform(0, 0.5)), device.device_id, "drop")

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, device_id, what = heapq.heappop(self.timers)
                device = self.devices[device_id]
                if what == "drop":
                    device.endpoint.stop()
                    self.later(float(self.rng.uniform(1, 3)), device_id, "back")
                elif what == "back":
                    device.reconnect()
                else:
                    device.answer(what)
            if self.inbox.empty():  # asks again only with nothing left to handle (a payload may wait in the queue)
                for device in list(self.devices.values()):
                    device.tend(now)
            wait = 0.2 if not self.timers else max(0.0, min(0.2, self.timers[0][0] - time.monotonic()))
            try:
                device_id, topic, data = self.inbox.get(timeout=wait)
            except queue.Empty:
                continue
            self.devices[device_id].handle(topic, data)


def device_process(url: str, ids: list[str], keys: dict[str, bytes], folder: str, frame_bytes: int, max_inbound: int,
                   delay_mean: float, churn: float, seed: int, stop: threading.Event, results: str,
                   together: "threading.Barrier | None" = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s fleet %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=False)  # kill -USR1 PID: the main thread's stack on stderr
    signal.signal(signal.SIGUSR2, lambda *_: print("".join(  # kill -USR2 PID: the protocol thread's stack
        traceback.format_stack(sys._current_frames()[worker.ident])), file=sys.stderr, flush=True))
    host = DeviceHost(url, frame_bytes, max_inbound, delay_mean, churn, seed, together)
    done = threading.Event()
    worker = threading.Thread(target=host.serve, args=(done,), daemon=True)
    worker.start()
    for device_id in ids:  # one at a time: a device lists the plans others got, and is not sent their files again
        device = host.devices[device_id] = SimDevice(host, device_id, keys[device_id], Path(folder) / device_id)
        device.start()
        device.endpoint.wait_connected(300)
        device.join()
        device.planned.wait(300)
    stop.wait()
    done.set()
    worker.join(10)
    stats = {d.device_id: d.stats for d in host.devices.values()}
    for device in host.devices.values():
        device.endpoint.stop()
    Path(results).write_text(json.dumps({"devices": stats, "released": host.released}))


# -- the server and the broker ----------------------------------------------------------------------


def fake_cifar(folder: Path) -> Path:
    """A CIFAR-10 folder in the standard pickle layout (10 random images a batch): the server reads the input shape
    and classes from it; the simulated devices bring no data."""
    root = folder / "cifar-10-batches-py"
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), b"labels": list(range(10))}
        (root / name).write_bytes(pickle.dumps(batch))
    return folder


def stat_fields(path: str) -> list[str]:
    """The fields of a /proc .../stat file after the command name: [0] state, [1] parent pid, [11] utime, [12] stime."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def proc_sample(pid: int) -> tuple[float, float]:
    """(CPU seconds so far, peak RSS MiB) of process ``pid``."""
    fields = stat_fields(f"/proc/{pid}/stat")
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    peak = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:")) / 1024
    return cpu, peak


def main_thread_cpu(pid: int) -> float:
    """CPU seconds so far of process ``pid``'s main thread (the server's main loop; the rest of its CPU is its other
    threads': paho's network thread, above all)."""
    fields = stat_fields(f"/proc/{pid}/task/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def log_time(words: list[str]) -> float:
    """The wall time of a server log line (its first two words, ``2026-12-02 14:28:42,334``, local time)."""
    whole, millis = words[1].split(",")
    return time.mktime(time.strptime(f"{words[0]} {whole}", "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def aggregators_peak_rss(server_pid: int) -> float:
    """The largest peak RSS (MiB) of the server's aggregator processes (its children running server.aggregator)."""
    peaks = [0.0]
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and b"server.aggregator" in (proc / "cmdline").read_bytes()
                    and int(stat_fields(f"{proc}/stat")[1]) == server_pid):
                peaks.append(proc_sample(int(proc.name))[1])
        except (OSError, StopIteration, ValueError):
            continue
    return max(peaks)


def watch(server: subprocess.Popen, log: Path, opened: dict[int, float], closed: dict[int, tuple[float, float]],
          closed_at: dict[int, float], main_cpu: dict[int, list[float]], members_rss: dict[int, float]) -> None:
    """Sample the server's CPU seconds as each round opens and (with its peak RSS, and its aggregators' largest in
    ``members_rss``) as it closes, from its log, and its main thread's in ``main_cpu`` (round -> [at the open, at the
    close]); keep the wall time of each round's close (its log line's time). The log is read every ``WATCH_S``: a
    sample lags its line by as much, and the server's CPU meanwhile (its checkpoint after a close, its tasks after an
    open) lands in the wrong round."""
    offset, rest = 0, b""
    while server.poll() is None:
        time.sleep(WATCH_S)
        try:
            with open(log, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            continue
        offset += len(chunk)
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            words = line.decode(errors="replace").split()
            try:
                if "fedara.server" in words and words[-2:] == ["device(s)", "asked"] and words[-4] == "opened:":
                    opened[int(words[-5])] = proc_sample(server.pid)[0]
                    main_cpu[int(words[-5])] = [main_thread_cpu(server.pid)]
                elif "fedara.progress" in words and words[4] == "round" and "/" in words[5]:
                    closed[int(words[5].split("/")[0])] = proc_sample(server.pid)
                    members_rss[int(words[5].split("/")[0])] = aggregators_peak_rss(server.pid)
                    main_cpu.setdefault(int(words[5].split("/")[0]), []).append(main_thread_cpu(server.pid))
                    closed_at[int(words[5].split("/")[0])] = log_time(words)
            except (IndexError, ValueError, OSError):
                continue


def server_lines(log: Path) -> Iterator[tuple[int, list[str], str]]:
    """The server's own lines of its log, each with the round open when it was written (0 before the first) and its
    words."""
    current = 0
    for line in log.read_text(errors="replace").splitlines():
        words = line.split()
        if "fedara.server" not in words:
            continue
        if words[-2:] == ["device(s)", "asked"] and words[-4] == "opened:":
            current = int(words[-5])
        yield current, words, line


def payload_publishes(log: Path) -> dict[int, list[tuple[str, int]]]:
    """Per round, every payload the server published (its SHA-256 prefix and bytes, once per publish), from its log:
    a round's distinct payloads are its plans' (``plan_payload_bytes``), the rest were published again on request."""
    rounds: dict[int, list[tuple[str, int]]] = {}
    for current, words, _ in server_lines(log):
        if words[4:6] == ["published", "payload"] and current:
            rounds.setdefault(current, []).append((words[6], int(words[7].lstrip("("))))
    return rounds


def held_and_asked(log: Path) -> dict[int, dict[str, int]]:
    """Per round, from the server's log: updates kept in its reassembly spill, pushed out half-received, and tasks sent
    again (to a device whose update was pushed out, that came online again, or after the server's reconnect)."""
    rounds: dict[int, dict[str, int]] = {}
    for current, words, line in server_lines(log):
        if words[4:5] == ["round"] and "spill" in words and words[-2:] == ["pushed", "out"]:
            record = rounds.setdefault(int(words[5].rstrip(":")), {"tasks_sent_again": 0})
            record.update(spilled=int(words[6]), pushed_out=int(words[-3]))
        elif current and ("sending its task again" in line or "re-sending the open round's task" in line):
            rounds.setdefault(current, {"tasks_sent_again": 0})["tasks_sent_again"] += 1
    return rounds


def aggregator_reads(out: Path) -> dict[int, dict[str, int | None]]:
    """Per round, summed over the aggregators' logs (OUT/aggregators/*.log): bytes in and updates kept in the spill
    (each member's line at the round's close; None where no member logs it) and pushed out half-received (its
    transport's warnings, counted in the round the server had open when they were written)."""
    opens = sorted((log_time(words), current) for current, words, line in server_lines(out / "server.log")
                   if words[-2:] == ["device(s)", "asked"])
    rounds: dict[int, dict[str, int | None]] = {r: {"aggregators_bytes_in": None, "aggregators_spilled": None,
                                                    "aggregators_awaiting_filed": None,
                                                    "aggregators_awaiting_peak_bytes": None,
                                                    "aggregators_pushed_out": 0} for _, r in opens}
    awaiting: dict[tuple[str, int], tuple[int, int]] = {}  # (member, round) -> its last line's (filed, peak bytes)
    for log in sorted((out / "aggregators").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            words = line.split()
            if "fedara.aggregator" in words and words[5:6] == ["round"] and words[-2:] == ["pushed", "out"]:
                record = rounds.setdefault(int(words[6].rstrip(":")), {"aggregators_pushed_out": 0})
                record["aggregators_bytes_in"] = (record.get("aggregators_bytes_in") or 0) + int(words[7])
                record["aggregators_spilled"] = (record.get("aggregators_spilled") or 0) + int(words[10])
            elif "fedara.aggregator" in words and words[5:6] == ["round"] and words[7:11] == ["awaiting", "updates",
                                                                                            "at", "most"]:
                awaiting[(log.name, int(words[6].rstrip(":")))] = (int(words[15]), int(words[11]))
            elif "fedara.transport" in words and "pushed out to make room" in line:
                at = log_time(words)
                current = max((r for t, r in opens if t <= at), default=0)
                record = rounds.setdefault(current, {"aggregators_pushed_out": 0})
                record["aggregators_pushed_out"] += int(words[5])
    for (_, round_index), (filed, peak) in awaiting.items():  # a close asked again logs the round's again
        record = rounds.setdefault(round_index, {"aggregators_pushed_out": 0})
        record["aggregators_awaiting_filed"] = (record.get("aggregators_awaiting_filed") or 0) + filed
        record["aggregators_awaiting_peak_bytes"] = max(record.get("aggregators_awaiting_peak_bytes") or 0, peak)
    return rounds


def server_command(args: argparse.Namespace, url: str, enrollment: Path, data: Path, overrides: Path,
                   out: Path) -> list[str]:
    profile = ([str(REPO / "scripts" / "thread_profile.py"), str(Path(args.profile_server).resolve())]
               if args.profile_server else [])
    return [sys.executable, *profile, "-m", "server.broker_loop", "--broker", url, "--prefix", PREFIX, "--enroll",
            str(enrollment), "--dataset", "cifar10", "--data-dir", str(data), "--model", "fedavgcnn",
            "--rounds", str(args.rounds), "--min-devices", str(args.devices), "--rank-tiers",
            ",".join(map(str, TIERS)), "--rank-overrides", str(overrides), "--round-deadline",
            str(args.round_deadline), "--join-timeout", "1800", "--max-message-bytes", str(args.max_message_bytes),
            "--aggregators", str(args.aggregators), "--threads", "1", "--out", str(out)]


@contextlib.contextmanager
def broker_of(kind: str, folder: Path) -> Iterator[tuple[str, Callable[[int], None] | None]]:
    """The --broker value of a fresh broker of ``kind``, and a function that kills node i of it (None: one node)."""
    import bench_aggregators as bench  # beside this script; loads torch, so not in the device processes
    if kind == "nats":
        with bench.nats_cluster_module().NatsCluster(folder / "nats", bench.NATS_NODES) as cluster:
            yield cluster.broker, cluster.kill
        return
    with bench.broker_of(kind, folder) as url:
        yield url, None


def kill_mid_round(kill: Callable[[int], None], round_index: int, opened: dict[int, float], stop: threading.Event,
                   killed: dict) -> None:
    """Kill node KILLED_NODE KILL_AFTER_S seconds after round ``round_index`` opened (watched in ``opened``)."""
    while round_index not in opened:
        if stop.wait(0.1):
            return
    if stop.wait(KILL_AFTER_S):
        return
    kill(KILLED_NODE)
    killed.update(node=KILLED_NODE, round=round_index, after_open_s=KILL_AFTER_S)
    print(f"killed node {KILLED_NODE} of the cluster in round {round_index}", flush=True)


def run(args: argparse.Namespace, folder: Path) -> dict:
    from server.mqtt.enrollment import save_enrollment
    import bench_aggregators as bench
    import bench_read_path
    devices = [f"dev_{i:05d}" for i in range(args.devices)]
    keys = {d: new_key() for d in devices}
    enrollment = save_enrollment(folder / "enrollment.json", keys)
    overrides = folder / "overrides.json"
    overrides.write_text(json.dumps({d: TIERS[i % len(TIERS)] for i, d in enumerate(devices)}))
    data = fake_cifar(folder / "data")
    with broker_of(args.broker, folder / "broker") as (url, kill):
        print(f"broker {args.broker} at {url}; measuring the broker-only ceiling", flush=True)
        bench.FRAME_BYTES = args.max_message_bytes
        ceiling = bench.measure_broker(url, min(args.devices, CEILING_UPDATES), args.rounds)
        read_path = None  # with aggregators the server reads receipts and partial sums, not the updates
        if not args.aggregators:
            print("measuring the server's in-process read path (scripts/bench_read_path.py)", flush=True)
            read_path = bench_read_path.run(min(args.devices, CEILING_UPDATES), args.rounds, False,
                                            folder / "read_path", args.max_message_bytes)
        out = folder / "server"
        with open(folder / "server.out", "w") as log:
            server = subprocess.Popen(server_command(args, url, enrollment, data, overrides, out), cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT)
        opened: dict[int, float] = {}
        closed: dict[int, tuple[float, float]] = {}
        closed_at: dict[int, float] = {}
        main_cpu: dict[int, list[float]] = {}
        members_rss: dict[int, float] = {}
        watcher = threading.Thread(target=watch, args=(server, out / "server.log", opened, closed, closed_at, main_cpu,
                                                       members_rss), daemon=True)
        watcher.start()
        killed: dict = {}
        done_killing = threading.Event()
        if args.kill_node_mid_round:
            threading.Thread(target=kill_mid_round, args=(kill, args.kill_node_mid_round, opened, done_killing, killed),
                             daemon=True).start()
        processes = args.processes or -(-args.devices // DEVICES_PER_PROCESS)
        spawn = mp.get_context("spawn")  # not fork: a lock another thread held at fork time stays held in the child
        stop = spawn.Event()
        together = spawn.Barrier(processes) if args.together else None
        procs, results = [], []
        max_inbound = 64 << 20
        for p in range(processes):
            ids = devices[p::processes]
            results.append(folder / f"devices-{p}.json")
            proc = spawn.Process(target=device_process, args=(url, ids, {d: keys[d] for d in ids}, str(folder / "dev"),
                                                           args.max_message_bytes, max_inbound, args.delay_mean,
                                                           args.churn, p, stop, str(results[-1]), together))
            proc.start()
            procs.append(proc)
        code = server.wait()
        done_killing.set()
        watcher.join(10)
        stop.set()
        for proc in procs:
            if code != 0:
                proc.terminate()  # a device still connecting would wait for the broker for minutes
            proc.join(120)
        if code != 0:
            raise SystemExit(fail(f"the server exited with {code}: see {folder / 'server.out'}"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stats, released = {}, {}
    for path in results:
        result = json.loads(path.read_text()) if path.exists() else {"devices": {}, "released": {}}
        stats.update(result["devices"])
        for r, t in result["released"].items():  # the round's release: the first process's
            released[int(r)] = min(t, released.get(int(r), t))
    published = payload_publishes(out / "server.log")
    held = held_and_asked(out / "server.log")
    members = aggregator_reads(out) if args.aggregators else {}
    rounds = []
    for record, broker, bench_round in zip(records, ceiling["rounds"],
                                           read_path["rounds"] if read_path else [None] * len(records)):
        r = record["round"]
        cpu, peak = closed.get(r, (float("nan"), float("nan")))
        main = main_cpu.get(r, [])
        update_bytes = record["bytes_up"]
        server_ms = (cpu - opened.get(r, float("nan"))) / record["participants"] * 1000
        read_path_ms = (None if bench_round is None else
                        (bench_round["cpu_s"] + bench_round["messages_cpu_s"]) / read_path["clients"] * 1000)
        rounds.append({
            "round": r, "devices": record["participants"], "updates_folded": record["participants"],
            "lost": record["selected"] - record["participants"], "seconds": record["seconds"],
            "server_bytes_out": record.get("wire_bytes_out"), "server_bytes_in": record.get("wire_bytes_in"),
            "plan_payload_bytes": sum(dict(published.get(r, [])).values()),
            "payload_publishes": len(published.get(r, [])),
            "update_mb_per_s": update_bytes / MB / record["seconds"],
            "broker_only_mb_per_s": broker["mb_per_s"],
            "server_peak_rss_mb": peak, "server_cpu_s": cpu - opened.get(r, float("nan")),
            "server_main_thread_cpu_s": main[1] - main[0] if len(main) == 2 else float("nan"),
            "server_cpu_ms_per_update": server_ms, "read_path_cpu_ms_per_update": read_path_ms,
            "server_to_read_path": read_path_ms and server_ms / read_path_ms, **held.get(r, {}), **members.get(r, {}),
            **({"aggregators_peak_rss_mb": members_rss.get(r, float("nan"))} if args.aggregators else {})})
        if args.together:
            read = closed_at.get(r, float("nan")) - released.get(r, float("nan"))
            rounds[-1].update(read_seconds=read, read_mb_per_s=update_bytes / MB / read,
                              read_to_broker=update_bytes / MB / read / broker["mb_per_s"])
    return {"devices": args.devices, "broker": args.broker, "aggregators": args.aggregators, "churn": args.churn,
            "delay_mean_s": args.delay_mean, "together": args.together, "max_message_bytes": args.max_message_bytes,
            "processes": processes,
            "cpu": bench.cpu_name(), "load_average": os.getloadavg(), "rounds": rounds, "read_path": read_path,
            "killed": killed or None,
            "device_totals": {k: sum(s[k] for s in stats.values()) for k in
                              ("payload_bytes", "payloads_refused", "payload_asks", "updates", "tasks",
                               "reconnects")},
            "devices_reporting": len(stats)}


def number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def mb(count: int | None) -> str:
    return number(None if count is None else count / MB, ".1f")


def table(result: dict) -> str:
    head = ("| round | devices | folded | lost | s | server out MB | server in MB | plan payloads MB | payload "
            "publishes | update MB/s | broker-only MB/s | server peak RSS MiB | server CPU s | of it main thread | "
            "CPU ms an update | read path's | server / read path |\n|" + "---:|" * 17)
    rows = [f"| {r['round']} | {r['devices']} | {r['updates_folded']} | {r['lost']} | {r['seconds']:.1f} | "
            f"{(r['server_bytes_out'] or 0) / MB:.1f} | {(r['server_bytes_in'] or 0) / MB:.1f} | "
            f"{r['plan_payload_bytes'] / MB:.1f} | {r['payload_publishes']} | {r['update_mb_per_s']:.1f} | "
            f"{r['broker_only_mb_per_s']:.1f} | "
            f"{r['server_peak_rss_mb']:.0f} | {r['server_cpu_s']:.1f} | {r['server_main_thread_cpu_s']:.1f} | "
            f"{r['server_cpu_ms_per_update']:.1f} | {number(r['read_path_cpu_ms_per_update'], '.1f')} | "
            f"{number(r['server_to_read_path'], '.2f')} |"
            for r in result["rounds"]]
    lines = [head, *rows]
    if "aggregators_peak_rss_mb" in result["rounds"][0]:
        lines += ["", "| round | aggregators in MB | spilled | pushed out | awaiting in files | awaiting in memory MB "
                  "(largest member) | largest aggregator peak RSS MiB |", "|" + "---:|" * 7]
        lines += [f"| {r['round']} | {mb(r.get('aggregators_bytes_in'))} | {r.get('aggregators_spilled')} | "
                  f"{r.get('aggregators_pushed_out')} | {r.get('aggregators_awaiting_filed')} | "
                  f"{mb(r.get('aggregators_awaiting_peak_bytes'))} | {r['aggregators_peak_rss_mb']:.0f} |"
                  for r in result["rounds"]]
    if "read_seconds" in result["rounds"][0]:
        lines += ["", "| round | read s (release to close) | read MB/s | broker-only MB/s | read / broker-only |",
                  "|" + "---:|" * 5]
        lines += [f"| {r['round']} | {r['read_seconds']:.2f} | {r['read_mb_per_s']:.1f} | "
                  f"{r['broker_only_mb_per_s']:.1f} | {r['read_to_broker']:.2f} |" for r in result["rounds"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        folder = Path(args.workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        result = run(args, folder)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"devices: {result['device_totals']}; CPU {result['cpu']}, load {result['load_average']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
