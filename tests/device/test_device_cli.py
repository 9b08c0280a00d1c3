"""python -m device_runtime as a careless user runs it: every bad input ends in one line that names the problem
and exit status 2 (the systemd unit does not restart a device on 2), never in a traceback."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from device_runtime.__main__ import PASSWORD_ENV
from device_runtime.shard import ZIP_MAGIC, Shard, save_shard
from server.mqtt.mosquitto_config import write_mosquitto_auth
from tests.support.broker import free_loopback_port
from tests.support.commands import assert_bad_input
from tests.support.sealing import write_key
from tests.support.processes import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE_ID = "dev_000"
TIMEOUT_S = 60
CONNECTED_WAIT_S = 20.0


@pytest.fixture
def shard_path(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    shard = Shard(x_train=rng.random((8, 1, 28, 28), dtype=np.float32), y_train=np.arange(8) % 2,
                  x_test=rng.random((4, 1, 28, 28), dtype=np.float32), y_test=np.arange(4) % 2, num_classes=10)
    path = tmp_path / f"{DEVICE_ID}.npz"
    save_shard(path, shard)
    return path


def device_args(data: Path, workdir: Path, broker: str = "mqtt://127.0.0.1:1", *extra: str) -> list[str]:
    return [sys.executable, "-m", "device_runtime", "--broker", broker, "--device-id", DEVICE_ID,
            "--data", str(data), "--workdir", str(workdir),
            "--key-file", str(write_key(workdir.parent / f"{DEVICE_ID}.key")), *extra]


def run_device(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=child_env(**(env or {})))


def test_a_shard_damaged_in_the_middle_is_named_corrupt(shard_path: Path, tmp_path: Path):
    raw = bytearray(shard_path.read_bytes())
    raw[raw.index(ZIP_MAGIC, 1) - 1] ^= 0xFF
    shard_path.write_bytes(bytes(raw))
    assert_bad_input(run_device(*device_args(shard_path, tmp_path / "w")),
                     "error: --data:", str(shard_path), "is corrupt (Bad CRC-32")


def test_a_truncated_shard_is_named_corrupt(shard_path: Path, tmp_path: Path):
    shard_path.write_bytes(shard_path.read_bytes()[:1000])
    assert_bad_input(run_device(*device_args(shard_path, tmp_path / "w")), str(shard_path), "is corrupt")


def test_a_text_file_as_shard_is_not_an_npz_archive(tmp_path: Path):
    text = tmp_path / "notes.npz"
    text.write_text("x,y\n1,2\n")
    done = run_device(*device_args(text, tmp_path / "w"))
    assert_bad_input(done, str(text), "is not a .npz archive")
    assert "pickle" not in done.stderr


def test_a_missing_shard_names_the_flag(tmp_path: Path):
    assert_bad_input(run_device(*device_args(tmp_path / "absent.npz", tmp_path / "w")),
                     "error: --data:", "No such file")


def test_a_workdir_that_is_a_file_names_the_flag(shard_path: Path, tmp_path: Path):
    assert_bad_input(run_device(*device_args(shard_path, shard_path)), "error: --workdir:")


def test_a_key_file_that_is_not_a_key_names_the_flag_and_the_format(shard_path: Path, tmp_path: Path):
    (tmp_path / "bad.key").write_text("not a key\n")
    args = device_args(shard_path, tmp_path / "work")
    args[args.index("--key-file") + 1] = str(tmp_path / "bad.key")
    assert_bad_input(run_device(*args), "error: --key-file: file")
    assert "64 hex digits" in run_device(*args).stderr


@pytest.mark.parametrize("flag, value, message", [
    ("--threads", "0", "--threads must be >= 1, got 0"),
    ("--memory-budget-mb", "-5", "--memory-budget-mb must be positive, got -5"),
    ("--connect-timeout", "-1", "--connect-timeout must be >= 0 (0: wait for ever), got -1"),
    ("--tls-ca", "/nonexistent/ca.pem", "--tls-ca /nonexistent/ca.pem: no such file"),
])
def test_a_flag_out_of_range_is_named_with_its_value(shard_path: Path, tmp_path: Path, flag, value, message):
    assert_bad_input(run_device(*device_args(shard_path, tmp_path / "w"), flag, value), message)


def test_a_bad_entry_of_a_broker_list_is_named_with_the_flag(shard_path: Path, tmp_path: Path):
    done = run_device(*device_args(shard_path, tmp_path / "w", "mqtt://127.0.0.1:1883,127.0.0.2:1883"))
    assert_bad_input(done, "error: --broker: broker URL '127.0.0.2:1883': scheme must be one of",
                     "comma-separated for several")


def test_a_broker_that_does_not_listen_is_reported_as_connection_refused(shard_path: Path, tmp_path: Path):
    port = free_loopback_port()
    started = time.monotonic()
    done = run_device(*device_args(shard_path, tmp_path / "w", f"mqtt://127.0.0.1:{port}", "--connect-timeout", "3"))
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert_bad_input(done, f"no broker at 127.0.0.1:{port} after --connect-timeout 3 s",
                     f"connection refused (is the broker running at 127.0.0.1:{port}?)")
    retrying = [line for line in done.stderr.splitlines() if line.endswith("; retrying until --connect-timeout 3 s")]
    assert len(retrying) == 1 and "connection refused" in retrying[0]


@pytest.fixture
def password_broker(tmp_path: Path, start_mosquitto):
    passwd, acl = write_mosquitto_auth(tmp_path / "auth", "server", "server-pw", {DEVICE_ID: "device-pw"}, "fedara")
    return start_mosquitto(password_file=passwd, acl_file=acl)


def test_a_wrong_password_is_refused_with_exit_2(password_broker, shard_path: Path, tmp_path: Path):
    done = run_device(*device_args(shard_path, tmp_path / "w", password_broker.url), env={PASSWORD_ENV: "wrong"})
    assert_bad_input(done, "refused the connection", f"${PASSWORD_ENV}")


def test_the_username_defaults_to_the_device_id(password_broker, shard_path: Path, tmp_path: Path):
    device = subprocess.Popen(device_args(shard_path, tmp_path / "w", password_broker.url), cwd=REPO_ROOT,
                              env=child_env(**{PASSWORD_ENV: "device-pw"}), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + CONNECTED_WAIT_S
        line = ""
        while "joined" not in line and time.monotonic() < deadline:
            line = device.stderr.readline()
        assert "joined" in line
    finally:
        device.terminate()
        device.wait(TIMEOUT_S)
    assert device.returncode == 0
