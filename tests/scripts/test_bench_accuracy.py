"""scripts/bench_accuracy.py: the studies' run matrix, the paired statistics, per-tier accuracy, the estimate and
the report files of a --quick run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.simulate import build_parser as simulate_parser
from tests.support import scripts

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_accuracy.py"
MODULE_NAME = "bench_accuracy"
QUICK_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(QUICK_TIMEOUT_S + 60)
"""Above the quick run's own limit: its 16 runs took 222 s on a loaded 2-core machine, near the suite's 300 s."""
QUICK_UNIQUE_RUNS = 16  # headline 5 + 6, λ sweep {0, 2, 10} adds λ=10 × 2 rules, pathological adds 3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_script():
    if MODULE_NAME not in sys.modules:
        return scripts.load_script(MODULE_NAME)
    return sys.modules[MODULE_NAME]


@pytest.fixture(scope="module")
def bench():
    return load_script()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(output folder, stdout) of a --quick run: digits, 5 clients, 2 rounds, one seed, every study."""
    out_dir = tmp_path_factory.mktemp("accuracy")
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(out_dir)],
                          capture_output=True, text=True, timeout=QUICK_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return out_dir, done.stdout


def parsed(spec) -> dict:
    return vars(simulate_parser().parse_args(list(spec.argv)))


def cell(study: str, setting: str, algorithm: str, seed: int, final: float, **extra) -> dict:
    rounds = [dict(round=1, accuracy=final, accuracy_std=0.1, bytes_down=100, bytes_up=50, seconds=2.0)]
    return dict(study=study, setting=setting, algorithm=algorithm, seed=seed, rounds=rounds, final_accuracy=final,
                best_accuracy=final, command=f"{algorithm} {seed}", **extra)


def differing(a: dict, b: dict) -> set[str]:
    return {k for k in a if a[k] != b[k]}


@pytest.mark.parametrize("preset", ["reduced", "paper", "quick"])
def test_every_run_is_a_valid_simulate_command_of_its_cells_seed(bench, preset):
    """Each cell's argv parses (a bad flag exits) into the run of the seed the cell is counted under."""
    specs = bench.bench_plan(bench.PRESETS[preset]).specs
    assert specs
    for spec in specs:
        assert parsed(spec)["seed"] == spec.seed, spec.command


def test_headline_runs_both_rules_their_ablations_and_local_over_ten_seeds(bench):
    specs = bench.headline_plan(bench.BenchConfig()).specs
    hetero = {s.algorithm for s in specs if s.setting.startswith("heterogeneous")}
    assert hetero == {"FedARA updates", "FedARA weights", "FedARA updates λ=0", "FedARA weights λ=0", "Local CNN1..5"}
    assert {s.seed for s in specs} == set(range(10))


def test_the_rules_differ_only_in_the_aggregation_and_the_ablation_only_in_lambda(bench):
    runs = {s.algorithm: parsed(s) for s in bench.headline_plan(bench.BenchConfig()).specs
            if s.seed == 3 and s.setting.startswith("heterogeneous")}
    assert differing(runs["FedARA updates"], runs["FedARA weights"]) == {"aggregate"}
    assert differing(runs["FedARA updates"], runs["FedARA updates λ=0"]) == {"lam"}
    assert (runs["FedARA weights"]["aggregate"], runs["FedARA weights λ=0"]["lam"]) == ("weights", 0.0)


def test_runs_of_one_partition_and_seed_share_the_data(bench):
    specs = [s for s in bench.bench_plan(bench.BenchConfig()).specs if s.seed == 1 and "α=0.5" in s.setting]
    data = {(a["dataset"], a["clients"], a["partition"], a["alpha"], a["seed"], a["max_samples"], a["rounds"])
            for a in map(parsed, specs)}
    assert data == {("fmnist", 10, "dirichlet", 0.5, 1, 2000, 10)}


def test_lambda_sweep_covers_the_papers_values_for_both_rules_on_three_seeds(bench):
    specs = bench.lambda_plan(bench.BenchConfig()).specs
    grid = {(a["aggregate"], a["lam"], a["seed"]) for a in map(parsed, specs)}
    assert grid == {(rule, lam, seed) for rule in ("weights", "updates")
                    for lam in (0, 0.1, 0.5, 1, 2, 5, 10, 20) for seed in (0, 1, 2)}
    assert all(a["rank_tiers"] == "1.0,0.75,0.5,0.25,0.125" for a in map(parsed, specs))


def test_partition_study_puts_the_pathological_split_beside_both_dirichlets(bench):
    specs = bench.partition_plan(bench.BenchConfig()).specs
    splits = {(a["partition"], a["alpha"] if a["partition"] == "dirichlet" else a["classes_per_client"])
              for a in map(parsed, specs)}
    assert splits == {("pathological", 2), ("dirichlet", 0.1), ("dirichlet", 0.5)}


def test_a_run_two_studies_share_runs_once(bench):
    plan = bench.bench_plan(bench.BenchConfig())
    headline = {s.command for s in plan.specs if s.study == "headline"}
    lam = [s for s in plan.specs if s.study == "lambda" and parsed(s)["lam"] in (0.0, 2.0)]
    assert lam and all(s.command in headline for s in lam)
    assert len(plan.unique()) == len({s.command for s in plan.specs}) < len(plan.specs)


def test_study_selection_plans_only_that_study(bench):
    plan = bench.bench_plan(bench.BenchConfig(studies=("partition",)))
    assert {s.study for s in plan.specs} == {"partition"} and {p.study for p in plan.pairs} == {"partition"}


def test_paper_preset_is_the_papers_schedule(bench):
    args = parsed(bench.bench_plan(bench.PRESETS["paper"]).specs[0])
    assert (args["clients"], args["rounds"], args["local_epochs"], args["lr"], args["max_samples"],
            args["batch_size"], args["lam_warmup"]) == (20, 100, 5, 5e-3, 0, 16, 10)


def test_lambda_warmup_scales_with_rounds(bench):
    assert [bench.BenchConfig(rounds=r).lam_warmup for r in (100, 20, 10, 1)] == [10, 2, 1, 1]


def test_summary_reports_mean_and_standard_error_over_seeds(bench):
    runs = [cell("s", "x", "A", seed, acc) for seed, acc in enumerate((0.6, 0.8))]
    (row,) = bench.summarize(runs)
    assert row["final_mean"] == pytest.approx(0.7)
    assert row["final_se"] == pytest.approx(0.1)  # sample std 0.1414 / √2
    assert row["bytes_per_round"] == 150 and row["seconds_per_round"] == 2.0


def test_paired_differences_follow_the_planned_pairs_seed_by_seed(bench):
    runs = [cell("h", "x", "FedARA updates", 0, 0.80), cell("h", "x", "FedARA updates", 1, 0.70),
            cell("h", "x", "Local", 0, 0.75), cell("h", "x", "Local", 1, 0.72), cell("h", "x", "Local", 2, 0.9)]
    (row,) = bench.paired_differences(runs, [bench.Pair("h", "x", "FedARA updates", "Local")])
    assert (row["first"], row["second"], row["seeds"], row["ahead"]) == ("FedARA updates", "Local", 2, 1)
    assert row["mean"] == pytest.approx(0.015) and row["se"] == pytest.approx(0.035)


def test_tier_accuracy_weights_each_device_by_its_test_split_in_round_robin_order(bench):
    devices = [f"dev_{i:03d}" for i in range(6)]  # dev_000 and dev_005 are both tier 1.0
    accuracy = [1.0, 0.5, 0.5, 0.5, 0.5, 0.0]
    run = dict(test_samples=dict(zip(devices, [30, 10, 10, 10, 10, 10])),
               rounds=[dict(per_device={d: {"accuracy": a} for d, a in zip(devices, accuracy)})])
    tiers = bench.tier_accuracy(run)
    assert tiers["1.0"] == pytest.approx(0.75) and tiers["0.125"] == pytest.approx(0.5)


def test_lambda_rows_give_each_rule_and_lambda_its_mean(bench):
    config = bench.BenchConfig(lambdas=(0.0, 2.0))
    runs = [cell("lambda", "x", "FedARA updates λ=2", seed, acc) for seed, acc in ((0, 0.7), (1, 0.9))]
    runs.append(cell("lambda", "x", "FedARA weights λ=0", 0, 0.6))
    rows = {(r["rule"], r["lam"]): r for r in bench.lambda_rows(runs, config)}
    assert set(rows) == {("updates", 2.0), ("weights", 0.0)}
    assert rows[("updates", 2.0)]["mean"] == pytest.approx(0.8) and rows[("updates", 2.0)]["seeds"] == 2


def test_cost_class_ignores_seed_lambda_rule_and_partition_but_not_the_model(bench):
    plan = bench.bench_plan(bench.BenchConfig())
    hetero = {bench.cost_class(s.argv) for s in plan.specs if "--rank-tiers" in s.argv}
    assert len(hetero) == 1
    assert len({bench.cost_class(s.argv) for s in plan.specs}) == 7


def test_rewriting_the_report_keeps_the_hand_written_analysis(bench):
    config = bench.BenchConfig(seeds=(0,), studies=("headline",))
    runs = [cell("headline", "homogeneous Dirichlet α=0.5", "FedARA", 0, 0.6)]
    first = bench.markdown_report(config, "cmd", runs, [], 60.0, "", 1)
    second = bench.markdown_report(config, "cmd", runs, [], 60.0,
                                   bench.kept_analysis(first + "FedARA loses to local here.\n"), 1)
    assert second.endswith(bench.ANALYSIS_MARKER + "\nFedARA loses to local here.\n")


@pytest.mark.parametrize("argv", [["--study", "headline,tiers"], ["--seeds", "0,x"], ["--quick", "--preset", "paper"]])
def test_bad_options_exit_2(bench, argv):
    with pytest.raises(SystemExit) as exc:
        bench.build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_negative_lambda_is_an_error_naming_the_flag(bench, capsys):
    assert bench.main(["--quick", "--lambdas", "0,-1", "--estimate"]) == 2
    assert "--lambdas" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_runs_each_command_once_and_every_cell_finds_its_run(quick_run, bench):
    out_dir, stdout = quick_run
    document = json.loads((out_dir / bench.JSON_NAME).read_text())
    commands = [run["command"] for run in document["runs"]]
    assert document["complete"] is True
    assert len(commands) == len(set(commands)) == QUICK_UNIQUE_RUNS
    assert {c["command"] for c in document["cells"]} == set(commands)
    assert all(len(run["rounds"]) == bench.PRESETS["quick"].rounds for run in document["runs"])
    assert sum(line.startswith("[") for line in stdout.splitlines()) == QUICK_UNIQUE_RUNS


@pytest.mark.slow
def test_quick_run_writes_every_studys_tables_and_both_plots(quick_run, bench):
    out_dir, _ = quick_run
    report = (out_dir / bench.MARKDOWN_NAME).read_text()
    for heading in ("## Study: headline", "## Study: lambda", "## Study: partition", "### Per tier"):
        assert heading in report
    assert "FedARA updates − FedARA weights" in report and "pathological 2 classes" in report
    for name in (bench.PLOT_NAME, bench.LAMBDA_PLOT_NAME):
        assert (out_dir / name).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_render_only_rebuilds_the_report_from_the_json(quick_run, bench, tmp_path):
    out_dir, _ = quick_run
    shutil.copy(out_dir / bench.JSON_NAME, tmp_path / bench.JSON_NAME)
    assert bench.main(["--render-only", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / bench.MARKDOWN_NAME).read_text() == (out_dir / bench.MARKDOWN_NAME).read_text()
    assert (tmp_path / bench.LAMBDA_PLOT_NAME).is_file()


def test_render_only_without_a_json_is_an_error(bench, tmp_path, capsys):
    assert bench.main(["--render-only", "--out-dir", str(tmp_path)]) == 2
    assert bench.JSON_NAME in capsys.readouterr().err


@pytest.mark.slow
def test_estimate_times_one_run_per_cost_class_and_shows_in_the_report(bench, tmp_path, quick_run):
    assert bench.main(["--quick", "--study", "partition", "--estimate", "--out-dir", str(tmp_path)]) == 0
    estimate = json.loads((tmp_path / bench.ESTIMATE_NAME).read_text())
    assert [c["runs"] for c in estimate["classes"]] == [4, 2]  # FedARA (2 rules × 2 partitions); local CNN1..5
    assert estimate["total_core_s"] == pytest.approx(sum(c["expected_core_s"] for c in estimate["classes"]))
    assert all(c["round_s"] > 0 and c["cpu_share"] > 0 for c in estimate["classes"])
    shutil.copy(quick_run[0] / bench.JSON_NAME, tmp_path / bench.JSON_NAME)
    assert bench.main(["--render-only", "--out-dir", str(tmp_path)]) == 0
    assert "## Expected run time" in (tmp_path / bench.MARKDOWN_NAME).read_text()


# -- the curves study -----------------------------------------------------------------------------------------


def curve_cell(setting: str, algorithm: str, seed: int, accuracies: list[float]) -> dict:
    rounds = [dict(round=t, accuracy=a, accuracy_std=0.1, bytes_down=1, bytes_up=1, seconds=1.0)
              for t, a in enumerate(accuracies, start=1)]
    return dict(study="curves", setting=setting, algorithm=algorithm, seed=seed, rounds=rounds,
                final_accuracy=accuracies[-1], best_accuracy=max(accuracies), command=f"{algorithm} {seed}")


def test_curves_study_runs_every_size_and_seed_for_forty_rounds_with_the_papers_warmup(bench):
    config = bench.BenchConfig(studies=("curves",))
    plan = bench.bench_plan(config)
    runs = [(s.algorithm, parsed(s)) for s in plan.specs]
    assert {(a["max_samples"] // a["clients"], a["seed"]) for _, a in runs} == {
        (size, seed) for size in (100, 200, 600) for seed in range(5)}
    assert {(a["rounds"], a["lam_warmup"]) for _, a in runs} == {(40, 10)}
    assert {label for label, _ in runs} == {"FedARA updates", "FedARA weights", "Local CNN1..5", "FedARA", "FedRep",
                                            "Local", "FedAvg"}
    assert len(plan.pairs) == 3 * 5 and {p.second for p in plan.pairs} == {"Local CNN1..5", "Local", "FedRep",
                                                                            "FedAvg"}


def test_curve_algorithms_keep_only_those_rows_and_their_pairs(bench):
    plan = bench.curves_plan(bench.BenchConfig(curve_algorithms=("FedARA updates", "Local CNN1..5")))
    assert {s.algorithm for s in plan.specs} == {"FedARA updates", "Local CNN1..5"}
    assert {(p.first, p.second) for p in plan.pairs} == {("FedARA updates", "Local CNN1..5")}


def test_ahead_from_is_the_round_after_which_the_difference_stays_positive(bench):
    assert bench.ahead_from([-0.1, 0.2, -0.1, 0.1, 0.3]) == 4
    assert bench.ahead_from([0.1, 0.2]) == 1
    assert bench.ahead_from([0.1, 0.2, 0.0]) is None


def test_curve_differences_pair_seeds_round_by_round(bench):
    results = [curve_cell("x", "FedARA", 0, [0.5, 0.7, 0.8]), curve_cell("x", "FedARA", 1, [0.4, 0.6, 0.9]),
               curve_cell("x", "Local", 0, [0.6, 0.6, 0.7]), curve_cell("x", "Local", 1, [0.6, 0.7, 0.8])]
    (row,) = bench.curve_differences(results, [bench.Pair("curves", "x", "FedARA", "Local")])
    assert row["per_round"] == pytest.approx([-0.15, 0.0, 0.1])
    assert (row["ahead_from"], row["ahead"], row["seeds"], row["rounds"]) == (3, 2, 2, 3)
    assert row["mean"] == pytest.approx(0.1)
    table = bench.curves_table([row, dict(row, ahead_from=None)])
    assert "| round 3 |" in table and "never within 3 rounds" in table


def test_rewriting_the_report_keeps_the_hand_written_lead(bench):
    config = bench.BenchConfig(seeds=(0,), studies=("headline",))
    runs = [cell("headline", "homogeneous Dirichlet α=0.5", "FedARA", 0, 0.6)]
    lead = f"{bench.LEAD_START}\nFederate below 100 samples.\n{bench.LEAD_END}"
    first = bench.markdown_report(config, "cmd", runs, [], 60.0, "", 1, lead=lead)
    assert bench.kept_lead(first) == lead
    assert bench.kept_lead(bench.markdown_report(config, "cmd", runs, [], 60.0, "", 1)) == ""


def test_a_gpu_run_passes_device_cuda_to_every_run_and_a_cpu_run_nothing(bench):
    gpu = bench.bench_plan(bench.BenchConfig(device="cuda", studies=("headline", "curves")))
    assert all(parsed(s)["device"] == "cuda" for s in gpu.specs)
    assert all("--device" not in s.argv for s in bench.bench_plan(bench.PRESETS["paper"]).specs)


def test_device_cuda_without_a_gpu_is_an_error_naming_the_flag(bench, capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)  # a machine without a GPU, on any machine
    assert bench.main(["--quick", "--device", "cuda", "--estimate"]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_the_models_study_pairs_bn_personal_shared_tiers_fedavg_and_local_of_each_model_by_seed(bench):
    config = bench.BenchConfig(studies=("models",), seeds=(0, 1), models=("examples/dscnn.py:build",
                                                                          "examples/resnet8.py:build"))
    plan = bench.bench_plan(config)
    args = [parsed(s) for s in plan.specs]
    assert {(Path(a["model"]).name, a["algo"], a["bn_stats"] if a["algo"] != "local" else None,
             a["rank_tiers"] if a["algo"] == "fedara" else None, a["seed"]) for a in args} == {
        (m, algo, bn, tiers, seed) for m in ("dscnn.py:build", "resnet8.py:build") for seed in (0, 1)
        for algo, bn, tiers in (("fedara", "personal", None), ("fedara", "shared", None),
                                ("fedara", "personal", "1.0,0.5,0.25"), ("fedavg", "shared", None),
                                ("local", None, None))}
    assert len({p.setting for p in plan.pairs}) == 2
    assert all(p.first.startswith("FedARA") for p in plan.pairs)


def test_the_models_study_without_a_model_is_refused_in_one_line(bench, capsys):
    assert bench.main(["--study", "models", "--out-dir", "/nonexistent"]) == 2
    assert "--study models needs --model" in capsys.readouterr().err
