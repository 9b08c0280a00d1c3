"""Shared test fixtures: one compute thread per test process, the root logger restored after each test, the one
rule for what a test needs from the machine (tests/support/machine.py: skipped here, a failure under CI=true), the
broker fixtures (a mosquitto subprocess restartable on its port, the embedded amqtt broker, a TLS test CA), the
endpoint factory and the artifact cache kept between runs. The helpers they wrap, and what test modules share,
live in tests/support/ (no test module imports another, nor this file).

Nothing here imports torch or the server's dependencies at load time, so the device-only tests also run on
a device-only install (numpy, onnxruntime, paho-mqtt)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from device_runtime.artifact_contract import KINDS
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES
from device_runtime.log_budget import lift_flood_budget
from device_runtime.transport import OUTBOUND_WINDOW, MqttEndpoint
from server.mqtt.mosquitto_config import TlsFiles, write_mosquitto_conf
from tests.support.artifact_cache import ARTIFACT_CLASSES, ARTIFACT_SHAPE, session_cache
from tests.support.broker import MOSQUITTO_BIN, MosquittoProcess, free_loopback_port
from tests.support.endpoints import endpoint_factory
from tests.support.machine import CI, NEEDS_MARKER, ci_verdict, missing_binary, require
from tests.support.tls import make_tls_files

if importlib.util.find_spec("torch") is not None:  # a server or dev install
    import torch

    # Multi-threaded MKL spins under load: on 2 shared cores one thread is both faster and repeatable.
    torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def shared_artifact_cache() -> Path:
    """The artifact cache kept between runs (tests/support/artifact_cache.py: keyed by the compiler's code and
    each set's shape hash), shared by every test that only reads artifacts; a test that damages or deletes
    artifacts works on a private copy or keeps its own cache."""
    return session_cache()


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


@pytest.fixture
def start_mosquitto(tmp_path: Path) -> Iterator[Callable[..., MosquittoProcess]]:
    """Factory: start_mosquitto(password_file=, acl_file=, tls=, persistence_dir=, max_frame_bytes=, max_inflight=)
    -> broker.

    Needs mosquitto (``require``: a skip here, a failure under CI=true).
    """
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    brokers: list[MosquittoProcess] = []
    run_as_user = "root" if os.geteuid() == 0 else None  # mosquitto would drop to a user who can't read tmp_path

    def start(*, password_file: Path | None = None, acl_file: Path | None = None, tls: TlsFiles | None = None,
              persistence_dir: Path | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
              max_inflight: int = OUTBOUND_WINDOW) -> MosquittoProcess:
        port = free_loopback_port()
        conf = write_mosquitto_conf(tmp_path / f"mosquitto-{port}.conf", port, max_frame_bytes,
                                    password_file=password_file, acl_file=acl_file, tls=tls,
                                    persistence_dir=persistence_dir, run_as_user=run_as_user,
                                    max_inflight=max_inflight)
        broker = MosquittoProcess(conf, port, tmp_path / f"mosquitto-{port}.log",
                                  scheme="mqtts" if tls else "mqtt")
        brokers.append(broker)
        broker.start()
        return broker

    yield start
    for broker in brokers:
        broker.stop()


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


@pytest.fixture
def connect() -> Iterator[Callable[..., MqttEndpoint]]:
    """Factory: connect(client_id, url, **kwargs) -> started endpoint, connected unless wait=False."""
    with endpoint_factory() as make:
        yield make


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A test CA and a server certificate for 127.0.0.1 that it signed."""
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> object:
    """The hostile world of tests/support/hostile_world.py, one per module (its plans' artifacts from the shared
    cache)."""
    from tests.support.hostile_world import build_world  # torch: a server dependency

    return build_world(tmp_path_factory.mktemp("hostile"), shared_artifact_cache)


@pytest.fixture(scope="module")
def dense_artifacts(shared_artifact_cache: Path):
    """A dense fedavgcnn 1x28x28 (seed 0) and its onnxruntime-training artifacts, from the shared cache."""
    from export.artifacts import build_artifacts  # torch: a server dependency
    from fedcore.models import build_model

    model = build_model("fedavgcnn", (1, 28, 28), 10, seed=0)
    return model, build_artifacts(model, {}, (1, 28, 28), 10, shared_artifact_cache)
