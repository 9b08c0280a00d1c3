"""Replays of captured messages and a frame flood, published with Debian's plain ``mosquitto_pub`` against a run
on Debian's mosquitto (issue 14): each is refused, every genuine device completes the run, and the final model
is bit-identical to an unattacked run with the same seed.

Three runs share one enrollment file (so one deployment): a capture run (seed 1, four devices) whose every frame a
plain MQTT subscriber records; an unattacked run (seed 0, three devices); and the same run attacked after its
first round with the captured bytes, two forgeries under a wrong key, and frame 0 of a captured update sent to
1,000 fresh topics.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from device_runtime.envelope import Message, MessageType
from device_runtime.framing import FRAME_HEADER_BYTES, chunk
from device_runtime.messages import ErrorCode, error_message
from device_runtime.topics import Topics
from server.mqtt.read_budgets import PENDING_UPDATES_BUDGETED
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.mqtt.enrollment import enroll, save_enrollment
from tests.support.broker import MOSQUITTO_PUB, MosquittoProcess, attack_broker, mosquitto_pub
from tests.support.waiting import wait_for
from tests.support.sealing import seal_down, seal_up
from tests.support.broker_capture import MARKER_TOPIC, PREFIX, Capture, finish, record, rss_mib, wait_for_line

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--threads", "1", "--join-timeout", "300", "--round-deadline", "300", "--prefix", PREFIX]
ROUNDS = 8
"""Rounds of the attacked and the clean run (the attack lands in round 2, while the devices are paused)."""
FLOOD_TOPICS = 1000
LARGEST_INBOUND_MIB = 5.3
"""The largest message this run's server takes (its inbound limit: the dense plan's update and slack)."""
RSS_BOUND_MIB = PENDING_UPDATES_BUDGETED * LARGEST_INBOUND_MIB + 43
"""The server's RSS may grow by at most this much during the flood: its reassembly budget (PENDING_UPDATES_BUDGETED
largest inbound messages, ~85 MiB here) plus allocator slack."""
ATTACK_MARKER_TOPIC = f"{PREFIX}/dev/dev_003/status"
"""The marker sent after the flood: on a topic of an enrolled id (the server reads its frames, and refuses the marker
with a logged line); the flood's ids are enrolled nowhere, so their frames are dropped at the frame, each counted."""
WRONG_KEY = bytes([0xEE]) * 32
ATTACK_TIMEOUT_S = 30  # well inside the broker's keep-alive (1.5 x 30 s): paused devices stay connected
SERVER_REFUSALS = 5
"""dev_000's JOIN, dev_001's offline frame and forged JOIN, dev_003's JOIN and ACK."""
WAIT_S = 30
"""Bound on waits for what takes a moment (a subscription, a message through the broker)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
"""The first test sets up three runs (and compiles their artifacts unless the session's cache has them): minutes
on a loaded 2-core machine, over the suite's 300 s default."""


def marker_frame() -> bytes:
    """One complete frame of junk: a transport delivers it, the server refuses it with a logged reason."""
    (frame,) = chunk(b"marker", 256 * 1024, "marker")
    return frame


def server(out: Path, url: str, cache: Path, enrollment: Path, devices: int, seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.broker_loop", *QUICK, "--broker", url, "--out", str(out),
                             "--cache-dir", str(cache), "--enroll", str(enrollment), "--local-devices", str(devices),
                             "--seed", str(seed), "--rounds", str(ROUNDS if devices == 3 else 1)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def still_running(proc: subprocess.Popen) -> Callable[[], None]:
    """For ``wait_for``'s ``alive``: fail at once once the run ended (the attack must land while it runs)."""
    def alive() -> None:
        assert proc.poll() is None, "the run ended before the attack landed: raise ROUNDS"
    return alive


@dataclass
class Runs:
    clean: Path
    attacked: Path
    server_log: str
    device_logs: dict[str, str]
    rss_before: float
    rss_after: float
    lines: list[str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> Runs:
    base = tmp_path_factory.mktemp("replays")
    with attack_broker(base, 256 * 1024) as broker:
        return attack(base, broker, shared_artifact_cache)


def attack(base: Path, broker: MosquittoProcess, cache: Path) -> Runs:
    port = broker.port
    enrollment = save_enrollment(base / "enroll.json", enroll({}, [f"dev_{i:03d}" for i in range(4)]))
    capture, stop = Capture(), threading.Event()
    recorder = record(port, stop, capture)
    lines: list[str] = []
    finish(server(base / "capture", broker.url, cache, enrollment, 4, seed=1), lines)
    mosquitto_pub(port, MARKER_TOPIC, marker_frame(), base / "marker.bin")
    assert capture.marked.wait(WAIT_S), "the recorder did not get the marker sent after the capture run"
    stop.set()
    recorder.join(10)

    finish(server(base / "clean", broker.url, cache, enrollment, 3, seed=0), lines)

    dev = {i: Topics(PREFIX, f"dev_{i:03d}") for i in range(4)}
    replays = [
        *[(dev[0].up, f) for f in capture.of(dev[0].up, "join-")],  # 1. an earlier run's JOIN of dev_000
        *[(dev[1].status, f) for f in capture.of(dev[1].status, "offline-")],  # 2. a captured offline frame
        *[(dev[2].down, f) for f in capture.of(dev[2].down, "plan-")],  # 3. an old run's PLAN, with its files
        *[(dev[3].up, f) for f in capture.of(dev[3].up, "join-")],  # 4. JOIN + ACK of an id not in this run
        *[(dev[3].up, f) for f in capture.of(dev[3].up, "ack-")],
    ]
    forgeries = [  # built with the project's encoder, but under a key the attacker made up
        (dev[1].up, chunk(seal_up(Message(MessageType.JOIN, "none", 0, "dev_001", "join-forged", {}), WRONG_KEY),
                          256 * 1024, "join-forged")[0]),  # malformed: once answered with a REFUSED
        (dev[1].down, chunk(seal_down(error_message(ErrorCode.REFUSED, "you are refused", device_id="dev_001"),
                                      WRONG_KEY), 256 * 1024, "error-forged")[0]),
    ]
    first_update_frame = capture.of(dev[0].update, "update-")[0]
    assert len(first_update_frame) > FRAME_HEADER_BYTES + 200 * 1024, "frame 0 of an update should be a full frame"

    proc = server(base / "attacked", broker.url, cache, enrollment, 3, seed=0)
    wait_for_line(proc, "round 1/", lines)
    # The genuine devices pause while the attack lands, so the run is still in round 2 whatever this machine's
    # speed: the server waits for their answers (its round deadline is minutes) and nothing depends on timing.
    devices = psutil.Process(proc.pid).children()
    for device in devices:
        device.suspend()
    try:
        rss_before = rss_mib(proc.pid)
        flood = base / "flood.bin"
        flood.write_bytes(first_update_frame)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: subprocess.run(
                [MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", f"{PREFIX}/dev/x{i:04d}/update",
                 "-f", str(flood)], check=True, capture_output=True), range(FLOOD_TOPICS)))
        server_log = base / "attacked" / "server.log"
        mosquitto_pub(port, ATTACK_MARKER_TOPIC, marker_frame(), base / "marker.bin")  # after every frame of the flood
        wait_for(lambda: f"dropped a message on {ATTACK_MARKER_TOPIC}" in server_log.read_text(), ATTACK_TIMEOUT_S,
                 "the server to refuse the marker sent after the flood", alive=still_running(proc))
        rss_after = rss_mib(proc.pid)
        for i, (topic, frame) in enumerate(replays + forgeries):
            mosquitto_pub(port, topic, frame, base / f"frame-{i}.bin")
        wait_for(lambda: len([line for line in server_log.read_text().splitlines() if "dropped a message on" in line
                              and "/dev/x" not in line and ATTACK_MARKER_TOPIC not in line]) >= SERVER_REFUSALS, ATTACK_TIMEOUT_S,
                 f"{SERVER_REFUSALS} refusals by the server", alive=still_running(proc))
    finally:
        for device in devices:
            device.resume()
    assert proc.poll() is None, "the run ended before the attacks landed"
    finish(proc, lines)
    attacked = base / "attacked"
    return Runs(base / "clean", attacked, (attacked / "server.log").read_text(),
                {d.name.removesuffix(".log"): d.read_text() for d in (attacked / "devices").glob("*.log")},
                rss_before, rss_after, lines)


def refusals(log: str, where: str) -> list[str]:
    return [line for line in log.splitlines() if f"dropped a message on {where}" in line or
            (where == "device" and "dropped a message:" in line)]


def test_an_earlier_runs_join_replayed_is_refused(runs: Runs):
    (line,) = refusals(runs.server_log, f"{PREFIX}/dev/dev_000/up")
    assert ": join join-" in line and line.endswith("[replay]")


def test_a_captured_offline_frame_does_not_mark_a_live_device_offline(runs: Runs):
    (line,) = refusals(runs.server_log, f"{PREFIX}/dev/dev_001/status")
    assert ": status status-offline-" in line and line.endswith("[stale_connection]")


def test_an_old_runs_plan_does_not_switch_a_device_to_that_run(runs: Runs):
    log = runs.device_logs["dev_002"]
    (line,) = [line for line in refusals(log, "device") if ": plan plan-" in line]
    assert line.endswith("[replay]")
    assert log.count("fresh heads") <= 1  # only the attacked run's own first plan


def test_a_join_and_ack_of_a_device_not_in_this_run_admit_nothing(runs: Runs):
    join, ack = refusals(runs.server_log, f"{PREFIX}/dev/dev_003/up")
    assert ": join join-" in join and join.endswith("[replay]")
    assert ": ack ack-" in ack and ack.endswith("[wrong_run]")
    assert "dev_003 joined" not in runs.server_log and "dev_003 is ready" not in runs.server_log


def test_forgeries_under_a_wrong_key_are_dropped_and_the_device_carries_on(runs: Runs):
    (join,) = refusals(runs.server_log, f"{PREFIX}/dev/dev_001/up")
    assert ": join join-forged" in join and join.endswith("[bad_tag]")
    log = runs.device_logs["dev_001"]
    (refused,) = [line for line in refusals(log, "device") if ": error error-" in line]
    assert refused.endswith("[bad_tag]") and "refused this device" not in log


def test_every_genuine_device_completes_every_round(runs: Runs):
    rounds = [l for l in runs.lines if l.startswith("round ")]
    attacked = rounds[-ROUNDS:]
    assert all("participants 3/3" in l and "dropped 0" in l for l in attacked), attacked


def test_the_attacked_runs_final_model_is_bit_identical_to_the_clean_run(runs: Runs):
    clean = load_checkpoint(runs.clean / CHECKPOINT_NAME).tensors
    attacked = load_checkpoint(runs.attacked / CHECKPOINT_NAME).tensors
    assert clean.keys() == attacked.keys()
    for name in clean:
        np.testing.assert_array_equal(attacked[name], clean[name], err_msg=name)


def test_a_flood_of_1000_topics_keeps_server_rss_within_its_bound(runs: Runs):
    print(f"server RSS {runs.rss_before:.0f} MiB before the flood, {runs.rss_after:.0f} MiB after")
    assert runs.rss_after - runs.rss_before <= RSS_BOUND_MIB
