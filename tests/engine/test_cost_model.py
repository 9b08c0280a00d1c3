"""server.engine.cost_model: predictions interpolate the device benchmark's measurements and scale by the probe."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import pytest

from device_runtime.artifact_contract import PORTABLE_KIND, TRAINING_KIND
from device_runtime.profile import ResourceProfile
from server.engine.cost_model import (FLOOR_MARGIN_MB, CostModelError, Prediction, load_cost_model, parse_cost_model,
                               peak_predictor, predict)
from server.engine.rank_assignment import assign_tier

SHAPE = (1, 28, 28)
BENCH_PROBE = 100.0


@dataclass(frozen=True)
class Device:
    probe_gflops: float = BENCH_PROBE
    threads: int = 1
    runtime: str | None = PORTABLE_KIND


def entry(ratio: float, peak16: float, peak64: float, step16: float, step64: float, model: str = "fedavgcnn") -> dict:
    """One measured ratio; at 2 threads every step takes half as long."""
    return dict(model=model, input_shape=list(SHAPE), ratio=ratio, probe_gflops=BENCH_PROBE,
                peak_mb={"16": peak16, "64": peak64},
                step_ms={"1": {"16": step16, "64": step64}, "2": {"16": step16 / 2, "64": step64 / 2}})


def document(*entries: dict) -> dict:
    return dict(format_version=2, generated_by="test", entries=list(entries))


MODEL = parse_cost_model(document(entry(0.25, 100.0, 140.0, 10.0, 34.0), entry(0.5, 120.0, 180.0, 20.0, 68.0),
                                  entry(1.0, 160.0, 260.0, 40.0, 136.0)))


def test_a_measured_point_is_predicted_as_measured():
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(), MODEL) == Prediction(120.0, 20.0)


def test_step_time_scales_with_the_inverse_probe_score_and_memory_does_not():
    slow = predict("fedavgcnn", SHAPE, 0.5, 16, Device(probe_gflops=BENCH_PROBE / 4), MODEL)
    assert slow == Prediction(120.0, 80.0)


def test_ratios_between_measured_ones_interpolate_linearly():
    assert predict("fedavgcnn", SHAPE, 0.75, 16, Device(), MODEL) == Prediction(140.0, 30.0)


def test_a_ratio_below_the_smallest_measured_takes_the_smallest():
    assert predict("fedavgcnn", SHAPE, 0.1, 16, Device(), MODEL) == Prediction(100.0, 10.0)


def test_batch_sizes_interpolate_between_and_extrapolate_above_the_measured_ones():
    assert predict("fedavgcnn", SHAPE, 0.25, 40, Device(), MODEL) == Prediction(120.0, 22.0)
    assert predict("fedavgcnn", SHAPE, 0.25, 112, Device(), MODEL) == Prediction(180.0, 58.0)


def test_a_batch_below_the_smallest_measured_takes_the_smallest():
    assert predict("fedavgcnn", SHAPE, 0.25, 4, Device(), MODEL) == Prediction(100.0, 10.0)


def test_the_fastest_measured_thread_count_within_the_device_is_used():
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(threads=8), MODEL).step_ms == 10.0
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(threads=1), MODEL).step_ms == 20.0


def test_a_thread_count_measured_slower_is_not_used():
    contended = entry(0.5, 120.0, 180.0, 20.0, 68.0)
    contended["step_ms"]["2"] = {"16": 50.0, "64": 90.0}
    model = parse_cost_model(document(contended))
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(threads=2), model).step_ms == 20.0


def test_a_device_resource_profile_is_accepted():
    profile = ResourceProfile(memory_budget_mb=None, threads=2, cpu_count=4, machine="aarch64", system="Linux",
                              total_memory_mb=4096.0, probe_gflops=BENCH_PROBE / 2)
    assert predict("fedavgcnn", SHAPE, 0.5, 16, profile, MODEL) == Prediction(120.0, 20.0)


def test_an_unmeasured_model_is_refused_naming_what_is_measured():
    with pytest.raises(CostModelError, match=r"no measurements for cnn2 3x32x32.*fedavgcnn 1x28x28"):
        predict("cnn2", (3, 32, 32), 0.5, 16, Device(), MODEL)


@pytest.mark.parametrize("ratio, batch_size, device", [(0.0, 16, Device()), (1.5, 16, Device()),
                                                        (0.5, 0, Device()), (0.5, 16, Device(probe_gflops=0.0)),
                                                        (0.5, 16, Device(threads=0))])
def test_bad_questions_raise_value_errors(ratio, batch_size, device):
    with pytest.raises(ValueError):
        predict("fedavgcnn", SHAPE, ratio, batch_size, device, MODEL)


def test_a_document_of_another_format_is_refused():
    with pytest.raises(CostModelError, match="format"):
        parse_cost_model(dict(document(entry(0.5, 1, 2, 3, 4)), format_version=99))


def test_a_repeated_ratio_is_refused():
    with pytest.raises(CostModelError, match="repeats ratio 0.5"):
        parse_cost_model(document(entry(0.5, 1, 2, 3, 4), entry(0.5, 1, 2, 3, 4)))


def test_a_non_positive_measurement_is_refused_by_name():
    bad = entry(0.5, 1, 2, 3, 4)
    bad["peak_mb"]["64"] = -1
    with pytest.raises(CostModelError, match=r"peak_mb\[64\]"):
        parse_cost_model(document(bad))


def test_a_file_is_loaded_from_a_path(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(document(entry(0.5, 1, 2, 3, 4))))
    assert load_cost_model(path).entries[("fedavgcnn", SHAPE)][0].peak_mb == {16: 1.0, 64: 2.0}


def test_an_unreadable_file_is_named(tmp_path):
    with pytest.raises(CostModelError, match="missing.json"):
        load_cost_model(tmp_path / "missing.json")


def test_the_shipped_cost_model_covers_the_benchmarked_models():
    shipped = load_cost_model()
    assert {("fedavgcnn", (1, 28, 28)), ("fedavgcnn", (3, 32, 32)), ("cnn1", (3, 32, 32))} <= set(shipped.entries)
    assert all(len(entries) == 5 for entries in shipped.entries.values())


def test_the_shipped_cost_model_has_floors_of_both_runtimes_at_batch_16_and_64_for_every_tier_of_every_model():
    shipped = load_cost_model()
    for entries in shipped.entries.values():
        assert all({16, 64} <= set(e.floors[kind].floor_mb) for e in entries for kind in (PORTABLE_KIND, TRAINING_KIND))


def test_every_shipped_floor_was_measured_on_the_build_of_the_runtime_it_is_filed_under():
    """A portable floor comes from stock onnxruntime (not the training build's InferenceSession), a training floor
    from onnxruntime-training, as each floor's recorded build says."""
    document = json.loads(resources.files("device_runtime").joinpath("cost_model.json").read_text())
    expected = {PORTABLE_KIND: {"onnxruntime"}, TRAINING_KIND: {"onnxruntime-training-cpu", "onnxruntime-training"}}
    for entry in document["entries"]:
        for kind, record in entry.get("floors", {}).items():
            assert set(record["onnxruntime"]) == set(record["floor_mb"]) == set(record["generated_by"])
            assert all(set(build) <= expected[kind] and build for build in record["onnxruntime"].values()), entry


FLOOR_SAMPLES = 80
SAMPLE_MB = 28 * 28 * 4 / 2**20


def with_floors(floors: dict[float, float], training: dict[float, float] | None = None) -> object:
    """MODEL with a portable floor at batch 16, measured on an 80-sample shard, for each ratio in ``floors``, and
    an onnxruntime-training one for each ratio in ``training``."""
    entries = [entry(0.25, 100.0, 140.0, 10.0, 34.0), entry(0.5, 120.0, 180.0, 20.0, 68.0),
               entry(1.0, 160.0, 260.0, 40.0, 136.0)]
    for e in entries:
        for kind, table in ((PORTABLE_KIND, floors), (TRAINING_KIND, training or {})):
            if e["ratio"] in table:
                e.setdefault("floors", {})[kind] = dict(floor_mb={"16": table[e["ratio"]]},
                                                        floor_samples=FLOOR_SAMPLES)
    return parse_cost_model(document(*entries))


FLOORED = with_floors({0.25: 60.0, 0.5: 80.0, 1.0: 130.0})


def test_a_measured_floor_plus_margin_is_the_memory_need():
    prediction = predict("fedavgcnn", SHAPE, 0.5, 16, Device(), FLOORED)
    assert (prediction.peak_mb, prediction.floor_mb, prediction.need_mb) == (120.0, 80.0, 80.0 + FLOOR_MARGIN_MB)
    assert prediction.floor_runtime == PORTABLE_KIND


def test_without_floors_the_need_is_the_predicted_peak():
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(), MODEL).need_mb == 120.0


def test_floors_interpolate_between_ratios():
    assert predict("fedavgcnn", SHAPE, 0.75, 16, Device(), FLOORED).floor_mb == 105.0


def test_a_floor_grows_with_the_batch_as_the_peak_does():
    assert predict("fedavgcnn", SHAPE, 0.25, 40, Device(), FLOORED).floor_mb == 60.0 + (120.0 - 100.0)


def test_a_floor_grows_by_the_bytes_of_a_larger_shard():
    floor = predict("fedavgcnn", SHAPE, 0.25, 16, Device(), FLOORED, shard_samples=FLOOR_SAMPLES + 1000).floor_mb
    assert floor == pytest.approx(60.0 + 1000 * SAMPLE_MB)


def test_a_smaller_shard_does_not_lower_a_floor():
    assert predict("fedavgcnn", SHAPE, 0.25, 16, Device(), FLOORED, shard_samples=10).floor_mb == 60.0


def test_floors_without_their_shard_size_are_refused():
    bad = entry(0.5, 1, 2, 3, 4)
    bad["floors"] = {PORTABLE_KIND: {"floor_mb": {"16": 50}}}
    with pytest.raises(CostModelError, match="floor_samples"):
        parse_cost_model(document(bad))


def test_floors_of_an_unknown_runtime_are_refused_naming_the_runtimes():
    bad = entry(0.5, 1, 2, 3, 4)
    bad["floors"] = {"tflite": {"floor_mb": {"16": 50}, "floor_samples": FLOOR_SAMPLES}}
    with pytest.raises(CostModelError, match="onnxruntime, onnxruntime-training.*tflite"):
        parse_cost_model(document(bad))


BOTH = with_floors({0.25: 60.0, 0.5: 80.0, 1.0: 130.0}, training={0.25: 70.0, 0.5: 76.0, 1.0: 120.0})


@pytest.mark.parametrize("runtime, floor", [(PORTABLE_KIND, 80.0), (TRAINING_KIND, 76.0)])
def test_a_device_is_predicted_with_the_floors_of_the_runtime_it_reports(runtime, floor):
    prediction = predict("fedavgcnn", SHAPE, 0.5, 16, Device(runtime=runtime), BOTH)
    assert (prediction.floor_mb, prediction.floor_runtime) == (floor, runtime)


def test_a_device_that_names_no_runtime_is_predicted_with_the_larger_floor_at_its_ratio():
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(runtime=None), BOTH).floor_mb == 80.0  # portable's
    assert predict("fedavgcnn", SHAPE, 0.25, 16, Device(runtime=None), BOTH).floor_mb == 70.0  # training's


def test_a_runtime_without_floors_of_its_own_gets_the_peak_not_another_runtimes_floor():
    prediction = predict("fedavgcnn", SHAPE, 0.5, 16, Device(runtime=TRAINING_KIND), FLOORED)
    assert (prediction.floor_mb, prediction.need_mb) == (None, 120.0)


def test_floors_interpolate_between_measured_batch_sizes_and_grow_with_the_peak_above_them():
    both_batches = entry(0.5, 120.0, 180.0, 20.0, 68.0)
    both_batches["floors"] = {PORTABLE_KIND: dict(floor_mb={"16": 80, "64": 104}, floor_samples=FLOOR_SAMPLES)}
    model = parse_cost_model(document(both_batches))
    assert predict("fedavgcnn", SHAPE, 0.5, 40, Device(), model).floor_mb == 92.0
    assert predict("fedavgcnn", SHAPE, 0.5, 112, Device(), model).floor_mb == 104.0 + (240.0 - 180.0)


def test_floors_on_only_some_ratios_are_not_used():
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(), with_floors({0.5: 80.0})).floor_mb is None


def test_a_non_positive_floor_is_refused_by_name():
    bad = entry(0.5, 1, 2, 3, 4)
    bad["floors"] = {PORTABLE_KIND: dict(floor_mb={"16": 0}, floor_samples=FLOOR_SAMPLES)}
    with pytest.raises(CostModelError, match=r"floors\[onnxruntime\] floor_mb\[16\]"):
        parse_cost_model(document(bad))


def test_tier_assignment_prefers_the_floor_over_the_peak():
    predictor = peak_predictor("fedavgcnn", SHAPE, 16, Device(), FLOORED)
    assert assign_tier(100.0, (1.0, 0.5, 0.25), predictor) == 0.5  # by peak: 0.25 (0.5 peaks at 120)
    assert assign_tier(140.0, (1.0, 0.5, 0.25), predictor) == 1.0  # by peak: 0.5 (dense peaks at 160)


def test_the_peak_predictor_drives_tier_assignment():
    predictor = peak_predictor("fedavgcnn", SHAPE, 16, Device(), MODEL)
    assert assign_tier(150.0, (1.0, 0.5, 0.25), predictor) == 0.5
    assert assign_tier(90.0, (1.0, 0.5, 0.25), predictor) == 0.25


def with_secure_floors(secure: dict[float, float]) -> object:
    """FLOORED's portable floors, with floors measured with the secure step (batch 16) at each ratio of ``secure``."""
    entries = [entry(0.25, 100.0, 140.0, 10.0, 34.0), entry(0.5, 120.0, 180.0, 20.0, 68.0),
               entry(1.0, 160.0, 260.0, 40.0, 136.0)]
    plain = {0.25: 60.0, 0.5: 80.0, 1.0: 130.0}
    for e in entries:
        e["floors"] = {PORTABLE_KIND: dict(floor_mb={"16": plain[e["ratio"]]}, floor_samples=FLOOR_SAMPLES)}
        if e["ratio"] in secure:
            e["floors"][PORTABLE_KIND]["secure_floor_mb"] = {"16": secure[e["ratio"]]}
    return parse_cost_model(document(*entries))


SECURE_FLOORED = with_secure_floors({0.25: 84.0, 0.5: 96.0, 1.0: 140.0})


def test_under_secure_aggregation_the_floors_measured_with_the_secure_step_are_the_need():
    predictor = peak_predictor("fedavgcnn", SHAPE, 16, Device(), SECURE_FLOORED, secure_step_mb=20.0)
    assert [predictor(r) for r in (0.25, 0.5, 1.0)] == [84.0 + FLOOR_MARGIN_MB, 96.0 + FLOOR_MARGIN_MB,
                                                       140.0 + FLOOR_MARGIN_MB]
    assert predict("fedavgcnn", SHAPE, 0.5, 16, Device(), SECURE_FLOORED, secure=True).secure_floor


def test_without_secure_aggregation_the_secure_floors_are_not_used():
    predictor = peak_predictor("fedavgcnn", SHAPE, 16, Device(), SECURE_FLOORED)
    assert predictor(0.5) == 80.0 + FLOOR_MARGIN_MB


def test_secure_floors_on_only_some_ratios_fall_back_to_the_plain_floor_plus_the_bound():
    predictor = peak_predictor("fedavgcnn", SHAPE, 16, Device(), with_secure_floors({0.5: 96.0}), secure_step_mb=20.0)
    assert predictor(0.5) == 80.0 + FLOOR_MARGIN_MB + 20.0
    assert not predict("fedavgcnn", SHAPE, 0.5, 16, Device(), with_secure_floors({0.5: 96.0}), secure=True).secure_floor


def test_a_device_naming_no_runtime_uses_secure_floors_only_where_every_runtime_has_them():
    """Only the portable runtime has secure floors: a profile without a runtime gets the larger plain floor of the
    runtimes, plus the bound (never a secure floor of one runtime against a plain one of the other)."""
    document_entries = [entry(0.25, 100.0, 140.0, 10.0, 34.0), entry(1.0, 160.0, 260.0, 40.0, 136.0)]
    for e in document_entries:
        e["floors"] = {PORTABLE_KIND: dict(floor_mb={"16": 80}, floor_samples=FLOOR_SAMPLES,
                                           secure_floor_mb={"16": 90}),
                       TRAINING_KIND: dict(floor_mb={"16": 84}, floor_samples=FLOOR_SAMPLES)}
    model = parse_cost_model(document(*document_entries))
    prediction = predict("fedavgcnn", SHAPE, 1.0, 16, Device(runtime=None), model, secure=True)
    assert (prediction.floor_mb, prediction.floor_runtime, prediction.secure_floor) == (84.0, TRAINING_KIND, False)
    assert predict("fedavgcnn", SHAPE, 1.0, 16, Device(), model, secure=True).floor_mb == 90.0
