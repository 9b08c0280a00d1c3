"""scripts/mosquitto_credentials.py: one command writes a broker set-up that Debian's mosquitto, dropping to its
own user, can read; a federation authenticates through it and a wrong password is refused."""
from __future__ import annotations

import os
import pwd
import queue
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client
import paho.mqtt.publish
import pytest

from device_runtime.__main__ import PASSWORD_ENV
from device_runtime.transport import PACKET_HEADROOM_BYTES, BrokerRefusedError, MqttEndpoint
from server import broker_loop
from server.mqtt.mosquitto_config import parse_passwords
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.broker import MOSQUITTO_BIN, MosquittoProcess, free_loopback_port
from tests.support.machine import missing_binary, missing_root, needs, require
from tests.support.processes import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "mosquitto_credentials.py"
AS_ROOT = needs(missing_root("handing files to the mosquitto user needs it"))
DATA = ["--dataset", "digits", "--max-samples", "300", "--seed", "0"]
TRAINING = ["--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--lam", "2", "--lam-warmup", "1",
            "--threads", "1"]
ROUNDS = 2
WAIT_S = 20.0
SMALL_FRAME = 4096
TIMEOUT_S = 120


def run_setup(out: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=child_env(drop=(PASSWORD_ENV,), **(env or {})))


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A folder the mosquitto user can enter (pytest's tmp_path lies under a root-only 0700 folder)."""
    folder = Path(tempfile.mkdtemp(prefix="fedara-mosquitto-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_the_server_password_comes_from_the_environment_and_device_passwords_are_generated(tmp_path: Path):
    done = run_setup(tmp_path / "m", "--devices", "2", "--user", pwd.getpwuid(os.geteuid()).pw_name,
                     env={PASSWORD_ENV: "from-env"})
    assert done.returncode == 0, done.stderr
    passwords_file = tmp_path / "m" / "passwords"
    passwords = parse_passwords(passwords_file.read_text(), "passwords")
    assert passwords["server"] == "from-env" and set(passwords) == {"server", "dev_000", "dev_001"}
    assert len(passwords["dev_000"]) >= 20 and passwords["dev_000"] != passwords["dev_001"]
    assert stat.S_IMODE(passwords_file.stat().st_mode) == 0o600
    assert "generated for dev_000, dev_001" in done.stdout
    assert "from-env" not in done.stdout


def test_passwords_given_in_a_file_are_kept(tmp_path: Path):
    given = tmp_path / "given"
    given.write_text("# kept across runs\nserver:s-pw\ndev_000:d0-pw\n")
    done = run_setup(tmp_path / "m", "--devices", "1", "--passwords", str(given),
                     "--user", pwd.getpwuid(os.geteuid()).pw_name)
    assert done.returncode == 0, done.stderr
    assert parse_passwords((tmp_path / "m" / "passwords").read_text(), "p") == {"server": "s-pw", "dev_000": "d0-pw"}


def test_the_output_tells_how_to_start_mosquitto_the_server_and_a_device(tmp_path: Path):
    done = run_setup(tmp_path / "m", "--devices", "1", "--bind", "127.0.0.1", "--port", "18830",
                     "--user", pwd.getpwuid(os.geteuid()).pw_name)
    assert f"/usr/sbin/mosquitto -c {tmp_path / 'm' / 'mosquitto.conf'}" in done.stdout
    assert "-m server.broker_loop --broker mqtt://127.0.0.1:18830 --username server" in done.stdout
    assert "-m device_runtime --broker mqtt://127.0.0.1:18830 --device-id dev_000" in done.stdout


def printed_server_command(stdout: str) -> list[str]:
    """The flags of the server command the set-up printed (what follows ``-m server.broker_loop``)."""
    (line,) = [line for line in stdout.splitlines() if "-m server.broker_loop " in line]
    return shlex.split(line.split("-m server.broker_loop ", 1)[1])


def test_the_printed_server_command_waits_for_the_enrolled_devices_and_runs_a_short_demo(tmp_path: Path):
    done = run_setup(tmp_path / "m", "--devices", "2", "--device-id", "board-7", "--bind", "127.0.0.1",
                     "--user", pwd.getpwuid(os.geteuid()).pw_name)
    assert done.returncode == 0, done.stderr
    args = broker_loop.build_parser().parse_args(printed_server_command(done.stdout))
    assert args.min_devices == 3 and args.enroll == str(tmp_path / "m" / "enrollment.json")
    assert (args.rounds, args.local_epochs) == (5, 1) and args.out is None  # each run its own folder: run it again
    assert "for a real run drop --rounds 5 --local-epochs 1" in done.stdout


def test_the_broker_limits_packets_with_max_packet_size_alone(start_mosquitto):
    """mosquitto 2.0 notes that message_size_limit should be max_packet_size: the conf uses the latter only,
    mosquitto starts without the note, a whole frame passes and a packet over the limit is refused."""
    broker = start_mosquitto(max_frame_bytes=SMALL_FRAME)
    assert "message_size_limit" not in broker.conf.read_text()
    received: queue.Queue[bytes] = queue.Queue()
    subscribed, dropped = threading.Event(), threading.Event()
    receiver = paho_client("receiver", broker.port, on_message=lambda c, u, m: received.put(m.payload),
                           on_subscribe=lambda *args: subscribed.set())
    sender = paho_client("sender", broker.port, on_disconnect=lambda *args: dropped.set())
    try:
        receiver.subscribe("t", qos=1)
        assert subscribed.wait(WAIT_S)
        sender.publish("t", bytes(SMALL_FRAME + PACKET_HEADROOM_BYTES), qos=0)
        assert dropped.wait(WAIT_S)  # the broker closed the sender's connection on the oversize packet
        paho.mqtt.publish.single("t", bytes(SMALL_FRAME), qos=1, hostname="127.0.0.1", port=broker.port)
        assert received.get(timeout=WAIT_S) == bytes(SMALL_FRAME) and received.empty()
    finally:
        for client in (sender, receiver):
            client.loop_stop()
            client.disconnect()
    assert "message_size_limit" not in broker.log.read_text()


def paho_client(client_id: str, port: int, **callbacks: object) -> paho.mqtt.client.Client:
    """A plain paho client (no frame checks of its own) with ``callbacks``, connected to 127.0.0.1:``port``."""
    client = paho.mqtt.client.Client(paho.mqtt.client.CallbackAPIVersion.VERSION2, client_id=client_id)
    for name, callback in callbacks.items():
        setattr(client, name, callback)
    connected = threading.Event()
    client.on_connect = lambda *args: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(WAIT_S)
    return client


def test_no_devices_is_refused_naming_the_flags(tmp_path: Path):
    done = run_setup(tmp_path / "m")
    assert done.returncode == 2 and done.stderr == "error: no devices: pass --devices N or --device-id ID\n"


@AS_ROOT
def test_files_mosquitto_reads_belong_to_its_user_and_the_passwords_to_the_operator(reachable_dir: Path):
    assert run_setup(reachable_dir / "m", "--devices", "1").returncode == 0
    mosquitto = pwd.getpwnam("mosquitto")
    for name in ("mosquitto.conf", "passwd", "acl"):
        info = (reachable_dir / "m" / name).stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (mosquitto.pw_uid, 0o600), name
    assert (reachable_dir / "m" / "passwords").stat().st_uid == 0


@AS_ROOT
def test_a_folder_the_mosquitto_user_cannot_enter_is_refused(tmp_path: Path):
    done = run_setup(tmp_path / "m", "--devices", "1")
    assert done.returncode == 2
    assert "user mosquitto cannot enter" in done.stderr and "mode 700" in done.stderr


@pytest.mark.slow
@AS_ROOT
def test_two_devices_federate_through_the_setup_and_a_wrong_password_is_refused(
        reachable_dir: Path, monkeypatch: pytest.MonkeyPatch):
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    port = free_loopback_port()
    setup = reachable_dir / "mosquitto"
    done = run_setup(setup, "--devices", "2", "--bind", "127.0.0.1", "--port", str(port),
                     env={PASSWORD_ENV: "server-secret"})
    assert done.returncode == 0, done.stderr
    passwords = parse_passwords((setup / "passwords").read_text(), "passwords")
    shards = subprocess.run([sys.executable, "-m", "server.shards", *DATA, "--clients", "2",
                             "--out", str(reachable_dir / "shards")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert shards.returncode == 0, shards.stderr
    broker = MosquittoProcess(setup / "mosquitto.conf", port, reachable_dir / "mosquitto.log")
    broker.start()
    devices: list[subprocess.Popen] = []
    try:
        assert _uid_of(broker) == pwd.getpwnam("mosquitto").pw_uid
        devices = [subprocess.Popen([sys.executable, "-m", "device_runtime", "--broker", broker.url,
                                     "--device-id", device_id,
                                     "--data", str(reachable_dir / "shards" / f"{device_id}.npz"),
                                     "--workdir", str(reachable_dir / device_id),
                                     "--key-file", str(setup / "keys" / f"{device_id}.key")],
                                    cwd=REPO_ROOT, env=child_env(**{PASSWORD_ENV: passwords[device_id]}),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for device_id in ("dev_000", "dev_001")]
        monkeypatch.setenv(PASSWORD_ENV, "server-secret")
        assert broker_loop.main([*DATA, *TRAINING, "--rounds", str(ROUNDS), "--min-devices", "2",
                                 "--broker", broker.url, "--username", "server", "--join-timeout", "300",
                                 "--round-deadline", "300", "--cache-dir", str(reachable_dir / "cache"),
                                 "--out", str(reachable_dir / "run"), "--enroll", str(setup / "enrollment.json")]) == 0
        intruder = MqttEndpoint("dev_001", broker.url, username="dev_001", password="wrong")
        intruder.start()
        try:
            with pytest.raises(BrokerRefusedError, match="refused the connection"):
                intruder.wait_connected(WAIT_S)
        finally:
            intruder.stop()
    finally:
        for device in devices:
            device.terminate()
            device.wait(WAIT_S)
        broker.stop()
    records = read_metrics(reachable_dir / "run" / METRICS_FILE)
    assert [r["participants"] for r in records] == [2] * ROUNDS
    assert all(device.returncode == 0 for device in devices)


def _uid_of(broker: MosquittoProcess) -> int:
    """The real uid of the running mosquitto process."""
    status = Path(f"/proc/{broker.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


@pytest.mark.slow
@AS_ROOT
def test_with_tls_host_a_device_connects_verifying_the_broker_with_the_generated_ca(reachable_dir: Path):
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    require(missing_binary("openssl", "openssl"))
    port = free_loopback_port()
    setup = reachable_dir / "mosquitto"
    done = run_setup(setup, "--devices", "1", "--bind", "127.0.0.1", "--port", str(port), "--tls-host", "127.0.0.1")
    assert done.returncode == 0, done.stderr
    assert f"mqtts://127.0.0.1:{port}" in done.stdout and f"--tls-ca {setup / 'ca.pem'}" in done.stdout
    assert stat.S_IMODE((setup / "ca.key").stat().st_mode) == 0o600 and (setup / "ca.key").stat().st_uid == 0
    passwords = parse_passwords((setup / "passwords").read_text(), "passwords")
    broker = MosquittoProcess(setup / "mosquitto.conf", port, reachable_dir / "mosquitto.log", scheme="mqtts")
    broker.start()
    device = MqttEndpoint("dev_000", broker.url, username="dev_000", password=passwords["dev_000"],
                          tls_ca=setup / "ca.pem")
    try:
        device.start()
        device.wait_connected(WAIT_S)
    finally:
        device.stop()
        broker.stop()
