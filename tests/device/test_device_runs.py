"""A device between runs: joining a new run keeps the last run's heads until the new run commits a trained round,
so a run that aborts before then costs nothing, and a server resuming the earlier run finds its heads again."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from device_runtime.agent import DeviceAgent
from device_runtime.workdir import HEADS_DIR, PREVIOUS_RUN_DIR, Workdir
from device_runtime.envelope import MessageType
from device_runtime.messages import Plan, plan_message, task_message
from device_runtime.profile import collect_profile
from device_runtime.shard import Shard
from device_runtime.task import Phase, Task
from device_runtime.topics import Topics
from fedcore.models import build_model
from server.engine.round_engine import algorithm_for
from server.engine.run_config import FederationConfig
from server.run_setup import PlanBook, global_state, initial_personal
from server.engine.sampling import factorize_per_plan, plan_key
from tests.support.sealing import device_link, seal_down
from tests.support.recording_endpoint import RecordingEndpoint

DEVICE = "dev_000"
PREFIX = "fedara-runs"
INPUT_SHAPE = (1, 16, 16)
CLASSES = 10
RUN_A, RUN_B, RUN_C = "run-a", "run-b", "run-c"


@dataclass(frozen=True)
class World:
    plan_hash: str
    description: str
    files: dict[str, bytes]
    personal: dict[str, np.ndarray]
    fe: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def world(shared_artifact_cache: Path) -> World:
    algorithm = algorithm_for(FederationConfig())
    model = build_model("fedavgcnn", INPUT_SHAPE, CLASSES, seed=0)
    plan = PlanBook(model, INPUT_SHAPE, shared_artifact_cache).get(1.0)
    fe = factorize_per_plan(global_state(model, algorithm), [plan.resolved])[plan_key(plan.resolved)]
    return World(plan.hash, plan.description, plan.files, initial_personal([model], algorithm)[model.name], fe)


def make_device(directory: Path) -> tuple[DeviceAgent, RecordingEndpoint]:
    rng = np.random.default_rng(0)
    x = rng.random((16, *INPUT_SHAPE), dtype=np.float32)
    y = np.arange(16, dtype=np.int64) % CLASSES
    endpoint = RecordingEndpoint()
    agent = DeviceAgent(DEVICE, Shard(x[:12], y[:12], x[12:], y[12:], CLASSES), collect_profile(None, 1), endpoint,
                        Workdir(directory / "work"), Topics(PREFIX, DEVICE), device_link(DEVICE, directory / "auth"))
    return agent, endpoint


def send_plan(agent: DeviceAgent, endpoint: RecordingEndpoint, world: World, run_id: str) -> None:
    files = {} if world.plan_hash in agent.workdir.held_artifacts() else world.files
    plan = Plan(world.plan_hash, 1.0, world.description, files, world.personal)
    agent.handle(agent.topics.down, seal_down(plan_message(plan, device_id=DEVICE, run_id=run_id)))
    assert endpoint.last().type == MessageType.ACK


def train_round(agent: DeviceAgent, endpoint: RecordingEndpoint, world: World, run_id: str, round_index: int) -> None:
    task = Task(round=round_index, weights=dict(world.fe), lam=0.0, mu=0.0, lr=0.05, phases=(Phase("all", 1),),
                batch_size=4, seed=round_index, returns="fe")
    agent.handle(agent.topics.down, seal_down(task_message(task, plan_hash=world.plan_hash, device_id=DEVICE,
                                                           run_id=run_id)))
    assert endpoint.last().type == MessageType.UPDATE


def heads(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (folder / HEADS_DIR).glob("*.npz")} if folder.is_dir() else {}


def test_a_run_that_aborts_before_its_first_commit_leaves_the_last_runs_head(world: World, tmp_path: Path):
    agent, endpoint = make_device(tmp_path)
    root = agent.workdir.root
    send_plan(agent, endpoint, world, RUN_A)
    train_round(agent, endpoint, world, RUN_A, 1)
    trained_in_a = heads(root)
    assert list(trained_in_a) == [f"{world.plan_hash}-1.npz"]

    send_plan(agent, endpoint, world, RUN_B)  # B plans, then aborts before its first round commits
    assert agent.state.run_id == RUN_B and heads(root) == {}
    assert heads(root / PREVIOUS_RUN_DIR) == trained_in_a

    send_plan(agent, endpoint, world, RUN_C)  # another run that commits nothing does not push A out
    assert agent.workdir.kept_run() == RUN_A and heads(root / PREVIOUS_RUN_DIR) == trained_in_a

    train_round(agent, endpoint, world, RUN_C, 1)  # C's first committed trained round: A's files go
    assert not (root / PREVIOUS_RUN_DIR).exists() and list(heads(root)) == [f"{world.plan_hash}-1.npz"]


def test_a_server_resuming_the_earlier_run_finds_the_devices_head_again(world: World, tmp_path: Path):
    agent, endpoint = make_device(tmp_path)
    root = agent.workdir.root
    send_plan(agent, endpoint, world, RUN_A)
    train_round(agent, endpoint, world, RUN_A, 1)
    trained_head = {k: v.copy() for k, v in agent.trainer.get_head().items()}
    trained_in_a = heads(root)

    send_plan(agent, endpoint, world, RUN_B)
    assert not all(np.array_equal(v, trained_head[k]) for k, v in agent.trainer.get_head().items())

    send_plan(agent, endpoint, world, RUN_A)  # A resumed after B aborted
    assert (agent.state.run_id, agent.state.answered_round) == (RUN_A, 1)
    assert heads(root) == trained_in_a and not (root / PREVIOUS_RUN_DIR).exists()
    for name, value in agent.trainer.get_head().items():
        np.testing.assert_array_equal(value, trained_head[name], err_msg=name)
    assert agent.workdir.load_state() == agent.state


def test_a_device_that_held_no_committed_head_sets_nothing_aside(world: World, tmp_path: Path):
    agent, endpoint = make_device(tmp_path)
    send_plan(agent, endpoint, world, RUN_A)
    send_plan(agent, endpoint, world, RUN_B)
    assert agent.workdir.kept_run() is None and not (agent.workdir.root / PREVIOUS_RUN_DIR).exists()
