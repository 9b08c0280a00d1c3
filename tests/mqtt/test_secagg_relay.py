"""The broker loop's relay of a secure round (``server.mqtt.secagg_relay``), in process with explicit clocks: four
devices' SecAgg+ clients talk to a real round engine only through the messages the relay sends and takes. Phases
close when everyone answered or at their deadline; a device that stops after sharing is recovered; a masked input
that comes after the unmasking began is refused with a logged reason and changes nothing; a message for a phase
not open, or from a device outside the round, is refused the same way. (Real processes over mosquitto:
tests/mqtt/test_secure_federation_mqtt.py.)"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from device_runtime import secagg_wire as wire
from device_runtime.envelope import Message
from device_runtime.messages import update_message
from device_runtime.secagg_client import SecAggClient
from device_runtime.task import Update
from fedcore.models import build_model
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.round_engine import RoundEngine, algorithm_for
from server.engine.run_config import FederationConfig, SecureSettings
from server.mqtt.secagg_relay import SecureRelay
from server.run_setup import PlanBook, global_state, initial_personal
from tests.support.engine import CLASSES, RUN, SHAPE, join

IDS = [f"dev_{i:03d}" for i in range(4)]
TIMEOUT = 10.0


class Round:
    """One secure round: the engine, the relay, each device's client and what the relay sent each device."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
        config = FederationConfig(algo="fedavg", rounds=2, aggregate="updates")
        algorithm = algorithm_for(config)
        coordinator = Coordinator(CoordinatorConfig(SHAPE, CLASSES, round_deadline_s=100.0, min_completion=0.5), RUN)
        self.engine = RoundEngine(algorithm, config, coordinator, PlanBook(model, SHAPE, None, onnx=False),
                                  global_state(model, algorithm), initial_personal([model], algorithm),
                                  tiers=(1.0,), secure=SecureSettings())
        for device_id in IDS:
            join(self.engine, device_id)
            self.engine.status(device_id, True, f"nonce-{device_id}", 0.0)
        self.sent: dict[str, list[Message]] = {d: [] for d in IDS}
        self.relay = SecureRelay(self.engine, lambda d, m: self.sent[d].append(m), TIMEOUT, Counter())
        self.tasks = self.engine.open_round(1, 0.0)
        self.relay.open(1, 0.0)
        self.server = self.engine.secure_round
        self.clients = {d: SecAggClient(d, t.secure) for d, t in self.tasks.items()}
        self.graph = self.server.graph

    def last(self, device_id: str) -> Message:
        return self.sent[device_id][-1]

    def keys(self, ids=IDS) -> None:
        for d in ids:
            self.relay.on_message(d, wire.keys_message(self.clients[d].advertise(), device_id=d, run_id=RUN,
                                                       round_index=1))

    def shares(self, ids=IDS) -> None:
        for d in ids:
            sealed = self.clients[d].share_keys(wire.parse_neighbour_keys(self.last(d), self.graph[d]))
            self.relay.on_message(d, wire.shares_message(sealed, device_id=d, run_id=RUN, round_index=1))

    def shared(self) -> None:
        """Every device through the keys and shares exchanges, each phase closed at t = 1 s."""
        self.keys()
        self.relay.tend(1.0)
        self.shares()
        self.relay.tend(1.0)

    def masked(self, device_id: str, x: np.ndarray) -> tuple[Message, bool]:
        """The device's UPDATE carrying its masked input, handled as the broker loop does (the relay first, then the
        engine); whether the relay took it."""
        y = self.clients[device_id].masked_input(x, wire.parse_shares(self.last(device_id), self.graph[device_id]))
        update = Update(1, {}, 50, 1.0, 0.5, {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0})
        msg = update_message(update, plan_hash=self.engine.plan_info(device_id).hash, device_id=device_id, run_id=RUN)
        msg.blobs[wire.MASKED_BLOB] = wire.masked_blob(y, self.server.spec.quantizer.bits)
        assert self.relay.takes_masked(device_id, msg)
        taken = self.relay.on_masked(device_id, msg)
        if taken:
            assert self.engine.receive(device_id, msg, 1.0).accepted
        return msg, taken

    def unmask(self, ids) -> None:
        for d in ids:
            asked = wire.parse_survivors(self.last(d), self.server.spec.participants)
            self.relay.on_message(d, wire.unmasking_message(self.clients[d].unmask(asked), device_id=d, run_id=RUN,
                                                            round_index=1))


@pytest.fixture
def secure() -> Round:
    return Round()


def inputs(d: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {device_id: rng.integers(0, 1 << 20, d).astype(np.uint64) for device_id in IDS}


def test_each_phase_closes_when_everyone_answered_and_the_relay_says_when_the_round_may_close(secure: Round):
    xs = inputs(secure.server.dimension)
    assert not secure.relay.tend(1.0) and secure.server.phase == "keys"
    secure.keys()
    assert not secure.relay.tend(1.0) and secure.server.phase == "shares"
    assert all(len(secure.sent[d]) == 1 for d in IDS)  # each got its neighbours' keys
    secure.shares()
    assert not secure.relay.tend(1.0) and secure.server.phase == "masked"
    for d in IDS:
        assert secure.masked(d, xs[d])[1]
    assert not secure.relay.tend(1.0) and secure.server.phase == "unmask"
    secure.unmask(IDS)
    assert secure.relay.tend(1.0)
    total = secure.server.finish(2.0)
    assert np.array_equal(total, sum(xs.values()) % (1 << 32))


def test_a_device_silent_at_the_keys_phase_is_out_when_its_deadline_passes(secure: Round, caplog):
    secure.keys(IDS[:3])
    assert not secure.relay.tend(TIMEOUT - 0.1) and secure.server.phase == "keys"
    secure.relay.tend(TIMEOUT)
    assert secure.server.phase == "shares" and secure.sent[IDS[3]] == []
    assert "did not advertise keys in time (dev_003)" in caplog.text


def test_a_device_stopping_after_sharing_is_recovered_and_its_late_masked_input_is_refused(secure: Round, caplog):
    xs = inputs(secure.server.dimension)
    secure.shared()
    late = IDS[2]
    for d in IDS:
        if d != late:
            assert secure.masked(d, xs[d])[1]
    assert not secure.relay.tend(50.0), "a device that shared and is online is waited for until the deadline"
    secure.relay.tend(100.0)  # the round's deadline
    assert secure.server.phase == "unmask" and not secure.sent[late][-1].meta.get("survivors")
    msg, taken = secure.masked(late, xs[late])
    assert not taken and (f"refused a masked input from {late} for secure aggregation (round 1): masked from {late}: "
                          "that phase is closed") in caplog.text
    assert late not in secure.server.masked
    survivors = [d for d in IDS if d != late]
    secure.unmask(survivors)
    assert secure.relay.tend(101.0)
    total = secure.server.finish(102.0)
    assert secure.server.recovered == (late,)
    assert np.array_equal(total, sum(xs[d] for d in survivors) % (1 << 32))


def test_a_device_gone_offline_after_sharing_closes_the_masked_phase_at_once(secure: Round):
    xs = inputs(secure.server.dimension)
    secure.shared()
    for d in IDS[:3]:
        secure.masked(d, xs[d])
    secure.engine.status(IDS[3], False, "", 2.0)  # its last will
    secure.relay.tend(2.0)
    assert secure.server.phase == "unmask"


def test_messages_for_a_phase_not_open_or_from_outside_the_round_change_nothing(secure: Round, caplog):
    secure.keys(IDS[:1])
    secure.relay.on_message(IDS[0], wire.unmasking_message({}, device_id=IDS[0], run_id=RUN, round_index=1))
    secure.relay.on_message("dev_099", wire.keys_message(secure.clients[IDS[1]].advertise(), device_id="dev_099",
                                                         run_id=RUN, round_index=1))
    secure.relay.on_message(IDS[1], wire.keys_message(secure.clients[IDS[2]].advertise(), device_id=IDS[1],
                                                      run_id=RUN, round_index=2))
    assert list(secure.server.keys) == [IDS[0]] and secure.server.revealed == {}
    assert f"unmask from {IDS[0]}: that phase is not open yet" in caplog.text
    assert "keys from dev_099, who is not in this phase" in caplog.text
    assert "round 2 has no secure exchange under way" in caplog.text
    assert secure.relay.refusals == {"secagg unmask": 1, "secagg keys": 2}


def test_too_few_survivors_asks_nobody_for_a_share_and_the_round_says_so_in_one_line(secure: Round, caplog):
    xs = inputs(secure.server.dimension)
    secure.shared()
    for d in IDS[:2]:
        secure.masked(d, xs[d])
    sent = {d: len(m) for d, m in secure.sent.items()}
    assert secure.relay.tend(100.0) and secure.server.phase == "failed"
    assert {d: len(m) for d, m in secure.sent.items()} == sent  # no survivors named: no share revealed
    secure.engine.close_round(101.0)
    record = secure.engine.pending["secagg"]
    assert record["aggregated"] is False and "survived, below" in record["failure"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round not aggregated")]
    assert len(lines) == 1 and "\n" not in lines[0]


def test_a_device_gone_offline_before_advertising_is_not_waited_for(secure: Round):
    secure.keys(IDS[:3])
    assert not secure.relay.tend(1.0)
    secure.engine.status(IDS[3], False, "", 1.0)
    secure.relay.tend(1.0)
    assert secure.server.phase == "shares" and IDS[3] not in secure.server.keys
