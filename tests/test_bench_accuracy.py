"""scripts/bench_accuracy.py: the run matrix, the summary, the report files of a --quick run."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.simulate import build_parser as simulate_parser

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_accuracy.py"
MODULE_NAME = "bench_accuracy"
ALGORITHMS_PER_ALPHA = 9
QUICK_TIMEOUT_S = 120


def load_script():
    if MODULE_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[MODULE_NAME]


@pytest.fixture(scope="module")
def bench():
    return load_script()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(output folder, stdout) of a --quick run: digits, 5 clients, 2 rounds, one seed, α = 0.5."""
    out_dir = tmp_path_factory.mktemp("accuracy")
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(out_dir)],
                          capture_output=True, text=True, timeout=QUICK_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return out_dir, done.stdout


def fake_run(setting: str, algorithm: str, seed: int, accuracies: list[float]) -> dict:
    rounds = [dict(round=i + 1, accuracy=a, accuracy_std=0.1, bytes_down=100, bytes_up=50, seconds=2.0)
              for i, a in enumerate(accuracies)]
    return dict(setting=setting, algorithm=algorithm, seed=seed, rounds=rounds, command="python -m server.simulate",
                final_accuracy=accuracies[-1], best_accuracy=max(accuracies))


def test_every_run_is_a_valid_simulate_command(bench):
    for spec in bench.bench_runs(bench.BenchConfig()):
        simulate_parser().parse_args(list(spec.argv))


def test_run_matrix_covers_seeds_alphas_and_both_settings(bench):
    config = bench.BenchConfig(seeds=(0, 1), alphas=(0.1, 0.5))
    specs = bench.bench_runs(config)
    assert len(specs) == 2 * 2 * ALGORITHMS_PER_ALPHA
    assert {s.setting for s in specs} == {"homogeneous α=0.1", "heterogeneous α=0.1",
                                          "homogeneous α=0.5", "heterogeneous α=0.5"}
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)


def test_runs_of_one_alpha_and_seed_share_the_partition(bench):
    specs = [s for s in bench.bench_runs(bench.BenchConfig()) if s.seed == 1 and s.setting.endswith("α=0.5")]
    partitions = set()
    for spec in specs:
        args = simulate_parser().parse_args(list(spec.argv))
        partitions.add((args.dataset, args.clients, args.alpha, args.seed, args.max_samples))
    assert partitions == {("fmnist", 20, 0.5, 1, 4000)}


def test_ablation_differs_from_fedara_only_in_lambda(bench):
    specs = {s.algorithm: simulate_parser().parse_args(list(s.argv)) for s in bench.bench_runs(bench.BenchConfig())
             if s.seed == 0 and s.setting == "homogeneous α=0.1"}
    fedara, ablation = vars(specs["FedARA"]), vars(specs["FedARA λ=0"])
    assert {k for k in fedara if fedara[k] != ablation[k]} == {"lam"}
    assert (fedara["lam"], ablation["lam"]) == (10.0, 0.0)


def test_lambda_warmup_scales_with_rounds(bench):
    assert [bench.BenchConfig(rounds=r).lam_warmup for r in (100, 20, 5, 1)] == [10, 2, 1, 1]


def test_summary_reports_mean_and_sample_std_over_seeds(bench):
    runs = [fake_run("s", "A", seed, [0.5, acc]) for seed, acc in enumerate((0.6, 0.8))]
    (row,) = bench.summarize(runs)
    assert row["final_mean"] == pytest.approx(0.7)
    assert row["final_std"] == pytest.approx(0.1414213, rel=1e-5)
    assert row["bytes_per_round"] == 150 and row["seconds_per_round"] == 2.0


def test_paired_differences_compare_the_first_algorithm_seed_by_seed(bench):
    runs = [fake_run("s", "FedARA", 0, [0.80]), fake_run("s", "FedARA", 1, [0.70]),
            fake_run("s", "Local", 0, [0.75]), fake_run("s", "Local", 1, [0.72])]
    (row,) = bench.paired_differences(runs)
    assert (row["reference"], row["other"], row["seeds"], row["ahead"]) == ("FedARA", "Local", 2, 1)
    assert row["mean"] == pytest.approx(0.015)


def test_rewriting_the_report_keeps_the_hand_written_analysis(bench):
    config = bench.BenchConfig(seeds=(0,))
    runs = [fake_run("homogeneous α=0.1", "FedARA", 0, [0.5, 0.6])]
    first = bench.markdown_report(config, "cmd", bench.summarize(runs), runs, 60.0, "")
    edited = first + "FedARA loses to local here.\n"
    second = bench.markdown_report(config, "cmd", bench.summarize(runs), runs, 60.0, bench.kept_analysis(edited))
    assert second.endswith(bench.ANALYSIS_MARKER + "\nFedARA loses to local here.\n")


def test_non_positive_alpha_is_rejected(bench):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--alphas", "0.1,0"])


def test_quick_run_writes_every_run_with_its_rounds(quick_run, bench):
    out_dir, _ = quick_run
    document = json.loads((out_dir / bench.JSON_NAME).read_text())
    assert document["complete"] is True
    assert len(document["runs"]) == ALGORITHMS_PER_ALPHA
    assert all(len(run["rounds"]) == bench.QUICK.rounds for run in document["runs"])


def test_quick_run_writes_table_plot_and_a_progress_line_per_run(quick_run, bench):
    out_dir, stdout = quick_run
    runs = json.loads((out_dir / bench.JSON_NAME).read_text())["runs"]
    table = (out_dir / bench.MARKDOWN_NAME).read_text()
    assert "scripts/bench_accuracy.py --quick" in table
    assert len(bench.summarize(runs)) == ALGORITHMS_PER_ALPHA
    assert bench.results_table(bench.summarize(runs)) in table
    assert (out_dir / bench.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(line.startswith("[") for line in stdout.splitlines()) == ALGORITHMS_PER_ALPHA


def test_render_only_rebuilds_the_report_from_the_json(quick_run, bench, tmp_path):
    out_dir, _ = quick_run
    shutil.copy(out_dir / bench.JSON_NAME, tmp_path / bench.JSON_NAME)
    assert bench.main(["--render-only", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / bench.MARKDOWN_NAME).read_text() == (out_dir / bench.MARKDOWN_NAME).read_text()
    assert (tmp_path / bench.PLOT_NAME).is_file()


def test_render_only_without_a_json_is_an_error(bench, tmp_path, capsys):
    assert bench.main(["--render-only", "--out-dir", str(tmp_path)]) == 2
    assert bench.JSON_NAME in capsys.readouterr().err
