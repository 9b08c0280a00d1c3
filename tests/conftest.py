"""Shared test set-up: one compute thread per test process, the one rule for what a test needs from the machine
(``require``/``needs``: a skip here, a failure under CI=true), the broker fixtures (a mosquitto subprocess
restartable on its port, and the embedded amqtt broker), the one condition wait (``wait_for``: tests wait on
something they can observe, never a fixed sleep), and the session's shared artifact cache.

Nothing here imports torch or the server's dependencies at load time, so the device-only tests also run on
a device-only install (numpy, onnxruntime, paho-mqtt)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from device_runtime.artifact_contract import KINDS
from device_runtime.log_budget import lift_flood_budget
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES
from server.mqtt.mosquitto_config import TlsFiles, write_mosquitto_conf

MOSQUITTO_BIN = Path("/usr/sbin/mosquitto")
MOSQUITTO_PUB = shutil.which("mosquitto_pub")
BROKER_START_TIMEOUT_S = 10.0
BROKER_STOP_TIMEOUT_S = 5.0
ACCEPT_POLL_S = 0.02
ARTIFACT_SHAPE, ARTIFACT_CLASSES = (1, 28, 28), 10
"""The input shape and classes of the ``artifacts`` fixture's model."""
WAIT_POLL_S = 0.05

T = TypeVar("T")
CI = os.environ.get("CI") == "true"
"""A CI run: what a test needs from the machine must be there (a skipped test did not run)."""
NEEDS_MARKER = "needs"

if importlib.util.find_spec("torch") is not None:  # a server or dev install
    import torch

    # Multi-threaded MKL spins under load: on 2 shared cores one thread is both faster and repeatable.
    torch.set_num_threads(1)


def require(missing: str | None) -> None:
    """The one rule for a test that needs something from the machine (a binary, root, a memory controller, a
    dataset folder): ``missing`` None means it is there; otherwise ``missing`` says what to install or enable, and
    the test fails with it under CI=true (a CI step that skips did not run) or skips with it elsewhere."""
    if missing is None:
        return
    if CI:
        pytest.fail(f"CI=true and this machine lacks what the test needs: {missing}", pytrace=False)
    pytest.skip(missing)


def needs(missing: str | None) -> pytest.MarkDecorator:
    """``require(missing)`` as a mark, checked before the test's fixtures are set up: for a test, a class, or a
    module's ``pytestmark``."""
    return getattr(pytest.mark, NEEDS_MARKER)(missing)


def missing_binary(name: str, package: str, path: Path | None = None) -> str | None:
    """None when ``name`` is at ``path`` (where the test runs it from), or on PATH when no path is given; else what
    to install."""
    if (path.exists() if path is not None else shutil.which(name) is not None):
        return None
    return f"{name} not found (apt-get install {package}; scripts/setup.sh installs it)"


def missing_fmnist() -> str | None:
    """None when Debian's Fashion-MNIST files are in their folder; else what to install."""
    from server.data.datasets import FMNIST_DIR, FMNIST_FILES, FMNIST_PACKAGE

    absent = [name for pair in FMNIST_FILES.values() for name in pair if not (FMNIST_DIR / name).is_file()]
    return f"Fashion-MNIST {absent} not in {FMNIST_DIR} (apt-get install {FMNIST_PACKAGE})" if absent else None


def missing_root(why: str) -> str | None:
    """None when this process is root; else that the test must run as root, and ``why``."""
    return None if os.geteuid() == 0 else f"run as root: {why}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{NEEDS_MARKER}(missing): what the test needs from the machine, None when "
                                       "it is there (conftest.needs: skipped locally, a failure under CI=true)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(NEEDS_MARKER):
        require(*mark.args)


_skipped: list[str] = []
"""The node ids of this session's skipped tests."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if CI:
        session.exitstatus, why = ci_verdict(exitstatus, _skipped)
        if why is not None:
            session.config.get_terminal_writer().line(why, red=True)


def ci_verdict(exitstatus: int, skipped: list[str]) -> tuple[int, str | None]:
    """The session's exit status under CI=true, and a line naming the skipped tests (None: none skipped). A session
    that ran no test already fails (pytest's exit 5); one that skipped a test fails too: it did not run them all."""
    if not skipped:
        return exitstatus, None
    return (pytest.ExitCode.TESTS_FAILED if exitstatus == pytest.ExitCode.OK else exitstatus,
            f"CI=true: {len(skipped)} test(s) skipped, so this step did not run them all: {', '.join(skipped[:10])}"
            + (" ..." if len(skipped) > 10 else ""))


def _ours(handler: logging.Handler) -> bool:
    """Not one of pytest's own capture handlers (those it adds and removes around each test phase)."""
    return not type(handler).__module__.startswith("_pytest")


@pytest.fixture(autouse=True)
def restored_logging() -> Iterator[None]:
    """The root logger's handlers and level as they were before the test: a CLI run in-process installs its
    console and run-log handlers, which must not outlive the test (nor log into a closed capture file), and its
    log budget, which would hold back the lines a later test counts."""
    root = logging.getLogger()
    before, level = [h for h in root.handlers if _ours(h)], root.level
    yield
    lift_flood_budget()
    for handler in [h for h in root.handlers if _ours(h) and h not in before]:
        root.removeHandler(handler)
        handler.close()
    for handler in before:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def wait_for(condition: Callable[[], T], timeout: float, what: str, *,
             alive: Callable[[], None] | None = None, poll_s: float = WAIT_POLL_S) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail naming ``what`` once
    ``timeout`` seconds passed. ``alive``, called before each poll, raises to fail early (the process that should
    bring the condition about has died)."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)


def assert_bad_input(done: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """A command refused its input as a user's mistake: exit status 2, no traceback, and a last stderr line that
    holds every fragment."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, last


@pytest.fixture(scope="session")
def shared_artifact_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One artifact cache for the whole session. Sets are keyed by a hash of all that shapes them (kind, model,
    ranks, shapes) and written by an atomic rename, so every test that only reads artifacts shares one compile of
    each; a test that damages or deletes artifacts keeps its own cache."""
    return tmp_path_factory.getbasetemp() / "artifact-cache"


@pytest.fixture(scope="module", params=KINDS)
def artifacts(request: pytest.FixtureRequest, shared_artifact_cache: Path) -> object:
    """The ArtifactSet of fedavgcnn (seed 0) at rank ratio 0.5 on ARTIFACT_SHAPE, ARTIFACT_CLASSES, of each
    runtime kind in turn; read-only."""
    from export.artifacts import build_artifacts_of_kind  # torch: a server dependency
    from fedcore.lowrank import RankPlan, resolve_plan
    from fedcore.models import build_model

    model = build_model("fedavgcnn", ARTIFACT_SHAPE, ARTIFACT_CLASSES, seed=0)
    ranks = resolve_plan(model, RankPlan(0.5)).ranks
    return build_artifacts_of_kind(request.param, model, ranks, ARTIFACT_SHAPE, ARTIFACT_CLASSES,
                                   shared_artifact_cache)


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
        proc.terminate()
        try:
            proc.wait(BROKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def start_mosquitto(tmp_path: Path) -> Iterator[Callable[..., MosquittoProcess]]:
    """Factory: start_mosquitto(password_file=, acl_file=, tls=, persistence_dir=, max_frame_bytes=) -> broker.

    Needs Debian's mosquitto (``require``).
    """
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    brokers: list[MosquittoProcess] = []
    run_as_user = "root" if os.geteuid() == 0 else None  # mosquitto would drop to a user who can't read tmp_path

    def start(*, password_file: Path | None = None, acl_file: Path | None = None, tls: TlsFiles | None = None,
              persistence_dir: Path | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
              ) -> MosquittoProcess:
        port = free_loopback_port()
        conf = write_mosquitto_conf(tmp_path / f"mosquitto-{port}.conf", port, max_frame_bytes,
                                    password_file=password_file, acl_file=acl_file, tls=tls,
                                    persistence_dir=persistence_dir, run_as_user=run_as_user)
        broker = MosquittoProcess(conf, port, tmp_path / f"mosquitto-{port}.log",
                                  scheme="mqtts" if tls else "mqtt")
        brokers.append(broker)
        broker.start()
        return broker

    yield start
    for broker in brokers:
        broker.stop()


@contextlib.contextmanager
def attack_broker(folder: Path, max_frame_bytes: int) -> Iterator[MosquittoProcess]:
    """A mosquitto for a module's attack scenario (conf and log in ``folder``) and ``mosquitto_pub`` to attack
    it with (``require``)."""
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


@pytest.fixture
def mosquitto_broker(start_mosquitto: Callable[..., MosquittoProcess]) -> MosquittoProcess:
    """A running anonymous mosquitto; `.url`, `.stop()`, `.start()` (same port)."""
    return start_mosquitto()


@pytest.fixture
def embedded_broker() -> Iterator[object]:
    """A running in-process amqtt broker on a free loopback port; `.url`."""
    from server.mqtt.embedded_broker import EmbeddedBroker  # amqtt: a server dependency

    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(params=["embedded", "mosquitto"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """URL of each broker kind in turn, for behaviour both must share."""
    return request.getfixturevalue(f"{request.param}_broker").url
