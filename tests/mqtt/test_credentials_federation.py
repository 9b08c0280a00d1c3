"""A federation over mosquitto configured as the project configures it: a password file and an ACL written by
server.mqtt.mosquitto_config.write_mosquitto_auth (what scripts/mosquitto_credentials.py writes), and TLS with a
CA this test creates. Every device logs in as itself. An impostor holding dev_001's credentials cannot
publish on dev_000's up topic (the server never sees it) nor read dev_000's down topic.
"""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from device_runtime.__main__ import PASSWORD_ENV
from device_runtime.envelope import MessageType, decode
from device_runtime.messages import DEFAULT_TOPIC_PREFIX, parse_task, update_message
from device_runtime.task import Update
from device_runtime.topics import Topics
from device_runtime.transport import BrokerRefusedError, MqttEndpoint
from server import broker_loop
from server.mqtt.mosquitto_config import TlsFiles, write_mosquitto_auth
from server.data.partition import write_shards
from server.outputs.report import METRICS_FILE, read_metrics
from server.run_setup import load_shards
from server.simulate import build_parser as simulate_parser
from server.mqtt.enrollment import save_enrollment
from tests.support.mqtt_peer import MqttPeer
from tests.support.sealing import seal_up, write_key
from tests.support.processes import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = DEFAULT_TOPIC_PREFIX
VICTIM, IMPOSTOR = "dev_000", "dev_001"
PASSWORDS = {VICTIM: "victim-pw", IMPOSTOR: "impostor-pw"}
KEYS = {VICTIM: bytes([1]) * 32, IMPOSTOR: bytes([2]) * 32}
"""Each device's own key: the impostor holds dev_001's, never dev_000's."""


def enrolled(path: Path) -> Path:
    return save_enrollment(path, KEYS)
SERVER_USER, SERVER_PASSWORD = "server", "server-pw"
QUICK = ["--dataset", "digits", "--max-samples", "300", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1"]
ROUNDS = 2
WAIT_S = 20.0
EVAL = {"eval_correct": 0, "eval_total": 1, "eval_loss": 1.0}


@pytest.fixture
def secured_broker(tmp_path: Path, start_mosquitto, tls_files: TlsFiles):
    passwd, acl = write_mosquitto_auth(tmp_path / "auth", SERVER_USER, SERVER_PASSWORD, PASSWORDS, PREFIX)
    return start_mosquitto(password_file=passwd, acl_file=acl, tls=tls_files)


def start_devices(url: str, ca: Path, directory: Path) -> list[subprocess.Popen]:
    """The two devices as their own processes, on the shards the server would make, each logged in as itself."""
    args = simulate_parser().parse_args([*QUICK, "--clients", str(len(PASSWORDS))])
    _, _, by_device = load_shards(args, len(PASSWORDS))
    assert list(by_device) == list(PASSWORDS)
    shards = write_shards(list(by_device.values()), directory / "shards")
    return [subprocess.Popen([sys.executable, "-m", "device_runtime", "--broker", url, "--device-id", device_id,
                              "--username", device_id, "--tls-ca", str(ca), "--data", str(shard),
                              "--workdir", str(directory / device_id),
                              "--key-file", str(write_key(directory / "keys" / f"{device_id}.key", KEYS[device_id]))],
                             cwd=REPO_ROOT, env=child_env(**{PASSWORD_ENV: PASSWORDS[device_id]}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for device_id, shard in zip(PASSWORDS, shards)]


class Impostor(MqttPeer):
    """Logged in as dev_001 (its own device runs alongside), subscribed to both devices' down topics. Each time
    it reads a task of its own, it sends the server a NaN update and garbage as dev_000, and garbage as itself."""

    def __init__(self, url: str, ca: Path) -> None:
        super().__init__()
        self.victim, self.own = Topics(PREFIX, VICTIM), Topics(PREFIX, IMPOSTOR)
        self.endpoint = MqttEndpoint("impostor", url, username=IMPOSTOR, password=PASSWORDS[IMPOSTOR], tls_ca=ca,
                                     subscriptions=[self.victim.down, self.own.down])
        self.read: dict[str, int] = {self.victim.down: 0, self.own.down: 0}
        self.attacks = 0

    def on_message(self, topic: str, payload: bytes) -> None:
        self.read[topic] += 1
        msg = decode(payload, max_bytes=1 << 28)
        if topic == self.own.down and msg.type == MessageType.TASK:
            self._attack(msg)

    def _attack(self, task_msg) -> None:
        plan_hash, task = parse_task(task_msg)
        nan_fe = {name: np.full_like(value, np.nan) for name, value in task.weights.items()}
        forged = update_message(Update(task.round, nan_fe, 1, 0.0, 0.0, dict(EVAL)), plan_hash=plan_hash,
                                device_id=VICTIM, run_id=task_msg.run_id)
        for topic, payload in ((self.victim.up, seal_up(forged, KEYS[IMPOSTOR])), (self.victim.up, b"not an envelope"),
                               (self.own.up, b"not an envelope")):
            self.endpoint.publish(topic, payload, f"impostor-{uuid.uuid4().hex}", wait=True)
        self.attacks += 1


def test_device_cannot_write_or_read_another_devices_topics_during_a_federation(
        secured_broker, tls_files: TlsFiles, tmp_path: Path, shared_artifact_cache: Path):
    devices = start_devices(secured_broker.url, tls_files.cafile, tmp_path)
    try:
        with Impostor(secured_broker.url, tls_files.cafile) as impostor:
            assert broker_loop.main([*QUICK, "--rounds", str(ROUNDS), "--min-devices", str(len(PASSWORDS)),
                                     "--broker", secured_broker.url, "--username", SERVER_USER,
                                     "--password", SERVER_PASSWORD, "--tls-ca", str(tls_files.cafile),
                                     "--join-timeout", "300", "--round-deadline", "300",
                                     "--cache-dir", str(shared_artifact_cache), "--out", str(tmp_path / "run"),
                                     "--enroll", str(enrolled(tmp_path / "enroll.json"))]) == 0
    finally:
        for device in devices:
            device.terminate()
            device.wait(WAIT_S)
    assert impostor.attacks >= ROUNDS
    assert impostor.read[impostor.own.down] > 0 and impostor.read[impostor.victim.down] == 0
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [r["participants"] for r in records] == [len(PASSWORDS)] * ROUNDS
    assert all(r["dropped"] == {} for r in records)
    log = (tmp_path / "run" / broker_loop.SERVER_LOG).read_text()
    assert f"dropped a message on {impostor.own.up}" in log
    assert f"from {VICTIM}:" not in log and f"on {impostor.victim.up}" not in log
    assert f"dropped an update from {VICTIM}" not in log


def test_anonymous_client_is_refused(secured_broker, tls_files: TlsFiles):
    anonymous = MqttEndpoint("anonymous", secured_broker.url, tls_ca=tls_files.cafile)
    anonymous.start()
    try:
        with pytest.raises(BrokerRefusedError, match="refused the connection"):
            anonymous.wait_connected(WAIT_S)
    finally:
        anonymous.stop()
