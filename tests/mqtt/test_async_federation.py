"""``python -m server.broker_loop --mode async`` end to end: real device processes over the embedded broker, the async
engine deciding (tasks as devices come free, a version every --buffer-size updates), a run resumed from its
checkpoint, a device stopped with SIGSTOP that does not hold the fleet back, and DP buffers that stop at the privacy
budget and keep their accounting across a resume.

Small on purpose (digits, 600 samples, 3 devices, 1 epoch, batch 32, one thread each)."""
from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from server import broker_loop
from server.engine.accountant import epsilon
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.waiting import wait_for

QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--local-devices", "3"]
ASYNC = ["--mode", "async", "--buffer-size", "2", "--concurrency", "3"]
BOUNDED = ["--join-timeout", "300", "--round-deadline", "300"]  # a broken run fails instead of hanging
VERSIONS = 3
WAIT_S = 300.0


def federate(out: Path, cache: Path, *extra: str) -> list[dict]:
    """Run the async broker loop in this process; returns its metrics."""
    assert broker_loop.main([*QUICK, *ASYNC, *BOUNDED, "--cache-dir", str(cache), "--out", str(out), *extra]) == 0
    return read_metrics(out / METRICS_FILE)


def fedbuff_state(run: Path) -> dict:
    return load_checkpoint(run / CHECKPOINT_NAME).state["engine"]["async"]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> Path:
    run = tmp_path_factory.mktemp("async") / "run"
    federate(run, shared_artifact_cache, "--rounds", str(VERSIONS))
    return run


@pytest.mark.slow
def test_an_async_run_makes_its_versions_each_a_row_on_the_wall_clock(async_run: Path):
    rows = read_metrics(async_run / METRICS_FILE)
    assert [(r["round"], r["mode"], r["participants"]) for r in rows] == [(v, "async", 2) for v in (1, 2, 3)]
    assert all(r["sim_time"] > 0 for r in rows) and [r["sim_time"] for r in rows] == sorted(r["sim_time"] for r in rows)
    assert rows[-1]["evaluated"] == 3  # after the last version every device evaluates it
    saved = load_checkpoint(async_run / CHECKPOINT_NAME)
    assert saved.state["finished"] and fedbuff_state(async_run)["fedbuff"]["version"] == VERSIONS


@pytest.mark.slow
def test_an_async_run_over_mqtt_says_every_version_and_every_versions_accuracy(async_run: Path):
    log = (async_run / broker_loop.SERVER_LOG).read_text().splitlines()
    made = [line.split(" version ")[1].split()[0] for line in log if "fedara.progress INFO version " in line]
    said = [line.split("accuracy after version ")[1].split(":")[0] for line in log if "accuracy after version " in line]
    rows = read_metrics(async_run / METRICS_FILE)
    assert made == [f"{v}/{VERSIONS}" for v in range(1, VERSIONS + 1)]
    assert said == [str(r["round"]) for r in rows] == [str(v) for v in range(1, VERSIONS + 1)]  # "–": none evaluated it



@pytest.mark.slow
def test_an_async_devices_models_are_named_by_the_version_they_came_from(async_run: Path):
    for device in sorted((async_run / broker_loop.DEVICES_DIR).iterdir()):
        if device.is_dir():
            names = [p.name.split("-", 1)[1] for p in sorted((device / "models").iterdir())]
            assert names and all(n.startswith("version") for n in names), names
            assert names[-1] == f"version{VERSIONS}"  # the last version, every device evaluates it


@pytest.mark.slow
def test_a_resumed_async_run_continues_its_versions_and_task_numbers(async_run: Path, tmp_path: Path,
                                                                    shared_artifact_cache: Path):
    run = tmp_path / "run"
    shutil.copytree(async_run, run)
    before = fedbuff_state(run)["fedbuff"]
    rows = federate(run, shared_artifact_cache, "--rounds", str(VERSIONS + 2), "--resume")
    assert rows[:VERSIONS] == read_metrics(async_run / METRICS_FILE)
    assert [r["round"] for r in rows] == list(range(1, VERSIONS + 3))
    after = fedbuff_state(run)["fedbuff"]
    assert after["version"] == VERSIONS + 2 and after["next_task"] > before["next_task"]


def child_pid(device_id: str) -> int | None:
    """The pid of this process's child running ``device_id`` (a local device process), None: none yet."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and device_id.encode() in command:
            return int(entry.name)
    return None


@pytest.mark.slow
def test_a_device_stopped_with_sigstop_does_not_hold_the_fleet_back(tmp_path: Path, shared_artifact_cache: Path):
    """dev_002 is stopped as soon as it is ready (it gets a task at once: --concurrency is the fleet): the other two
    make every version; --task-timeout ends its task, so the final evaluation does not wait for it either."""
    run, stopped, failures = tmp_path / "run", [], []

    def stop_when_ready() -> None:
        try:
            log = run / broker_loop.SERVER_LOG
            wait_for(lambda: log.exists() and "dev_002 is ready" in log.read_text(), WAIT_S, "dev_002 ready")
            pid = wait_for(lambda: child_pid("dev_002"), WAIT_S, "dev_002's process")
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    watcher = threading.Thread(target=stop_when_ready, daemon=True)
    watcher.start()
    rows = federate(run, shared_artifact_cache, "--rounds", "4", "--task-timeout", "10")
    watcher.join(WAIT_S)
    assert not failures and stopped
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert fedbuff_state(run)["timeouts"]["count"] >= 1  # its task ended by --task-timeout
    assert "dev_002: [timed_out]" in (run / broker_loop.SERVER_LOG).read_text()


DP = ["--aggregate", "updates", "--dp-noise-multiplier", "1", "--dp-clip", "0.01", "--dp-accountant", "rdp"]


def versions_eps(versions: int) -> float:
    """ε after this many versions: unsampled Gaussian mechanisms, at the default δ of 3 devices."""
    return epsilon(1.0, 1.0, versions, 3 ** -1.1, "rdp")


@pytest.mark.slow
def test_dp_buffers_over_mqtt_stop_before_the_version_that_would_pass_the_target_and_resume_keeps_the_budget(
        tmp_path: Path, shared_artifact_cache: Path, capsys: pytest.CaptureFixture[str]):
    """One version, then a resume that may make 5: it makes the second and stops before the third (over the target),
    charging on from the first."""
    run, target = tmp_path / "run", (versions_eps(2) + versions_eps(3)) / 2
    budget = [*DP, "--dp-target-epsilon", f"{target:.6f}"]
    first = federate(run, shared_artifact_cache, "--rounds", "1", *budget)
    assert [r["epsilon"] for r in first] == pytest.approx([versions_eps(1)])
    rows = federate(run, shared_artifact_cache, "--rounds", "5", "--resume", *budget)
    assert [r["round"] for r in rows] == [1, 2]
    assert [r["epsilon"] for r in rows] == pytest.approx([versions_eps(1), versions_eps(2)])
    assert rows[-1]["epsilon"] <= target and "privacy budget: round 3 would spend" in capsys.readouterr().out
    saved = load_checkpoint(run / CHECKPOINT_NAME)
    assert saved.state["finished"] and saved.state["engine"]["privacy"]["accountant"]["rounds"] == 2
