"""The aggregator's pure core and the engine's side of remote aggregation, driven directly (no broker).

The broker is open: anyone can publish anything, exact replays included. An aggregator refuses what it cannot
authenticate or what does not answer the round's brief; the engine alone decides what counts, so a replayed
update that reaches a second aggregator is never folded twice, and the engine refuses receipts and partial sums
that are not sealed under the server key.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from device_runtime.auth import KeyRing, Refusal
from device_runtime.envelope import Message
from device_runtime.link import Refused
from device_runtime.messages import parse_task, task_message, update_message
from device_runtime.protocol import ProtocolError
from device_runtime.task import Update
from device_runtime.topics import Topics
from server.engine import folding_records as folding
from server.mqtt import aggregation_wire as wire
from server.engine.aggregate import PartialSum
from server.engine.privacy import ClippedSum
from server.engine.run_config import DpSettings
from server import aggregator
from server.aggregator import Aggregator
from tests.support.sealing import KEY, OPEN_MAX, read, seal_down, seal_up
from tests.support.engine import RUN, join, make_engine

DEVICES = ("dev_000", "dev_001", "dev_002")
WRONG_KEY = bytes(32)
SERVER_KEY = bytes(range(100, 132))


def device_update(engine, device_id: str, task, scale: float, key: bytes = KEY, round_index: int | None = None
                  ) -> Message:
    """The device's UPDATE for ``task`` as it arrives on its update topic: sealed under ``key``, then decoded."""
    update = Update(task.round if round_index is None else round_index,
                    {k: v * np.float32(scale) for k, v in task.weights.items()}, 50, 1.0, 0.5,
                    {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0})
    msg = update_message(update, plan_hash=engine.plan_info(device_id).hash, device_id=device_id, run_id=RUN)
    return read(seal_up(msg, key))


@pytest.fixture
def federation():
    """A remote-aggregation engine with round 1 open, its tasks, and two aggregators holding its brief."""
    engine = make_engine(remote=True)
    for device_id in DEVICES:
        join(engine, device_id)
    tasks = engine.open_round(1, 0.0)
    brief = engine.brief(OPEN_MAX)
    members = [Aggregator(f"agg-{i}", KeyRing(dict.fromkeys(DEVICES, KEY))) for i in range(2)]
    engine.set_members([m.name for m in members])
    for member in members:
        member.on_brief(brief)
    return engine, tasks, members


def deliver(engine, member: Aggregator, msg: Message):
    """The member's receipt judged by the engine, the verdict back to the member."""
    receipt = member.on_update(msg.device_id, msg)
    assert not isinstance(receipt, str), receipt
    verdict = engine.receive_receipt(member.name, receipt, 1.0)
    member.on_verdict(receipt.round, receipt.device_id, verdict.accepted, verdict.reason)
    return verdict


def close(engine, member: Aggregator, round_index: int = 1) -> folding.Partial:
    """The member's answer to the engine's CLOSE of the round (naming what the engine told it to fold)."""
    partial = member.on_close(round_index, tuple(engine.fold_list(member.name)))
    assert not isinstance(partial, str), partial
    return partial


def test_an_update_under_a_key_not_its_devices_is_refused_with_its_reason(federation, caplog):
    engine, tasks, (member, _) = federation
    with caplog.at_level(logging.WARNING, "fedara.aggregator"):
        answer = member.on_update("dev_000", device_update(engine, "dev_000", tasks["dev_000"], 1.0, WRONG_KEY))
    assert isinstance(answer, str) and Refusal.BAD_TAG.value in answer
    assert Refusal.BAD_TAG.value in caplog.text and "dev_000" in caplog.text


def test_an_update_on_another_devices_topic_is_refused_as_a_bad_topic(federation):
    engine, tasks, (member, _) = federation
    answer = member.on_update("dev_001", device_update(engine, "dev_000", tasks["dev_000"], 1.0))
    assert answer == "a message of 'dev_000' on a topic of 'dev_001' [bad_topic]"
    assert not member.forwarded and not member.awaiting


def test_an_update_for_another_round_is_refused_as_stale(federation, caplog):
    engine, tasks, (member, _) = federation
    with caplog.at_level(logging.WARNING, "fedara.aggregator"):
        answer = member.on_update("dev_000", device_update(engine, "dev_000", tasks["dev_000"], 1.0, round_index=2))
    assert answer == "stale: update for round 2, round 1 is open" and answer in caplog.text


def test_a_second_update_of_a_device_in_one_round_is_refused_as_a_duplicate(federation, caplog):
    engine, tasks, (member, _) = federation
    assert deliver(engine, member, device_update(engine, "dev_000", tasks["dev_000"], 1.0)).accepted
    with caplog.at_level(logging.WARNING, "fedara.aggregator"):
        answer = member.on_update("dev_000", device_update(engine, "dev_000", tasks["dev_000"], 2.0))
    assert answer == "duplicate update for round 1" and answer in caplog.text


def test_an_exact_replay_reaching_a_second_aggregator_is_folded_once(federation):
    engine, tasks, (first, second) = federation
    genuine = device_update(engine, "dev_000", tasks["dev_000"], 1.0)
    assert deliver(engine, first, genuine).accepted
    replay = deliver(engine, second, genuine)  # the second member never saw it: only the engine can refuse it
    assert not replay.accepted and "replay" in replay.reason
    assert (first.folded, second.folded) == (["dev_000"], [])


def test_merged_partials_give_the_single_aggregators_model(federation):
    engine, tasks, members = federation
    alone = make_engine()
    for device_id in DEVICES:
        join(alone, device_id)
    alone_tasks = alone.open_round(1, 0.0)
    for i, device_id in enumerate(DEVICES):
        deliver(engine, members[i % 2], device_update(engine, device_id, tasks[device_id], 1.0 + i))
        assert alone.receive(device_id, device_update(alone, device_id, alone_tasks[device_id], 1.0 + i), 1.0).accepted
    for member in members:
        assert engine.receive_partial(member.name, close(engine, member)) is None
    engine.close_round(2.0)
    alone.close_round(2.0)
    for name, value in alone.global_state.items():
        torch.testing.assert_close(engine.global_state[name], value, rtol=1e-5, atol=1e-6)
    assert engine.pending["participants"] == len(DEVICES)


def test_a_partial_over_other_updates_than_the_engine_told_is_refused(federation):
    engine, tasks, (member, _) = federation
    deliver(engine, member, device_update(engine, "dev_000", tasks["dev_000"], 1.0))
    partial = close(engine, member)
    forged = folding.Partial(1, partial.sum, ("dev_000", "dev_001"))
    assert "it was told to fold ['dev_000']" in engine.receive_partial(member.name, forged)


def test_a_missing_partial_leaves_its_updates_undelivered(federation):
    engine, tasks, members = federation
    for i, device_id in enumerate(DEVICES):
        deliver(engine, members[i % 2], device_update(engine, device_id, tasks[device_id], 1.0))
    assert engine.receive_partial("agg-0", close(engine, members[0])) is None
    assert engine.partials_missing() == ["agg-1"]
    result, _ = engine.close_round(2.0)
    assert result.dropped == {"dev_001": "aggregator agg-1 sent no partial sums"}
    assert engine.pending["participants"] == 2


def test_an_update_whose_verdict_was_lost_is_folded_when_the_close_names_it(federation):
    """The member was away from the broker when the engine's "fold" verdict went out: the CLOSE (sent again until
    a partial comes) names the update, and the partial counts."""
    engine, tasks, (member, _) = federation
    msg = device_update(engine, "dev_000", tasks["dev_000"], 1.0)
    receipt = member.on_update("dev_000", msg)
    assert engine.receive_receipt(member.name, receipt, 1.0).accepted  # its verdict never reaches the member
    assert member.folded == []
    assert engine.receive_partial(member.name, close(engine, member)) is None
    assert member.folded == ["dev_000"]


def test_an_update_the_close_does_not_name_is_not_folded(federation):
    """A verdict that refused it was lost: the close's list leaves it out, so the partial stays over what counts."""
    engine, tasks, (member, _) = federation
    member.on_update("dev_000", device_update(engine, "dev_000", tasks["dev_000"], 1.0))
    partial = member.on_close(1, ())
    assert partial.devices == () and partial.sum.count == 0


def test_a_close_naming_something_other_than_device_ids_is_malformed():
    with pytest.raises(wire.WireError, match="malformed close"):
        wire.parse_close(wire.message(wire.CLOSE, "agg-0", round_index=1, fold="dev_000"))
    with pytest.raises(wire.WireError, match="malformed close"):
        wire.parse_close(wire.message(wire.CLOSE, "agg-0", round_index=1, fold=["../x"]))


@pytest.mark.parametrize("kind", [wire.RECEIPT, wire.PARTIAL])
def test_the_engine_refuses_what_is_sealed_under_another_key_than_the_server_key(kind: str, tmp_path: Path):
    engine_side = wire.engine_link(SERVER_KEY, tmp_path / "engine", OPEN_MAX)
    forger = wire.aggregator_link(WRONG_KEY, tmp_path / "forger", OPEN_MAX)
    if kind == wire.RECEIPT:
        msg = wire.receipt_message(folding.Receipt("dev_000", RUN, 1, "update-1", 7, {}, 0), "agg-0")
    else:
        msg = wire.partial_message(folding.Partial(1, PartialSum({}, 50.0, 1), ("dev_000",)), "agg-0")
    with pytest.raises(Refused) as info:
        engine_side.open(forger.seal(msg), RUN, device_id="agg-0")
    assert info.value.reason == Refusal.BAD_TAG
    genuine = wire.aggregator_link(SERVER_KEY, tmp_path / "genuine", OPEN_MAX)
    assert wire.kind_of(engine_side.open(genuine.seal(msg), RUN, device_id="agg-0")) == kind


def test_a_member_refuses_what_the_engine_sealed_before_it_started(tmp_path: Path):
    """A CLOSE the engine bound to an earlier member process, left on the broker, does not move a fresh member
    (its workdir new: no counter of the engine's was ever seen there)."""
    engine_side = wire.engine_link(SERVER_KEY, tmp_path / "engine", OPEN_MAX)
    earlier = wire.aggregator_link(SERVER_KEY, tmp_path / "member", OPEN_MAX)
    engine_side.open(earlier.seal(wire.message(wire.READY, "agg-0")), RUN, device_id="agg-0")
    close = engine_side.seal(wire.close_message("agg-0", 1, ["dev_000"]))
    with pytest.raises(Refused) as info:
        wire.aggregator_link(SERVER_KEY, tmp_path / "fresh-member", OPEN_MAX).open(close, RUN, device_id="agg-0")
    assert info.value.reason == Refusal.STALE_SESSION


@pytest.mark.parametrize("side", ["engine", "aggregator"])
def test_a_link_started_again_on_its_state_refuses_what_it_took_before(side: str, tmp_path: Path):
    """A brief of last week's run published to a member of today's run before today's engine has spoken (or a
    receipt of last week's member to today's engine) is refused: the last counter taken is on disk."""
    receiver, sender = (wire.engine_link, wire.aggregator_link) if side == "engine" else (wire.aggregator_link,
                                                                                         wire.engine_link)
    senders = [sender(SERVER_KEY, tmp_path / "sender", OPEN_MAX) for _ in range(2)]
    receiving = receiver(SERVER_KEY, tmp_path / "receiver", OPEN_MAX)
    if side == "aggregator":  # a member's READY names its session, and the engine binds what it sends to it
        for engine_side in senders:
            engine_side.open(receiving.seal(wire.message(wire.READY, "agg-0")), RUN, device_id="agg-0")
    earlier, latest = (s.seal(wire.message(wire.READY, "agg-0")) for s in senders)
    assert wire.kind_of(receiving.open(latest, RUN, device_id="agg-0"))
    with pytest.raises(Refused) as info:
        receiver(SERVER_KEY, tmp_path / "receiver", OPEN_MAX).open(earlier, RUN, device_id="agg-0")
    assert info.value.reason == Refusal.REPLAY

def test_the_open_rounds_brief_again_keeps_what_was_folded(federation):
    engine, tasks, (member, _) = federation
    deliver(engine, member, device_update(engine, "dev_000", tasks["dev_000"], 1.0))
    member.on_brief(engine.brief(OPEN_MAX))  # a device rejoined with a new plan during the round
    assert member.folded == ["dev_000"] and member.average.count == 1
    assert member.on_update("dev_000", device_update(engine, "dev_000", tasks["dev_000"], 1.0)) == \
        "duplicate update for round 1"


@pytest.mark.parametrize("flags, named", [
    (["--name", "agg-0"], "--broker is required"),
    (["--name", "agg/0", "--broker", "mqtt://127.0.0.1:1"], "--prefix/--name"),
    (["--name", "agg-0", "--broker", "mqtt://127.0.0.1:1,127.0.0.1:2"], "--broker: broker URL '127.0.0.1:2'"),
    (["--name", "agg-0", "--broker", "mqtt://127.0.0.1:1"], "does not exist"),
])
def test_the_aggregator_command_exits_2_saying_what_to_fix(flags: list[str], named: str, tmp_path: Path, capsys):
    assert aggregator.main([*flags, "--enroll", str(tmp_path / "missing.json"),
                            "--workdir", str(tmp_path / "work")]) == 2
    assert named in capsys.readouterr().err


def test_routing_keeps_each_device_on_its_member_and_moves_only_a_lost_members_devices():
    devices = [f"dev_{i:03d}" for i in range(60)]
    three = {d: folding.route(d, ["agg-0", "agg-1", "agg-2"]) for d in devices}
    assert three == {d: folding.route(d, ["agg-2", "agg-0", "agg-1"]) for d in devices}  # a function of the set
    assert set(three.values()) == {"agg-0", "agg-1", "agg-2"}
    two = {d: folding.route(d, ["agg-0", "agg-2"]) for d in devices}
    assert {d for d in devices if two[d] != three[d]} == {d for d in devices if three[d] == "agg-1"}
    assert folding.route("dev_000", []) is None


def test_each_task_names_its_devices_member_and_a_member_takes_only_its_topic():
    engine = make_engine(remote=True)
    for device_id in DEVICES:
        join(engine, device_id)
    engine.open_round(1, 0.0)
    engine.set_members(["agg-0", "agg-1"])
    for device_id in DEVICES:
        task = engine.task(device_id)
        assert task.aggregator == folding.route(device_id, ["agg-0", "agg-1"])
        assert parse_task(task_message(task, plan_hash=engine.plan_info(device_id).hash, device_id=device_id,
                                       run_id=RUN))[1].aggregator == task.aggregator
        topic = Topics("fedara", device_id).update_via(task.aggregator)
        assert wire.device_from_member_topic("fedara", task.aggregator, topic) == device_id
        other = "agg-1" if task.aggregator == "agg-0" else "agg-0"
        with pytest.raises(ProtocolError):
            wire.device_from_member_topic("fedara", other, topic)


def test_a_lost_members_told_updates_are_awaited_again_and_its_devices_routed_to_the_others(federation):
    engine, tasks, members = federation
    routed = {d: engine.route(d) for d in DEVICES}
    lost = routed["dev_000"]
    by_name = {m.name: m for m in members}
    deliver(engine, by_name[lost], device_update(engine, "dev_000", tasks["dev_000"], 1.0))
    assert not engine.coordinator.awaits("dev_000")
    again = engine.member_lost(lost)
    assert again == sorted(d for d in DEVICES if routed[d] == lost)
    assert engine.coordinator.awaits("dev_000") and engine.partials_missing() == []
    assert all(engine.route(d) != lost for d in DEVICES)
    late = engine.receive_receipt(lost, by_name[lost].on_update("dev_001", device_update(
        engine, "dev_001", tasks["dev_001"], 1.0)), 1.0)
    assert not late.accepted and "not a member" in late.reason
    survivor = by_name[engine.route("dev_000")]
    assert deliver(engine, survivor, device_update(engine, "dev_000", tasks["dev_000"], 1.0)).accepted
    assert engine.partials_missing() == [survivor.name]


@pytest.mark.parametrize("topic", ["fedara/dev/dev_000/up/agg-0", "fedara/dev/dev_000/update",
                                   "other/dev/dev_000/update/agg-0", "fedara/dev/+/update/agg-0",
                                   "fedara/dev/a/b/update/agg-0", "fedara/dev/dev_000/update/agg-00"])
def test_a_member_reads_a_device_only_from_an_update_topic_routed_to_it(topic):
    with pytest.raises(ProtocolError):
        wire.device_from_member_topic("fedara", "agg-0", topic)


# -- DP through aggregators: each member clips by the engine's rule, the engine adds the noise once ------------------

FLOAT32_ULP = 2.0 ** -23
"""The models with and without aggregators differ only in how float64 sums of the same clipped changes are grouped
(~1e-16 relative), then both are rounded to the float32 model: at most one float32 ulp apart, i.e. within
2^-23 of the value relatively."""


def dp(**kw) -> DpSettings:
    """Every device sampled (rate 1 of 3, E = 3); the test seed fixes sampling and noise, so two engines draw alike."""
    return DpSettings(**{"noise_multiplier": 0.2, "join_ratio": 1.0, "population": len(DEVICES), "clip": 0.05,
                         "delta": 1e-5, "test_seed": 11, **kw})


def dp_round(settings: DpSettings, scales: dict[str, float], remote: bool, tiers=(1.0,)):
    """Round 1 of a private engine, each device returning its task's weights times its scale (through two members
    when ``remote``, to the engine itself otherwise), closed; returns the engine and the model before the round."""
    engine = make_engine(tiers=tiers, remote=remote, privacy=settings,
                         predictor=(lambda profile, n: (lambda ratio: 100.0 * ratio)) if len(tiers) > 1 else None)
    for i, device_id in enumerate(DEVICES):
        join(engine, device_id, budget=(500.0, 50.0)[i % 2] if len(tiers) > 1 else None)
    before = {k: v.clone() for k, v in engine.global_state.items()}
    tasks = engine.open_round(1, 0.0)
    assert sorted(engine.opened.train) == list(DEVICES)
    if not remote:
        for device_id in DEVICES:
            assert engine.receive(device_id, device_update(engine, device_id, tasks[device_id], scales[device_id]),
                                  1.0).accepted
        engine.close_round(2.0)
        return engine, before
    members = [Aggregator(f"agg-{i}", KeyRing(dict.fromkeys(DEVICES, KEY))) for i in range(2)]
    engine.set_members([m.name for m in members])
    brief = wire.parse_brief(read(seal_down(wire.brief_message(engine.brief(OPEN_MAX), "agg-0"))))  # over the wire
    for member in members:
        member.on_brief(brief)
    by_name = {m.name: m for m in members}
    for device_id in DEVICES:
        member = by_name[engine.route(device_id)]
        assert deliver(engine, member, device_update(engine, device_id, tasks[device_id], scales[device_id])).accepted
    for member in members:
        partial = wire.parse_partial(read(seal_up(wire.partial_message(close(engine, member), member.name), KEY)))
        assert engine.receive_partial(member.name, partial) is None
    engine.close_round(2.0)
    return engine, before


def test_dp_through_two_aggregators_gives_the_engines_own_model_within_a_float32_ulp():
    """The adaptive clip too: its next clip, learned from the count within C, is the same."""
    scales = {"dev_000": 1.0001, "dev_001": 1.5, "dev_002": 0.9}  # within the clip, and far beyond it
    settings = dp(clip_quantile=0.5, clip=0.01)
    alone, _ = dp_round(settings, scales, remote=False, tiers=(1.0, 0.25))
    routed, _ = dp_round(settings, scales, remote=True, tiers=(1.0, 0.25))
    for name, value in alone.global_state.items():
        torch.testing.assert_close(routed.global_state[name], value, rtol=FLOAT32_ULP, atol=0.0)
    assert routed.dp.mechanism.clip == pytest.approx(alone.dp.mechanism.clip, rel=1e-12)
    assert routed.dp.mechanism.clip != settings.clip and routed.pending["epsilon"] == alone.pending["epsilon"]


def test_an_update_1000x_too_large_through_an_aggregator_moves_the_model_by_at_most_clip_over_expected():
    """Noise negligible, the others return what they were sent (Δ = 0): the model moves by C/E exactly, E = 3."""
    settings = dp(noise_multiplier=1e-9)
    engine, before = dp_round(settings, {"dev_000": 1000.0, "dev_001": 1.0, "dev_002": 1.0}, remote=True,
                              tiers=(1.0, 0.25))
    moved = math.sqrt(sum(float((engine.global_state[k].double() - v.double()).square().sum())
                          for k, v in before.items()))
    assert moved == pytest.approx(settings.clip / settings.expected, rel=1e-4)  # float32 model: ~1e-7 relative


def test_a_partial_that_is_not_clipped_at_the_rounds_clip_is_refused_in_a_private_round():
    engine = make_engine(remote=True, privacy=dp())
    for device_id in DEVICES:
        join(engine, device_id)
    tasks = engine.open_round(1, 0.0)
    member = Aggregator("agg-0", KeyRing(dict.fromkeys(DEVICES, KEY)))
    engine.set_members([member.name])
    member.on_brief(engine.brief(OPEN_MAX))
    deliver(engine, member, device_update(engine, "dev_000", tasks["dev_000"], 2.0))
    honest = close(engine, member)
    unclipped = folding.Partial(1, PartialSum(honest.sum.sums, 50.0, 1), honest.devices)
    wider = folding.Partial(1, ClippedSum(1.0, honest.sum.sums, 1, 1), honest.devices)
    for partial in (unclipped, wider):
        assert "expected a clipped sum at the round's clip 0.05" in engine.receive_partial(member.name, partial)
    assert engine.receive_partial(member.name, honest) is None
