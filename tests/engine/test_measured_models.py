"""A model nobody measured: its tiers' measurements kept in the user's cost-model file, keyed by the fingerprint
of its graphs, read beside the shipped zoo's by every prediction."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from server.engine import cost_model
from server.engine.cost_model import CostModelError, add_measured, has_measurements, measured_path, predict
from server.tier_measurement import cost_entry


@dataclass(frozen=True)
class Device:
    probe_gflops: float = 50.0
    threads: int = 1


WORKER_RESULT = {"probe_gflops": 100.0, "step_ms": {"p50": 2.0},
                 "rounds": {"16": {"seconds": 1.0, "steps": 10, "peak_rss_bytes": 80 << 20},
                            "64": {"seconds": 1.0, "steps": 4, "peak_rss_bytes": 96 << 20}}}


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cost_model._shipped.cache_clear()
    yield tmp_path
    cost_model._shipped.cache_clear()


def test_a_worker_result_becomes_an_entry_with_both_batch_sizes():
    entry = cost_entry(WORKER_RESULT, "graphs-abc", (3, 20), 0.5)
    assert entry["peak_mb"] == {"16": 80.0, "64": 96.0}
    assert entry["step_ms"] == {"1": {"16": 2.0, "64": 2.0 * (1.0 / 4) / (1.0 / 10)}}
    assert entry["input_shape"] == [3, 20] and entry["probe_gflops"] == 100.0


def test_measured_entries_are_predicted_beside_the_zoo_from_the_user_cache(user_cache):
    with pytest.raises(CostModelError, match="no measurements for graphs-abc 3x20"):
        predict("graphs-abc", (3, 20), 0.5, 16, Device())
    add_measured([cost_entry(WORKER_RESULT, "graphs-abc", (3, 20), r) for r in (1.0, 0.5)], "test")
    assert measured_path() == user_cache / "fedara-edge" / "cost_model.json"
    prediction = predict("graphs-abc", (3, 20), 0.75, 16, Device())
    assert prediction.peak_mb == 80.0 and prediction.step_ms == pytest.approx(2.0 * 100.0 / 50.0)
    assert has_measurements("graphs-abc", (3, 20), [1.0, 0.5]) and not has_measurements("graphs-abc", (3, 20), [0.25])
    assert has_measurements("fedavgcnn", (1, 28, 28), [1.0])


def test_a_tier_measured_again_replaces_its_entry(user_cache):
    add_measured([cost_entry(WORKER_RESULT, "graphs-abc", (7,), 1.0)], "test")
    bigger = dict(WORKER_RESULT, rounds={k: dict(v, peak_rss_bytes=v["peak_rss_bytes"] * 2)
                                         for k, v in WORKER_RESULT["rounds"].items()})
    add_measured([cost_entry(bigger, "graphs-abc", (7,), 1.0)], "test")
    assert predict("graphs-abc", (7,), 1.0, 16, Device()).peak_mb == 160.0


def test_a_damaged_user_cache_counts_as_empty(user_cache):
    measured_path().parent.mkdir(parents=True)
    measured_path().write_text("{not json")
    assert has_measurements("fedavgcnn", (1, 28, 28), [1.0]) and not has_measurements("graphs-abc", (7,), [1.0])


def test_a_tier_that_fails_the_parity_gate_is_refused_in_one_line_naming_model_and_tier(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from export.step_compiler import ParityError
    from server import tier_measurement

    def fails(*args, **kwargs):
        raise ParityError("compiled step differs from PyTorch by 2e-05 (> 1e-05) at fe.x.u.next, batch 6")

    monkeypatch.setattr(tier_measurement, "build_artifacts_of_kind", fails)
    with pytest.raises(ValueError, match=r"^--model mine.py:build at rank ratio 0.5: compiled step differs") as caught:
        tier_measurement.build_tier("onnxruntime", SimpleNamespace(name="mine.py:build", num_classes=3), 0.5, {},
                                    (4,), tmp_path)
    assert "\n" not in str(caught.value)


def test_a_new_step_form_for_a_models_ops_is_a_new_measured_key_and_other_models_keep_theirs(monkeypatch):
    from export import step_compiler
    from server.tier_measurement import measured_key
    from tests.support.edge_models import ds_cnn, resnet8

    depthwise, plain = ds_cnn((1, 12, 10)), resnet8((1, 8, 8))
    before = measured_key(depthwise, (1, 12, 10)), measured_key(plain, (1, 8, 8))
    monkeypatch.setattr(step_compiler, "DEPTHWISE_FORM_VERSION", step_compiler.DEPTHWISE_FORM_VERSION + 1)
    assert measured_key(depthwise, (1, 12, 10)) != before[0] and measured_key(plain, (1, 8, 8)) == before[1]
    assert before[0].startswith("graphs-")


def test_a_new_way_of_measuring_is_a_new_measured_key(monkeypatch):
    """Tiers measured by an older device worker (one that held memory no device holds) are measured again."""
    from server import tier_measurement
    from tests.support.edge_models import resnet8

    model = resnet8((1, 8, 8))
    before = tier_measurement.measured_key(model, (1, 8, 8))
    monkeypatch.setattr(tier_measurement, "MEASUREMENT_VERSION", tier_measurement.MEASUREMENT_VERSION + 1)
    assert tier_measurement.measured_key(model, (1, 8, 8)) != before
