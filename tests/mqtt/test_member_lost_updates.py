"""An update an aggregator process lost half-received is asked for again (server/aggregator.py ``Shell.report_lost``,
aggregation_wire's LOST, server/mqtt/aggregator_channel.py, server/mqtt/lost_updates.py).

A member past its reassembly budget with no room left in its spill pushes an incomplete update out (or loses it to
expiry); its endpoint names the topic (``take_lost``). The member tells the engine which of the open round's devices
it lost, in a message sealed under the server key; the engine hands those it awaits from that member to the server's
own lost-update machinery, so each device gets its task again and re-sends its saved answer to the same member.
"""
from __future__ import annotations

import logging
import re
from argparse import Namespace
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from device_runtime.auth import KeyRing, Refusal
from device_runtime.link import Link, Refused
from device_runtime.messages import update_message
from device_runtime.task import Update
from device_runtime.topics import Topics
from server import broker_loop
from server.aggregator import Aggregator, Shell
from server.mqtt import aggregation_wire as wire
from server.mqtt.aggregator_channel import AggregatorChannel
from server.mqtt.lost_updates import LostUpdates
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support import tight_member
from tests.support.burst_fleet import fleet_run
from tests.support.engine import RUN, join, make_engine
from tests.support.sealing import KEY, OPEN_MAX, read

PREFIX, NAME = "fedara", "agg-0"
DEVICES = tuple(f"dev_{i:03d}" for i in range(6))
SERVER_KEY = bytes(range(100, 132))
WRONG_KEY = bytes(32)


def links(tmp_path: Path):
    """The engine's link and a member's, the member's session bound (its READY taken)."""
    engine_side = wire.engine_link(SERVER_KEY, tmp_path / "engine", OPEN_MAX)
    member = wire.aggregator_link(SERVER_KEY, tmp_path / "member", OPEN_MAX)
    engine_side.open(member.seal(wire.message(wire.READY, NAME)), RUN, device_id=NAME)
    return engine_side, member


# -- the wire ----------------------------------------------------------------------------------


def test_a_lost_message_round_trips_sealed_under_the_server_key(tmp_path: Path):
    engine_side, member = links(tmp_path)
    msg = engine_side.open(member.seal(wire.lost_message(NAME, RUN, 1, ["dev_002", "dev_000"])), RUN, device_id=NAME)
    assert wire.kind_of(msg) == wire.LOST and msg.round == 1
    assert wire.parse_lost(msg, len(DEVICES)) == ("dev_000", "dev_002")


@pytest.mark.parametrize("how", ["forged", "tampered"])
def test_a_lost_message_not_sealed_by_a_member_is_refused(how: str, tmp_path: Path):
    """Sealed under another key than the server key, or a member's with another device named in it."""
    engine_side, member = links(tmp_path)
    if how == "forged":
        payload = wire.aggregator_link(WRONG_KEY, tmp_path / "forger", OPEN_MAX).seal(
            wire.lost_message(NAME, RUN, 1, ["dev_000"]))
    else:
        payload = member.seal(wire.lost_message(NAME, RUN, 1, ["dev_000"])).replace(b"dev_000", b"dev_001")
    with pytest.raises(Refused) as info:
        engine_side.open(payload, RUN, device_id=NAME)
    assert info.value.reason == Refusal.BAD_TAG


@pytest.mark.parametrize("devices", [[f"dev_{i:03d}" for i in range(7)], "dev_000", ["../x"], [3]])
def test_a_lost_message_naming_more_than_the_round_asks_or_no_device_ids_is_malformed(devices):
    with pytest.raises(wire.WireError, match="malformed lost"):
        wire.parse_lost(wire.message(wire.LOST, NAME, round_index=1, devices=devices), len(DEVICES))


# -- the member --------------------------------------------------------------------------------


class LosingEndpoint:
    """What a Shell uses of its endpoint: the topics it lost, what it published."""

    def __init__(self, lost: list[str]) -> None:
        self.lost, self.sent = lost, []

    def take_lost(self) -> list[str]:
        lost, self.lost = self.lost, []
        return lost

    def publish(self, topic: str, payload: bytes, msg_id: str) -> None:
        self.sent.append((topic, payload))


def briefed_member() -> Aggregator:
    engine = make_engine(remote=True)
    for device_id in DEVICES:
        join(engine, device_id)
    engine.open_round(1, 0.0)
    core = Aggregator(NAME, KeyRing(dict.fromkeys(DEVICES, KEY)))
    core.on_brief(engine.brief(OPEN_MAX))
    return core


def test_a_member_names_the_open_rounds_devices_whose_updates_its_endpoint_lost(tmp_path: Path):
    """Of four lost topics: two updates of asked devices (one twice) are named; one whose update it already
    forwarded (a lost copy) and the engine's own down topic (the engine sends it again itself) are not."""
    core = briefed_member()
    core.forwarded.add("dev_003")
    endpoint = LosingEndpoint([Topics(PREFIX, d).update_via(NAME) for d in ("dev_004", "dev_001", "dev_003",
                                                                            "dev_004")]
                              + [wire.down_topic(PREFIX, NAME)])
    engine_side, member = links(tmp_path)
    shell = Shell(Namespace(prefix=PREFIX), core, endpoint, member, len(DEVICES))
    shell.report_lost()
    (topic, payload), = endpoint.sent
    assert topic == wire.up_topic(PREFIX, NAME)
    msg = engine_side.open(payload, RUN, device_id=NAME)
    assert wire.kind_of(msg) == wire.LOST and (msg.run_id, msg.round) == (RUN, 1)
    assert wire.parse_lost(msg, len(DEVICES)) == ("dev_001", "dev_004")
    shell.report_lost()  # nothing lost since
    assert len(endpoint.sent) == 1


def test_a_member_without_a_brief_names_nothing():
    endpoint = LosingEndpoint([Topics(PREFIX, "dev_000").update_via(NAME)])
    shell = Shell(Namespace(prefix=PREFIX), Aggregator(NAME, KeyRing(dict.fromkeys(DEVICES, KEY))), endpoint,
                  None, len(DEVICES))
    shell.report_lost()
    assert endpoint.sent == [] and endpoint.lost == []


def test_a_re_sent_update_of_a_device_whose_first_was_lost_is_taken_once(tmp_path: Path):
    """The first copy never reached the member's verifier (pushed out half-received); the saved answer resealed (a
    fresh counter) is verified, judged and folded; a further re-send is a duplicate, and the device is no longer named
    lost."""
    engine = make_engine(remote=True)
    for device_id in DEVICES:
        join(engine, device_id)
    tasks = engine.open_round(1, 0.0)
    core = Aggregator(NAME, KeyRing(dict.fromkeys(DEVICES, KEY)))
    core.on_brief(engine.brief(OPEN_MAX))
    engine.set_members([NAME])
    device = Link.device("dev_000", KEY, tmp_path / "dev_000", OPEN_MAX)
    task = tasks["dev_000"]
    first = device.seal(update_message(Update(1, task.weights, 50, 1.0, 0.5, {"eval_correct": 5, "eval_total": 10,
                                                                            "eval_loss": 1.0}),
                                       plan_hash=engine.plan_info("dev_000").hash, device_id="dev_000", run_id=RUN))
    assert core.lost(["dev_000"]) == ["dev_000"]
    receipt = core.on_update("dev_000", read(device.reseal(first)))
    verdict = engine.receive_receipt(NAME, receipt, 1.0)
    core.on_verdict(1, "dev_000", verdict.accepted, verdict.reason)
    assert verdict.accepted and core.folded == ["dev_000"] and not engine.awaits("dev_000")
    assert core.on_update("dev_000", read(device.reseal(first))) == "duplicate update for round 1"
    assert core.lost(["dev_000"]) == [] and engine.fold_list(NAME) == ["dev_000"]


# -- the engine's side -------------------------------------------------------------------------


class RecordingEndpoint:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, msg_id: str) -> None:
        self.sent.append((topic, payload))


def channel_with_round_open(tmp_path: Path, lost: LostUpdates):
    """The engine with round 1 open over members agg-0 and agg-1 (both briefed), its channel, and the member agg-0's
    link."""
    engine = make_engine(remote=True)
    for device_id in DEVICES:
        join(engine, device_id)
    engine.open_round(1, 0.0)
    engine_side, member = links(tmp_path)
    channel = AggregatorChannel(engine, RecordingEndpoint(), engine_side, prefix=PREFIX, names=(NAME, "agg-1"),
                                timeout_s=30.0, join_timeout_s=30.0, max_inbound=OPEN_MAX, logs=tmp_path,
                                pump=lambda *a, **k: True, send_task=lambda d: None, lost=lost.lost,
                                refusals=Counter())
    channel.send_brief()
    engine.set_members((NAME, "agg-1"))
    return engine, channel, member


def test_the_engine_asks_again_exactly_the_devices_a_member_lost_that_it_awaits_from_it(tmp_path: Path, caplog):
    lost = LostUpdates()
    engine, channel, member = channel_with_round_open(tmp_path, lost)
    mine = [d for d in DEVICES if engine.route(d) == NAME]
    others = [d for d in DEVICES if engine.route(d) != NAME]
    assert mine and others  # both members serve devices here
    with caplog.at_level(logging.WARNING, logger="fedara.server"):
        channel.handle(NAME, member.seal(wire.lost_message(NAME, RUN, 1, [*mine, others[0]])))
    assert lost.to_ask(engine.awaits) == sorted(mine)
    assert f"ignored 1 update(s) {NAME} says it lost in round 1 ({others[0]})" in caplog.text


def test_a_lost_message_of_another_round_asks_nothing(tmp_path: Path, caplog):
    lost = LostUpdates()
    engine, channel, member = channel_with_round_open(tmp_path, lost)
    mine = [d for d in DEVICES if engine.route(d) == NAME]
    with caplog.at_level(logging.WARNING, logger="fedara.server"):
        channel.handle(NAME, member.seal(wire.lost_message(NAME, RUN, 2, mine)))
    assert lost.to_ask(engine.awaits) == [] and "round 1 is open" in caplog.text


def test_a_sealed_lost_message_sent_again_is_refused_as_a_replay(tmp_path: Path):
    lost = LostUpdates(at_once=len(DEVICES))
    engine, channel, member = channel_with_round_open(tmp_path, lost)
    mine = [d for d in DEVICES if engine.route(d) == NAME]
    sealed = member.seal(wire.lost_message(NAME, RUN, 1, mine))
    channel.handle(NAME, sealed)
    assert lost.to_ask(engine.awaits) == sorted(mine)
    channel.handle(NAME, sealed)
    assert lost.waiting == {} and channel.refusals["aggregator message"] == 1


# -- over mosquitto: a member with no spill and room for two updates, six answering at once ----------------------


ROUNDS, DEADLINE_S = 2, 300.0
FOLDED = re.compile(r"(agg-\d+) folded (dev_\d+)'s update of round (\d+)")
PUSHED_OUT = re.compile(r"round (\d+): \d+ bytes in, \d+ incomplete message\(s\) kept in the spill past the memory "
                        r"budget, (\d+) pushed out")


def member_log(run: Path) -> str:
    return (run / broker_loop.AGGREGATORS_DIR / "agg-0.log").read_text()


@pytest.mark.slow
def test_updates_a_member_pushed_out_are_asked_again_and_the_model_is_the_one_without_push_outs(
        mosquitto_broker, tmp_path: Path):
    """Six dense and factorized updates arrive at a member at once (tests/support/burst_fleet.py); it holds two and
    has no spill, so the others are pushed out, named to the engine and asked again (re-sent, maybe pushed out again)
    until every one is folded, once. The rounds close with every update, before their deadline, and the model is the
    one a member with room for them all makes, to the rounding of its float64 sums in another order (a few float32
    ULPs of each tensor's largest value)."""
    roomy, tight = (fleet_run(tmp_path / name, tmp_path / "cache", mosquitto_broker.url, devices=6, aggregators=1,
                              rounds=ROUNDS, deadline_s=DEADLINE_S, tight=name == "tight")
                    for name in ("roomy", "tight"))

    pushed_out = {run: {int(r): int(n) for r, n in PUSHED_OUT.findall(member_log(run))} for run in (roomy, tight)}
    assert pushed_out[roomy] == {1: 0, 2: 0} and pushed_out[tight][1] >= 6 - tight_member.PENDING_UPDATES, pushed_out
    assert "asking the engine to ask again" in member_log(tight)
    assert "sending its task again" in (tight / broker_loop.SERVER_LOG).read_text()
    for run in (roomy, tight):
        records = read_metrics(run / METRICS_FILE)
        assert [(r["participants"], r["selected"]) for r in records] == [(6, 6)] * ROUNDS
        assert all(r["seconds"] < DEADLINE_S / 2 for r in records), [r["seconds"] for r in records]
        folded = [(d, int(r)) for _, d, r in FOLDED.findall(member_log(run))]
        assert sorted(folded) == sorted((f"dev_{i:05d}", r) for i in range(6) for r in range(1, ROUNDS + 1))
    expected, got = load_checkpoint(roomy / CHECKPOINT_NAME), load_checkpoint(tight / CHECKPOINT_NAME)
    assert got.round == ROUNDS and set(got.tensors) == set(expected.tensors)
    for name, value in expected.tensors.items():  # the same float64 sums in another fold order, rounded to float32
        ulps = np.abs(got.tensors[name] - value).max() / np.spacing(np.abs(value).max())
        assert ulps <= 4, (name, ulps)
