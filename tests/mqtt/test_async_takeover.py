"""A client-id takeover in ``--mode async`` on Debian's mosquitto (issue 44): real device processes, the takeover by
a plain ``mosquitto_sub -i dev_001`` while dev_001 computes (every device process stopped with SIGSTOP meanwhile, so
dev_001 cannot take its id back at once and the other two cannot end the run without it), as in
tests/mqtt/test_freshness.py.

The server sends dev_001 its task in flight again when it comes back: a TASK naming its version's payload, never the
model again, and every payload published is booked in ``bytes_down``. That re-ask crosses dev_001's answer (it was
sent before the answer came): the server's receipt of the answer reaches dev_001 before its wait for it ends, so the
answer is not sent twice."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from device_runtime.framing import frame_msg_id
from device_runtime.topics import Topics
from server.mqtt.enrollment import enroll, save_enrollment
from tests.support.broker import attack_broker
from tests.support.broker_capture import PREFIX, Capture, finish, record
from tests.support.machine import missing_binary, require
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "30", "--batch-size", "32", "--lr", "0.05",
       "--threads", "1", "--join-timeout", "300", "--round-deadline", "300", "--prefix", PREFIX, "--mode", "async",
       "--buffer-size", "2", "--concurrency", "3", "--rounds", "4", "--local-devices", "3", "--seed", "0"]
SMALL_TASK_BYTES = 4096
"""A TASK that names its payload: ~1 KB sealed (the model it names is 2.3 MB at these settings' dense tier)."""
WAIT_S = 120


@dataclass
class TakenOver:
    server_log: str
    device_log: str
    records: list[dict]
    down_frames: list[bytes]


def computing(device_log: Path) -> str | None:
    """The task dev_001 fetched the payload of and has not finished training, from its log (None: none)."""
    if not device_log.exists():
        return None
    text = device_log.read_text()
    fetched = re.findall(r"round (\d+): payload \w+ fetched", text)
    return fetched[-1] if fetched and f"round {fetched[-1]}: trained" not in text else None


def device_processes(server_pid: int) -> dict[str, psutil.Process] | None:
    """The server's three local device processes by device id, once all three run."""
    found = {d: p for p in psutil.Process(server_pid).children() for d in ("dev_000", "dev_001", "dev_002")
             if d in " ".join(p.cmdline())}
    return found if len(found) == 3 else None


@pytest.fixture(scope="module")
def taken_over(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> TakenOver:
    require(missing_binary("mosquitto_sub", "mosquitto-clients"))
    base = tmp_path_factory.mktemp("async_takeover")
    with attack_broker(base, 256 * 1024) as broker:
        enrollment = save_enrollment(base / "enroll.json", enroll({}, [f"dev_{i:03d}" for i in range(3)]))
        capture, stop = Capture(), threading.Event()
        recorder = record(broker.port, stop, capture)
        out = base / "run"
        proc = subprocess.Popen([sys.executable, "-m", "server.broker_loop", *RUN, "--broker", broker.url,
                                 "--out", str(out), "--cache-dir", str(shared_artifact_cache),
                                 "--enroll", str(enrollment)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        device_log, server_log = out / "devices" / "dev_001.log", out / "server.log"
        # every device is stopped while dev_001 computes a task (30 epochs: seconds), so dev_001 has a task in hand
        # and the other two cannot finish the run while it is away, however fast they train
        devices = wait_for(lambda: device_processes(proc.pid), WAIT_S, "the three device processes")
        while True:
            task = wait_for(lambda: computing(device_log), WAIT_S, "dev_001 to compute a task")
            for device in devices.values():
                device.suspend()
            if computing(device_log) == task:
                break
            for device in devices.values():  # it finished the task before it stopped: catch the next one
                device.resume()
        subprocess.run(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-i", "dev_001", "-t",
                        f"{PREFIX}/takeover", "-W", "2"], capture_output=True)
        wait_for(lambda: "dev_001 is offline" in server_log.read_text(), WAIT_S, "the server to see dev_001 offline")
        devices["dev_001"].resume()
        wait_for(lambda: "dev_001 is online" in server_log.read_text().partition("dev_001 is offline")[2], WAIT_S,
                 "dev_001 to come back")
        for device in devices.values():
            device.resume()
        finish(proc, lines)
        stop.set()
        recorder.join(10)
        down = Topics(PREFIX, "dev_001").down
        return TakenOver(server_log.read_text(), device_log.read_text(),
                         [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                         [f for t, f in capture.frames if t == down and frame_msg_id(f).startswith("task-")])


def test_an_async_task_sent_again_after_a_takeover_names_its_payload(taken_over: TakenOver):
    assert "sending dev_001 its task in flight again" in taken_over.server_log
    sizes = [len(f) for f in taken_over.down_frames]
    print(f"dev_001's TASK frames: {sizes} bytes")
    assert sizes and max(sizes) <= SMALL_TASK_BYTES


def test_every_payload_published_is_booked_as_sent_down(taken_over: TakenOver):
    published = sum(int(n) for n in re.findall(r"published payload \w+ \((\d+) bytes", taken_over.server_log))
    booked = sum(r["bytes_down"] + r.get("bytes_down_eval", 0) for r in taken_over.records)
    print(f"payload bytes published {published}, booked {booked}")
    assert published == booked > 0


def test_the_reask_that_crossed_the_answer_gets_no_second_copy(taken_over: TakenOver):
    assert "waiting for the answer's receipt" in taken_over.device_log
    assert "re-sending the saved answer" not in taken_over.device_log
    assert not re.search(r"dropped an update from dev_001", taken_over.server_log)
