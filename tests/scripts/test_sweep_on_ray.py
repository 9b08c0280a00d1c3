"""The sweeps with --ray on a two-node Ray cluster on loopback (tests/support/ray_cluster.py): every run's result
equals its --jobs 1 run's (but the wall time). scripts/bench_accuracy.py's with the second node killed while it runs a
sweep's run; scripts/bench_privacy.py's and scripts/bench_async.py's on the whole cluster."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.machine import needs
from tests.support.processes import child_env
from tests.support.ray_cluster import missing_loopback_namespace, short_temp, two_node_run

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "bench_accuracy.py"
PRIVACY_SWEEP = ["--epsilons", "8,inf", "--settings", "hetero", "--seeds", "2", "--clients", "20", "--rounds", "2",
                 "--join-ratio", "0.5", "--max-samples", "400", "--min-samples", "10", "--local-epochs", "1",
                 "--dp-test-seed", "7"]  # DP's noise from the OS's generator would differ run to run
ASYNC_SWEEP = ["--seeds", "2", "--dataset", "digits", "--max-samples", "300", "--clients", "8", "--rounds", "2",
               "--min-samples", "10", "--buffer-size", "4", "--concurrency", "4"]
SWEEP = ["--quick", "--study", "lambda"]
TIMED = ("wall_s", "cpu_s", "seconds")


def untimed(value):
    """``value`` without its wall-clock fields, at any depth."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if k not in TIMED}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def runs(out_dir: Path) -> dict[str, dict]:
    document = json.loads((out_dir / "accuracy.json").read_text())
    assert document["complete"] and document["failed"] == []
    return {run["command"]: untimed(run) for run in document["runs"]}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs(missing_loopback_namespace())
def test_a_sweep_on_two_nodes_with_one_killed_gives_every_runs_one_process_result(tmp_path):
    with short_temp() as temp:
        result = two_node_run(temp, [sys.executable, str(SCRIPT), *SWEEP, "--out-dir", str(tmp_path / "ray")],
                              kill_when="_call", kill_after="sweep: 1/")
    assert result["returncode"] == 0, result["output"][-3000:]
    assert result["killed_busy"] and "sweep: 6/6 done, 0 running, 0 queued" in result["output"]
    done = subprocess.run([sys.executable, str(SCRIPT), *SWEEP, "--jobs", "1", "--out-dir", str(tmp_path / "one")],
                          capture_output=True, text=True, timeout=900, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert runs(tmp_path / "ray") == runs(tmp_path / "one")


def one_process_and_cluster(tmp_path: Path, script: Path, sweep: list[str]) -> tuple[dict, dict]:
    """The sweep's document with --jobs 1 here and with --ray on a two-node cluster (no node killed)."""
    one, ray = tmp_path / "one.json", tmp_path / "ray.json"
    done = subprocess.run([sys.executable, str(script), *sweep, "--jobs", "1", "--out", str(one)],
                          capture_output=True, text=True, timeout=900, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    with short_temp() as temp:
        result = two_node_run(temp, [sys.executable, str(script), *sweep, "--out", str(ray)])
    assert result["returncode"] == 0, result["output"][-3000:]
    assert "0 running, 0 queued" in result["output"]
    return json.loads(one.read_text()), json.loads(ray.read_text())


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs(missing_loopback_namespace())
def test_the_privacy_sweep_on_a_cluster_gives_every_runs_one_process_result(tmp_path):
    one, ray = one_process_and_cluster(tmp_path, SCRIPTS / "bench_privacy.py", PRIVACY_SWEEP)
    assert ray["failed"] == [] and len(ray["runs"]) == 4
    assert untimed(ray["runs"]) == untimed(one["runs"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs(missing_loopback_namespace())
def test_the_async_sweep_on_a_cluster_gives_every_runs_one_process_result(tmp_path):
    one, ray = one_process_and_cluster(tmp_path, SCRIPTS / "bench_async.py", ASYNC_SWEEP)
    assert ray["failed"] == [] and ray["seeds_left_out"] == []
    assert untimed(ray["results"]) == untimed(one["results"])
