"""Norm-bounded updates (server.engine.robust): off by default; with a bound, an update further than it from the
global FE is clipped onto it or rejected, in the simulator and in the broker loop alike."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from device_runtime.envelope import Message
from device_runtime.messages import update_message
from device_runtime.task import Update, tensor_bytes
from fedcore.lowrank import reconstruct_state
from server import broker_loop, simulate
from server.engine.aggregate import StreamingAverage
from server.outputs.progress import Progress
from server.engine.robust import bound_update, clip_to_bound, fe_distance
from server.engine.run_config import NormAction, NormBound, norm_bound_from_args
from server.run_setup import RunFolder
from server.engine.sampling import plan_key, to_torch
from server.engine.update_rule import Answer
from tests.support.hostile_world import (DENSE, EVAL, FACTORED, RUN, SERVER_LOG, TRAINER, World, close, genuine_update,
                                         open_server, update_topic)
from tests.support.sealing import seal_up as encode  # as the device would seal it

GLOBAL = {"fe.fc.weight": torch.zeros(3, 4), "fe.fc.bias": torch.zeros(3)}
SHAPES = {k: tuple(v.shape) for k, v in GLOBAL.items()}
QUICK = ["--dataset", "digits", "--max-samples", "300", "--clients", "3", "--rounds", "1", "--local-epochs", "1",
         "--batch-size", "32", "--lr", "0.05", "--rank-ratio", "0.5"]


def update_of(fe: dict[str, torch.Tensor], num_samples: int = 10) -> Update:
    return Update(1, {k: v.numpy() for k, v in fe.items()}, num_samples, 0.0, 0.0, {})


def average(updates: list[Update]) -> dict[str, torch.Tensor]:
    """The sample-weighted mean the server aggregates these updates into."""
    running = StreamingAverage(SHAPES)
    for update in updates:
        running.add(to_torch(update.weights), update.num_samples)
    return running.result()


def ones(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: torch.full(v.shape, scale) for k, v in GLOBAL.items()}


# -- the rule --------------------------------------------------------------------------------------


def test_distance_is_the_l2_norm_over_every_fe_tensor():
    assert fe_distance(ones(2.0), GLOBAL) == pytest.approx(2.0 * math.sqrt(15))


def test_update_within_the_bound_counts_as_sent():
    update = update_of(ones())
    assert bound_update(update, GLOBAL, NormBound(4.0)) == (update, pytest.approx(math.sqrt(15)))


def test_clip_scales_an_update_back_onto_the_bound_along_its_direction():
    client = {"fe.fc.weight": torch.arange(12.0).reshape(3, 4), "fe.fc.bias": torch.tensor([1.0, -2.0, 3.0])}
    clipped = clip_to_bound(client, GLOBAL, 2.0)
    assert fe_distance(clipped, GLOBAL) == pytest.approx(2.0)
    scale = 2.0 / fe_distance(client, GLOBAL)
    for name, value in client.items():
        torch.testing.assert_close(clipped[name], value * scale)


def test_reject_refuses_an_update_beyond_the_bound():
    assert bound_update(update_of(ones()), GLOBAL, NormBound(1.0, NormAction.REJECT)) == \
        (None, pytest.approx(math.sqrt(15)))


def test_low_rank_update_is_measured_and_clipped_as_its_full_rank_reconstruction():
    u, v = torch.ones(3, 1), torch.full((4, 1), 2.0)
    update = Update(1, {"fe.fc.u": u.numpy(), "fe.fc.v": v.numpy(), "fe.fc.bias": np.zeros(3, np.float32)}, 10, 0.0,
                    0.0, {})
    clipped, distance = bound_update(update, GLOBAL, NormBound(1.0))
    assert distance == pytest.approx(float(torch.linalg.norm(u @ v.T)))
    assert set(clipped.weights) == set(GLOBAL)
    assert fe_distance(to_torch(clipped.weights), GLOBAL) == pytest.approx(1.0)


def counted(updates: list, rule: NormBound) -> list:
    """The updates the engine's screen lets through (clipped where it clips)."""
    return [bounded for update in updates if (bounded := bound_update(update, GLOBAL, rule)[0]) is not None]


def test_no_client_moves_the_aggregate_further_than_the_bound():
    honest = [update_of(ones(0.1), 30), update_of(ones(-0.2), 20)]
    attacker = update_of(ones(1e6), 1000)
    kept = counted([*honest, attacker], NormBound(1.0))
    assert fe_distance(average(kept), GLOBAL) <= 1.0 + 1e-6
    assert fe_distance(average([*honest, attacker]), GLOBAL) > 1e5


def test_reject_keeps_only_the_updates_within_the_bound():
    honest = update_of(ones(0.1))
    assert counted([honest, update_of(ones(5.0))], NormBound(1.0, NormAction.REJECT)) == [honest]


@pytest.mark.parametrize("bound", [0.0, -1.0, math.nan, math.inf, True])
def test_bound_must_be_a_positive_finite_number(bound):
    with pytest.raises(ValueError, match="update norm bound must be a positive finite number"):
        NormBound(bound)


def test_action_must_be_clip_or_reject():
    with pytest.raises(ValueError, match=r"update norm action must be one of \['clip', 'reject'\], got 'drop'"):
        NormBound(1.0, "drop")


# -- command lines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("parser", [broker_loop.build_parser, simulate.build_parser], ids=["broker_loop", "simulate"])
def test_bound_is_off_by_default(parser):
    assert norm_bound_from_args(parser().parse_args(["--out", "x"])) is None


@pytest.mark.parametrize("parser", [broker_loop.build_parser, simulate.build_parser], ids=["broker_loop", "simulate"])
def test_flags_set_the_bound_and_its_action(parser):
    args = parser().parse_args(["--out", "x", "--update-norm-bound", "2.5", "--update-norm-action", "reject"])
    assert norm_bound_from_args(args) == NormBound(2.5, NormAction.REJECT)


def test_broker_loop_refuses_a_bound_that_is_not_positive(tmp_path: Path, capsys):
    assert broker_loop.main(["--update-norm-bound", "0", "--out", str(tmp_path)]) == 2
    assert "update norm bound must be a positive finite number" in capsys.readouterr().err


def test_simulator_refuses_a_bound_that_is_not_positive(tmp_path: Path, capsys):
    assert simulate.main([*QUICK, "--update-norm-bound", "-1", "--out", str(tmp_path)]) == 2
    assert "update norm bound must be a positive finite number" in capsys.readouterr().err


# -- the coordinator's screen ----------------------------------------------------------------------------


def test_screened_out_update_is_the_devices_rejected_answer(world: World):
    server = open_server(world)
    verdict = server.engine.coordinator.judge(TRAINER, Answer.of_message(genuine_update(world)), 0.0, screen=lambda device, update: "too far")
    assert not verdict.accepted and verdict.reason == "too far"
    assert close(server).dropped[TRAINER] == "too far"


def test_screen_decides_what_is_aggregated(world: World):
    server = open_server(world)
    replacement = Update(1, {}, 30, 0.0, 0.0, {})
    verdict = server.engine.coordinator.judge(TRAINER, Answer.of_message(genuine_update(world)), 0.0, screen=lambda device, update: replacement)
    assert verdict.accepted and verdict.update is replacement


def evaluation_round(server) -> Message:
    """Close round 1 and open the evaluation-only round 2; TRAINER's evaluation answer to it."""
    close(server)
    server.engine.open_round(2, time.monotonic(), train=False)
    evaluation = Update(2, {}, 0, 0.0, 0.0, dict(EVAL))
    return update_message(evaluation, plan_hash=server.engine.plan_info(TRAINER).hash, device_id=TRAINER, run_id=RUN)


def test_evaluation_answers_are_not_screened(world: World):
    server = open_server(world)
    message = evaluation_round(server)
    assert server.engine.coordinator.judge(TRAINER, Answer.of_message(message), time.monotonic(),
                                           screen=lambda device, update: "too far").accepted


def test_engine_screens_training_updates_only(world: World):
    """A bound no update meets, with reject: the engine refuses every training update, never an evaluation."""
    server = open_server(world, "--update-norm-bound", "1e-9", "--update-norm-action", "reject")
    verdict = server.engine.receive(TRAINER, genuine_update(world), time.monotonic())
    assert not verdict.accepted and "over the norm bound 1e-09" in verdict.reason
    message = evaluation_round(server)
    assert server.engine.receive(TRAINER, message, time.monotonic()).accepted


# -- the broker loop ----------------------------------------------------------------------------------


def poisoned_update(world: World) -> Message:
    """TRAINER's update pushed fifty times as far from what it was sent as an honest one."""
    start = world.round_fe[plan_key(world.plans.get(DENSE).resolved)]
    return genuine_update(world, TRAINER, fe={name: value + np.float32(0.5) for name, value in start.items()})


def distance_of(world: World, message: Message) -> float:
    shapes = {name: tuple(value.shape) for name, value in world.global_fe.items()}
    return fe_distance(reconstruct_state(to_torch(message.tensors), shapes), world.global_fe)


def honest_bound(world: World) -> float:
    """Twice the distance of the honest updates of both plans (the low-rank one includes its truncation error)."""
    bound = 2 * max(distance_of(world, genuine_update(world, d)) for d in (TRAINER, FACTORED))
    assert bound < distance_of(world, poisoned_update(world))
    return bound


def test_broker_loop_aggregates_a_poisoned_update_by_default(world: World):
    server = open_server(world)
    server._handle(update_topic(TRAINER), encode(poisoned_update(world)))
    assert close(server).accepted == (TRAINER,)


def test_broker_loop_rejects_an_update_beyond_the_bound(world: World, caplog):
    server = open_server(world, "--update-norm-bound", str(honest_bound(world)), "--update-norm-action", "reject")
    with caplog.at_level(logging.WARNING, logger=SERVER_LOG):
        server._handle(update_topic(TRAINER), encode(poisoned_update(world)))
        server._handle(update_topic(FACTORED), encode(genuine_update(world, FACTORED)))
    result = close(server)
    assert result.accepted == (FACTORED,) and "over the norm bound" in result.dropped[TRAINER]
    assert f"dropped an update from {TRAINER} (round 1): update is" in caplog.text


def test_broker_loop_clips_an_update_onto_the_bound(world: World):
    bound = honest_bound(world)
    server = open_server(world, "--update-norm-bound", str(bound))
    sent = [poisoned_update(world), genuine_update(world, FACTORED)]
    for message in sent:
        server._handle(update_topic(message.device_id), encode(message))
    result = close(server)
    assert result.accepted == (TRAINER, FACTORED) and result.enough
    assert bound / 2 < fe_distance(server.engine.global_state, world.global_fe) <= bound * (1 + 1e-6)
    assert server.engine.pending["bytes_up"] == sum(tensor_bytes(m.tensors) for m in sent)  # counted as sent


# -- the simulator ------------------------------------------------------------------------------------


def simulate_round(out: Path, *flags: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]]:
    """(initial, final) global FE and the records of one simulated round with these flags."""
    args = simulate.build_parser().parse_args([*QUICK, *flags])
    out.mkdir()
    simulation = simulate.Simulation(args, RunFolder(out), progress=Progress(1, emit=lambda line: None))
    initial = {k: v.detach().clone() for k, v in simulation.engine.global_state.items()}
    records = simulation.run()
    return initial, simulation.engine.global_state, records


def test_simulator_with_a_bound_no_update_reaches_matches_the_simulator_without_one(tmp_path: Path):
    initial, unbounded, _ = simulate_round(tmp_path / "unbounded")
    _, bounded, _ = simulate_round(tmp_path / "bounded", "--update-norm-bound", "1e6")
    assert unbounded.keys() == initial.keys() and not torch.equal(unbounded["fe.fc1.weight"], initial["fe.fc1.weight"])
    for name, value in unbounded.items():
        assert torch.equal(bounded[name], value), name


def test_simulator_that_rejects_every_update_keeps_the_global_fe(tmp_path: Path):
    initial, final, records = simulate_round(tmp_path / "run", "--update-norm-bound", "1e-9", "--update-norm-action", "reject")
    assert [(r["participants"], r["selected"], r["aggregated"]) for r in records] == [(0, 3, False)]
    for name, value in initial.items():
        assert torch.equal(final[name], value), name


def test_simulator_clipping_keeps_the_round_within_the_bound(tmp_path: Path):
    initial, final, records = simulate_round(tmp_path / "run", "--update-norm-bound", "0.5")
    assert [(r["participants"], r["aggregated"]) for r in records] == [(3, True)]
    assert 0.25 < fe_distance(final, initial) <= 0.5 * (1 + 1e-6)
