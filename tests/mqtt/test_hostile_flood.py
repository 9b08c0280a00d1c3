"""An incomplete-message flood at the server's wildcard, made with Debian's plain ``mosquitto_pub`` against a run on
Debian's mosquitto (issue 44): frames written with the project's own framing code (chunk 0 of 2, a fresh msg_id
each), published from round 2 to the run's end on the update topic of an id nobody enrolled and on that of an
enrolled device of the run. The run's frames are small (16 KiB), so every honest update travels as several frames and
is half-received while the flood lands.

The unenrolled id's frames never reach the server: its enrollment is closed, so it subscribes to the enrolled
devices' topics only (server/mqtt/admission.py's ``server_filters``) and the broker forwards nothing of that id; the
enrolled id's junk fills only that id's own reassembly budget, where it ranks below the device's authenticated update
(framing.Reassembler, server/mqtt/admission.py). Every round folds every honest update, none is pushed out and asked
again, and the final model is bit-identical to an undisturbed run of the same seed.

Before the attacked run, a junk frame claiming the genuine payload's hash and size is retained on every payload topic
the undisturbed run used (the same seed: the same payload hashes). Payload topics carry the run's id, so none of it
is on the attacked run's topics: its payload bytes of every round equal the undisturbed run's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from device_runtime.framing import FRAME_HEADER_BYTES, chunk
from device_runtime.topics import Topics
from server.mqtt.enrollment import enroll, save_enrollment
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.broker import MOSQUITTO_PUB, MosquittoProcess, attack_broker, mosquitto_pub
from tests.support.broker_capture import PREFIX, finish, wait_for_line

REPO_ROOT = Path(__file__).resolve().parents[2]
FRAME_BYTES = 16 * 1024
ROUNDS = 4
QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--threads", "1", "--join-timeout", "300", "--round-deadline", "300", "--prefix", PREFIX, "--rounds",
         str(ROUNDS), "--local-devices", "3", "--seed", "0", "--max-message-bytes", str(FRAME_BYTES)]
UNENROLLED = Topics(PREFIX, "dev_009").update
ENROLLED = Topics(PREFIX, "dev_001").update
WORKERS_PER_TOPIC = 2
MIN_FLOOD_FRAMES = 50
"""Frames per topic the flood must have sent before the run ended (a machine too slow to flood fails loudly)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def junk_frame() -> bytes:
    """Chunk 0 of a 2-chunk message with a fresh msg_id: a full frame that never completes."""
    step = FRAME_BYTES - FRAME_HEADER_BYTES
    return chunk(os.urandom(2 * step), FRAME_BYTES, f"flood-{uuid.uuid4().hex[:12]}")[0]


def server(out: Path, url: str, cache: Path, enrollment: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.broker_loop", *QUICK, "--broker", url, "--out", str(out),
                             "--cache-dir", str(cache), "--enroll", str(enrollment)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def watch_payload_topics(port: int) -> tuple[mqtt.Client, set[str]]:
    """A plain subscriber noting every payload topic (``PREFIX/payload/RUN/SHA256``) it sees a frame on."""
    topics: set[str] = set()
    subscribed = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="payload-watcher", protocol=mqtt.MQTTv311)
    client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/payload/#", qos=1)
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = lambda c, u, message: topics.add(message.topic.rsplit("/", 1)[0])
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert subscribed.wait(30), "the payload watcher did not subscribe"
    return client, topics


def retain_junk_before_the_run(port: int, topics: set[str], folder: Path) -> None:
    """On each payload topic of an earlier run, frame 0 retained: junk claiming that payload's hash (and its size)."""
    for topic in sorted(topics):
        digest = bytes.fromhex(topic.rsplit("/", 1)[1])
        (frame,) = chunk(b"\0" * 1000, FRAME_BYTES, f"junk-{digest.hex()[:8]}")
        frame = frame[:FRAME_HEADER_BYTES - 32] + digest + frame[FRAME_HEADER_BYTES:]
        path = folder / "retained.bin"
        path.write_bytes(frame)
        subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-r", "-t", f"{topic}/0", "-f",
                        str(path)], check=True, capture_output=True)


@dataclass
class Runs:
    clean: Path
    attacked: Path
    server_log: str
    lines: list[str]
    sent: dict[str, int]
    junk_topics: int


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> Runs:
    base = tmp_path_factory.mktemp("flood")
    with attack_broker(base, FRAME_BYTES) as broker:
        return attack(base, broker, shared_artifact_cache)


def attack(base: Path, broker: MosquittoProcess, cache: Path) -> Runs:
    enrollment = save_enrollment(base / "enroll.json", enroll({}, [f"dev_{i:03d}" for i in range(3)]))
    lines: list[str] = []
    watcher, payload_topics = watch_payload_topics(broker.port)
    finish(server(base / "clean", broker.url, cache, enrollment), lines)
    watcher.loop_stop()
    watcher.disconnect()
    retain_junk_before_the_run(broker.port, payload_topics, base)
    proc = server(base / "attacked", broker.url, cache, enrollment)
    wait_for_line(proc, "round 1/", lines)
    stop, sent, lock = threading.Event(), {UNENROLLED: 0, ENROLLED: 0}, threading.Lock()

    def flood(topic: str, worker: int) -> None:
        path = base / f"flood-{worker}.bin"
        while not stop.is_set():
            mosquitto_pub(broker.port, topic, junk_frame(), path)
            with lock:
                sent[topic] += 1 if proc.poll() is None else 0

    workers = [threading.Thread(target=flood, args=(topic, i * len(sent) + j), daemon=True)
               for i in range(WORKERS_PER_TOPIC) for j, topic in enumerate(sent)]
    for worker in workers:
        worker.start()
    try:
        finish(proc, lines)
    finally:
        stop.set()
        for worker in workers:
            worker.join(30)
    attacked = base / "attacked"
    return Runs(base / "clean", attacked, (attacked / "server.log").read_text(), lines, dict(sent), len(payload_topics))


def test_the_flood_landed_on_both_ids_while_the_run_ran(runs: Runs):
    assert min(runs.sent.values()) >= MIN_FLOOD_FRAMES, runs.sent


def test_frames_of_an_id_nobody_enrolled_never_reach_the_server(runs: Runs):
    assert UNENROLLED not in runs.server_log and "[not_admitted]" not in runs.server_log


def test_no_honest_update_is_pushed_out_or_asked_again(runs: Runs):
    assert "pushed out half-received" not in runs.server_log


def test_every_round_folds_every_honest_update(runs: Runs):
    rounds = [line for line in runs.lines if line.startswith("round ")]
    attacked = rounds[-ROUNDS:]
    assert len(attacked) == ROUNDS and all("participants 3/3" in r and "dropped 0" in r for r in attacked), attacked


def test_the_flooded_runs_final_model_is_bit_identical_to_the_undisturbed_run(runs: Runs):
    clean = load_checkpoint(runs.clean / CHECKPOINT_NAME)
    attacked = load_checkpoint(runs.attacked / CHECKPOINT_NAME)
    assert attacked.round == clean.round == ROUNDS and clean.tensors.keys() == attacked.tensors.keys()
    for name in clean.tensors:
        np.testing.assert_array_equal(attacked.tensors[name], clean.tensors[name], err_msg=name)


def test_junk_retained_before_the_run_changes_no_rounds_payload_bytes(runs: Runs):
    clean, attacked = (read_metrics(run / METRICS_FILE) for run in (runs.clean, runs.attacked))
    print(f"junk retained on {runs.junk_topics} payload topics of the undisturbed run; flood frames sent {runs.sent}; "
          f"round seconds undisturbed {[round(r['seconds'], 2) for r in clean]}, "
          f"flooded {[round(r['seconds'], 2) for r in attacked]}")
    assert runs.junk_topics >= ROUNDS
    assert [r["bytes_down"] for r in attacked] == [r["bytes_down"] for r in clean]
