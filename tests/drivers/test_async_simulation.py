"""``python -m server.simulate`` on the virtual clock: --mode async end to end, its exact --resume, and sync rounds
timed by their slowest trainer on the same device trace (tiny digits runs, torch backend)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from server.outputs.checkpoint import load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from server.run_setup import RunFolder
from server.simulate import Simulation, build_parser, main
from server.virtual_clock import VirtualFleet

QUICK = ["--dataset", "digits", "--clients", "4", "--local-epochs", "1", "--batch-size", "32", "--max-samples", "600",
         "--lr", "0.05", "--lam", "1", "--lam-warmup", "1", "--rank-tiers", "1.0,0.25", "--aggregate", "updates",
         "--device-speed", "lognormal:1", "--availability", "0.7,0.2"]
ASYNC = ["--mode", "async", "--buffer-size", "2", "--concurrency", "3"]


def run(out, *flags: str) -> list[dict]:
    assert main([*QUICK, "--out", str(out), *flags]) == 0
    return read_metrics(out / METRICS_FILE)


@pytest.mark.parametrize("algo", ["fedara", "local"])
def test_an_async_run_writes_a_row_per_version_on_the_virtual_clock(algo, tmp_path):
    records = run(tmp_path / "run", *ASYNC, "--rounds", "3", "--algo", algo)
    assert [r["round"] for r in records] == [1, 2, 3]
    times = [r["sim_time"] for r in records]
    assert times == sorted(times) and times[0] > 0
    for r in records:
        assert r["participants"] == 2 and r["evaluated"] == 4 and r["mode"] == "async"
        assert r["staleness_max"] >= 0 and r["too_stale"] == 0 and 0 <= r["accuracy"] <= 1


def test_an_async_run_says_each_version_and_each_evaluated_versions_accuracy_once(tmp_path, capsys):
    records = run(tmp_path / "run", *ASYNC, "--rounds", "4")
    out = capsys.readouterr().out.splitlines()
    made = [line.split()[1] for line in out if line.startswith("version ")]
    said = [line.split()[3].rstrip(":") for line in out if line.startswith("  accuracy after version ")]
    assert made == ["1/4", "2/4", "3/4", "4/4"]
    assert said == [str(r["round"]) for r in records if r["accuracy"] is not None] == ["1", "2", "3", "4"]
    assert all(" virtual " in line for line in out if line.startswith("version "))


@pytest.mark.slow
def test_an_async_run_resumed_from_its_checkpoint_ends_with_the_same_model(tmp_path):
    run(tmp_path / "straight", *ASYNC, "--rounds", "4")
    run(tmp_path / "resumed", *ASYNC, "--rounds", "2")
    records = run(tmp_path / "resumed", *ASYNC, "--rounds", "4", "--resume")
    straight = load_checkpoint(tmp_path / "straight" / "checkpoint.npz").tensors
    resumed = load_checkpoint(tmp_path / "resumed" / "checkpoint.npz").tensors
    assert set(straight) == set(resumed)
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight)
    straight_rows = read_metrics(tmp_path / "straight" / METRICS_FILE)
    assert [(r["round"], r["accuracy"], r["sim_time"], r["staleness_mean"]) for r in records] == \
        [(r["round"], r["accuracy"], r["sim_time"], r["staleness_mean"]) for r in straight_rows]


def test_a_sync_round_lasts_until_its_slowest_trainer_is_done(tmp_path):
    args = build_parser().parse_args([*QUICK, "--rounds", "1", "--out", str(tmp_path / "sync")])
    simulation = Simulation(args, RunFolder(tmp_path / "sync"))
    record = simulation.run()[0]
    fleet = VirtualFleet.from_flags(args.seed, args.device_speed, args.availability, "fedavgcnn", (1, 28, 28), 32)
    trainers = [d for d in simulation.devices if fleet.online(d, 0.0)]  # devices away at the start only evaluate
    ends = []
    for device_id in trainers:
        steps = math.ceil(len(simulation.devices[device_id].shard.y_train) / 32)
        ratio = simulation.engine.registry()[device_id].ratio
        ends.append(fleet.finish(device_id, 0.0, steps * fleet.step_seconds(ratio) * fleet.trace.factor(device_id)))
    assert record["participants"] == len(trainers) > 0 and record["evaluated"] == 4
    assert record["sim_time"] == max(ends)


def test_an_async_run_whose_every_update_is_refused_stops_in_one_line(tmp_path, capsys):
    flags = list(QUICK)
    flags[flags.index("--lr") + 1] = "1e30"  # every device's training diverges: each update is refused
    assert main([*flags, "--out", str(tmp_path / "run"), *ASYNC, "--rounds", "3"]) == 2
    err = capsys.readouterr().err
    assert "updates in a row were refused, none accepted" in err and "lower --lr" in err
