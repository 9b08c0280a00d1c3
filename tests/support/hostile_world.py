"""The hostile world: the broker loop's server in process (a stub endpoint, the real Federation and RoundEngine)
with devices on a dense and a low-rank plan joined and round 1 open, and what every test of bad input needs to
hand it messages and see that a refusal changed nothing. The ``world`` fixture (tests/conftest.py) builds one
per module."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from unittest import mock
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from device_runtime.envelope import Message
from device_runtime.messages import DEFAULT_TOPIC_PREFIX, Join, ShardInfo, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Update
from device_runtime.topics import Topics
from device_runtime.transport import STAT_KEYS
from fedcore.models import build_model
from server import broker_loop
from server.broker_loop import Federation, inbound_limit
from server.mqtt.local_processes import LocalDevices
from server.cli import config_from_args
from server.engine.coordinator import Coordinator, CoordinatorConfig, RoundResult
from server.engine import round_engine as engine_module
from server.engine.round_engine import RoundEngine, algorithm_for
from server.engine.run_config import FederationConfig, norm_bound_from_args
from server.run_setup import PlanBook, RunFolder, global_state, initial_personal
from server.engine.sampling import factorize_per_plan, plan_key
from tests.support.sealing import memory_server_link

RUN = "run1"
PREFIX = DEFAULT_TOPIC_PREFIX
INPUT_SHAPE = (1, 16, 16)
CLASSES = 10
DENSE, LOW_RANK = 1.0, 0.5
TRAINER, FACTORED, UNASSIGNED, STRANGER = "dev_000", "dev_001", "dev_002", "dev_999"
"""A device on the dense plan, one on the low-rank plan, one that joined but has no plan, one never seen."""
ROUND = 1
DEADLINE_S = 600.0
SHARD = ShardInfo(num_train=30, num_test=10, input_shape=INPUT_SHAPE, num_classes=CLASSES)
PROFILE = ResourceProfile(memory_budget_mb=None, threads=1, cpu_count=2, machine="x86_64", system="Linux",
                          total_memory_mb=None, probe_gflops=1.0)
EVAL = {"eval_correct": 7, "eval_total": 10, "eval_loss": 0.5}
REFUSED = ("dropped", "refused", "ignored")
"""How the server's log lines about a refused message begin."""
SERVER_LOG = "fedara.server"
WAIT_S = 10.0


# -- the server, in process -------------------------------------------------------------------------


class StubEndpoint:
    """Stands in for the server's MqttEndpoint: keeps what the server sends."""

    def __init__(self) -> None:
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, msg_id: str, retain: bool = False, **kwargs: object) -> None:
        self.sent.append((topic, payload))

    def take_lost(self) -> list[str]:
        """No message is ever pushed out of a reassembly budget here."""
        return []


ALGORITHM = algorithm_for(FederationConfig())
"""Factorizes and sends back the FE only: the plans' FE tensors are exactly what an update must carry."""


@dataclass(frozen=True)
class World:
    """What every in-process server shares: the global FE, the initial head, the plans' artifacts, round 1's
    FEs (as the engine factorizes them), and the largest message the server takes."""

    global_fe: dict[str, torch.Tensor]
    personal: dict[str, np.ndarray]
    plans: PlanBook
    round_fe: dict[tuple, dict[str, np.ndarray]]
    max_inbound: int
    local: LocalDevices
    out: RunFolder


def build_world(directory: Path, cache: Path) -> World:
    model = build_model("fedavgcnn", INPUT_SHAPE, CLASSES, seed=0)
    plans = PlanBook(model, INPUT_SHAPE, cache)
    global_fe = global_state(model, ALGORITHM)
    personal = initial_personal([model], ALGORITHM)
    round_fe = factorize_per_plan(global_fe, [plans.get(r).resolved for r in (DENSE, LOW_RANK)])
    max_inbound = inbound_limit(global_fe, personal)
    return World(global_fe, personal, plans, round_fe, max_inbound, LocalDevices(), RunFolder(directory / "out"))


@functools.lru_cache(maxsize=None)
def server_args(out: Path, *flags: str) -> argparse.Namespace:
    """The broker loop's command line (parsed once per set of flags: servers only read it)."""
    return broker_loop.build_parser().parse_args(["--out", str(out), "--rank-tiers", f"{DENSE},{LOW_RANK}", *flags])


def open_engine(world: World, *flags: str) -> RoundEngine:
    """A RoundEngine with TRAINER (dense plan) and FACTORED (low-rank plan) joined through it and ready,
    UNASSIGNED joined without a plan, and round 1 open."""
    args = server_args(world.out.path, *flags)
    coordinator = Coordinator(CoordinatorConfig(INPUT_SHAPE, CLASSES, round_deadline_s=DEADLINE_S), RUN)
    config = config_from_args(args)
    engine = RoundEngine(algorithm_for(config), config, coordinator, world.plans, world.global_fe, world.personal,
                         tiers=(DENSE, LOW_RANK), overrides={TRAINER: DENSE, FACTORED: LOW_RANK},
                         norm_bound=norm_bound_from_args(args))
    now = time.monotonic()
    for device_id in (TRAINER, FACTORED):
        plan = world.plans.get(ratio_of(device_id))
        admission = engine.join(device_id, Join(PROFILE, SHARD, (plan.hash,)))
        assert admission.plan.plan_hash == plan.hash and admission.plan.files == {}  # it holds them already
        assert engine.acknowledge(device_id, plan.hash) is None
    assert coordinator.join(UNASSIGNED, Join(PROFILE, SHARD, ())) is None
    with mock.patch.object(engine_module, "factorize_per_plan", functools.partial(round_one_fe, world)):
        engine.open_round(ROUND, now)
    return engine


def round_one_fe(world: World, global_fe: dict[str, torch.Tensor], plans: list) -> dict[tuple, dict[str, np.ndarray]]:
    """``factorize_per_plan`` for round 1, computed once per world (the fuzz tests open 11,000 servers)."""
    assert global_fe is world.global_fe and {plan_key(p) for p in plans} <= set(world.round_fe)
    return world.round_fe


def open_server(world: World, *flags: str) -> Federation:
    """The broker loop's Federation over ``open_engine``'s engine, with a stub endpoint."""
    args = server_args(world.out.path, *flags)
    return Federation(args, open_engine(world, *flags), StubEndpoint(), world.out, world.local, {}, world.max_inbound,
                      memory_server_link([TRAINER, FACTORED, UNASSIGNED, STRANGER], world.max_inbound))


def up(device_id: str) -> str:
    return Topics(PREFIX, device_id).up


def update_topic(device_id: str) -> str:
    return Topics(PREFIX, device_id).update


def ratio_of(device_id: str) -> float:
    return LOW_RANK if device_id == FACTORED else DENSE


def trained_fe(world: World, device_id: str) -> dict[str, np.ndarray]:
    """The FE a device was sent this round, moved a little as training would."""
    start = world.round_fe[plan_key(world.plans.get(ratio_of(device_id)).resolved)]
    return {name: value + np.float32(0.01) for name, value in start.items()}


def genuine_update(world: World, device_id: str = TRAINER, *, round_index: int = ROUND, run_id: str = RUN,
                   fe: dict[str, np.ndarray] | None = None, sender: str | None = None) -> Message:
    """The update ``device_id`` should send this round (``sender`` puts another id in the header)."""
    update = Update(round_index, trained_fe(world, device_id) if fe is None else fe, SHARD.num_train, 0.5, 0.8,
                    dict(EVAL))
    return update_message(update, plan_hash=world.plans.get(ratio_of(device_id)).hash, device_id=sender or device_id,
                          run_id=run_id)


def aggregated(server: Federation) -> int:
    """How many updates the open round has accepted: folded into its average, or held to be folded in id order."""
    return server.engine._average.count + len(server.engine._folds.held)


def server_state(server: Federation) -> tuple:
    """What a refused message must leave as it was: the global FE's bytes, the running average, the round's
    byte and training book, the registry, and which plans the server sent, re-sent or still asks for."""
    engine = server.engine
    return ({name: value.numpy().tobytes() for name, value in engine.global_state.items()},
            (engine._average.count, engine._average.total_weight, sorted(engine._folds.held), engine._folds.next),
            repr(engine._book),
            json.dumps(engine.coordinator.to_state(), sort_keys=True),
            (dict(engine._resends), dict(engine._files_sent), dict(engine.kinds), dict(engine.demoted),
             dict(engine.presence.unjoined)))


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == SERVER_LOG and r.getMessage().startswith(REFUSED)]


def refused(server: Federation, topic: str, payload: bytes, caplog: pytest.LogCaptureFixture) -> str:
    """Hand one message to the server; check it was refused once and changed nothing; return the log line."""
    before = server_state(server)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=SERVER_LOG):
        server._handle(topic, payload)
    (reason,) = refusals(caplog)
    assert server_state(server) == before
    return reason


def close(server: Federation) -> RoundResult:
    result, _ = server.engine.close_round(time.monotonic())
    return result
