"""scripts/bench_model_mqtt.py's reading of a run, without running one (the benchmark itself is not a test; the
MQTT runs of the example models in memory cgroups are tests/mqtt/test_your_model_federation.py's)."""
from __future__ import annotations

import json

import pytest

from tests.support.scripts import load_script

bench = load_script("bench_model_mqtt")

LOG = """\
2026-12-05 07:06:58,101 fedara.engine INFO dev_000: tier 1, predicted to need 115.6 MiB
2026-12-05 07:06:58,140 fedara.engine INFO dev_001: tier 0.5, predicted to need 115.5 MiB
2026-12-05 07:08:30,614 fedara.server INFO local device dev_000: cgroup peak 106.34765625 MiB under its 400 MiB limit
2026-12-05 07:08:30,615 fedara.server INFO local device dev_001: cgroup peak 108.94921875 MiB under its 115.65 MiB limit
"""


def test_each_devices_tier_need_peak_and_limit_are_read_from_the_server_log():
    assert bench.device_lines(LOG) == {
        "dev_000": dict(tier=1.0, need_mb=115.6, peak_mb=106.34765625, limit_mb=400.0),
        "dev_001": dict(tier=0.5, need_mb=115.5, peak_mb=108.94921875, limit_mb=115.65)}


def test_a_rows_predicted_floor_is_its_tiers_charged_peak_at_batch_16_set_against_the_real_peak(tmp_path):
    cost = tmp_path / "cost_model.json"
    cost.write_text(json.dumps({"entries": [
        dict(model="graphs-x", input_shape=[1, 28, 28], ratio=1.0, peak_mb={"16": 127.0, "64": 245.0},
             step_ms={"1": {"16": 90.0, "64": 350.0}},
             floors={"onnxruntime": {"floor_mb": {"16": 100.0, "64": 200.0}}}),
        dict(model="graphs-y", input_shape=[1, 28, 28], ratio=0.5, peak_mb={"16": 1.0, "64": 1.0},
             step_ms={"1": {"16": 1.0, "64": 1.0}})]}))
    floors = bench.measured_floors(cost, "graphs-x", (1, 28, 28))
    assert list(floors) == [1.0] and floors[1.0]["floor_mb"] == {"16": 100.0, "64": 200.0}
    [row] = bench.rows(bench.device_lines(LOG.splitlines()[0] + "\n" + LOG.splitlines()[2]), floors, {1.0: 2e-6})
    assert row["tier"] == 1.0 and row["predicted_floor_mb"] == 100.0 and row["parity"] == 2e-6
    assert row["floor_vs_peak"] == pytest.approx(100.0 / 106.34765625 - 1)
