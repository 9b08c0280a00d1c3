"""Differential privacy inside a run (``server.simulate`` and the round engine): the clip applies to the reconstructed
update of every plan, ε is in every metrics row, the budget stops the run before a round that would overspend it,
a resumed run continues the accounting, and the noise is not fixed by --seed.

Runs are tiny (digits, 4 devices, 1 epoch, torch backend).
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from device_runtime.messages import update_message
from device_runtime.task import Update
from fedcore.lowrank import reconstruct_state
from server.engine.accountant import epsilon
from server.engine.privacy import l2_norm
from server.engine.sampling import to_torch
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.outputs.prometheus_metrics import SnapshotCollector
from server.outputs.report import METRICS_FILE, PRIVACY_PLOT, REPORT_FILE, read_metrics
from server.outputs.status_snapshot import fleet_snapshot
from server.run_setup import RunFolder
from server.simulate import Simulation, build_parser, main

QUICK = ["--dataset", "digits", "--clients", "4", "--local-epochs", "1", "--batch-size", "32", "--max-samples", "600",
         "--lr", "0.05", "--lam", "1", "--lam-warmup", "1", "--aggregate", "updates", "--join-ratio", "0.5"]
DP = ["--dp-noise-multiplier", "1.0", "--dp-clip", "0.01", "--dp-accountant", "rdp"]  # noise std z·C/E = 0.005: small
# enough that no device's training diverges on the noised model (at C = 0.5, 0.25 per coordinate, some runs did)
DELTA = 4 ** -1.1  # the default δ for 4 devices


def eps_after(rounds: int) -> float:
    return epsilon(0.5, 1.0, rounds, DELTA, "rdp")


def run(out, *flags: str) -> list[dict]:
    assert main([*QUICK, *DP, "--out", str(out), *flags]) == 0
    return read_metrics(out / METRICS_FILE)


def test_every_row_carries_the_epsilon_spent_so_far(tmp_path):
    records = run(tmp_path / "run", "--rounds", "2")
    assert [r["epsilon"] for r in records] == pytest.approx([eps_after(1), eps_after(2)])


@pytest.mark.parametrize("algo", ["fedavg", "fedrep"])
def test_every_algorithm_with_a_shared_model_runs_private(algo, tmp_path):
    records = run(tmp_path / "run", "--rounds", "1", "--algo", algo)
    assert records[0]["epsilon"] == pytest.approx(eps_after(1)) and records[0]["aggregated"]


def test_the_report_shows_the_budget_spent(tmp_path):
    records = run(tmp_path / "run", "--rounds", "1")
    text = (tmp_path / "run" / REPORT_FILE).read_text()
    assert f"user-level ε = {records[-1]['epsilon']:.4g} spent after round 1" in text and "| ε |" in text
    assert (tmp_path / "run" / PRIVACY_PLOT).stat().st_size > 0


def test_the_status_and_metrics_show_the_budget_spent(tmp_path):
    args = build_parser().parse_args([*QUICK, *DP, "--rounds", "3", "--dp-target-epsilon", "9",
                                      "--out", str(tmp_path / "s")])
    engine = Simulation(args, RunFolder(tmp_path / "s")).engine
    engine.dp.accountant.charge()  # as if one round had opened
    snapshot = fleet_snapshot(engine, now=0.0, wall=0.0)
    assert snapshot["privacy"]["epsilon"] == pytest.approx(eps_after(1))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    values = {(s.name, tuple(s.labels.values())): s.value
              for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}
    assert values[("fedara_privacy_epsilon", ("spent",))] == pytest.approx(eps_after(1))
    assert values[("fedara_privacy_epsilon", ("target",))] == 9.0
    assert values[("fedara_privacy_delta", ())] == pytest.approx(DELTA)


def test_a_run_without_dp_reports_no_epsilon(tmp_path):
    assert main([*QUICK, "--rounds", "1", "--out", str(tmp_path / "run")]) == 0
    assert [r["epsilon"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == [None]


def test_the_run_stops_before_the_round_that_would_exceed_the_budget(tmp_path, capsys):
    target = (eps_after(2) + eps_after(3)) / 2
    records = run(tmp_path / "run", "--rounds", "5", "--dp-target-epsilon", f"{target:.6f}")
    assert [r["round"] for r in records] == [1, 2]
    assert records[-1]["epsilon"] <= target
    out = capsys.readouterr().out
    assert f"privacy: --dp-target-epsilon {float(f'{target:.6f}'):g} stops the run after round 2 of 5" in out
    assert out.index("privacy: --dp-target-epsilon") < out.index(f"round 1/5")  # said before training
    assert "privacy budget: round 3 would spend" in out
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME).state["finished"]
    assert f"stopped by the privacy budget at ε = {records[-1]['epsilon']:.4g} after round 2 of 5" in \
        (tmp_path / "run" / REPORT_FILE).read_text()


@pytest.mark.slow
def test_a_run_whose_noise_swamps_the_updates_stops_naming_the_noise_instead_of_going_on(tmp_path, capsys):
    """digits, 3 devices, z = 1, C = 1: noise of std 1/3 per coordinate; the devices' training goes NaN on a noised
    model (round 1's or 2's: which one depends on the draw, so the noise is seeded here), and the run stops at the
    round after it (exit 2) without releasing more."""
    flags = ["--dataset", "digits", "--clients", "3", "--rounds", "4", "--local-epochs", "1", "--aggregate", "updates",
             "--dp-noise-multiplier", "1", "--dp-clip", "1", "--dp-test-seed", "0", "--out", str(tmp_path / "run")]
    assert main(flags) == 2
    err = capsys.readouterr().err
    stopped = re.search(r"round (\d+): every training device's round went non-finite on the model of round (\d+)", err)
    assert stopped and int(stopped[2]) == int(stopped[1]) - 1
    assert "std z·C/E = 1·1/3 = 0.333 per coordinate" in err
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME).round == int(stopped[2])


def test_a_resumed_run_continues_the_accounting(tmp_path):
    run(tmp_path / "run", "--rounds", "2")
    records = run(tmp_path / "run", "--rounds", "3", "--resume")
    assert [r["round"] for r in records] == [1, 2, 3]
    assert records[-1]["epsilon"] == pytest.approx(eps_after(3))


ASYNC = ["--mode", "async", "--buffer-size", "2", "--concurrency", "3", "--rank-tiers", "1.0,0.25",
         "--device-speed", "lognormal:1", "--availability", "0.7,0.2", "--dp-clip", "0.01"]


def versions_eps(versions: int) -> float:
    """ε after this many async versions: unsampled Gaussian mechanisms (rate 1) at the default δ."""
    return epsilon(1.0, 1.0, versions, DELTA, "rdp")


def test_an_async_run_charges_each_version_as_an_unsampled_gaussian(tmp_path):
    records = run(tmp_path / "run", *ASYNC, "--rounds", "3")
    assert [r["round"] for r in records] == [1, 2, 3]
    assert [r["epsilon"] for r in records] == pytest.approx([versions_eps(1), versions_eps(2), versions_eps(3)])


def test_an_async_run_stops_before_the_version_that_would_exceed_the_budget(tmp_path, capsys):
    target = (versions_eps(2) + versions_eps(3)) / 2
    records = run(tmp_path / "run", *ASYNC, "--rounds", "5", "--dp-target-epsilon", f"{target:.6f}")
    assert [r["round"] for r in records] == [1, 2] and records[-1]["epsilon"] <= target
    out = capsys.readouterr().out
    assert f"privacy: --dp-target-epsilon {float(f'{target:.6f}'):g} stops the run after version 2 of 5" in out
    assert out.index("privacy: --dp-target-epsilon") < out.index(f"version 1/5")  # said before training
    assert "privacy budget: round 3 would spend" in out
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME).state["finished"]
    assert f"stopped by the privacy budget at ε = {records[-1]['epsilon']:.4g} after version 2 of 5" in \
        (tmp_path / "run" / REPORT_FILE).read_text()


@pytest.mark.slow  # three async runs
def test_an_async_run_resumed_mid_run_continues_the_accounting(tmp_path):
    run(tmp_path / "run", *ASYNC, "--rounds", "2")
    records = run(tmp_path / "run", *ASYNC, "--rounds", "3", "--resume")
    assert [r["round"] for r in records] == [1, 2, 3]
    assert records[-1]["epsilon"] == pytest.approx(versions_eps(3))


@pytest.mark.slow  # four runs: ~15 s
def test_the_noise_is_not_fixed_by_the_seed(tmp_path):
    def final(name: str, *flags: str) -> dict[str, np.ndarray]:
        run(tmp_path / name, "--rounds", "1", *flags)
        tensors = load_checkpoint(tmp_path / name / CHECKPOINT_NAME).tensors
        return {k: v for k, v in tensors.items() if k.startswith("fe.")}
    first, second = final("a"), final("b")
    assert any(not np.array_equal(first[k], second[k]) for k in first)
    fixed, again = final("c", "--dp-test-seed", "3"), final("d", "--dp-test-seed", "3")
    assert all(np.array_equal(fixed[k], again[k]) for k in fixed)


def test_a_low_rank_update_far_too_large_moves_the_model_by_at_most_clip_over_expected(tmp_path):
    """The engine, driven by hand, noise negligible: three devices return what they were sent (Δ = 0), one returns
    its factors 1000x larger; the global model moves by C/E, E = q·N = 2, with Δ taken on the reconstruction."""
    args = build_parser().parse_args([*QUICK, "--rounds", "1", "--rank-ratio", "0.5", "--dp-accountant", "rdp",
                                      "--dp-noise-multiplier", "1e-9", "--dp-clip", "0.5", "--dp-test-seed", "1",
                                      "--out", str(tmp_path / "s")])
    sim = Simulation(args, RunFolder(tmp_path / "s"))
    engine = sim.engine
    before = {k: v.clone() for k, v in engine.global_state.items()}
    now = time.monotonic()
    tasks = engine.open_round(1, now)
    trainers = sorted(engine.opened.train)
    assert trainers, "seeded Poisson sample of 4 at rate 0.5 drew nobody: pick another --dp-test-seed"
    attacker = trainers[0]
    for device_id in trainers:
        weights = {n: v * (1000.0 if device_id == attacker else 1.0) for n, v in tasks[device_id].weights.items()}
        shard = sim.devices[device_id].shard
        msg = update_message(Update(1, weights, shard.y_train.size, 0.5, 0.5,
                                    {"eval_correct": 1, "eval_loss": 1.0, "eval_total": shard.y_test.size}),
                             plan_hash=sim.devices[device_id].plan_hash, device_id=device_id, run_id=sim.run_id)
        assert engine.receive(device_id, msg, now).accepted
    sent = reconstruct_state(to_torch(tasks[attacker].weights), engine.dense_shapes)
    returned = reconstruct_state(to_torch({n: v * 1000.0 for n, v in tasks[attacker].weights.items()}),
                                 engine.dense_shapes)
    assert l2_norm({k: returned[k] - sent[k] for k in sent}) > 1000 * 0.5  # far beyond the clip
    engine.close_round(now)
    moved = l2_norm({k: engine.global_state[k].double() - before[k].double() for k in before})
    assert moved == pytest.approx(0.5 / 2, rel=1e-4)  # float32 model: ~1e-7 relative, noise 1e-9·C/E per entry
