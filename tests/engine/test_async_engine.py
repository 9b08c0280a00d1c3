"""The round engine's async mode (server/engine/async_engine.py), driven directly with explicit ``now``: tasks by
version, updates judged against their task, the buffer applied every K updates, records and state per version."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_runtime.messages import Join, ShardInfo, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Update
from fedcore.models import build_model
from server.engine.async_engine import TIMED_OUT, AsyncEngine
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.fedbuff import TOO_STALE
from server.engine.run_config import BufferRule
from server.engine.round_engine import RoundEngine, algorithm_for
from server.engine.run_config import FederationConfig
from server.run_setup import PlanBook, global_state, initial_personal

SHAPE = (1, 28, 28)
CLASSES = 10
RUN = "run0"
PROFILE = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0)
DEVICES = [f"dev_{i:03d}" for i in range(4)]
EVAL = {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0}


def parts(algo: str, tiers: tuple[float, ...]):
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    config = FederationConfig(algo=algo, rounds=3, local_epochs=1, aggregate="updates")
    algorithm = algorithm_for(config)
    coordinator = Coordinator(CoordinatorConfig(SHAPE, CLASSES, round_deadline_s=10.0), RUN)
    overrides = {d: tiers[i % len(tiers)] for i, d in enumerate(DEVICES)}
    return ((algorithm, config, coordinator, PlanBook(model, SHAPE, None, onnx=False), global_state(model, algorithm),
             initial_personal([model], algorithm)), dict(tiers=tiers, overrides=overrides))


def make_async(algo: str = "fedara", *, tiers=(1.0, 0.5), buffer_size: int = 2, max_staleness: int = 3,
               concurrency: int = 4, exponent: float = 0.5, joined: bool = True,
               timeout: float | None = None, shared_payloads: bool = False) -> AsyncEngine:
    args, kwargs = parts(algo, tiers)
    engine = AsyncEngine(*args, **kwargs, rule=BufferRule(buffer_size, max_staleness, exponent,
                                                          concurrency=concurrency, task_timeout=timeout),
                         shared_payloads=shared_payloads)
    if joined:
        join_all(engine)
    return engine


def join_all(engine: RoundEngine) -> None:
    for device_id in DEVICES:
        admission = engine.join(device_id, Join(PROFILE, ShardInfo(50, 10, SHAPE, CLASSES), ()))
        engine.acknowledge(device_id, admission.plan.plan_hash)


def reply(engine: RoundEngine, device_id: str, task, scale: float = 1.1, round_index: int | None = None):
    """The device's UPDATE for ``task``: its received tensors times ``scale`` (what training changed)."""
    weights = {} if task.evaluate_only or task.returns == "none" else \
        {k: v * np.float32(scale) for k, v in task.weights.items()}
    update = Update(task.round if round_index is None else round_index, weights, 0 if task.evaluate_only else 50,
                    1.0, 0.5, EVAL)
    return update_message(update, plan_hash=engine.plan_info(device_id).hash, device_id=device_id, run_id=RUN)


def test_with_every_device_in_one_fresh_buffer_a_version_is_the_sync_rounds_model():
    """Oracle: K = N updates of staleness 0 with η_g = 1 is the sync rule ω + Σ p_k (W_k − S_k). Both sum float64
    reconstructions of float32 factors, in other orders (measured max |Δ| 3e-8 here; bound 1e-6)."""
    engine = make_async(buffer_size=4)
    tasks = engine.dispatch(DEVICES)
    for device_id in DEVICES:
        assert engine.receive(device_id, reply(engine, device_id, tasks[device_id]), now=1.0).accepted
    assert engine.version == 1
    args, kwargs = parts("fedara", (1.0, 0.5))
    sync = RoundEngine(*args, **kwargs)
    join_all(sync)
    for device_id, task in sync.open_round(1, now=0.0).items():
        assert sync.receive(device_id, reply(sync, device_id, task), now=1.0).accepted
    sync.close_round(now=2.0)
    for key, value in sync.global_state.items():
        torch.testing.assert_close(engine.global_state[key], value, rtol=0, atol=1e-6)


def test_staleness_is_measured_from_the_tasks_version_and_recorded_per_version():
    engine = make_async(buffer_size=2)
    tasks = engine.dispatch(DEVICES)  # all four at version 0
    for device_id in DEVICES[:2]:
        engine.receive(device_id, reply(engine, device_id, tasks[device_id]), now=1.0)
    assert engine.version == 1
    for device_id in DEVICES[2:]:  # one version late
        engine.receive(device_id, reply(engine, device_id, tasks[device_id]), now=2.0)
    engine.finish()
    assert [(r["round"], r["staleness_mean"], r["sim_time"]) for r in engine.records] == [(1, 0.0, 1.0),
                                                                                       (2, 1.0, 2.0)]


def test_a_task_goes_to_at_most_concurrency_devices_chosen_by_seed():
    first, second = make_async(concurrency=2), make_async(concurrency=2)
    chosen = first.dispatch(DEVICES)
    assert len(chosen) == 2 and chosen.keys() == second.dispatch(list(reversed(DEVICES))).keys()
    assert first.dispatch(DEVICES) == {}  # no free slot


def test_a_replayed_update_or_one_for_an_old_task_moves_nothing():
    engine = make_async(buffer_size=3)
    tasks = engine.dispatch(DEVICES)
    device_id = DEVICES[0]
    msg = reply(engine, device_id, tasks[device_id])
    assert engine.receive(device_id, msg, now=1.0).accepted
    before = {k: v.clone() for k, v in engine.buff._buffer.sums.items()}
    assert "no task in flight" in engine.receive(device_id, msg, now=1.5).reason  # the same bytes again
    new_task = engine.dispatch([device_id])[device_id]
    old = reply(engine, device_id, tasks[device_id])
    assert f"task is {new_task.round}" in engine.receive(device_id, old, now=2.5).reason
    assert all(torch.equal(before[k], v) for k, v in engine.buff._buffer.sums.items())
    assert engine.buff.buffered == [(device_id, 0)]


def test_an_update_staler_than_the_limit_is_refused_and_counted_in_the_row():
    engine = make_async(buffer_size=1, max_staleness=1)
    tasks = engine.dispatch(DEVICES[:3])
    for device_id in DEVICES[:2]:
        engine.receive(device_id, reply(engine, device_id, tasks[device_id]), now=1.0)
    verdict = engine.receive(DEVICES[2], reply(engine, DEVICES[2], tasks[DEVICES[2]]), now=2.0)
    assert not verdict.accepted and verdict.reason.startswith(TOO_STALE)
    engine.receive(DEVICES[3], reply(engine, DEVICES[3], engine.dispatch([DEVICES[3]])[DEVICES[3]]), now=3.0)
    engine.finish()
    row = engine.records[-1]
    assert row["too_stale"] == 1 and DEVICES[2] in row["dropped"] and engine.version == 3


def test_a_run_resumed_mid_buffer_makes_the_same_model():
    def run(stop: bool) -> dict[str, torch.Tensor]:
        engine = make_async(buffer_size=3)
        tasks = engine.dispatch(DEVICES)
        for i, device_id in enumerate(DEVICES):
            if stop and i == 1:  # one update waits in the buffer
                state, tensors = engine.to_state(), engine.state_tensors()
                tensors.update(engine.global_arrays())
                engine = make_async(buffer_size=3, joined=False)
                engine.restore(state, tensors)
                join_all(engine)
                tasks = {d: engine.resend(d) for d in engine.training()}
            engine.receive(device_id, reply(engine, device_id, tasks[device_id], scale=1.0 + i / 10), now=1.0 + i)
        more = engine.dispatch(DEVICES)
        for device_id, task in sorted(more.items()):
            engine.receive(device_id, reply(engine, device_id, task), now=6.0)
        assert engine.version == 2
        return engine.global_state
    straight, resumed = run(False), run(True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_evaluations_asked_of_a_version_complete_its_row():
    engine = make_async(buffer_size=4)
    tasks = engine.dispatch(DEVICES)
    for device_id in DEVICES:
        engine.receive(device_id, reply(engine, device_id, tasks[device_id]), now=1.0)
    evaluations = engine.evaluation_tasks(DEVICES[:3])
    assert all(t.evaluate_only and t.round > tasks[DEVICES[-1]].round for t in evaluations.values())
    for device_id, task in evaluations.items():
        assert engine.receive(device_id, reply(engine, device_id, task), now=1.5).accepted
    row = engine.finish()
    assert row["round"] == 1 and row["evaluated"] == 3 and row["accuracy"] == 0.5


@pytest.mark.parametrize("algo", ["fedavg", "fedrep", "local"])
def test_every_algorithm_makes_versions(algo):
    engine = make_async(algo, tiers=(1.0,), buffer_size=2)
    tasks = engine.dispatch(DEVICES)
    for device_id in DEVICES:
        assert engine.receive(device_id, reply(engine, device_id, tasks[device_id]), now=1.0).accepted
    assert engine.version == 2
    initial = global_state(build_model("fedavgcnn", SHAPE, CLASSES, seed=0), algorithm_for(FederationConfig(algo=algo)))
    assert any(not torch.equal(engine.global_state[k], v) for k, v in initial.items()) == (algo != "local")


def test_a_task_not_answered_in_the_task_timeout_frees_its_slot_and_is_counted_in_the_row():
    engine = make_async(buffer_size=1, concurrency=2, timeout=5.0)
    tasks = engine.dispatch(DEVICES, now=0.0)
    stuck, answering = sorted(tasks)
    assert engine.expire(4.9) == [] and engine.next_expiry() == 5.0
    assert engine.expire(5.0) == [stuck, answering]  # both reached it: neither answered
    assert engine.free_slots() == 2
    again = engine.dispatch([answering], now=6.0)
    engine.receive(answering, reply(engine, answering, again[answering]), now=7.0)
    engine.finish()
    assert engine.records[-1]["timed_out"] == 2 and stuck in engine.records[-1]["dropped"]


def test_a_late_update_of_a_timed_out_task_is_refused_with_its_reason_and_moves_nothing():
    engine = make_async(buffer_size=2, concurrency=1, timeout=5.0)
    device_id, task = next(iter(engine.dispatch(DEVICES, now=0.0).items()))
    engine.expire(10.0)
    verdict = engine.receive(device_id, reply(engine, device_id, task), now=11.0)
    assert not verdict.accepted and verdict.reason.startswith(TIMED_OUT)
    assert engine.buff.buffered == [] and engine.version == 0


def test_without_a_task_timeout_a_silent_device_keeps_its_slot():
    engine = make_async(concurrency=1)
    engine.dispatch(DEVICES, now=0.0)
    assert engine.expire(1e9) == [] and engine.next_expiry() is None and engine.free_slots() == 0


def test_a_task_restored_from_a_checkpoint_times_out_counting_from_the_first_expire_after():
    engine = make_async(concurrency=1, timeout=5.0)
    engine.dispatch(DEVICES, now=0.0)
    state, tensors = engine.to_state(), engine.state_tensors()
    tensors.update(engine.global_arrays())
    resumed = make_async(concurrency=1, timeout=5.0, joined=False)
    resumed.restore(state, tensors)
    training = resumed.training()
    assert resumed.expire(100.0) == [] and resumed.expire(105.0) == training


def test_a_non_positive_task_timeout_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--task-timeout"):
        BufferRule(task_timeout=0.0)


def test_a_versions_row_waits_for_the_evaluations_asked_of_it_until_the_version_after_next():
    engine = make_async(buffer_size=1, concurrency=2)
    trainer, evaluator, silent = DEVICES[0], DEVICES[1], DEVICES[2]
    task = engine.dispatch([trainer])[trainer]
    engine.receive(trainer, reply(engine, trainer, task), now=1.0)  # version 1
    asked = engine.evaluation_tasks([evaluator, silent])
    task = engine.dispatch([trainer])[trainer]
    engine.receive(trainer, reply(engine, trainer, task), now=2.0)  # version 2: version 1's row still waits
    assert [r["round"] for r in engine.records] == []
    engine.receive(evaluator, reply(engine, evaluator, asked[evaluator]), now=2.5)
    assert [r["round"] for r in engine.records] == []  # the silent device is still asked
    task = engine.dispatch([trainer])[trainer]
    engine.receive(trainer, reply(engine, trainer, task), now=3.0)  # version 3: rows 1 and 2 are written
    # version 1: the evaluator and the trainer's task of version 1 (every task evaluates what it carries first)
    assert [(r["round"], r["evaluated"]) for r in engine.records] == [(1, 2), (2, 1)]


def test_with_shared_payloads_a_task_sent_again_names_its_payload_and_costs_no_model_bytes():
    engine = make_async(buffer_size=4, shared_payloads=True)
    tasks = engine.dispatch(DEVICES, now=0.0)
    published = {}
    for device_id, task in tasks.items():
        ref, data = engine.payload(device_id, task, now=0.0)
        if data is not None:
            published[ref.sha256] = len(data)
    assert len(published) == 2  # one per plan (two tiers), however many devices
    booked = engine._book.bytes_down
    assert booked == sum(published.values())
    again = engine.resend("dev_001")
    assert engine.payload("dev_001", again, now=1.0) == (engine.payload("dev_001", tasks["dev_001"], now=1.0)[0], None)
    assert engine._book.bytes_down == booked
    assert engine.payload_wanted("dev_001", engine.payload("dev_001", again, now=1.0)[0], now=5.0) is not None
    assert engine._book.bytes_down > booked  # a publish again is booked


def test_with_shared_payloads_a_versions_payload_is_forgotten_once_no_task_uses_it():
    engine = make_async(buffer_size=2, concurrency=2, shared_payloads=True)
    tasks = engine.dispatch(DEVICES, now=0.0)
    refs = {d: engine.payload(d, t, now=0.0)[0] for d, t in tasks.items()}
    assert engine.unused_payloads() == []
    for device_id, task in tasks.items():
        assert engine.receive(device_id, reply(engine, device_id, task), now=1.0).accepted
    assert sorted(r.sha256 for r in engine.unused_payloads()) == sorted({r.sha256 for r in refs.values()})
