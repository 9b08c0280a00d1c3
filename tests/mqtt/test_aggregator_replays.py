"""Replays on the aggregators' topics, published with Debian's plain ``mosquitto_pub`` against a run with
``--aggregators 2`` on Debian's mosquitto: every captured engine<->aggregator frame and every device update sent
again is refused with a logged reason, each update is folded once, and the run ends with the unattacked run's
model.

Two runs share one enrollment file (one deployment). A plain paho subscriber records every frame on ``PREFIX/#``
of the first, unattacked run, and of the second. There, two devices are paused the moment their round-1 update is
recorded, so round 2 stays open (the server waits for them; its deadline is minutes) while the third device's
round-2 update is folded and the attack lands: the engine's briefs, verdicts and close requests, the aggregators'
readies, receipts and partials, and every update, of the earlier run (new to every process: the links and the
aggregators judge them) and of this run so far (the transports drop them as repeats), each sent once more.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from device_runtime.framing import frame_msg_id
from fedcore.models import build_model
from server.engine.round_engine import algorithm_for
from server.engine.run_config import FederationConfig
from server.broker_loop import AGGREGATORS_DIR, SERVER_LOG
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.data.datasets import load_dataset
from server.mqtt.enrollment import enroll, save_enrollment
from server.outputs.report import METRICS_FILE, read_metrics
from server.run_setup import global_state
from tests.support.broker import MosquittoProcess, attack_broker, mosquitto_pub
from tests.support.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "fedara"
QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--threads", "1", "--join-timeout", "300", "--round-deadline", "300", "--prefix", PREFIX,
         "--local-devices", "3", "--rounds", "3"]
PAUSED = ("dev_001", "dev_002")
LIVE = "dev_000"
BROKER_LIMIT = 16 << 20
"""mosquitto's message size limit here, and the processes' frame limit: each update travels in one frame, so a
device paused at its first recorded update frame has published the whole update."""
WAIT_S = 120
ATTACK_WAIT_S = 30
"""Bound on the waits while devices are paused: well inside the broker's keep-alive (1.5 x 30 s), so they stay
connected; the attack takes seconds."""
AGG_TOPIC = re.compile(rf"{PREFIX}/agg/(agg-\d+)/(up|down)")
UPDATE_TOPIC = re.compile(rf"{PREFIX}/dev/(dev_\d+)/update/agg-\d+")
"""A device's update topic routed to an aggregator (its task names it)."""
MSG_ID = re.compile(r"aggregation-[0-9a-f]{32}")
REPEAT = re.compile(r"ignored a frame on (\S+): .*\[repeat\]$")
FOLDED = re.compile(r"(agg-\d+) folded (dev_\d+)'s update of round (\d+)")
AGREEMENT = 2e-3
"""Of what training moved each tensor, how far the attacked run's final model may be from the clean run's. The runs
differ only in how the two aggregators grouped float sums (float64, rounded to float32 once a round); training
carries that on, and a ulp that flips a ReLU or max-pool decision moves a weight by ~lr·|grad|. Measured here
(2026-12-02, Intel): max |Δ| 3.0e-8, ‖Δ‖ ≤ 1.5e-6 of the movement; one flip measured 3.5e-4 of it in the same
federation split differently (tests/mqtt/test_cluster_federation.py). The bound is 5.7x that flip, while one update of 3
devices folded twice moves a round by a quarter of that device's distance from the mean update (not measured here);
which updates were folded, and how often, is counted exactly above."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
"""The first test sets up two runs of three processes and two aggregators (and compiles their artifacts unless
the session's cache has them): minutes on a loaded 2-core machine, over the suite's 300 s default."""
MARKER_TOPIC = f"{PREFIX}/test/marker"
"""Published once a run ended: the recorder has every frame of that run once it sees this (the broker forwards
to one subscriber in the order it took the messages in)."""


@dataclass
class Recorder:
    """Every frame on ``PREFIX/#`` in arrival order; pauses a device's process at its first recorded update."""

    devices: dict[str, psutil.Process]
    frames: list[tuple[str, bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    marked: threading.Event = field(default_factory=threading.Event)
    """Set when the marker arrived (it is not recorded)."""

    def on_message(self, _client, _userdata, message) -> None:
        if message.topic == MARKER_TOPIC:
            self.marked.set()
            return
        match = UPDATE_TOPIC.fullmatch(message.topic)
        if match and match[1] in self.devices:
            self.devices.pop(match[1]).suspend()
        with self.lock:
            self.frames.append((message.topic, bytes(message.payload)))

    def snapshot(self) -> list[tuple[str, bytes]]:
        with self.lock:
            return list(self.frames)


def start_server(out: Path, broker_url: str, cache: Path, enrollment: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.broker_loop", *QUICK, "--broker", broker_url,
                             "--out", str(out), "--cache-dir", str(cache), "--enroll", str(enrollment),
                             "--aggregators", "2", "--max-message-bytes", str(BROKER_LIMIT)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> None:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]


def running(proc: subprocess.Popen) -> Callable[[], None]:
    """For ``wait_for``'s ``alive``: fail at once, with the server's output, once the server ended."""
    def alive() -> None:
        assert proc.poll() is None, f"the server ended:\n{proc.stdout.read()[-4000:]}"
    return alive


def device_processes(server: psutil.Process, ids: tuple[str, ...]) -> dict[str, psutil.Process]:
    """The server's local device processes of ``ids`` (started by it, named by ``--device-id``)."""
    found = {}
    for child in server.children():
        try:
            command = child.cmdline()
        except psutil.Error:  # a child that ended (or is ending) since children() listed it
            continue
        if "device_runtime" in command and "--device-id" in command:
            device_id = command[command.index("--device-id") + 1]
            if device_id in ids:
                found[device_id] = child
    return found


def aggregator_logs(run: Path) -> dict[str, str]:
    return {log.stem: log.read_text() for log in sorted((run / AGGREGATORS_DIR).glob("*.log"))}


@dataclass
class Attack:
    clean: Path
    attacked: Path
    replayed: list[tuple[str, bytes]]
    earlier: int
    """The first ``earlier`` replayed frames are the earlier run's."""

    def refusals(self) -> dict[str, list[str]]:
        """The refusal lines in the logs of the engine and of both aggregators, by the kind of topic refused: by a
        transport, a frame of a message it delivered moments ago (a repeat); by a link, an aggregator or the
        engine, a message they judged."""
        lines = [*(self.attacked / SERVER_LOG).read_text().splitlines(),
                 *(line for text in aggregator_logs(self.attacked).values() for line in text.splitlines())]
        found: dict[str, list[str]] = {"down": [], "up": [], "update": []}
        for line in lines:
            repeat = REPEAT.search(line)
            if repeat:
                found[kind_of(repeat[1])].append(line)
            elif "dropped a message from the engine" in line:
                found["down"].append(line)
            elif "dropped a message from aggregator" in line:
                found["up"].append(line)
            elif "refused an update from" in line or ("dropped an update from" in line and ", via agg-" in line):
                found["update"].append(line)
        return found


def kind_of(topic: str) -> str:
    agg = AGG_TOPIC.fullmatch(topic)
    return agg[2] if agg else "update"


def replayed_counts(replayed: list[tuple[str, bytes]]) -> Counter:
    """Replayed frames by kind of topic (down, up, update)."""
    return Counter(kind_of(topic) for topic, _ in replayed)


def unrefused(attack: Attack) -> dict[str, object]:
    """What the logs do not yet show refused: the engine<->aggregator messages (by msg_id; a message of several
    frames is refused once when new, each frame when a repeat) and how many updates (an earlier run's update is
    refused once whatever its frames, each frame of this run's is dropped as a repeat)."""
    refusals = attack.refusals()
    named = " ".join(refusals["down"] + refusals["up"])
    missing = sorted({frame_msg_id(f) for t, f in attack.replayed if kind_of(t) != "update"} - set(
        MSG_ID.findall(named)))
    earlier = {frame_msg_id(f) for t, f in attack.replayed[:attack.earlier] if kind_of(t) == "update"}
    expected = len(earlier) + replayed_counts(attack.replayed[attack.earlier:])["update"]
    unanswered = expected - len(refusals["update"])
    return {"messages": missing, "updates": max(0, unanswered)}  # a device's answer sent again is refused too


@pytest.fixture(scope="module")
def attack(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> Attack:
    base = tmp_path_factory.mktemp("aggregator-replays")
    with attack_broker(base, BROKER_LIMIT) as broker:
        return run_attack(base, broker, shared_artifact_cache)


@contextlib.contextmanager
def recording(port: int, recorder: Recorder) -> Iterator[Recorder]:
    """A plain paho client subscribed to ``PREFIX/#`` (QoS 1) for the length of the block."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="recorder", protocol=mqtt.MQTTv311)
    subscribed = threading.Event()
    client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/#", qos=1)
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = recorder.on_message
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        assert subscribed.wait(30), "the recorder did not subscribe"
        yield recorder
    finally:
        client.loop_stop()
        client.disconnect()


def aggregation_frames(recorder: Recorder) -> list[tuple[str, bytes]]:
    return [(t, f) for t, f in recorder.snapshot() if AGG_TOPIC.fullmatch(t) or UPDATE_TOPIC.fullmatch(t)]


def run_attack(base: Path, broker: MosquittoProcess, cache: Path) -> Attack:
    enrollment = save_enrollment(base / "enroll.json", enroll({}, [f"dev_{i:03d}" for i in range(3)]))
    with recording(broker.port, Recorder({})) as earlier:
        finish(start_server(base / "clean", broker.url, cache, enrollment))
        mosquitto_pub(broker.port, MARKER_TOPIC, b"marker", base / "marker.bin")
        assert earlier.marked.wait(WAIT_S), "the recorder did not get the marker sent after the run"
    replayed = aggregation_frames(earlier)
    earlier_frames = len(replayed)

    attacked = base / "attacked"
    proc = start_server(attacked, broker.url, cache, enrollment)
    server = psutil.Process(proc.pid)
    paused: dict[str, psutil.Process] = {}
    wait_for(lambda: paused.update(device_processes(server, PAUSED)) or len(paused) == len(PAUSED), WAIT_S,
             "device processes", alive=running(proc))
    try:
        with recording(broker.port, Recorder(dict(paused))) as recorder:
            # Devices train only after the server built their artifacts (seconds): the recorder sees every update.
            wait_for(lambda: not recorder.devices, WAIT_S, f"round-1 updates of {', '.join(PAUSED)}",
                     alive=running(proc))
            wait_for(lambda: any((LIVE, 2) == (d, int(r)) for text in aggregator_logs(attacked).values()
                                 for _, d, r in FOLDED.findall(text)), ATTACK_WAIT_S,
                     f"{LIVE}'s round-2 update folded", alive=running(proc))
            live = lambda t: (match := UPDATE_TOPIC.fullmatch(t)) is not None and match[1] == LIVE  # noqa: E731
            wait_for(lambda: sum(live(t) for t, _ in recorder.snapshot()) >= 2,  # the fold may come before the copy
                     ATTACK_WAIT_S, f"{LIVE}'s round-2 update recorded", alive=running(proc))
            replayed += aggregation_frames(recorder)
        with ThreadPoolExecutor(8) as pool:  # while devices are paused: seconds, not one process after another
            list(pool.map(lambda i: mosquitto_pub(broker.port, *replayed[i], base / f"frame-{i}.bin"),
                          range(len(replayed))))
        attack = Attack(base / "clean", attacked, replayed, earlier_frames)
        wait_for(lambda: unrefused(attack) == {"messages": [], "updates": 0}, ATTACK_WAIT_S,
                 "refusal of every replayed frame", alive=running(proc))
    finally:
        for device in paused.values():
            device.resume()
    finish(proc)
    return attack


def test_the_replay_covers_every_kind_of_aggregation_message_of_both_runs(attack: Attack):
    earlier, this = (replayed_counts(attack.replayed[:attack.earlier]),
                     replayed_counts(attack.replayed[attack.earlier:]))
    for counts in (earlier, this):  # briefs, verdicts, closes; readies, receipts, partials
        assert counts["down"] >= 4 and counts["up"] >= 4, counts
    # Three devices, three rounds and the final evaluation; here round 1 of all three and round 2 of the live one.
    # More when a device sent an answer again (it does when the server re-sends a task it already answered).
    assert earlier["update"] >= 3 * 4 and this["update"] >= 3 + 1, (earlier, this)


def test_every_replayed_message_is_refused_with_a_logged_reason(attack: Attack):
    assert unrefused(attack) == {"messages": [], "updates": 0}


def test_the_earlier_runs_messages_are_new_to_the_transports_and_refused_by_links_and_aggregators(attack: Attack):
    earlier = {frame_msg_id(f) for _, f in attack.replayed[:attack.earlier]}
    judged = [line for lines in attack.refusals().values() for line in lines if not REPEAT.search(line)]
    assert len(judged) >= len(earlier), judged


def test_replayed_engine_and_aggregator_messages_are_refused_as_repeats_or_replays(attack: Attack):
    refusals = attack.refusals()
    for kind in ("down", "up"):  # at least one line per replayed message (a repeat: one per frame)
        replayed = {frame_msg_id(f) for t, f in attack.replayed if kind_of(t) == kind}
        assert len(refusals[kind]) >= len(replayed) > 0, (kind, refusals)
    assert all(line.endswith(("[repeat]", "[replay]")) for line in refusals["down"] + refusals["up"]), refusals


def test_each_update_is_folded_once_and_every_device_completes_every_round(attack: Attack):
    folded = sorted((d, int(r)) for text in aggregator_logs(attack.attacked).values()
                    for _, d, r in FOLDED.findall(text))
    assert folded == sorted((f"dev_{i:03d}", r) for i in range(3) for r in range(1, 4))
    assert [r["participants"] for r in read_metrics(attack.attacked / METRICS_FILE)] == [3, 3, 3]


def test_the_attacked_runs_model_is_the_unattacked_runs(attack: Attack):
    clean = load_checkpoint(attack.clean / CHECKPOINT_NAME)
    attacked = load_checkpoint(attack.attacked / CHECKPOINT_NAME)
    assert attacked.round == 3 and attacked.tensors.keys() == clean.tensors.keys()
    data = load_dataset("digits")
    initial = global_state(build_model("fedavgcnn", data.input_shape, data.num_classes, seed=0),
                           algorithm_for(FederationConfig()))
    assert clean.tensors.keys() == initial.keys()
    relative = {name: float(np.linalg.norm(attacked.tensors[name] - value)
                            / np.linalg.norm(value - initial[name].numpy()))
                for name, value in clean.tensors.items()}
    absolute = max(float(np.abs(attacked.tensors[n] - v).max()) for n, v in clean.tensors.items())
    print(f"attacked vs clean: max |Δ| {absolute:.3g}, largest ‖Δ‖ / ‖clean - initial‖ {max(relative.values()):.3g}")
    assert max(relative.values()) <= AGREEMENT, relative
