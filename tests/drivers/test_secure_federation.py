"""Secure aggregation inside a run (``server.simulate --secure-aggregation``): the model equals the plain engine's
within the quantization bound, every metrics row carries its ``secagg`` object, devices dropping after sharing are
recovered, distributed DP charges the Skellam accountant and stops at the target, and the combinations it cannot
serve are refused in one line. Runs are tiny (digits, 4 devices, 1 epoch, torch backend)."""
from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from device_runtime.dense_delta import dimension
from server.engine.accountant import SkellamAccountant
from server.engine.run_config import DpSettings
from server.engine.secure_rounds import dp_noise
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, REPORT_FILE, read_metrics
from server.outputs.prometheus_metrics import SnapshotCollector
from server.outputs.status_page import meta_parts
from server.outputs.status_snapshot import fleet_snapshot
from server.run_setup import RunFolder
from server.simulate import Simulation, build_parser, main

QUICK = ["--dataset", "digits", "--clients", "4", "--local-epochs", "1", "--batch-size", "32", "--max-samples", "600",
         "--lr", "0.05", "--lam", "1", "--lam-warmup", "1", "--aggregate", "updates"]
SECURE = ["--secure-aggregation"]


def run(out, *flags: str) -> list[dict]:
    assert main([*QUICK, "--out", str(out), *flags]) == 0
    return read_metrics(out / METRICS_FILE)


def shared(out) -> dict[str, np.ndarray]:
    tensors = load_checkpoint(out / CHECKPOINT_NAME).tensors
    return {k: v for k, v in tensors.items() if not k.startswith("device/")}


def test_the_secure_model_equals_the_plain_one_within_the_quantization_bound(tmp_path):
    """Dense tiers: the plain engine's change is then exact in float64 (with factors it multiplies them in float32,
    a few ulp off; mixed-rank sums against a float64 reference: tests/engine/test_secure_aggregation.py)."""
    secure = run(tmp_path / "secure", "--rounds", "1", "--rank-ratio", "1.0", *SECURE)
    run(tmp_path / "plain", "--rounds", "1", "--rank-ratio", "1.0")
    bound = secure[0]["secagg"]["quantization_bound"]
    ours, theirs = shared(tmp_path / "secure"), shared(tmp_path / "plain")
    assert ours.keys() == theirs.keys() and 0 < bound < 1e-6
    for key in theirs:  # both float32: the bound plus one rounding of each to float32
        slack = bound + 2 * np.spacing(np.abs(theirs[key]).astype(np.float32))
        assert np.all(np.abs(ours[key].astype(np.float64) - theirs[key]) <= slack), key


def test_every_row_says_what_the_secure_round_did_and_the_report_status_and_metrics_show_it(tmp_path):
    args = build_parser().parse_args([*QUICK, "--rounds", "2", *SECURE, "--out", str(tmp_path / "run")])
    simulation = Simulation(args, RunFolder(tmp_path / "run"))
    records = simulation.run()
    RunFolder(tmp_path / "run").report(records, simulation.settings)
    for row in records:
        s = row["secagg"]
        assert (s["survivors"], s["dropped"], s["recovered"], s["threshold"], s["aggregated"]) == (4, 0, 0, 3, True)
        assert set(s["phases"]) == {"keys", "shares", "masked", "unmask"}
        assert s["phases"]["masked"]["bytes_in"] == 4 * 4 * s["dimension"]
    assert "| 2 | 4 | 0 | 0 | 3 | yes |" in (tmp_path / "run" / REPORT_FILE).read_text()
    snapshot = fleet_snapshot(simulation.engine, now=0.0, wall=0.0)
    assert "secure aggregation round 2: 4 survivors, 0 dropped, 0 recovered, t 3, aggregated" in meta_parts(snapshot)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    values = {(m.name, tuple(m.labels.values())): m.value
              for family in text_string_to_metric_families(generate_latest(registry).decode()) for m in family.samples}
    assert values[("fedara_secagg", ("survivors",))] == 4 and values[("fedara_secagg", ("aggregated",))] == 1
    assert values[("fedara_secagg_phase_bytes", ("in", "masked"))] == records[-1]["secagg"]["phases"]["masked"]["bytes_in"]


def test_devices_dropping_after_sharing_are_recovered_or_the_round_is_not_aggregated(tmp_path):
    records = run(tmp_path / "run", "--rounds", "6", *SECURE, "--secagg-drop", "0.3", "--seed", "3")
    rounds = [r["secagg"] for r in records]
    recovered = [s for s in rounds if s["dropped"] == 1]
    failed = [s for s in rounds if s["dropped"] >= 2]
    assert recovered and all(s["aggregated"] and s["recovered"] == 1 for s in recovered)
    assert failed and all(not s["aggregated"] and s["failure"] for s in failed)


def test_distributed_dp_charges_the_skellam_mechanism_and_stops_at_the_target(tmp_path, capsys):
    dp = ["--dp-noise-multiplier", "2.0", "--dp-clip", "0.05", "--join-ratio", "1"]
    records = run(tmp_path / "run", "--rounds", "5", *SECURE, *dp, "--dp-target-epsilon", "1")
    shapes = {k: v.shape for k, v in shared(tmp_path / "run").items()}
    settings = DpSettings(2.0, 1.0, 4, 0.05)
    mu, l2 = dp_noise(settings, dimension(shapes))
    accountant = SkellamAccountant(1.0, mu, l2, dimension(shapes), 4 ** -1.1)
    assert [r["epsilon"] for r in records] == pytest.approx([accountant.epsilon_after(i + 1)
                                                            for i in range(len(records))])
    assert len(records) == 3 and accountant.epsilon_after(4) > 1  # (0.18, 0.56, 0.89, 1.14, ...)
    said = capsys.readouterr().out  # the plan before training is the Skellam accountant's, not the Gaussian's
    assert (f"privacy: --dp-target-epsilon 1 stops the run after round 3 of 5 (ε = {accountant.epsilon_after(3):.4g}; "
            f"round 4 would spend {accountant.epsilon_after(4):.4g}; δ = {4 ** -1.1:.3g}, skellam accountant") in said
    assert "pld accountant" not in said
    assert all(r["secagg"]["noise_mu_per_device"] > 0 for r in records)


@pytest.mark.slow
def test_under_distributed_dp_a_round_short_of_survivors_is_not_aggregated_but_still_charged(tmp_path):
    """--secagg-drop 0.3 with DP (seed 3: rounds 1 and 3 keep fewer than s = 3 of the 4 devices, round 2 three):
    every round is charged when it opens, released or not, so ε stays an upper bound; the run stops at the target
    after three rounds as without drops."""
    dp = ["--dp-noise-multiplier", "2.0", "--dp-clip", "0.05", "--join-ratio", "1"]
    records = run(tmp_path / "run", "--rounds", "5", *SECURE, *dp, "--dp-target-epsilon", "1", "--secagg-drop",
                  "0.3", "--seed", "3")
    shapes = {k: v.shape for k, v in shared(tmp_path / "run").items()}
    mu, l2 = dp_noise(DpSettings(2.0, 1.0, 4, 0.05), dimension(shapes))
    accountant = SkellamAccountant(1.0, mu, l2, dimension(shapes), 4 ** -1.1)
    rounds = [r["secagg"] for r in records]
    assert [r["epsilon"] for r in records] == pytest.approx([accountant.epsilon_after(i + 1) for i in range(3)])
    assert [s["aggregated"] for s in rounds] == [False, True, False]
    assert all(s["survivors"] < s["min_survivors"] == 3 for s in rounds if not s["aggregated"])
    assert rounds[1]["survivors"] == 3 and rounds[1]["recovered"] == 1


def test_a_target_below_one_distributed_round_is_refused_in_one_line_on_the_skellam_accountant(tmp_path, capsys):
    """The Gaussian PLD accountant gives this round ε = 0 at δ = 4^-1.1; the Skellam accountant that charges it
    gives 0.18: the target is checked against the latter (once the model's size is known), not the former."""
    dp = ["--dp-noise-multiplier", "2.0", "--dp-clip", "0.05", "--join-ratio", "1", "--dp-target-epsilon", "0.1"]
    assert main([*QUICK, "--rounds", "3", "--out", str(tmp_path / "run"), *SECURE, *dp]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dp-target-epsilon 0.1 fits no round: one round already spends ε = 0.18" in err[0]
    assert "skellam accountant" in err[0]


@pytest.mark.parametrize("flags,says", [
    (["--mode", "async"], "--mode sync"),
    (["--update-norm-bound", "1"], "leave --update-norm-bound out"),
    (["--aggregate", "weights"], "use --aggregate updates"),
    (["--dp-noise-multiplier", "1", "--dp-clip-quantile", "0.5"], "fixed --dp-clip"),
])
def test_what_secure_aggregation_cannot_serve_is_refused_in_one_line(flags, says, tmp_path, capsys):
    assert main([*QUICK, "--out", str(tmp_path / "run"), *SECURE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


@pytest.mark.parametrize("flags,says", [
    (["--secagg-neighbors", "2"], "--secagg-neighbors 2: with 4 devices at --secagg-dropout-rate 0.1"),
    (["--secagg-threshold", "2"], "--secagg-threshold 2 must be above (k + 1)/2 = 2 and at most k = 3"),
    (["--secagg-corrupt-rate", "0.5"], "--secagg-corrupt-rate must be in [0, 0.5)"),
])
def test_explicit_graph_settings_that_miss_the_bounds_are_refused_in_one_line(flags, says, tmp_path, capsys):
    assert main([*QUICK, "--out", str(tmp_path / "run"), *SECURE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_secagg_drop_needs_secure_aggregation(tmp_path, capsys):
    assert main([*QUICK, "--out", str(tmp_path / "run"), "--secagg-drop", "0.2"]) == 2
    assert "needs --secure-aggregation" in capsys.readouterr().err


def test_a_round_too_small_to_aggregate_securely_asks_for_nothing_in_the_clear(tmp_path):
    """Poisson sampling at rate 0.5 of 4 devices under DP draws rounds of fewer than 3: SecAgg+ cannot run them, the
    devices return no tensor, the round is not aggregated and says why."""
    args = build_parser().parse_args([*QUICK, "--rounds", "1", *SECURE, "--dp-noise-multiplier", "1",
                                      "--dp-clip", "0.05", "--join-ratio", "0.5", "--dp-test-seed", "2",
                                      "--out", str(tmp_path / "run")])
    engine = Simulation(args, RunFolder(tmp_path / "run")).engine
    tasks = engine.open_round(1, 0.0)
    trainers = [d for d, t in tasks.items() if not t.evaluate_only]
    assert len(trainers) < 3, "this --dp-test-seed drew 3 or more: pick another"
    assert engine.secure_round is None and all(tasks[d].returns == "none" for d in trainers)
    _, _ = engine.close_round(1.0)
    assert engine.pending["secagg"]["aggregated"] is False
    assert "at least 3 participants" in engine.pending["secagg"]["failure"]


@pytest.mark.parametrize("algo", ["fedavg", "fedrep"])
def test_every_algorithm_with_a_shared_model_aggregates_securely(algo, tmp_path):
    records = run(tmp_path / "run", "--rounds", "1", "--algo", algo, *SECURE)
    assert records[0]["aggregated"] and records[0]["secagg"]["survivors"] == 4


REPRODUCIBLE = [*SECURE, "--secagg-drop", "0.3", "--seed", "3", "--secagg-test-seed", "7", "--rank-tiers", "1.0,0.5"]


def same_checkpoints(a, b) -> None:
    ours, theirs = load_checkpoint(a / CHECKPOINT_NAME), load_checkpoint(b / CHECKPOINT_NAME)
    assert ours.round == theirs.round and set(ours.tensors) == set(theirs.tensors)
    assert all(np.array_equal(ours.tensors[k], theirs.tensors[k]) for k in ours.tensors)


def test_a_secure_run_resumed_from_its_checkpoint_ends_with_the_same_model(tmp_path):
    """With --secagg-test-seed the devices' rounding is a function of the round and the device, so a run stopped
    after round 2 and resumed ends where the uninterrupted run does, bit for bit (with drops and recoveries). (Round
    2's accuracy differs: the first run, ending there, evaluated its model on every device; the straight run on
    round 3's devices that did not drop.)"""
    straight = run(tmp_path / "straight", *REPRODUCIBLE, "--rounds", "4")
    run(tmp_path / "resumed", *REPRODUCIBLE, "--rounds", "2")
    resumed = run(tmp_path / "resumed", *REPRODUCIBLE, "--rounds", "4", "--resume")
    assert [r["secagg"]["aggregated"] for r in straight] == [r["secagg"]["aggregated"] for r in resumed]
    assert [r["round"] for r in straight] == [r["round"] for r in resumed] == [1, 2, 3, 4]
    assert straight[-1]["accuracy"] == resumed[-1]["accuracy"]
    same_checkpoints(tmp_path / "straight", tmp_path / "resumed")


def test_a_resumed_secure_run_must_keep_its_secure_settings(tmp_path, capsys):
    run(tmp_path / "run", *REPRODUCIBLE, "--rounds", "1")
    capsys.readouterr()
    assert main([*QUICK, "--out", str(tmp_path / "run"), *REPRODUCIBLE, "--rounds", "2", "--resume",
                 "--secagg-dropout-rate", "0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "secagg_dropout_rate" in err[0]


def test_secagg_test_seed_needs_secure_aggregation(tmp_path, capsys):
    assert main([*QUICK, "--out", str(tmp_path / "run"), "--secagg-test-seed", "1"]) == 2
    assert "--secagg-test-seed 1 needs --secure-aggregation" in capsys.readouterr().err


@pytest.mark.slow
def test_a_secure_run_killed_after_a_round_resumes_to_the_uninterrupted_runs_checkpoint(tmp_path):
    """A real process SIGKILLed once a round's checkpoint is on disk; --resume finishes it."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    command = [sys.executable, "-m", "server.simulate", *QUICK, *REPRODUCIBLE, "--rounds", "4"]
    root = Path(__file__).resolve().parents[2]
    subprocess.run([*command, "--out", str(tmp_path / "straight")], check=True, cwd=root, capture_output=True)
    victim = subprocess.Popen([*command, "--out", str(tmp_path / "killed")], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    for line in victim.stdout:  # round 2 has closed (its checkpoint written or about to be: either resumes)
        if line.startswith("round 2/4"):
            break
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert load_checkpoint(tmp_path / "killed" / CHECKPOINT_NAME).round < 4
    subprocess.run([*command, "--out", str(tmp_path / "killed"), "--resume"], check=True, cwd=root, capture_output=True)
    same_checkpoints(tmp_path / "straight", tmp_path / "killed")
