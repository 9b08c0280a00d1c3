"""scripts/bench_flood.py, its smallest run: a slow flood on an id not enrolled and on an enrolled one changes no
round's participants and no bit of the final model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.broker import MOSQUITTO_BIN
from tests.support.machine import missing_binary, require
from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_flood_on_either_id_leaves_every_round_whole_and_the_model_bit_identical(tmp_path: Path,
                                                                                       shared_artifact_cache: Path):
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    out = tmp_path / "flood.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_flood.py"), "--rate", "300", "--rounds", "2",
                           "--cache-dir", str(shared_artifact_cache), "--out", str(out)], capture_output=True,
                          text=True, timeout=900, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["run"] for r in runs] == ["undisturbed", "unenrolled", "enrolled"]
    assert all(r["participants"] == [3, 3] and r["model_equal"] and r["asked_again"] == 0 for r in runs), runs
    assert all(r["flood_frames"] > 0 for r in runs[1:]), runs


def test_a_rate_of_zero_exits_2_naming_the_flag():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_flood.py"), "--rate", "0"], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and "--rate" in done.stderr and "Traceback" not in done.stderr, done.stderr
