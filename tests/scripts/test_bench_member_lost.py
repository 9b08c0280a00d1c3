"""scripts/bench_member_lost.py, its smallest run: four simulated devices, one member, one round, each way."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS
from tests.support.tight_member import PENDING_UPDATES

DEVICES = 4


@pytest.mark.slow
def test_a_tight_member_pushes_out_all_but_its_room_and_every_update_is_folded_all_the_same(tmp_path: Path):
    out = tmp_path / "member_lost.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_member_lost.py"), "--devices", str(DEVICES),
                           "--aggregators", "1", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    (roomy,), (tight,) = result["roomy"]["rounds"], result["tight"]["rounds"]
    assert roomy["folded"] == tight["folded"] == DEVICES and roomy["tasks_sent_again"] == 0, result
    assert roomy["aggregators_bytes_in"] < tight["aggregators_bytes_in"], result
    assert tight["aggregators_pushed_out"] >= DEVICES - PENDING_UPDATES, result
    assert tight["tasks_sent_again"] >= DEVICES - PENDING_UPDATES, result
    assert "| tight | 1 | 4 / 4 |" in done.stdout
