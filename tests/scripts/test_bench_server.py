"""scripts/bench_server.py end to end on a tiny configuration: the report's shape, not its timings."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedcore.lowrank import matrix_shape
from fedcore.models import build_model
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_server.py"
QUICK_SHAPE = "1x28x28"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """(JSON report, stdout) of a --quick run on one input shape."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--input-shape", QUICK_SHAPE,
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
def test_quick_run_reports_every_client_count_and_phase(quick_run):
    report, _ = quick_run
    bench = load_script("bench_server")
    assert [(r["input_shape"], r["clients"]) for r in report["results"]] == [(QUICK_SHAPE, k) for k in bench.QUICK_CLIENTS]
    for result in report["results"]:
        assert set(result) >= {"factorize", "batched", "per_client", "floor", "checkpoint", "process_peak_rss_bytes"}
        assert len(result["plans"]) == len(bench.TIERS)


@pytest.mark.slow
def test_quick_run_measures_positive_seconds_bytes_and_rates(quick_run):
    """What only a clock or the kernel can say is checked for being measured at all; what follows from it is
    recomputed below."""
    report, _ = quick_run
    for result in report["results"]:
        f, b, p, fl, c = (result[k] for k in ("factorize", "batched", "per_client", "floor", "checkpoint"))
        for value in (f["seconds"], f["svd_seconds"], b["seconds"], p["seconds"], fl["gemm_flops_per_second"],
                      c["seconds"], c["bytes"], result["process_peak_rss_bytes"]):
            assert value > 0


@pytest.mark.slow
def test_quick_run_derives_its_bytes_and_floor_from_its_plans_and_measurements(quick_run):
    """Client k has plan k mod (number of plans); its update is its task's tensors plus noise (as many bytes); the
    floor is 2 FLOP per multiply-add at the measured GEMM rate, and the fraction reached is the floor over the
    batched path's time; its multiply-adds are Σ over clients and factorized layers of rank × the layer's matrix."""
    report, _ = quick_run
    bench = load_script("bench_server")
    model = build_model(bench.MODEL, tuple(int(d) for d in QUICK_SHAPE.split("x")), bench.NUM_CLASSES)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for result in report["results"]:
        b, fl, tasks = result["batched"], result["floor"], result["plan_task_bytes"]
        assert result["tasks_total_bytes"] == sum(tasks[k % len(tasks)] for k in range(result["clients"]))
        assert b["updates_total_bytes"] == result["tasks_total_bytes"] and b["clients"] == result["clients"]
        ranks = [re.findall(r"([\w.]+)@r(\d+)", plan) for plan in result["plans"]]  # "fe.fc1@r256": factorized
        assert fl["multiply_adds"] == sum(int(rank) * math.prod(matrix_shape(shapes[f"{layer}.weight"]))
                                          for k in range(result["clients"]) for layer, rank in ranks[k % len(ranks)])
        assert fl["seconds"] == pytest.approx(2 * fl["multiply_adds"] / fl["gemm_flops_per_second"], rel=1e-12)
        assert fl["fraction_reached"] == pytest.approx(fl["seconds"] / b["seconds"], rel=1e-12)


@pytest.mark.slow
def test_quick_run_factorizes_with_one_svd_per_factorized_layer(quick_run):
    report, _ = quick_run
    assert all(r["factorize"]["svd_layers"] == 2 for r in report["results"])  # FedAvgCNN: conv2 and fc1


@pytest.mark.slow
def test_quick_run_scales_the_per_client_path_beyond_the_limit(quick_run):
    report, _ = quick_run
    bench = load_script("bench_server")
    measured = [r["per_client"]["clients"] for r in report["results"]]
    assert measured == [min(k, bench.QUICK_PER_CLIENT_LIMIT) for k in bench.QUICK_CLIENTS]


@pytest.mark.slow
def test_batched_and_per_client_paths_agree_where_both_saw_every_update(quick_run):
    report, _ = quick_run
    compared = [r["per_client"]["max_relative_difference"] for r in report["results"]
                if r["per_client"]["clients"] == r["clients"]]
    assert compared and max(compared) < 1e-6


@pytest.mark.slow
def test_batched_path_traces_far_less_than_the_updates_it_folds(quick_run):
    report, _ = quick_run
    for result in report["results"]:
        assert result["batched"]["tracemalloc_peak_bytes"] < result["batched"]["updates_total_bytes"] / 10


@pytest.mark.slow
def test_quick_run_prints_markdown_tables(quick_run):
    _, stdout = quick_run
    assert "| input | K |" in stdout and "tracemalloc peak" in stdout


def test_client_counts_must_be_positive_integers():
    bench = load_script("bench_server")
    with pytest.raises(ValueError, match="'10,x'"):
        bench.parse_clients("10,x")
    with pytest.raises(ValueError, match="positive"):
        bench.parse_clients("0,10")


def test_input_shape_parses_c_by_h_by_w():
    assert load_script("bench_server").parse_shape("3x32x32") == (3, 32, 32)


def test_input_shape_without_three_sizes_is_rejected():
    bench = load_script("bench_server")
    with pytest.raises(ValueError, match="'32x32'"):
        bench.parse_shape("32x32")
