"""scripts/bench_packet_reads.py, its smallest run: every update's packets read and joined, the reader's CPU timed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS


def test_two_updates_are_read_whole_and_timed(tmp_path: Path):
    out = tmp_path / "packet_reads.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_packet_reads.py"), "--updates", "2", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cpu"]  # the CPU the figures are of
    (row,) = result["rounds"]
    assert row["updates"] == 2 and row["mb"] > 4.4 and row["reader_cpu_s"] > 0, row


def test_zero_updates_exits_2_naming_the_flag():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_packet_reads.py"), "--updates", "0"],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 2 and "--updates" in done.stderr and "Traceback" not in done.stderr, done.stderr
