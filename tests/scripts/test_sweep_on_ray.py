"""scripts/bench_accuracy.py --ray on a two-node Ray cluster on loopback (tests/support/ray_cluster.py), the second
node killed while it runs a sweep's run: every run's result equals its --jobs 1 run's (but the wall time)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.machine import needs
from tests.support.processes import child_env
from tests.support.ray_cluster import missing_loopback_namespace, short_temp, two_node_run

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_accuracy.py"
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
