"""scripts/bench_device.py end to end on its --quick subset: the report's shape and the cost model it writes,
not its timings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.engine.cost_model import COST_MODEL_FORMAT, MIB, load_cost_model, parse_cost_model, predict
from tests.support.processes import child_env
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_device.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.timeout(600)
"""Above the quick run's own 480 s limit: on a loaded 2-core machine it took over the suite's 300 s default."""


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> tuple[Path, str]:
    """(output folder, stdout) of a --quick run that also writes a cost model."""
    out = tmp_path_factory.mktemp("bench_device")
    shared_artifact_cache.mkdir(parents=True, exist_ok=True)
    (out / "cache").mkdir()
    (out / "cache" / "fedara").symlink_to(shared_artifact_cache)  # where the script keeps its artifacts
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(out), "--cost-model",
                           str(out / "cost_model.json"), "--cache-dir", str(out / "cache")],
                          capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


@pytest.mark.slow
def test_quick_run_reports_every_ratio_of_its_subset(quick_run):
    out, _ = quick_run
    bench = load_script("bench_device")
    report = json.loads((out / "bench_device.json").read_text())
    reported = sorted((r["model"], tuple(r["input_shape"]), ratio) for r in report["results"] for ratio in r["ratios"])
    assert reported == sorted((m, s, ratio) for m, s in bench.QUICK_CONFIGS for ratio in bench.QUICK_RATIOS)


@pytest.mark.slow
def test_quick_run_measures_every_session_variant_and_latency_variant(quick_run):
    out, _ = quick_run
    bench = load_script("bench_device")
    for result in json.loads((out / "bench_device.json").read_text())["results"]:
        assert set(result["sessions"]) == set(bench.SESSION_VARIANTS)
        assert set(result["latency"]["threads"]) == {str(t) for t in bench.THREADS}
        for per_variant in result["latency"]["threads"].values():
            assert set(per_variant) == set(bench.LATENCY_VARIANTS)
            assert all(v["n"] == bench.QUICK_STEPS and v["p95"] >= v["p50"] > 0 for v in per_variant.values())


@pytest.mark.slow
def test_the_device_process_imports_neither_torch_nor_onnx(quick_run):
    out, _ = quick_run
    for result in json.loads((out / "bench_device.json").read_text())["results"]:
        for session in (*result["sessions"].values(), result["portable"]):
            assert session["imported_torch"] is False and session["imported_onnx"] is False


@pytest.mark.slow
def test_peak_memory_is_at_least_the_memory_after_loading(quick_run):
    out, _ = quick_run
    for result in json.loads((out / "bench_device.json").read_text())["results"]:
        for worker in (*result["sessions"].values(), result["portable"], result["torch"]):
            assert worker["rounds"]["16"]["peak_rss_bytes"] >= worker["rss_loaded_bytes"] > worker["rss_import_bytes"]


@pytest.mark.slow
def test_quick_run_writes_tables_and_a_png(quick_run):
    out, stdout = quick_run
    tables = (out / "bench_device.md").read_text()
    for heading in ("### Memory", "### Step latency", "### Frobenius decay", "### onnxruntime session options"):
        assert heading in tables and heading in stdout
    assert (out / "bench_device.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_the_written_cost_model_predicts_for_the_measured_configuration(quick_run):
    """A prediction between the two measured ratios is the linear interpolation of what the report measured: the
    portable runtime's peak RSS, and its 1-thread step (decay amortized) scaled by the probe scores."""
    out, _ = quick_run
    bench = load_script("bench_device")
    model = load_cost_model(out / "cost_model.json")
    (name, shape), = bench.QUICK_CONFIGS
    measured = {ratio: r for r in json.loads((out / "bench_device.json").read_text())["results"]
                for ratio in r["ratios"]}

    class Device:
        probe_gflops, threads = 10.0, 1

    def peak_mb(ratio: float) -> float:
        return measured[ratio]["portable"]["rounds"][str(bench.BATCH)]["peak_rss_bytes"] / MIB

    def step_ms(ratio: float) -> float:
        latency = measured[ratio]["latency"]
        one = bench.amortized_ms(latency["threads"]["1"], "portable", "portable_decay", bench.BATCH)
        return one * latency["probe_gflops"] / Device.probe_gflops

    low, high = sorted(bench.QUICK_RATIOS)
    ratio = (low + high) / 2
    weight = (ratio - low) / (high - low)
    prediction = predict(name, shape, ratio, bench.BATCH, Device(), model)
    # the same float64 arithmetic in another order: equal to a few ulps
    assert prediction.peak_mb == pytest.approx(peak_mb(low) + weight * (peak_mb(high) - peak_mb(low)), rel=1e-12)
    assert prediction.step_ms == pytest.approx(step_ms(low) + weight * (step_ms(high) - step_ms(low)), rel=1e-12)


def test_a_plan_the_training_kind_refuses_is_reported_with_its_reason_and_its_portable_step_against_pytorch():
    bench = load_script("bench_device")
    timing = {"p50": 10.0, "cpu_p50": 8.0}
    decay = {"p50": 0.0, "cpu_p50": 0.0}
    peak = {"rounds": {str(b): {"peak_rss_bytes": 100 * MIB} for b in bench.BATCH_SIZES}}
    result = dict(model=str(bench.ROOT / "examples/dscnn.py") + ":build", input_shape=[1, 28, 28], ratios=[1.0],
                  plan="dense", training_refused="fe.bn.running_mean: no step state", portable=peak, torch=peak,
                  latency={"threads": {"1": {"portable": timing, "portable_decay": decay,
                                             "torch": dict(timing, p50=20.0, cpu_p50=16.0), "torch_decay": decay}}})
    row = bench.step_table([result], None).splitlines()[-1]
    assert row.startswith("| examples/dscnn.py:build | 1x28x28 | 1.0 | dense | 10.0 | 20.0 | 0.50 (0.50) ")
    assert row.endswith("| skipped: fe.bn.running_mean: no step state |")


def test_the_leanest_session_variant_has_the_lowest_total_peak():
    bench = load_script("bench_device")

    def result(peaks: dict[str, int], steps: dict[str, float]) -> dict:
        return {"sessions": {name: {"rounds": {str(bench.BATCH): {"peak_rss_bytes": peaks[name]}},
                                    "step_ms": {"p50": steps[name]}} for name in bench.SESSION_VARIANTS}}

    names = list(bench.SESSION_VARIANTS)
    peaks = {name: 200 for name in names} | {names[1]: 100, names[2]: 101}
    steps = {name: 1.0 for name in names} | {names[1]: 5.0, names[2]: 2.0}
    assert bench.best_session_variant([result(peaks, steps)]) == names[2]
    assert bench.best_session_variant([result(peaks | {names[2]: 150}, steps)]) == names[1]


def test_a_timed_block_times_count_calls_after_one_untimed_call():
    calls = []
    times = load_script("bench_device").timed_block(lambda: calls.append(1), 3)
    assert len(times) == 3 and len(calls) == 4 and all(t >= 0 for t in times)


def test_floor_bisection_finds_the_smallest_passing_limit_to_the_resolution():
    bench = load_script("bench_device")
    floor, trials = bench.bisect_floor(lambda limit: limit >= 113, upper_mb=150, resolution_mb=4)
    assert floor == 116 and trials[0] == (152, True)
    assert all(passed == (limit >= 113) for limit, passed in trials)


def test_floor_bisection_raises_the_upper_bracket_until_it_passes():
    bench = load_script("bench_device")
    floor, trials = bench.bisect_floor(lambda limit: limit >= 300, upper_mb=100, resolution_mb=4)
    assert floor == 300 and [t for t in trials if t[0] in (100, 200, 400)] == [(100, False), (200, False), (400, True)]


def test_floor_bisection_gives_up_above_its_ceiling():
    with pytest.raises(RuntimeError, match="no limit up to 256 MiB"):
        load_script("bench_device").bisect_floor(lambda limit: False, upper_mb=100, max_upper_mb=256)


def floor_result(runtime: str, ratios: list[float], floor: int, batch_size: int = 16) -> dict:
    build = {"onnxruntime": "1.27.0"} if runtime == "portable" else None
    return dict(model="cnn1", input_shape=[1, 28, 28], ratios=ratios, plan="p", runtime=runtime,
                batch_size=batch_size, floor_mb=floor, onnxruntime=build)


def test_floors_of_each_device_runtime_go_into_the_cost_model_under_its_kind_and_reference_ones_do_not():
    bench = load_script("bench_device")
    document = dict(entries=[dict(model="cnn1", input_shape=[1, 28, 28], ratio=r) for r in (1.0, 0.5)])
    bench.with_floors(document, [floor_result("ort-training", [1.0], 148), floor_result("portable", [1.0], 152),
                                 floor_result("torch", [0.5], 240)], "cmd")
    dense, half = document["entries"]
    samples = bench.FLOOR_TRAIN_SAMPLES + bench.TEST_SAMPLES
    assert dense["floors"] == {"onnxruntime-training": dict(floor_mb={"16": 148}, floor_samples=samples,
                                                            generated_by={"16": "cmd"}, onnxruntime={"16": None}),
                               "onnxruntime": dict(floor_mb={"16": 152}, floor_samples=samples,
                                                   generated_by={"16": "cmd"},
                                                   onnxruntime={"16": {"onnxruntime": "1.27.0"}})}
    assert "floors" not in half


def test_floors_of_another_batch_size_join_those_already_measured_each_with_its_command():
    bench = load_script("bench_device")
    document = dict(entries=[dict(model="cnn1", input_shape=[1, 28, 28], ratio=1.0)])
    bench.with_floors(document, [floor_result("portable", [1.0], 152)], "first")
    bench.with_floors(document, [floor_result("portable", [1.0], 180, batch_size=64)], "second")
    record = document["entries"][0]["floors"]["onnxruntime"]
    assert record["floor_mb"] == {"16": 152, "64": 180} and record["generated_by"] == {"16": "first", "64": "second"}


def test_the_cost_model_reads_the_floors_the_benchmark_writes():
    bench = load_script("bench_device")
    raw = dict(model="cnn1", input_shape=[1, 28, 28], ratio=1.0, probe_gflops=50.0, peak_mb={"16": 150.0},
               step_ms={"1": {"16": 20.0}})
    document = bench.with_floors(dict(format_version=COST_MODEL_FORMAT, entries=[raw]),
                                 [floor_result("portable", [1.0], 152)], "cmd")
    (entry,) = parse_cost_model(document).entries[("cnn1", (1, 28, 28))]
    assert entry.floors["onnxruntime"].floor_mb == {16: 152.0}


def secure_results(plain: int, secure: int, ratios: list[float] = [1.0]) -> list[dict]:
    settings = dict(bound_mb=20.0)
    return [dict(floor_result("portable", ratios, plain), secure=False, secure_settings=None),
            dict(floor_result("portable", ratios, secure), secure=True, secure_settings=settings)]


def test_a_secure_floor_run_sets_only_the_secure_floors_beside_the_plain_ones_and_the_cost_model_reads_them():
    bench = load_script("bench_device")
    raw = dict(model="cnn1", input_shape=[1, 28, 28], ratio=1.0, probe_gflops=50.0, peak_mb={"16": 150.0},
               step_ms={"1": {"16": 20.0}})
    document = bench.with_floors(dict(format_version=COST_MODEL_FORMAT, entries=[raw]),
                                 [floor_result("portable", [1.0], 152)], "plain")
    bench.with_floors(document, secure_results(148, 168), "secure")
    record = document["entries"][0]["floors"]["onnxruntime"]
    assert record["floor_mb"] == {"16": 152} and record["generated_by"] == {"16": "plain"}  # the published ones
    assert record["secure_floor_mb"] == {"16": 168} and record["secure_generated_by"] == {"16": "secure"}
    (entry,) = parse_cost_model(document).entries[("cnn1", (1, 28, 28))]
    assert entry.floors["onnxruntime"].secure_floor_mb == {16: 168.0}


def test_a_secure_floor_where_the_cost_model_has_no_plain_one_names_the_command_to_run_first():
    bench = load_script("bench_device")
    document = dict(entries=[dict(model="cnn1", input_shape=[1, 28, 28], ratio=1.0)])
    with pytest.raises(KeyError, match="measure the plain floors first"):
        bench.with_floors(document, secure_results(148, 168), "secure")


def test_the_secure_floor_table_sets_the_measured_step_against_the_bound():
    table = load_script("bench_device").secure_floor_table(secure_results(92, 104))
    assert "| cnn1 | 1x28x28 | 1 | 16 | portable | 92 | 104 | 12 | 20.0 | 112.0 | 1.67 |" in table


def test_floors_for_an_entry_the_cost_model_lacks_name_the_command_to_measure_it():
    bench = load_script("bench_device")
    with pytest.raises(KeyError, match="--config cnn1:1x28x28"):
        bench.with_floors(dict(entries=[]), [floor_result("ort-training", [0.5], 112)], "cmd")


def test_a_cost_model_rewrite_keeps_the_entries_it_does_not_measure():
    bench = load_script("bench_device")
    old = dict(generated_by="old", entries=[dict(model="a", input_shape=[1, 2, 2], ratio=1.0, peak_mb=1),
                                            dict(model="b", input_shape=[1, 2, 2], ratio=1.0, peak_mb=2)])
    new = dict(generated_by="new", entries=[dict(model="b", input_shape=[1, 2, 2], ratio=1.0, peak_mb=3)])
    merged = bench.merge_cost_model(old, new)
    assert [(e["model"], e["peak_mb"], e["generated_by"]) for e in merged["entries"]] == [("a", 1, "old"),
                                                                                          ("b", 3, "new")]


def test_a_cost_model_rewrite_keeps_the_memory_floors_of_the_entries_it_re_measures():
    bench = load_script("bench_device")
    floors = dict(floors={"onnxruntime": dict(floor_mb={"16": 88}, floor_samples=80, generated_by={"16": "floors"})})
    old = dict(generated_by="old", entries=[dict(model="b", input_shape=[1, 2, 2], ratio=1.0, peak_mb=2, **floors)])
    new = dict(generated_by="new", entries=[dict(model="b", input_shape=[1, 2, 2], ratio=1.0, peak_mb=3)])
    (entry,) = bench.merge_cost_model(old, new)["entries"]
    assert entry["peak_mb"] == 3 and entry["generated_by"] == "new"
    assert {k: entry[k] for k in floors} == floors


def test_an_unknown_floor_runtime_is_refused_naming_the_choices(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--memory-floor", "--runtimes", "tflite", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "tflite" in done.stderr and "ort-training,portable,torch" in done.stderr


def test_a_floor_run_of_some_runtimes_names_its_report_after_them_and_one_of_all_keeps_the_plain_name():
    bench = load_script("bench_device")
    assert bench.floor_report_name(("portable",)) == "memory_floor_portable"
    assert bench.floor_report_name(tuple(bench.FLOOR_WORKERS)) == "memory_floor"


def test_a_non_positive_floor_batch_size_is_refused_naming_the_flag(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--memory-floor", "--batch-sizes", "16,0", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--batch-sizes" in done.stderr and "16,0" in done.stderr


def test_portable_floors_for_a_cost_model_are_refused_from_a_training_build_before_any_measurement(tmp_path):
    """This environment's onnxruntime is the training build: its InferenceSession runs the step graph, but a floor
    measured with it is not the stock runtime's, so it must not be written into the cost model as one."""
    cost_model = tmp_path / "cost_model.json"
    cost_model.write_text("{}")
    done = subprocess.run([sys.executable, str(SCRIPT), "--memory-floor", "--runtimes", "portable", "--out-dir",
                           str(tmp_path), "--cost-model", str(cost_model)], capture_output=True, text=True, timeout=120)
    if "needs memory cgroups" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 2 and "--portable-python" in done.stderr and "stock onnxruntime" in done.stderr
    assert cost_model.read_text() == "{}" and not list(tmp_path.glob("memory_floor*"))


def test_the_runtime_probe_names_this_environments_onnxruntime_build():
    probe = load_script("bench_device").runtime_probe_worker({})
    assert probe["kinds"][0] == "onnxruntime" and probe["distributions"]


CHILD_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
"""Runs a command and prints its peak resident memory (KiB), so a test reads one worker's peak alone."""


def test_a_worker_holds_no_parse_tree_of_the_benchmark_as_a_script_run_would():
    """CPython keeps a script's parse tree until the script returns (about 4 MiB for this file), where an imported
    module's is freed before it runs: a worker imports the benchmark, as a device runs ``python -m device_runtime``,
    so a measured floor holds nothing a device does not."""
    bench = load_script("bench_device")

    def peak_kib(command: list[str]) -> int:
        done = subprocess.run([sys.executable, "-c", CHILD_PEAK, *command], capture_output=True, text=True,
                              env=child_env(drop=("PYTHONPATH",), **{name: "1" for name in bench.THREAD_ENV}),
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    as_script = [sys.executable, str(SCRIPT), "--worker", "runtime-probe", "{}"]
    assert peak_kib(bench.worker_command("runtime-probe", {})) < peak_kib(as_script) - 2048
