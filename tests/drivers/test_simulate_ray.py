"""``server.simulate --ray``: the devices' tasks on a Ray cluster give the metrics (but seconds) and the checkpoint
of ``--workers 1`` bit for bit (sync, async, DP, the portable backend), also when a node of a two-node cluster is
killed while it trains a device; without Ray installed, ``--ray`` is one line.

Ray runs in a network namespace with loopback alone (tests/support/ray_cluster.py); starting it takes seconds, so
every test that starts one is marked slow (.ci/run runs them, as root)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from server.ray_devices import local_plan
from server.simulate import main
from tests.support.artifact_cache import session_cache
from tests.support.machine import needs
from tests.support.processes import child_env
from tests.support.ray_cluster import missing_loopback_namespace, run_on_loopback, short_temp, two_node_run

SMALL = ["--dataset", "digits", "--clients", "6", "--rounds", "3", "--local-epochs", "2", "--batch-size", "16",
         "--max-samples", "360", "--lr", "0.05", "--lam", "1", "--lam-warmup", "1", "--seed", "3"]
FEDARA = ["--algo", "fedara", "--rank-tiers", "1.0,0.5,0.25", "--aggregate", "updates"]
ASYNC = ["--mode", "async", "--buffer-size", "2", "--concurrency", "3", "--device-speed", "lognormal:1",
         "--availability", "0.7,0.2"]
DP = ["--dp-noise-multiplier", "0.5", "--dp-clip", "0.01", "--join-ratio", "0.5", "--dp-test-seed", "7"]  # noise of std
# z·C/E = 0.0017 a coordinate: at C = 1 it swamped 3 devices' updates and the run stopped non-finite (as it should)
TIMED = ("seconds",)
"""The metrics that may differ: wall-clock time."""
on_loopback = needs(missing_loopback_namespace())


def timeless(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMED} for row in read_metrics(out / METRICS_FILE)]


def assert_same_run(ray_out: Path, one_out: Path) -> None:
    assert timeless(ray_out) == timeless(one_out)
    ray_tensors = load_checkpoint(ray_out / CHECKPOINT_NAME).tensors
    one_tensors = load_checkpoint(one_out / CHECKPOINT_NAME).tensors
    assert set(ray_tensors) == set(one_tensors) and any(k.startswith("device/") for k in ray_tensors)
    assert not [k for k in one_tensors if not np.array_equal(one_tensors[k], ray_tensors[k])]


def simulate_on_ray(out: Path, flags: list[str]) -> str:
    """``python -m server.simulate FLAGS --ray`` on a local Ray the run starts and stops; its output."""
    with short_temp() as temp:
        done = run_on_loopback([sys.executable, "-m", "server.simulate", *flags, "--out", str(out), "--ray"], temp)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@on_loopback
@pytest.mark.parametrize("flags", [pytest.param(FEDARA, id="sync"), pytest.param([*FEDARA, *ASYNC], id="async"),
                                   pytest.param([*FEDARA, *DP], id="dp"),
                                   pytest.param(["--algo", "local"], id="local-whole-model-personal"),
                                   pytest.param(["--algo", "fedrep"], id="fedrep")])
def test_ray_tasks_give_the_one_process_runs_metrics_and_checkpoint_bit_for_bit(flags, tmp_path):
    output = simulate_on_ray(tmp_path / "ray", [*SMALL, *flags])
    assert "device task(s) on 1 node(s)" in output and "MB to them" in output  # the traffic line of each round
    assert main([*SMALL, *flags, "--out", str(tmp_path / "one")]) == 0
    assert_same_run(tmp_path / "ray", tmp_path / "one")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@on_loopback
def test_ray_tasks_on_the_portable_backend_run_stock_onnxruntime_and_give_the_same_bits(tmp_path):
    flags = [*SMALL, "--rounds", "2", *FEDARA, "--backend", "portable", "--cache-dir", str(session_cache())]
    simulate_on_ray(tmp_path / "ray", flags)
    assert main([*flags, "--out", str(tmp_path / "one")]) == 0
    assert_same_run(tmp_path / "ray", tmp_path / "one")


@pytest.mark.slow
@on_loopback
def test_a_node_killed_while_it_trains_a_device_changes_nothing(tmp_path):
    """Round 1 runs on both nodes; in round 2 the second node dies mid-task and Ray runs its tasks on the head."""
    with short_temp() as temp:
        result = two_node_run(temp, [sys.executable, "-m", "server.simulate", *SMALL, *FEDARA,
                                     "--out", str(tmp_path / "ray")], kill_when="_train", kill_after="round 1/3")
    assert result["returncode"] == 0, result["output"][-3000:]
    assert result["killed_busy"] and "device task(s) on 2 node(s)" in result["output"]
    assert main([*SMALL, *FEDARA, "--out", str(tmp_path / "one")]) == 0
    assert_same_run(tmp_path / "ray", tmp_path / "one")


BROKEN_PLAN = """
from types import SimpleNamespace
from server.cli import LOCAL_RAY
from server.parallel_devices import WorkerError, WorkerSettings
from server.ray_cluster import connected
from server.ray_devices import RayDevicePool
device = SimpleNamespace(shard=None, plan_hash="broken", personal={})
with connected(LOCAL_RAY):
    pool = RayDevicePool({"dev_000": device}, {"broken": None}, WorkerSettings("torch", 1), 0.0, emit=print)
    try:
        pool.answer({"dev_000": SimpleNamespace(weights={})})
    except WorkerError as exc:
        print(exc)
"""


@pytest.mark.slow
@on_loopback
def test_an_error_in_a_ray_task_names_the_device_and_the_error():
    with short_temp() as temp:
        done = run_on_loopback([sys.executable, "-c", BROKEN_PLAN], temp)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "ray task of dev_000 failed: AttributeError: 'NoneType' object has no attribute 'artifacts'")


def test_ray_flag_without_ray_installed_is_one_line_naming_the_install_command():
    hide_ray = ("import runpy, sys; sys.modules['ray'] = None; sys.argv[0] = 'server.simulate'; "
                "runpy.run_module('server.simulate', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hide_ray, "--dataset", "digits", "--ray"], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --ray needs Ray, which is not installed") and "pip install '.[ray]'" in line


@pytest.mark.parametrize("flags, fix", [(["--ray", "--workers", "2"], "leave out --workers 2"),
                                        (["--ray", "--ray-gpus", "1.5"], "--ray-gpus must be a share")])
def test_ray_flag_mistakes_exit_2_naming_the_flag(flags, fix):
    done = subprocess.run([sys.executable, "-m", "server.simulate", "--dataset", "digits", *flags],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and fix in done.stderr and "Traceback" not in done.stderr


@dataclass(frozen=True)
class Artifacts:
    directory: Path


@dataclass(frozen=True)
class Plan:
    hash: str
    files: dict[str, bytes]
    artifacts: Artifacts


def test_a_node_without_the_drivers_artifact_folder_writes_the_plans_files_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = Plan("abc", {"manifest.json": b"{}", "step.onnx": b"graph"}, Artifacts(tmp_path / "on-the-driver-only"))
    local = local_plan(plan)
    assert local.artifacts.directory == tmp_path / "fedara-ray-plans" / "abc"
    assert {p.name: p.read_bytes() for p in local.artifacts.directory.iterdir()} == plan.files
    assert local_plan(plan) == local


def test_a_node_that_sees_the_drivers_artifact_folder_uses_it(tmp_path):
    plan = Plan("abc", {"manifest.json": b"{}"}, Artifacts(tmp_path))
    assert local_plan(plan) is plan
