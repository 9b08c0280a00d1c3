"""scripts/fleet_load.py, its smallest run: 20 simulated devices, 2 rounds, one mosquitto, the real server process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS

DEVICES, ROUNDS = 20, 2
TASK_BYTES = 16 * 1024
"""What the issue allows a device's TASK (and its share of the rest) on top of the round's payloads."""


@pytest.mark.slow
def test_twenty_devices_two_rounds_over_mosquitto_every_update_folded_payloads_once_per_plan(tmp_path: Path):
    out = tmp_path / "fleet.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "fleet_load.py"), "--devices", str(DEVICES), "--rounds",
                           str(ROUNDS), "--broker", "mosquitto", "--aggregators", "0", "--delay-mean", "0.2",
                           "--churn", "0.1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:
        assert r["devices"] == r["updates_folded"] == DEVICES and r["lost"] == 0, r
        assert r["plan_payload_bytes"] > 0 and r["server_peak_rss_mb"] > 0 and r["server_cpu_s"] > 0, r
        assert 0 < r["server_main_thread_cpu_s"] <= r["server_cpu_s"], r
        ratio = r["server_cpu_ms_per_update"] / r["read_path_cpu_ms_per_update"]
        assert r["server_to_read_path"] == pytest.approx(ratio) and ratio > 0, r
        assert r["server_bytes_out"] <= 1.1 * r["plan_payload_bytes"] + DEVICES * TASK_BYTES, r
    assert result["device_totals"]["updates"] >= DEVICES * ROUNDS
    assert [r["round"] for r in result["read_path"]["rounds"]] == list(range(1, ROUNDS + 1))  # measured in this run


@pytest.mark.slow
def test_together_every_device_answers_at_one_release_and_the_read_window_is_inside_the_round(tmp_path: Path):
    out = tmp_path / "fleet.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "fleet_load.py"), "--devices", "10", "--rounds", "1",
                           "--processes", "2", "--together", "--delay-mean", "0", "--broker", "mosquitto",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=1200, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (r,) = json.loads(out.read_text())["rounds"]
    assert r["devices"] == r["updates_folded"] == 10 and r["lost"] == 0, r
    assert 0 < r["read_seconds"] < r["seconds"], r  # from the release (after every task) to the round's close
    assert r["read_to_broker"] == pytest.approx(r["read_mb_per_s"] / r["broker_only_mb_per_s"]), r
    assert "read / broker-only" in done.stdout


def test_together_with_churn_exits_2_naming_both_flags(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "fleet_load.py"), "--devices", "10", "--together",
                           "--churn", "0.1", "--out", str(tmp_path / "fleet.json")],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and "--together" in done.stderr and "--churn" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
