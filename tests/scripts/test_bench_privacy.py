"""scripts/bench_privacy.py: the commands it runs and the table it prints (the runs themselves are the benchmark's)."""
from __future__ import annotations

from tests.support.scripts import load_script

bench = load_script("bench_privacy")


def test_a_private_cell_runs_fedara_under_the_updates_rule_with_its_calibrated_noise_and_budget():
    argv = bench.run_argv(bench.parse_args([]), "hetero", 2, 0.75, 8.0)
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--algo"] == "fedara" and flags["--aggregate"] == "updates" and flags["--seed"] == "2"
    assert (flags["--dp-noise-multiplier"], flags["--dp-target-epsilon"]) == ("0.75", "8")
    assert int(flags["--clients"]) >= 500 and float(flags["--join-ratio"]) <= 0.1


def test_the_baseline_cell_has_no_dp():
    assert not any(a.startswith("--dp-") for a in bench.run_argv(bench.parse_args([]), "homog", 0, None, float("inf")))


def test_a_test_seed_reaches_the_private_runs_only():
    args = bench.parse_args(["--dp-test-seed", "7"])
    private = bench.run_argv(args, "hetero", 0, 0.75, 8.0)
    assert private[private.index("--dp-test-seed") + 1] == "7"
    assert "--dp-test-seed" not in bench.run_argv(args, "hetero", 0, None, float("inf"))


def test_the_table_pairs_each_private_run_with_its_seeds_baseline():
    runs = [dict(setting="hetero", target=t, seed=s, final_accuracy=acc, z=z, epsilon=e, rounds_run=10)
            for t, s, acc, z, e in [("inf", 0, 0.60, None, None), ("inf", 1, 0.70, None, None),
                                    ("8", 0, 0.55, 0.5, 7.9), ("8", 1, 0.61, 0.5, 7.95)]]
    text = bench.table({"config": {"settings": ["hetero"], "epsilons": ["inf", "8"]}, "runs": runs})
    row = next(line for line in text.splitlines() if line.startswith("| hetero | 8 |"))
    assert "+7.00 ± 2.00 pp" in row and "0.5800 ± 0.0300" in row and "7.950" in row
