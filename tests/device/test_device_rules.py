"""The device's decisions, one rule per test (pure functions of its saved state)."""
from __future__ import annotations

from device_runtime.device_rules import DeviceState, TaskAction, answered, on_task, starts_new_run, takes_initial_tensors

PLAN = "a" * 64


def state(answered_round: int = 3, evaluation: bool = False) -> DeviceState:
    return DeviceState("run1", PLAN, answered_round, evaluation, ("head.weight",))


def test_a_task_of_another_run_is_an_unknown_plan():
    assert on_task(state(), PLAN, "run2", PLAN, 4, False, True) == TaskAction.UNKNOWN_PLAN


def test_a_task_for_a_plan_not_loaded_is_an_unknown_plan():
    assert on_task(state(), None, "run1", PLAN, 4, False, True) == TaskAction.UNKNOWN_PLAN


def test_a_task_before_the_last_answered_round_is_stale():
    assert on_task(state(3), PLAN, "run1", PLAN, 2, False, True) == TaskAction.STALE


def test_the_last_answered_task_asked_again_gets_the_saved_answer():
    assert on_task(state(3), PLAN, "run1", PLAN, 3, False, True) == TaskAction.RESEND


def test_without_a_saved_answer_the_same_task_is_computed_again():
    assert on_task(state(3), PLAN, "run1", PLAN, 3, False, False) == TaskAction.COMPUTE


def test_a_training_task_for_a_round_answered_by_evaluation_only_is_computed():
    assert on_task(state(3, evaluation=True), PLAN, "run1", PLAN, 3, False, True) == TaskAction.COMPUTE


def test_the_next_round_is_computed():
    assert on_task(state(3), PLAN, "run1", PLAN, 4, False, True) == TaskAction.COMPUTE


def test_only_a_plan_of_another_run_starts_a_new_run():
    assert starts_new_run(state(), "run2") and not starts_new_run(state(), "run1")


def test_initial_tensors_are_taken_only_while_nothing_of_the_run_is_committed():
    assert takes_initial_tensors(state(), has_committed_personal=False)
    assert not takes_initial_tensors(state(), has_committed_personal=True)
    assert takes_initial_tensors(DeviceState("run1"), has_committed_personal=True)


def test_answering_commits_the_round_and_keeps_the_run_and_plan():
    after = answered(state(3), 4, False)
    assert (after.run_id, after.plan_hash, after.answered_round, after.answered_evaluation) == ("run1", PLAN, 4, False)
