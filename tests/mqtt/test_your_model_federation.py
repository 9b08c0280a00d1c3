"""docs/your_model.md's worked example as a test: an example model file federated over MQTT by
`python -m server.broker_loop` with three local device processes on three rank tiers, its tiers measured on the
first run (``server.tier_measurement``) into a fresh user cache. Slow: the measuring and the compiles take minutes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from server import broker_loop
from server.engine import cost_model
from server.outputs.report import METRICS_FILE, read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
TIERS = {"dev_000": 1.0, "dev_001": 0.5, "dev_002": 0.25}
ROUNDS = 2


@pytest.mark.slow
def test_an_example_model_federates_over_mqtt_on_three_tiers_measured_on_its_first_run(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    cost_model._shipped.cache_clear()
    overrides = tmp_path / "tiers.json"
    overrides.write_text(json.dumps(TIERS))
    out = tmp_path / "run"
    status = broker_loop.main([
        "--model", str(REPO_ROOT / "examples" / "tiny_transformer.py") + ":build", "--dataset", "digits",
        "--max-samples", "600", "--local-devices", "3", "--rounds", str(ROUNDS), "--local-epochs", "1",
        "--rank-tiers", "1,0.5,0.25", "--rank-overrides", str(overrides), "--local-memory-mb", "512",
        "--join-timeout", "600", "--round-deadline", "300", "--cache-dir", str(tmp_path / "artifacts"),
        "--out", str(out)])
    cost_model._shipped.cache_clear()
    assert status == 0
    records = [r for r in read_metrics(out / METRICS_FILE) if r.get("accuracy") is not None]
    assert len(records) == ROUNDS
    measured = json.loads((tmp_path / "user-cache" / "fedara-edge" / "cost_model.json").read_text())["entries"]
    assert sorted(e["ratio"] for e in measured) == [0.25, 0.5, 1.0]
    assert all(e["model"].startswith("graphs-") and e["input_shape"] == [1, 28, 28] for e in measured)
    log = (out / "server.log").read_text()
    assert all(f"{device}: tier {ratio:g}," in log or f"{device} joined: budget 512.0 MiB, ratio {ratio:g}" in log
               for device, ratio in TIERS.items())
