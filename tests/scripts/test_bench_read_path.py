"""scripts/bench_read_path.py, its smallest run: every sealed update opened and folded, CPU seconds per phase."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS


def test_five_updates_are_opened_folded_and_timed_per_phase(tmp_path: Path):
    out = tmp_path / "read_path.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_read_path.py"), "--clients", "5", "--rounds", "1",
                           "--profile", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rounds"]
    assert row["update_bytes"] > 0 and row["envelope_bytes"] > row["update_bytes"], row
    assert row["cpu_s"] > 0 and row["open_cpu_s"] + row["receive_cpu_s"] + row["close_cpu_s"] <= row["cpu_s"] + 1e-6
    assert "open_with_status" in result["profile"]


def test_the_rounds_own_messages_are_timed_apart_from_the_read_path(tmp_path: Path):
    out = tmp_path / "read_path.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_read_path.py"), "--clients", "5", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rounds"]
    assert row["tasks_cpu_s"] > 0 and row["receipts_cpu_s"] > 0, row
    assert row["messages_cpu_s"] == row["tasks_cpu_s"] + row["receipts_cpu_s"], row
    assert row["join_cpu_s"] + row["open_cpu_s"] + row["receive_cpu_s"] + row["close_cpu_s"] == \
        pytest.approx(row["cpu_s"], abs=1e-6), row  # the receipts are not in the read path's CPU


def test_the_updates_come_in_frames_of_the_size_asked(tmp_path: Path):
    out = tmp_path / "read_path.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_read_path.py"), "--clients", "2", "--rounds", "1",
                           "--frame-bytes", "1048576", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(out.read_text())["frame_bytes"] == 1048576


def test_a_frame_no_larger_than_its_header_exits_2_naming_the_flag(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_read_path.py"), "--frame-bytes", "10"],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and "--frame-bytes" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_zero_clients_exits_2_naming_the_flag(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_read_path.py"), "--clients", "0"],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and "--clients" in done.stderr and "Traceback" not in done.stderr, done.stderr
