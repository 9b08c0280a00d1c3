"""docs/your_model.md's worked example as a test: an example model file federated over MQTT by
`python -m server.broker_loop` with three local device processes on three rank tiers, its tiers measured on the
first run (``server.tier_measurement``) into a fresh user cache; and each example's devices in memory cgroups,
charged no more than the need their tier was chosen by. Slow: the measuring and the compiles take minutes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from server import broker_loop
from server.engine import cost_model
from server.mqtt.cgroups import available
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.machine import needs
from tests.support.scripts import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
TIERS = {"dev_000": 1.0, "dev_001": 0.5, "dev_002": 0.25}
ROUNDS = 2
bench = load_script("bench_model_mqtt")  # its reading of a run's server.log


def token_dataset(path: Path) -> str:
    """Sequences of 12 ids of a 64-id vocabulary whose first 4 ids hint at the class (docs/your_model.md's)."""
    rng = np.random.default_rng(0)
    y = np.arange(600) % 3
    x = rng.integers(0, 64, (600, 12))
    x[:, :4] = y[:, None] * 20 + rng.integers(0, 20, (600, 4))
    np.savez(path, x_train=x[:450], y_train=y[:450], x_test=x[450:], y_test=y[450:], vocabulary=np.int64(64))
    return f"npz:{path}"


def federate(tmp_path: Path, monkeypatch, example: str, dataset: str, *flags: str) -> tuple[int, Path]:
    """``python -m server.broker_loop`` on examples/EXAMPLE.py with three local devices on TIERS, its tiers measured
    into a fresh user cache: the exit status and the run's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    cost_model._shipped.cache_clear()
    overrides = tmp_path / "tiers.json"
    overrides.write_text(json.dumps(TIERS))
    out = tmp_path / "run"
    status = broker_loop.main([
        "--model", str(REPO_ROOT / "examples" / f"{example}.py") + ":build", "--dataset", dataset,
        "--max-samples", "600", "--local-devices", "3", "--rounds", str(ROUNDS), "--local-epochs", "1",
        "--rank-tiers", "1,0.5,0.25", "--rank-overrides", str(overrides), "--round-deadline", "300",
        "--cache-dir", str(tmp_path / "artifacts"), "--out", str(out), *flags])
    cost_model._shipped.cache_clear()
    return status, out


@pytest.mark.slow
def test_an_example_model_federates_over_mqtt_on_three_tiers_measured_on_its_first_run(tmp_path, monkeypatch):
    status, out = federate(tmp_path, monkeypatch, "tiny_transformer", "digits", "--local-memory-mb", "512",
                           "--join-timeout", "600")
    assert status == 0
    records = [r for r in read_metrics(out / METRICS_FILE) if r.get("accuracy") is not None]
    assert len(records) == ROUNDS
    measured = json.loads((tmp_path / "user-cache" / "fedara-edge" / "cost_model.json").read_text())["entries"]
    assert sorted(e["ratio"] for e in measured) == [0.25, 0.5, 1.0]
    assert all(e["model"].startswith("graphs-") and e["input_shape"] == [1, 28, 28] for e in measured)
    log = (out / "server.log").read_text()
    assert all(f"{device}: tier {ratio:g}," in log or f"{device} joined: budget 512.0 MiB, ratio {ratio:g}" in log
               for device, ratio in TIERS.items())


@pytest.mark.slow
@pytest.mark.cgroup
@pytest.mark.timeout(1200)  # compiling and measuring three tiers: minutes each on a loaded machine
@needs(available())
@pytest.mark.parametrize("example", ["dscnn", "resnet8", "token_classifier"])
def test_an_example_models_devices_in_memory_cgroups_are_charged_less_than_the_need_of_their_tier(
        example, tmp_path, monkeypatch):
    dataset = token_dataset(tmp_path / "tokens.npz") if example == "token_classifier" else "digits"
    status, out = federate(tmp_path, monkeypatch, example, dataset, "--local-memory-limit-mb", "400",
                           "--join-timeout", "900")
    assert status == 0
    assert len([r for r in read_metrics(out / METRICS_FILE) if r.get("accuracy") is not None]) == ROUNDS
    devices = bench.device_lines((out / "server.log").read_text())  # each device's tier, need and cgroup peak
    assert {device: seen.get("tier") for device, seen in devices.items()} == TIERS
    assert all(0 < devices[d].get("peak_mb", 0) < devices[d]["need_mb"] for d in TIERS)
