"""server/sweep_runner.py: a sweep's runs here, in worker processes or as Ray tasks; a failed run is run once more,
then reported, never dropped; results in the items' order; a progress line (done, running, queued) per run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from server.sweep_runner import Failure, run_sweep
from tests.support.machine import needs
from tests.support.ray_cluster import missing_loopback_namespace, run_on_loopback, short_temp


def flaky(item: tuple[str, str, int]) -> str:
    """Fails its first ``fails`` attempts (counted in a file, so across processes and nodes), then answers."""
    folder, name, fails = item
    marker = Path(folder) / name
    tries = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(tries))
    if tries <= fails:
        raise RuntimeError(f"{name} fails on attempt {tries}")
    return f"{name} answered on attempt {tries}"


def items(folder: Path) -> list[tuple[str, str, int]]:
    return [(str(folder), "steady", 0), (str(folder), "flaky", 1), (str(folder), "broken", 5),
            (str(folder), "late", 0)]


EXPECTED = ["steady answered on attempt 1", "flaky answered on attempt 2", None, "late answered on attempt 1"]
BROKEN = Failure("broken", "RuntimeError: broken fails on attempt 2", 2)


def label(item: tuple[str, str, int]) -> str:
    return item[1]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_run_is_run_once_more_then_reported_and_the_others_come_back_in_order(jobs, tmp_path):
    lines: list[str] = []
    outcome = run_sweep(flaky, items(tmp_path), jobs=jobs, label=label, emit=lines.append)
    assert outcome.results == EXPECTED and outcome.failures == [BROKEN]
    assert any(line.startswith("sweep: flaky failed (RuntimeError") and "once more" in line for line in lines)
    assert lines[-1] == "sweep: 3/4 done, 0 running, 0 queued, 1 failed"


def test_progress_counts_runs_done_running_and_queued(tmp_path):
    lines: list[str] = []
    run_sweep(flaky, [(str(tmp_path), f"run{i}", 0) for i in range(3)], jobs=1, label=label, emit=lines.append)
    assert lines == ["sweep: 1/3 done, 1 running, 1 queued", "sweep: 2/3 done, 1 running, 0 queued",
                     "sweep: 3/3 done, 0 running, 0 queued"]


RAY_SWEEP = """
import json, sys
from pathlib import Path
from server.cli import LOCAL_RAY
from server.sweep_runner import run_sweep
from tests.drivers.test_sweep_runner import flaky, items, label
outcome = run_sweep(flaky, items(Path(sys.argv[1])), ray=LOCAL_RAY, label=label, emit=lambda line: None)
print(json.dumps(dict(results=outcome.results, failures=[vars(f) for f in outcome.failures])))
"""


@pytest.mark.slow
@needs(missing_loopback_namespace())
def test_on_ray_a_failed_run_is_run_once_more_then_reported(tmp_path):
    with short_temp() as temp:
        done = run_on_loopback([sys.executable, "-c", RAY_SWEEP, str(tmp_path)], temp)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["results"] == EXPECTED and outcome["failures"] == [vars(BROKEN)]
