"""The round state machine: who is in, when a round closes, and which updates count (and why not)."""
from __future__ import annotations

import numpy as np
import pytest

from device_runtime.messages import Join, ShardInfo, ack_message, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Update
from server.engine.update_rule import Answer
from server.engine.coordinator import (ALL_ANSWERED, DEADLINE, NO_ANSWER, Coordinator, CoordinatorConfig, Evaluation)

RUN = "run1"
PLAN = "a1" * 32
OTHER_PLAN = "b2" * 32
SHAPES = {"fe.w": (2, 3), "fe.b": (2,)}
DEADLINE_S = 10.0
PROFILE = ResourceProfile(memory_budget_mb=None, threads=1, cpu_count=2, machine="x86_64", system="Linux",
                          total_memory_mb=None, probe_gflops=1.0)
SHARD = ShardInfo(num_train=30, num_test=10, input_shape=(1, 8, 8), num_classes=10)
EVAL = {"eval_correct": 7, "eval_total": 10, "eval_loss": 0.5}


def make_coordinator(devices: int = 3, **config) -> Coordinator:
    """A coordinator whose `devices` devices joined, got PLAN and acknowledged it."""
    coordinator = Coordinator(CoordinatorConfig(input_shape=(1, 8, 8), num_classes=10,
                                                round_deadline_s=DEADLINE_S, **config), RUN)
    for i in range(devices):
        device_id = f"dev_{i:03d}"
        assert coordinator.join(device_id, Join(PROFILE, SHARD, ())) is None
        coordinator.assign_plan(device_id, 1.0, PLAN, SHAPES)
        assert coordinator.acknowledge(device_id, PLAN) is None
    return coordinator


def fe(**changes) -> dict[str, np.ndarray]:
    return {**{name: np.ones(shape, np.float32) for name, shape in SHAPES.items()}, **changes}


def update(device_id: str = "dev_000", round_index: int = 1, tensors=None, num_samples: int = 30,
           metrics=None, plan_hash: str = PLAN, run_id: str = RUN):
    body = Update(round_index, fe() if tensors is None else tensors, num_samples, 0.5, 0.8,
                  dict(EVAL if metrics is None else metrics))
    return Answer.of_message(update_message(body, plan_hash=plan_hash, device_id=device_id, run_id=run_id))


# -- registry -------------------------------------------------------------------------------------


def join_in_order(device_ids: list[str], **config) -> Coordinator:
    """A coordinator whose devices registered, joined and acknowledged PLAN in this order."""
    coordinator = make_coordinator(0, **config)
    for device_id in device_ids:
        coordinator.register(device_id)
    for device_id in device_ids:
        coordinator.join(device_id, Join(PROFILE, SHARD, ()))
        coordinator.assign_plan(device_id, 1.0, PLAN, SHAPES)
        coordinator.acknowledge(device_id, PLAN)
    return coordinator


def test_ready_devices_are_listed_by_id_never_by_the_order_they_came_in():
    assert join_in_order(["dev_c", "dev_a", "dev_b"]).ready_devices() == ["dev_a", "dev_b", "dev_c"]


def test_who_trains_does_not_depend_on_the_order_devices_joined_in():
    ids = [f"dev_{i:03d}" for i in range(8)]
    rounds = [join_in_order(order, join_ratio=0.5, seed=3).open_round(2, now=1.0) for order in (ids, ids[::-1])]
    assert rounds[0] == rounds[1] and len(rounds[0].train) == 4


def test_rejoining_device_keeps_its_plan_and_must_acknowledge_it_again():
    coordinator = make_coordinator(1)
    coordinator.join("dev_000", Join(PROFILE, SHARD, (PLAN,)))
    record = coordinator.devices["dev_000"]
    assert (record.ratio, record.plan_hash, record.ready, record.online) == (1.0, PLAN, False, True)
    assert coordinator.ready_devices() == []


def test_shard_that_does_not_fit_the_model_is_refused():
    coordinator = make_coordinator(0)
    refusal = coordinator.join("dev_x", Join(PROFILE, ShardInfo(30, 10, (3, 32, 32), 10), ()))
    assert "does not fit the model" in refusal and "dev_x" not in coordinator.devices


@pytest.mark.parametrize("model_input, shard_input, fits", [
    ((20, 6), (20, 6), True), ((20, 6), (6, 20), False), ((12,), (12,), True), ((12,), (1, 12), False)])
def test_a_shard_of_any_sample_shape_is_checked_against_the_models_input(model_input, shard_input, fits):
    coordinator = Coordinator(CoordinatorConfig(input_shape=model_input, num_classes=10, round_deadline_s=DEADLINE_S),
                              RUN)
    refusal = coordinator.join("dev_000", Join(PROFILE, ShardInfo(30, 10, shard_input, 10), ()))
    assert (refusal is None) == fits


def test_device_is_ready_only_once_it_acknowledged_its_plan():
    coordinator = make_coordinator(0)
    coordinator.join("dev_000", Join(PROFILE, SHARD, ()))
    coordinator.assign_plan("dev_000", 0.5, PLAN, SHAPES)
    assert coordinator.ready_devices() == []
    assert "its plan is" in coordinator.acknowledge("dev_000", OTHER_PLAN)
    coordinator.acknowledge("dev_000", PLAN)
    assert coordinator.ready_devices() == ["dev_000"]


def test_offline_device_is_not_ready():
    coordinator = make_coordinator(2)
    coordinator.set_online("dev_001", False)
    assert coordinator.ready_devices() == ["dev_000"]


def test_rounds_wait_for_min_devices():
    assert not make_coordinator(2, min_devices=3).can_start()
    assert make_coordinator(3, min_devices=3).can_start()


def test_registry_survives_a_checkpoint_with_every_device_offline():
    coordinator = make_coordinator(2)
    restored = make_coordinator(0)
    restored.restore(coordinator.to_state())
    assert {d: (r.ratio, r.plan_hash, r.ready, r.online, r.num_train, r.artifacts)
            for d, r in restored.devices.items()} == \
        {"dev_000": (1.0, PLAN, True, False, 30, {PLAN}), "dev_001": (1.0, PLAN, True, False, 30, {PLAN})}
    assert restored.plan_shapes == {PLAN: SHAPES}


# -- opening rounds --------------------------------------------------------------------------------


def test_with_join_ratio_one_every_ready_device_trains():
    opened = make_coordinator(3).open_round(1, now=0.0)
    assert opened.train == ("dev_000", "dev_001", "dev_002") and opened.evaluate == ()
    assert opened.deadline == DEADLINE_S


def test_devices_not_sampled_evaluate_instead():
    opened = make_coordinator(4, join_ratio=0.5).open_round(1, now=0.0)
    assert len(opened.train) == 2 and sorted(opened.train + opened.evaluate) == [f"dev_{i:03d}" for i in range(4)]


def test_evaluation_round_trains_nobody():
    opened = make_coordinator(2).open_round(6, now=0.0, train=False)
    assert opened.train == () and opened.evaluate == ("dev_000", "dev_001")


# -- judging updates ------------------------------------------------------------------------------


def test_update_answering_the_open_round_is_accepted():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    verdict = coordinator.judge("dev_000", update(), now=1.0)
    assert verdict.accepted and verdict.update.num_samples == 30


NOT_ITS_ANSWER = ("on a topic of 'dev_000' [bad_topic]", "this run is run1", "stale: update for round 2, round 1 is open")
"""Refusals of a message that is not the device's answer to the open round: it may still answer."""


@pytest.mark.parametrize("message, reason", [
    (update(device_id="dev_001"), "on a topic of 'dev_000' [bad_topic]"),
    (update(run_id="oldrun"), "this run is run1"),
    (update(round_index=2), "stale: update for round 2, round 1 is open"),
    (update(plan_hash=OTHER_PLAN), "the device's plan is"),
    (update(tensors=fe(**{"fe.extra": np.ones(2, np.float32)})), "unknown ['fe.extra']"),
    (update(tensors={"fe.w": np.ones((2, 3), np.float32)}), "missing ['fe.b']"),
    (update(tensors=fe(**{"fe.w": np.ones((3, 2), np.float32)})), "shape (3, 2), expected (2, 3)"),
    (update(tensors=fe(**{"fe.w": np.ones((2, 3), np.float64)})), "dtype float64"),
    (update(tensors=fe(**{"fe.b": np.array([1.0, np.nan], np.float32)})), "NaN or infinity"),
    (update(num_samples=10_000), "num_samples 10000, expected 30"),
    (update(metrics={"eval_correct": 11, "eval_total": 10, "eval_loss": 0.1}), "does not fit the 10 test samples"),
    (update(metrics={}), "metrics lack"),
    (update(metrics={**EVAL, "eval_majority": 11}), "eval_majority must be an integer in 0..10"),
    (update(metrics={**EVAL, "eval_classes": True}), "eval_classes must be an integer in 0..10"),
])
def test_bad_update_is_rejected_with_its_reason(message, reason):
    """A refused update is never accepted; it is the device's answer (dropped, with its reason, at the close) only
    when it answers the open round, else the device is still awaited and the round ends as if it never came."""
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    verdict = coordinator.judge("dev_000", message, now=1.0)
    assert not verdict.accepted and reason in verdict.reason
    assert coordinator.judge("dev_001", update(device_id="dev_001"), now=1.0).accepted
    if reason in NOT_ITS_ANSWER:
        assert coordinator.awaits("dev_000") and coordinator.closing(now=1.0) is None
        result = coordinator.close_round(now=DEADLINE_S)
        assert result.accepted == ("dev_001",) and result.dropped == {"dev_000": NO_ANSWER}
    else:
        assert not coordinator.awaits("dev_000") and coordinator.closing(now=1.0) == ALL_ANSWERED
        result = coordinator.close_round(now=1.0)
        assert result.accepted == ("dev_001",) and result.dropped == {"dev_000": verdict.reason}
    assert set(result.evaluations) == {"dev_001"}


def test_update_from_an_unknown_device_is_rejected():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    assert coordinator.judge("dev_999", update(device_id="dev_999"), now=1.0).reason == "unknown device"
    assert "dev_999" not in coordinator.devices and coordinator.awaits("dev_000")
    assert coordinator.close_round(now=DEADLINE_S).dropped == {"dev_000": NO_ANSWER}


def test_second_update_of_a_device_is_a_duplicate():
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    assert coordinator.judge("dev_000", update(), now=2.0).reason == "duplicate update for round 1"
    assert coordinator.close_round(now=DEADLINE_S).accepted == ("dev_000",)  # once


def test_update_after_the_deadline_is_late():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    assert "deadline passed" in coordinator.judge("dev_000", update(), now=DEADLINE_S + 1).reason


def test_update_for_a_closed_round_is_stale():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    coordinator.close_round(now=DEADLINE_S)
    assert "no round is open" in coordinator.judge("dev_000", update(), now=DEADLINE_S + 1).reason


def test_device_joined_after_the_round_opened_was_not_asked():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    coordinator.join("dev_new", Join(PROFILE, SHARD, ()))
    coordinator.assign_plan("dev_new", 1.0, PLAN, SHAPES)
    assert coordinator.judge("dev_new", update(device_id="dev_new"), now=2.0).reason == "not asked in round 1"
    assert coordinator.judge("dev_000", update(), now=2.0).accepted
    result = coordinator.close_round(now=2.0)
    assert result.closed_by == ALL_ANSWERED and result.accepted == ("dev_000",) and "dev_new" not in result.dropped
    assert set(result.evaluations) == {"dev_000"}


def test_evaluation_answer_carries_no_tensors():
    coordinator = make_coordinator(1)
    coordinator.open_round(4, now=0.0, train=False)
    assert coordinator.judge("dev_000", update(round_index=4, tensors={}, num_samples=0), now=1.0).accepted
    result = coordinator.close_round(now=1.0)
    assert result.accepted == () and result.evaluations == {"dev_000": Evaluation(7, 10, 0.5)}


HEAD = {"head.w": (10, 2)}


def test_expected_tensors_replace_the_plans_for_a_training_update():
    """FedAvg's devices send their head too: the engine passes the tensors a training update must carry."""
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    verdict = coordinator.judge("dev_000", update(), now=1.0, expected={**SHAPES, **HEAD})
    assert not verdict.accepted and "missing ['head.w']" in verdict.reason


def test_update_carrying_exactly_the_expected_tensors_is_accepted():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    tensors = fe(**{"head.w": np.ones((10, 2), np.float32)})
    verdict = coordinator.judge("dev_000", update(tensors=tensors), now=1.0, expected={**SHAPES, **HEAD})
    assert verdict.accepted and set(verdict.update.weights) == {"fe.w", "fe.b", "head.w"}


def test_nothing_expected_means_a_training_update_carries_no_tensors():
    """Local training: the update reports its samples and evaluation, and no tensor."""
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    assert coordinator.judge("dev_000", update(tensors={}), now=1.0, expected={}).accepted
    verdict = coordinator.judge("dev_001", update(device_id="dev_001"), now=1.0, expected={})
    assert not verdict.accepted and "unknown ['fe.b', 'fe.w']" in verdict.reason


def test_an_evaluation_answer_carries_no_tensors_whatever_is_expected_of_training():
    coordinator = make_coordinator(2)
    coordinator.open_round(4, now=0.0, train=False)
    assert coordinator.judge("dev_000", update(round_index=4, tensors={}, num_samples=0), now=1.0,
                             expected=SHAPES).accepted
    verdict = coordinator.judge("dev_001", update(device_id="dev_001", round_index=4, num_samples=0), now=1.0,
                                expected=SHAPES)
    assert not verdict.accepted and "unknown ['fe.b', 'fe.w']" in verdict.reason


def test_only_updates_are_judged():
    with pytest.raises(ValueError, match="UPDATE"):
        Answer.of_message(ack_message(PLAN, device_id="dev_000", run_id=RUN))


# -- closing rounds -------------------------------------------------------------------------------


def test_round_closes_once_everyone_answered():
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    assert coordinator.closing(now=1.0) is None
    coordinator.judge("dev_001", update(device_id="dev_001"), now=2.0)
    assert coordinator.closing(now=2.0) == ALL_ANSWERED
    result = coordinator.close_round(now=2.0)
    assert result.accepted == ("dev_000", "dev_001") and result.dropped == {} and result.enough


def test_rejected_answer_does_not_keep_the_round_open():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(num_samples=1), now=1.0)
    assert coordinator.closing(now=1.0) == ALL_ANSWERED
    assert "num_samples" in coordinator.close_round(now=1.0).dropped["dev_000"]


def test_a_device_that_declines_its_round_is_refused_and_does_not_keep_the_round_open():
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    verdict = coordinator.decline("dev_001", 1, "non-finite: train_loss is nan")
    assert not verdict.accepted and verdict.reason == "non-finite: train_loss is nan"
    assert coordinator.closing(now=2.0) == ALL_ANSWERED
    result = coordinator.close_round(now=2.0)
    assert result.accepted == ("dev_000",) and result.dropped == {"dev_001": "non-finite: train_loss is nan"}


@pytest.mark.parametrize("device_id, round_index", [("dev_000", 1), ("dev_001", 2)], ids=["answered", "other-round"])
def test_declining_a_round_that_does_not_await_the_device_changes_nothing(device_id: str, round_index: int):
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    verdict = coordinator.decline(device_id, round_index, "non-finite: train_loss is nan")
    assert not verdict.accepted and verdict.reason.startswith("not asked")
    assert coordinator.awaits("dev_001") and coordinator.close_round(now=2.0).accepted == ("dev_000",)


def test_silent_device_is_dropped_at_the_deadline():
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    assert coordinator.closing(now=DEADLINE_S - 0.1) is None
    assert coordinator.closing(now=DEADLINE_S) == DEADLINE
    result = coordinator.close_round(now=DEADLINE_S)
    assert result.dropped == {"dev_001": NO_ANSWER} and result.closed_by == DEADLINE
    assert result.enough  # 1 of 2 meets the default min completion of 0.5


def test_round_below_min_completion_is_not_aggregated():
    coordinator = make_coordinator(3, min_completion=0.6)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    assert not coordinator.close_round(now=DEADLINE_S).enough


def test_open_round_awaits_only_unanswered_devices():
    coordinator = make_coordinator(2)
    coordinator.open_round(1, now=0.0)
    coordinator.judge("dev_000", update(), now=1.0)
    assert not coordinator.awaits("dev_000") and coordinator.awaits("dev_001")


def test_a_round_cannot_open_twice():
    coordinator = make_coordinator(1)
    coordinator.open_round(1, now=0.0)
    with pytest.raises(RuntimeError, match="still open"):
        coordinator.open_round(2, now=1.0)
