"""scripts/fleet_load.py, its smallest run: 20 simulated devices, 2 rounds, one mosquitto, the real server process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
        assert r["server_bytes_out"] <= 1.1 * r["plan_payload_bytes"] + DEVICES * TASK_BYTES, r
    assert result["device_totals"]["updates"] >= DEVICES * ROUNDS
