"""scripts/bench_secagg.py's MQTT mode: its tables from a run's figures, and (slow) one small run of real device
processes, plain and secure, whose JSON holds what the tables print."""
from __future__ import annotations

import json

import pytest

from tests.support.scripts import load_script

bench = load_script("bench_secagg")


def run_doc(secure_phases: bool) -> dict:
    phases = {p: {"bytes_in": 10 * i, "bytes_out": i, "seconds": 0.5 * i}
              for i, p in enumerate(("keys", "shares", "masked", "unmask"), 1)}
    return {"round_s": [2.0, 4.0], "server_cpu_s": 5.0, "device_cpu_s": 6.0, "device_processes": 3,
            "bytes_in": [3e6, 5e6], "bytes_out": [1e6, 1e6], "server_peak_rss_mb": 500.0,
            "device_peak_rss_mb_by_tier": {"1": [100.0, 120.0], "0.25": [90.0]},
            "secagg": [{"phases": phases}, {"phases": phases}] if secure_phases else [None, None]}


def test_the_mqtt_tables_show_each_runs_means_and_the_secure_runs_phases():
    doc = {"config": {"mqtt": 3, "rounds": 2, "memory_mb": "128,84"}, "plain": run_doc(False),
           "secure": run_doc(True)}
    text = bench.mqtt_tables(doc)
    assert "| plain | 3.00 | 5.0 | 6.0 | 2.00 | 4.00 | 1.00 |" in text
    assert "| 1 | 2 | 110.0 / 120.0 | 110.0 / 120.0 |" in text and "| server | 1 | 500.0 | 500.0 |" in text
    assert "| masked | 30 | 3 | 1.500 |" in text


@pytest.mark.slow
def test_a_small_mqtt_run_measures_plain_and_secure(tmp_path, capsys):
    out = tmp_path / "mqtt.json"
    assert bench.main(["--mqtt", "3", "--rounds", "1", "--max-samples", "300", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for name in ("plain", "secure"):
        run = doc[name]
        assert len(run["round_s"]) == 1 and run["device_processes"] == 3 and run["server_cpu_s"] > 0
        assert sum(len(v) for v in run["device_peak_rss_mb_by_tier"].values()) == 3
    (row,) = doc["secure"]["secagg"]
    assert row["aggregated"] and row["phases"]["masked"]["bytes_in"] == 3 * row["dimension"] * 4
    assert doc["plain"]["secagg"] == [None]
    assert "| secure |" in capsys.readouterr().out
