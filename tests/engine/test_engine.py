"""The round engine's rules, driven directly (no transport, explicit ``now``)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from device_runtime.artifact_contract import TRAINING_KIND
from device_runtime.messages import update_message
from device_runtime.task import Phase, Update
from server.engine.round_engine import MAX_PLAN_RESENDS
from server.engine.run_config import DpSettings, RunError
from tests.support.engine import RUN, answer, join, make_engine


def test_a_devices_batch_seed_follows_its_id_not_the_order_devices_joined_in():
    first, second = make_engine(), make_engine()
    for device_id in ("dev_000", "dev_001", "dev_002"):
        join(first, device_id)
    for device_id in ("dev_002", "dev_000", "dev_001"):
        join(second, device_id)
    a, b = first.open_round(1, 0.0), second.open_round(1, 0.0)
    assert {d: t.seed for d, t in a.items()} == {d: t.seed for d, t in b.items()}
    assert len({t.seed for t in a.values()}) == 3


def test_fedrep_trains_its_head_then_its_fe_and_returns_the_fe():
    engine = make_engine("fedrep")
    join(engine, "dev_000")
    task = engine.open_round(1, 0.0)["dev_000"]
    assert task.phases == (Phase("head", 1), Phase("fe", 2))
    assert task.returns == "fe" and task.lam == 0.0 and task.mu == 0.0
    assert all(k.startswith("fe.") for k in task.weights)


def test_fedavg_sends_and_expects_the_head_as_well():
    engine = make_engine("fedavg")
    join(engine, "dev_000")
    task = engine.open_round(1, 0.0)["dev_000"]
    assert task.returns == "all" and any(k.startswith("head.") for k in task.weights)
    fe_only = Update(1, {k: v for k, v in task.weights.items() if k.startswith("fe.")}, 50, 1.0, 0.5,
                     {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0})
    msg = update_message(fe_only, plan_hash=engine.plan_info("dev_000").hash, device_id="dev_000", run_id=RUN)
    verdict = engine.receive("dev_000", msg, 1.0)
    assert not verdict.accepted and "missing" in verdict.reason and "head." in verdict.reason


def test_local_training_sends_nothing_and_keeps_no_global_model():
    engine = make_engine("local")
    plan = join(engine, "dev_000")
    assert any(k.startswith("fe.") for k in plan.init)  # the device starts from the initial model, then keeps its own
    task = engine.open_round(1, 0.0)["dev_000"]
    assert task.weights == {} and task.returns == "none"
    assert answer(engine, "dev_000", task).accepted
    result, _ = engine.close_round(2.0)
    assert engine.global_state == {} and engine.pending["aggregated"] is False


def test_fedara_has_no_anchor_term_in_round_one_and_ramps_lambda_after():
    engine = make_engine("fedara", rounds=12)
    join(engine, "dev_000")
    lams = []
    for t in (1, 2, 11):
        task = engine.open_round(t, 0.0)["dev_000"]
        lams.append(task.lam)
        answer(engine, "dev_000", task)
        engine.close_round(1.0)
    assert lams[0] == 0.0 and 0.0 < lams[1] < lams[2] == pytest.approx(10.0)


def test_aggregation_weights_updates_by_training_samples():
    engine = make_engine("fedavg")
    join(engine, "dev_000", num_train=30)
    join(engine, "dev_001", num_train=10)
    before = {k: v.clone() for k, v in engine.global_state.items()}
    tasks = engine.open_round(1, 0.0)
    answer(engine, "dev_000", tasks["dev_000"], num_train=30, scale=1.0)
    answer(engine, "dev_001", tasks["dev_001"], num_train=10, scale=3.0)
    engine.close_round(1.0)
    name = "fe.0.weight" if "fe.0.weight" in before else next(k for k in before if k.startswith("fe."))
    expected = before[name] * (30 * 1.0 + 10 * 3.0) / 40
    assert torch.allclose(engine.global_state[name], expected, atol=1e-6)


def test_a_round_below_min_completion_keeps_the_global_model():
    engine = make_engine("fedavg", min_completion=1.0)
    join(engine, "dev_000")
    join(engine, "dev_001")
    before = {k: v.clone() for k, v in engine.global_state.items()}
    tasks = engine.open_round(1, 0.0)
    answer(engine, "dev_000", tasks["dev_000"], scale=2.0)
    result, _ = engine.close_round(20.0)  # past the deadline, dev_001 silent
    assert not result.enough and engine.pending["aggregated"] is False
    assert all(torch.equal(engine.global_state[k], v) for k, v in before.items())


def test_a_rounds_record_is_completed_by_the_next_rounds_evaluations_with_per_tier_accuracy():
    engine = make_engine("fedara", tiers=(1.0, 0.5), predictor=lambda profile, samples: (lambda ratio: 100 * ratio))
    join(engine, "dev_000", budget=200)  # dense fits
    join(engine, "dev_001", budget=60)  # only 0.5 fits
    tasks = engine.open_round(1, 0.0)
    for device_id, task in tasks.items():
        answer(engine, device_id, task)
    _, completed = engine.close_round(1.0)
    assert completed is None and engine.records == []
    tasks = engine.open_round(2, 2.0)
    for device_id, task in tasks.items():
        answer(engine, device_id, task, now=3.0)
    _, completed = engine.close_round(3.0)
    assert completed["round"] == 1 and completed["accuracy"] == pytest.approx(0.5)
    assert set(completed["per_tier"]) == {"1", "0.5"}
    assert completed["per_device"]["dev_001"]["tier"] == "0.5"


def test_a_record_puts_each_devices_majority_class_baseline_beside_its_accuracy():
    engine = make_engine("fedara", tiers=(1.0, 0.5), predictor=lambda profile, samples: (lambda ratio: 100 * ratio))
    join(engine, "dev_000", budget=200)
    join(engine, "dev_001", budget=60)
    baselines = {"dev_000": {"eval_majority": 5, "eval_classes": 1}, "dev_001": {"eval_majority": 3, "eval_classes": 4}}
    for round_index, now in ((1, 0.0), (2, 2.0)):
        for device_id, task in engine.open_round(round_index, now).items():
            assert answer(engine, device_id, task, now=now + 1, baseline=baselines[device_id]).accepted
        _, completed = engine.close_round(now + 1)
    assert completed["per_device"]["dev_000"] == {"accuracy": 0.5, "tier": "1", "majority": 0.5, "classes": 1,
                                                  "samples": 10}
    assert completed["per_device"]["dev_001"]["majority"] == 0.3
    assert {t: v["majority"] for t, v in completed["per_tier"].items()} == {"1": 0.5, "0.5": 0.3}


def test_a_device_lost_during_its_training_round_that_misses_it_rejoins_at_a_lower_tier():
    engine = make_engine("fedara", tiers=(1.0, 0.5, 0.25), predictor=lambda profile, samples: (lambda ratio: 10 * ratio))
    join(engine, "dev_000", budget=100)
    assert engine.coordinator.devices["dev_000"].ratio == 1.0
    engine.open_round(1, 0.0)
    engine.lost_in_round("dev_000")
    engine.coordinator.set_online("dev_000", False)
    join(engine, "dev_000", budget=100)  # back before the round closed: no evidence yet
    assert engine.coordinator.devices["dev_000"].ratio == 1.0 and engine.demoted == {}
    engine.close_round(20.0)
    join(engine, "dev_000", budget=100)
    assert engine.coordinator.devices["dev_000"].ratio == 0.5


def test_a_device_back_from_a_brief_disconnect_that_answers_its_round_keeps_its_tier():
    engine = make_engine("fedara", tiers=(1.0, 0.5, 0.25), predictor=lambda profile, samples: (lambda ratio: 10 * ratio))
    join(engine, "dev_000", budget=100)
    tasks = engine.open_round(1, 0.0)
    engine.lost_in_round("dev_000")
    join(engine, "dev_000", budget=100)
    assert answer(engine, "dev_000", tasks["dev_000"]).accepted
    engine.close_round(2.0)
    join(engine, "dev_000", budget=100)
    assert engine.coordinator.devices["dev_000"].ratio == 1.0 and engine.demoted == {}


def test_a_device_killed_for_memory_rejoins_at_a_lower_tier_within_the_round():
    engine = make_engine("fedara", tiers=(1.0, 0.5, 0.25), predictor=lambda profile, samples: (lambda ratio: 10 * ratio))
    join(engine, "dev_000", budget=100)
    engine.open_round(1, 0.0)
    engine.lost_in_round("dev_000")
    assert engine.demote("dev_000", "was killed at its 128 MiB memory limit")
    join(engine, "dev_000", budget=100)
    assert engine.coordinator.devices["dev_000"].ratio == 0.5


def test_a_device_killed_for_memory_before_it_had_a_tier_or_at_the_lowest_has_nowhere_lower_to_go():
    engine = make_engine("fedara", tiers=(1.0, 0.5), predictor=lambda profile, samples: (lambda ratio: 10 * ratio))
    assert not engine.demote("dev_000", "was killed at its 20 MiB memory limit")  # it never joined
    join(engine, "dev_000", budget=6)  # 0.5 fits, 1.0 does not
    assert engine.coordinator.devices["dev_000"].ratio == 0.5
    assert not engine.demote("dev_000", "was killed at its 20 MiB memory limit")


def test_artifacts_are_resent_a_bounded_number_of_times():
    engine = make_engine()
    join(engine, "dev_000")
    resent = [engine.artifacts_lost("dev_000") for _ in range(MAX_PLAN_RESENDS + 2)]
    assert sum(plan is not None for plan in resent) == MAX_PLAN_RESENDS


def test_an_update_from_a_device_not_asked_this_round_is_refused_and_changes_nothing():
    """A device that joined after the round opened (not asked at all) and an evaluator posing as a trainer (not
    asked to train) are refused with their reasons; the round then ends exactly as the same round without them."""
    def run(forge: bool):
        engine = make_engine("fedavg", join_ratio=0.5)
        join(engine, "dev_000")
        join(engine, "dev_001")
        for device_id, task in engine.open_round(1, 0.0).items():  # round 1 leaves a record pending
            assert answer(engine, device_id, task).accepted
        engine.close_round(1.0)
        round_1 = copy.deepcopy(engine.global_state)
        tasks = engine.open_round(2, 2.0)
        evaluator = next(d for d, t in tasks.items() if t.evaluate_only)
        trainer = next(d for d, t in tasks.items() if not t.evaluate_only)
        join(engine, "dev_002")  # after the round opened
        if forge:
            before = copy.deepcopy((engine.records, engine.pending, engine.global_state))
            late = answer(engine, "dev_002", tasks[trainer], now=3.0)
            assert (late.accepted, late.reason) == (False, "not asked in round 2")
            posing = answer(engine, evaluator, tasks[trainer], now=3.0)  # a training answer to an evaluation task
            assert not posing.accepted
            assert posing.reason.startswith("tensors do not match the plan: missing [], unknown ['fe."), posing.reason
            after = (engine.records, engine.pending, engine.global_state)
            assert after[:2] == before[:2] and all(torch.equal(after[2][k], v) for k, v in before[2].items())
        assert answer(engine, trainer, tasks[trainer], scale=3.0, now=3.0).accepted
        result, _ = engine.close_round(30.0)
        return engine, result, round_1

    clean, clean_result, round_1 = run(forge=False)
    forged, forged_result, _ = run(forge=True)
    assert forged_result.accepted == clean_result.accepted and len(forged_result.accepted) == 1
    assert forged_result.enough and clean_result.enough
    assert "dev_002" not in forged_result.dropped
    assert forged.global_state.keys() == clean.global_state.keys()
    assert all(torch.equal(forged.global_state[k], clean.global_state[k]) for k in clean.global_state)
    same = ("round", "participants", "selected", "aggregated", "train_loss", "train_accuracy")
    assert {k: forged.pending[k] for k in same} == {k: clean.pending[k] for k in same}
    assert not all(torch.equal(clean.global_state[k], v) for k, v in round_1.items())  # round 2 moved the model


def test_a_device_that_declines_its_round_as_non_finite_is_counted_and_nothing_of_it_is_aggregated():
    """The device whose round diverged (device_runtime.task.non_finite) says so: the round closes without waiting
    for it, its reason is in the record, and the new model is the one its fellow trainer alone makes."""
    def run(decline: bool):
        engine = make_engine("fedavg")
        for device_id in ("dev_000", "dev_001"):
            join(engine, device_id)
        tasks = engine.open_round(1, 0.0)
        assert answer(engine, "dev_000", tasks["dev_000"], scale=2.0).accepted
        if decline:
            verdict = engine.decline("dev_001", 1, "train_loss is nan")
            assert (verdict.accepted, verdict.reason) == (False, "non-finite: train_loss is nan")
        return engine, engine.close_round(1.0)[0]

    declined, result = run(decline=True)
    silent, _ = run(decline=False)  # dev_001 never answers: the round closes at its deadline without it
    assert result.closed_by == "all answered" and result.accepted == ("dev_000",)
    assert result.dropped == {"dev_001": "non-finite: train_loss is nan"}
    assert declined.pending["dropped"] == {"dev_001": "non-finite: train_loss is nan"}
    assert all(torch.equal(declined.global_state[k], v) for k, v in silent.global_state.items())


def test_a_round_whose_every_trainer_went_non_finite_stops_the_run_naming_the_cause():
    engine = make_engine("fedavg")
    for device_id in ("dev_000", "dev_001"):
        join(engine, device_id)
    engine.open_round(1, 0.0)
    for device_id in ("dev_000", "dev_001"):
        engine.decline(device_id, 1, "train_loss is nan")
    before = {k: v.clone() for k, v in engine.global_state.items()}
    with pytest.raises(RunError, match=r"round 1: every training device's round went non-finite .*lower --lr"):
        engine.close_round(1.0)
    assert all(torch.equal(before[k], v) for k, v in engine.global_state.items()) and engine.records == []


def test_a_non_finite_aggregate_is_never_released():
    """DP noise of std z·C/E = 1e39 overflows float32: the model it would make is not released, and the error names
    the noise against the clip."""
    engine = make_engine("fedavg", privacy=DpSettings(1e39, 1.0, 1, clip=1.0, test_seed=0))
    join(engine, "dev_000")
    tasks = engine.open_round(1, 0.0)
    assert answer(engine, "dev_000", tasks["dev_000"], scale=1.01).accepted
    before = {k: v.clone() for k, v in engine.global_state.items()}
    with pytest.raises(RunError, match=r"round 1: the new global model is not finite, so it is not released; the DP "
                                       r"noise added to the model each round has std z·C/E = 1e\+39"):
        engine.close_round(1.0)
    assert all(torch.equal(before[k], v) for k, v in engine.global_state.items())


def test_the_new_model_is_bit_identical_whatever_order_the_updates_arrive_in():
    def run(order: list[str]) -> dict[str, torch.Tensor]:
        engine = make_engine("fedavg")
        for device_id in ("dev_000", "dev_001", "dev_002"):
            join(engine, device_id, num_train=37)
        tasks = engine.open_round(1, 0.0)
        scales = {"dev_000": 1.1, "dev_001": 0.3, "dev_002": 7.7}
        for device_id in order:
            answer(engine, device_id, tasks[device_id], num_train=37, scale=scales[device_id])
        engine.close_round(1.0)
        return engine.global_state, engine.pending["train_loss"]

    (a, loss_a), (b, loss_b) = run(["dev_000", "dev_001", "dev_002"]), run(["dev_002", "dev_000", "dev_001"])
    assert all(torch.equal(a[k], b[k]) for k in a) and loss_a == loss_b


def test_a_resumed_engine_plans_a_device_for_the_runtime_it_joined_with():
    """A checkpoint keeps each device's runtime: the resumed server's first task names a plan of the kind the device
    runs (not the portable kind's, which a training-runtime device answers with 'unknown plan' and a new JOIN)."""
    engine = make_engine()
    join(engine, "dev_000", runtime=TRAINING_KIND)
    resumed = make_engine()
    resumed.restore(copy.deepcopy(engine.to_state()), {k: v.numpy() for k, v in engine.global_state.items()})
    asked = []
    book = resumed.plans

    class Recording:
        def get(self, ratio, kind, model):
            asked.append(kind)
            return book.get(ratio, kind, model)

    resumed.plans = Recording()
    resumed.plan_info("dev_000")
    assert asked == [TRAINING_KIND]


def test_a_tier_no_memory_budget_selects_is_named_once_in_the_log(caplog):
    needs = {1.0: 74.0, 0.5: 74.0, 0.25: 82.0}  # a depthwise-separable model: its factors at 0.25 hold more
    engine = make_engine("fedara", tiers=(1.0, 0.5, 0.25), predictor=lambda profile, samples: needs.__getitem__)
    with caplog.at_level(logging.WARNING, logger="fedara.engine"):
        join(engine, "dev_000", budget=80)
        join(engine, "dev_001", budget=90)
    lines = [r.getMessage() for r in caplog.records if "no device is sent there by its memory" in r.getMessage()]
    assert [line.split(" is predicted")[0] for line in lines] == ["rank tier 0.5", "rank tier 0.25"]
    assert "--rank-overrides" in lines[1] and "tier 1's 74.0" in lines[1]
