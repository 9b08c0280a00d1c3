"""Buffered asynchronous aggregation (server/engine/fedbuff.py): versions, staleness, the buffer and its step,
driven directly with small float64 tensors whose expected results are written out by hand."""
from __future__ import annotations

import pytest
import torch

from fedcore.lowrank import reconstruct
from server.engine.run_config import BufferRule
from server.engine.fedbuff import TOO_STALE, FedBuff, Judged, staleness_weight, update_delta

SHAPE = (2, 3)


def model(value: float) -> dict[str, torch.Tensor]:
    return {"fe.w": torch.full(SHAPE, value, dtype=torch.float64)}


def delta(value: float) -> dict[str, torch.Tensor]:
    return model(value)


def assert_filled(tensor: torch.Tensor, value: float) -> None:
    """Equal to ``value`` up to the float64 rounding of the step's two operations (a few ulp: rtol 1e-15)."""
    torch.testing.assert_close(tensor, torch.full(SHAPE, value, dtype=torch.float64), rtol=1e-15, atol=0)


def fedbuff(**rule) -> FedBuff:
    return FedBuff(BufferRule(**{"buffer_size": 2, "max_staleness": 3, **rule}), model(0.0))


def judged(buff: FedBuff, device_id: str) -> Judged:
    result = buff.judge(device_id, buff.in_flight[device_id].task)
    assert isinstance(result, Judged), result
    return result


def advance(buff: FedBuff, versions: int, step: float = 0.0) -> None:
    """Apply ``versions`` buffers of updates from helper devices (each a change of ``step``)."""
    for _ in range(versions):
        for i in range(buff.rule.buffer_size):
            helper = f"helper_{i}"
            buff.dispatch(helper)
            buff.accept(helper, judged(buff, helper), delta(step), 1)
        buff.flush()


def test_staleness_is_counted_from_the_version_the_device_was_given():
    buff = fedbuff()
    buff.dispatch("a")  # at version 0
    advance(buff, 2)
    buff.dispatch("b")  # at version 2
    advance(buff, 1)
    assert (judged(buff, "a").staleness, judged(buff, "b").staleness) == (3, 1)


def test_the_step_weighs_each_update_by_its_staleness_and_samples():
    buff = fedbuff(buffer_size=2, staleness_exponent=0.5, server_lr=0.5, normalize="samples")
    buff.dispatch("old")
    advance(buff, 3)  # "old" is now 3 versions stale: s = 1/2
    buff.dispatch("fresh")
    assert not buff.accept("old", judged(buff, "old"), delta(4.0), 30)
    assert buff.accept("fresh", judged(buff, "fresh"), delta(1.0), 10)
    buff.flush()
    # v + η · (s(3)·30·4 + s(0)·10·1) / (30 + 10) = 0 + 0.5 · (60 + 10) / 40
    assert_filled(buff.current["fe.w"], 0.5 * 70 / 40)


def test_the_staleness_normalized_step_divides_by_the_weighted_samples():
    buff = fedbuff(buffer_size=2, normalize="staleness")
    buff.dispatch("old")
    advance(buff, 3)
    buff.dispatch("fresh")
    buff.accept("old", judged(buff, "old"), delta(4.0), 30)
    buff.accept("fresh", judged(buff, "fresh"), delta(1.0), 10)
    buff.flush()
    assert_filled(buff.current["fe.w"], 70 / (0.5 * 30 + 10))


def test_staleness_weight_is_the_inverse_power_of_one_plus_tau():
    assert [staleness_weight(t, 0.5) for t in (0, 3, 8)] == [1.0, 0.5, 1 / 3]
    assert staleness_weight(7, 0.0) == 1.0


def test_an_update_staler_than_the_limit_is_refused_counted_and_frees_its_slot():
    buff = fedbuff(max_staleness=1)
    buff.dispatch("slow")
    task = buff.in_flight["slow"].task
    advance(buff, 2)
    reason = buff.judge("slow", task)
    assert isinstance(reason, str) and reason.startswith(TOO_STALE) and "staleness 2" in reason
    assert buff.too_stale == 1 and "slow" not in buff.in_flight
    assert 0 not in buff.versions  # its base version is no longer kept


def test_a_buffer_of_k_updates_is_applied_once():
    buff = fedbuff(buffer_size=3)
    full = []
    for device_id in ("a", "b", "c"):
        buff.dispatch(device_id)
    for device_id in ("a", "b", "c"):
        full.append(buff.accept(device_id, judged(buff, device_id), delta(3.0), 1))
    assert full == [False, False, True]
    assert [d for d, _ in buff.flush()] == ["a", "b", "c"]
    assert buff.version == 1 and buff.buffered == []
    assert_filled(buff.current["fe.w"], 3.0)
    with pytest.raises(ValueError, match="empty"):
        buff.flush()


def test_a_replayed_or_repeated_update_is_refused():
    buff = fedbuff()
    buff.dispatch("a")
    first = buff.in_flight["a"].task
    buff.accept("a", judged(buff, "a"), delta(1.0), 1)
    assert "no task in flight" in buff.judge("a", first)  # the same update again
    buff.dispatch("a")
    assert f"a's task is {first + 1}" in buff.judge("a", first)  # an old task's update replayed
    assert "no task in flight" in buff.judge("b", first)  # a device that was given nothing


def test_task_numbers_only_grow_so_a_device_sees_an_old_task_as_a_replay():
    buff = fedbuff()
    numbers = [buff.dispatch("a").task, buff.next_number()]
    buff.finish("a")
    numbers.append(buff.dispatch("a").task)
    assert numbers == sorted(set(numbers))


def test_only_the_versions_of_tasks_in_flight_are_kept():
    buff = fedbuff(max_staleness=5)
    buff.dispatch("a")  # version 0
    advance(buff, 2)
    buff.dispatch("b")  # version 2
    advance(buff, 1)
    assert set(buff.versions) == {0, 2, 3}
    buff.finish("a")
    assert set(buff.versions) == {2, 3}


def test_a_run_resumed_mid_buffer_continues_exactly():
    def run(resume_after: int | None) -> dict[str, torch.Tensor]:
        buff = fedbuff(buffer_size=3, staleness_exponent=0.7, server_lr=0.9)
        for i in range(7):
            buff.dispatch(f"d{i}")
            if i % 2:
                advance(buff, 1, step=0.1 * i)
        for i in range(7):
            if resume_after == i:
                state, tensors = buff.to_state()
                buff = FedBuff(buff.rule, model(0.0))
                buff.restore(state, {k: v.copy() for k, v in tensors.items()})
            if buff.accept(f"d{i}", judged(buff, f"d{i}"), delta(1.0 / (i + 3)), 10 + i):
                buff.flush()
        return buff.current
    straight = run(None)
    for stop in (1, 4):  # one and two updates in the buffer
        assert torch.equal(run(stop)["fe.w"], straight["fe.w"])


def test_an_updates_change_is_taken_against_what_its_rank_was_sent():
    torch.manual_seed(0)
    u0, v0, u1, v1 = (torch.randn(n, 2) for n in (4, 3, 4, 3))
    shapes = {"fe.fc.weight": (4, 3), "fe.fc.bias": (4,)}
    sent = {"fe.fc.u": u0, "fe.fc.v": v0, "fe.fc.bias": torch.zeros(4)}
    returned = {"fe.fc.u": u1, "fe.fc.v": v1, "fe.fc.bias": torch.ones(4)}
    change = update_delta(returned, sent, shapes)
    expected = reconstruct(u1, v1, (4, 3)).double() - reconstruct(u0, v0, (4, 3)).double()
    assert torch.equal(change["fe.fc.weight"], expected)
    assert torch.equal(change["fe.fc.bias"], torch.ones(4, dtype=torch.float64))


def test_an_algorithm_without_a_global_model_still_counts_versions():
    buff = FedBuff(BufferRule(buffer_size=2), {})
    for device_id in ("a", "b"):
        buff.dispatch(device_id)
    assert not buff.count_only("a", judged(buff, "a"))
    assert buff.count_only("b", judged(buff, "b"))
    buff.flush()
    assert buff.version == 1 and buff.current == {}


@pytest.mark.parametrize("field, value", [("buffer_size", 0), ("max_staleness", -1), ("staleness_exponent", -0.5),
                                          ("server_lr", 0.0), ("normalize", "mean"), ("concurrency", 0)])
def test_a_rule_out_of_range_names_its_flag(field, value):
    flag = "--buffer-normalize" if field == "normalize" else "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        BufferRule(**{field: value})
