"""scripts/bench_async_mqtt.py's arms and figures, without running them (the benchmark itself is not a test)."""
from __future__ import annotations

import argparse
import json

from tests.support.scripts import load_script

bench = load_script("bench_async_mqtt")


def test_the_async_arms_spend_multiples_of_syncs_device_tasks():
    args = argparse.Namespace(rounds=10, buffer_size=3, async_multiples="1,2", task_timeout=600.0)
    arms = bench.arms(args)
    versions = {name: int(flags[flags.index("--rounds") + 1]) for name, flags in arms.items()}
    assert versions == {"sync": 10, "async x1": 20, "async x2": 40}  # 10 rounds x 6 devices = 20 x 3 updates


def test_time_to_target_is_the_first_row_reaching_it_and_the_rate_spans_first_to_last_row():
    rows = [{"sim_time": 2.0, "accuracy": 0.5}, {"sim_time": 3.0, "accuracy": None}, {"sim_time": 5.0, "accuracy": 0.9}]
    assert bench.time_to(rows, 0.8) == 5.0 and bench.time_to(rows, 0.95) is None
    assert bench.per_minute(rows) == 60.0 * 2 / 3.0


def test_the_fleet_is_mixed_rank_by_overrides_and_the_tiers_are_read_back_from_the_rows(tmp_path):
    path = bench.tier_overrides("1.0,0.5,0.25", tmp_path)
    assert json.loads(path.read_text()) == {"dev_000": 1.0, "dev_001": 0.5, "dev_002": 0.25,
                                                         "dev_003": 1.0, "dev_004": 0.5, "dev_005": 0.25}
    rows = [{"per_device": {"dev_000": {"tier": "1"}}}, {"per_device": {"dev_001": {"tier": "0.5"}}}, {}]
    assert bench.fleet_tiers(rows) == {"dev_000": "1", "dev_001": "0.5"}
