"""Real mosquitto brokers for tests: a subprocess restartable on its port, an attack scenario's broker with
``mosquitto_pub`` to attack it, and free loopback ports."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path


from server.mqtt.mosquitto_config import write_mosquitto_conf
from tests.support.machine import missing_binary, require
from tests.support.processes import stop_processes
from tests.support.waiting import wait_for

MOSQUITTO_BIN = Path("/usr/sbin/mosquitto")
MOSQUITTO_PUB = shutil.which("mosquitto_pub")
BROKER_START_TIMEOUT_S = 10.0
BROKER_STOP_TIMEOUT_S = 5.0
ACCEPT_POLL_S = 0.02


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=ACCEPT_POLL_S * 10):
            return True
    except OSError:
        return False


class MosquittoProcess:
    """A mosquitto subprocess on a fixed loopback port; stop() and start() keep the port."""

    def __init__(self, conf: Path, port: int, log: Path, scheme: str = "mqtt") -> None:
        self.conf, self.port, self.log, self.scheme = conf, port, log, scheme
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The running mosquitto's process id (None when stopped)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Launch mosquitto and return once its port accepts TCP connections."""
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen([str(MOSQUITTO_BIN), "-c", str(self.conf)],
                                          stdout=log, stderr=subprocess.STDOUT)
        proc = self._proc

        def alive() -> None:
            if proc.poll() is not None:
                raise AssertionError(f"mosquitto exited with status {proc.returncode}")
        try:
            wait_for(lambda: _accepts_connections(self.port), BROKER_START_TIMEOUT_S,
                     f"mosquitto to accept connections on port {self.port}", alive=alive, poll_s=ACCEPT_POLL_S)
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.log.read_text()}") from None

    def stop(self) -> None:
        """Terminate mosquitto (kill it if it lingers) and wait for it to exit."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_processes([proc], BROKER_STOP_TIMEOUT_S)


@contextlib.contextmanager
def attack_broker(folder: Path, max_frame_bytes: int) -> Iterator[MosquittoProcess]:
    """A mosquitto for a module's attack scenario (conf and log in ``folder``) and ``mosquitto_pub`` to attack
    it with (``require``: a skip here, a failure under CI=true)."""
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    require(missing_binary("mosquitto_pub", "mosquitto-clients"))
    port = free_loopback_port()
    conf = write_mosquitto_conf(folder / "mosquitto.conf", port, max_frame_bytes,
                                run_as_user="root" if os.geteuid() == 0 else None)
    broker = MosquittoProcess(conf, port, folder / "mosquitto.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def mosquitto_pub(port: int, topic: str, frame: bytes, path: Path) -> None:
    """One frame through ``mosquitto_pub -f`` (QoS 1, written to ``path`` first), as anyone on an open broker
    can."""
    path.write_bytes(frame)
    subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", topic, "-f", str(path)],
                   check=True, capture_output=True)
