"""The server <-> device messages: every kind survives the wire, and nonsense fields are refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from device_runtime.artifact_contract import TRAINING_KIND
from device_runtime.auth import Direction
from device_runtime.envelope import Message, decode, seal
from device_runtime.framing import Reassembler, chunk
from device_runtime.messages import (ARTIFACT_BLOBS_BY_KIND, ErrorCode, Join, MessageError, Plan, ShardInfo, ack_message,
                                     error_message, join_message, parse_ack, parse_error,
                                     parse_join, parse_plan, parse_task, parse_update, plan_message, task_message,
                                     update_message)
from device_runtime.profile import ProfileError, ResourceProfile, collect_profile
from device_runtime.task import Phase, Task, Update

MAX_BYTES = 1 << 24
HASH = "ab" * 32
PROFILE = ResourceProfile(memory_budget_mb=128.0, threads=1, cpu_count=4, machine="aarch64", system="Linux",
                          total_memory_mb=1024.0, probe_gflops=3.5)
FE = {"fe.conv1.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2), "fe.fc1.u": np.ones((5, 2), np.float32)}


def wire(msg: Message) -> Message:
    return decode(encode(msg), max_bytes=MAX_BYTES)


def encode(msg: Message) -> bytes:
    return seal(msg, bytes(32), Direction.UP, 1)


def make_task(**changes) -> Task:
    return Task(**{**dict(round=3, weights=FE, lam=2.0, mu=1e-3, lr=0.05, phases=(Phase("all", 1),), batch_size=32,
                          seed=7, returns="fe", deadline=1.7e9), **changes})


def test_join_round_trips():
    join = Join(PROFILE, ShardInfo(90, 30, (1, 28, 28), 10), (HASH,))
    assert parse_join(wire(join_message(join, device_id="dev_000"))) == join


def test_join_with_a_malformed_profile_is_refused():
    msg = join_message(Join(PROFILE, ShardInfo(90, 30, (1, 28, 28), 10), ()), device_id="dev_000")
    msg.meta["profile"]["threads"] = 0
    with pytest.raises(MessageError, match="threads"):
        parse_join(wire(msg))


def test_plan_carries_artifact_files():
    files = {name: name.encode() * 3 for name in ARTIFACT_BLOBS_BY_KIND[TRAINING_KIND]}
    plan = Plan(HASH, 0.5, "fe.fc1@r256", files)
    assert parse_plan(wire(plan_message(plan, device_id="dev_000", run_id="run1"))) == plan


def test_plan_without_files_means_the_device_has_them():
    plan = Plan(HASH, 1.0, "dense", {})
    assert parse_plan(wire(plan_message(plan, device_id="dev_000", run_id="run1"))).files == {}


def test_plan_carries_the_initial_personal_tensors():
    init = {"head.fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "head.fc.bias": np.zeros(2, np.float32)}
    got = parse_plan(wire(plan_message(Plan(HASH, 1.0, "dense", {}, init), device_id="dev_000", run_id="run1")))
    assert set(got.init) == set(init)
    for name, value in init.items():
        np.testing.assert_array_equal(got.init[name], value)


def test_plan_with_float64_initial_tensors_is_refused():
    msg = plan_message(Plan(HASH, 1.0, "dense", {}, {"head.w": np.ones(3)}), device_id="dev_000", run_id="run1")
    with pytest.raises(MessageError, match="float32"):
        parse_plan(wire(msg))


def test_plan_with_a_foreign_file_is_refused():
    files = {name: b"x" for name in ARTIFACT_BLOBS_BY_KIND[TRAINING_KIND]} | {"evil.sh": b"rm -rf /"}
    msg = plan_message(Plan(HASH, 1.0, "dense", files), device_id="dev_000", run_id="run1")
    with pytest.raises(MessageError, match="plan files"):
        parse_plan(wire(msg))


def test_task_round_trips_with_its_tensors():
    plan_hash, task = parse_task(wire(task_message(make_task(), plan_hash=HASH, device_id="dev_000", run_id="r")))
    assert plan_hash == HASH
    assert (task.round, task.lam, task.mu, task.lr, task.phases, task.returns, task.batch_size, task.seed,
            task.deadline) == (3, 2.0, 1e-3, 0.05, (Phase("all", 1),), "fe", 32, 7, 1.7e9)
    for name, value in FE.items():
        np.testing.assert_array_equal(task.weights[name], value)


def test_an_async_task_carries_the_version_of_its_weights_and_a_sync_one_does_not():
    sync_msg = task_message(make_task(), plan_hash=HASH, device_id="dev_000", run_id="r")
    assert "version" not in sync_msg.meta and parse_task(wire(sync_msg))[1].model_name == "round2"
    _, task = parse_task(wire(task_message(make_task(version=5), plan_hash=HASH, device_id="dev_000", run_id="r")))
    assert (task.round, task.version, task.model_name) == (3, 5, "version5")


def test_phases_and_returns_round_trip_in_order():
    phases = (Phase("head", 1), Phase("fe", 3))
    sent = make_task(phases=phases, returns="all")
    _, task = parse_task(wire(task_message(sent, plan_hash=HASH, device_id="dev_000", run_id="r")))
    assert task.phases == phases and task.returns == "all" and task.epochs == 4


def test_no_phases_is_an_evaluation_only_task():
    _, task = parse_task(wire(task_message(make_task(phases=(), returns="none"), plan_hash=HASH, device_id="dev_000",
                                           run_id="r")))
    assert task.evaluate_only and not make_task().evaluate_only


@pytest.mark.parametrize("phases, match", [([["bias", 1]], "task phase"), ([["fe", 0]], "phase epochs"),
                                           ("fe", "task phases"), ([["fe", 1]] * 5, "task phases")])
def test_task_with_malformed_phases_is_refused(phases, match):
    msg = task_message(make_task(), plan_hash=HASH, device_id="dev_000", run_id="r")
    msg.meta["phases"] = phases
    with pytest.raises(MessageError, match=match):
        parse_task(wire(msg))


def test_task_with_an_unknown_returns_is_refused():
    msg = task_message(make_task(), plan_hash=HASH, device_id="dev_000", run_id="r")
    msg.meta["returns"] = "everything"
    with pytest.raises(MessageError, match="returns"):
        parse_task(wire(msg))


@pytest.mark.parametrize("field, value, match", [("lr", 0.0, "lr"), ("batch_size", 0, "batch_size"),
                                                 ("lam", -1.0, "lam"), ("seed", -1, "seed")])
def test_task_with_an_out_of_range_field_is_refused(field, value, match):
    msg = task_message(make_task(), plan_hash=HASH, device_id="dev_000", run_id="r")
    msg.meta[field] = value
    with pytest.raises(MessageError, match=match):
        parse_task(wire(msg))


def test_task_with_float64_tensors_is_refused():
    task = make_task(weights={"fe.w": np.ones(3)})
    with pytest.raises(MessageError, match="float32"):
        parse_task(wire(task_message(task, plan_hash=HASH, device_id="dev_000", run_id="r")))


def test_update_round_trips():
    update = Update(3, FE, 90, 0.7, 0.8, {"eval_correct": 20, "eval_total": 30, "eval_loss": 0.9})
    plan_hash, got = parse_update(wire(update_message(update, plan_hash=HASH, device_id="dev_000", run_id="r")))
    assert plan_hash == HASH
    assert (got.round, got.num_samples, got.train_loss, got.train_accuracy, got.metrics) == \
        (3, 90, 0.7, 0.8, update.metrics)
    np.testing.assert_array_equal(got.weights["fe.fc1.u"], FE["fe.fc1.u"])


def test_update_missing_its_sample_count_is_refused():
    msg = update_message(Update(3, FE, 90, 0.7, 0.8), plan_hash=HASH, device_id="dev_000", run_id="r")
    del msg.meta["num_samples"]
    with pytest.raises(MessageError, match="num_samples"):
        parse_update(wire(msg))


def test_parser_refuses_a_message_of_another_type():
    with pytest.raises(MessageError, match="expected a task message"):
        parse_task(wire(ack_message(HASH, device_id="dev_000", run_id="r")))


def test_ack_and_error_round_trip():
    assert parse_ack(wire(ack_message(HASH, device_id="dev_000", run_id="r"))) == HASH
    report = parse_error(wire(error_message(ErrorCode.ARTIFACTS_CORRUPT, "bad checkpoint", device_id="dev_000")))
    assert (report.code, report.detail) == (ErrorCode.ARTIFACTS_CORRUPT, "bad checkpoint")


def test_unknown_error_code_is_refused():
    msg = error_message(ErrorCode.REJOIN, "x", device_id="dev_000")
    msg.meta["code"] = "format_disk"
    with pytest.raises(MessageError, match="unknown error code"):
        parse_error(wire(msg))


def test_task_larger_than_the_frame_limit_round_trips_in_chunks():
    big = {"fe.fc1.weight": np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)}
    payload = encode(task_message(make_task(weights=big), plan_hash=HASH, device_id="dev_000", run_id="r"))
    frames = chunk(payload, 64 * 1024, "task-1")
    assert len(frames) > 30 and all(len(f) <= 64 * 1024 for f in frames)
    reassembler = Reassembler(MAX_BYTES, timeout_s=10.0, max_pending=4)
    delivered = [p for f in reversed(frames) if (p := reassembler.feed(f, now=0.0)) is not None]
    _, task = parse_task(decode(delivered[0], max_bytes=MAX_BYTES))
    np.testing.assert_array_equal(task.weights["fe.fc1.weight"], big["fe.fc1.weight"])


def test_collected_profile_measures_this_machine():
    profile = collect_profile(memory_budget_mb=256.0, threads=2)
    assert profile.memory_budget_mb == 256.0 and profile.threads == 2
    assert profile.cpu_count >= 1 and profile.probe_gflops > 0
    assert ResourceProfile.from_meta(profile.to_meta()) == profile


def test_profile_with_a_negative_budget_is_refused():
    with pytest.raises(ProfileError, match="memory_budget_mb"):
        ResourceProfile.from_meta(dict(PROFILE.to_meta(), memory_budget_mb=-5))
