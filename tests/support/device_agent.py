"""A device agent driven directly for tests: a tiny shard, an agent over a recording endpoint, the artifacts and the
plan and task messages a server would send it, delivered sealed on its down topic."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from device_runtime.agent import DeviceAgent
from device_runtime.artifact_contract import TRAINING_KIND
from device_runtime.messages import ARTIFACT_BLOBS_BY_KIND, DEFAULT_TOPIC_PREFIX, Plan
from device_runtime.profile import collect_profile
from device_runtime.shard import Shard, load_shard, save_shard
from device_runtime.task import Phase, Task
from device_runtime.topics import Topics
from device_runtime.workdir import Workdir
from tests.support.recording_endpoint import RecordingEndpoint
from tests.support.sealing import device_link, seal_down


def tiny_shard(path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.random((16, 1, 28, 28), dtype=np.float32)
    y = np.arange(16, dtype=np.int64) % 10
    save_shard(path, Shard(x[:12], y[:12], x[12:], y[12:], 10))
    return path


def make_agent(workdir: Path, shard_path: Path) -> tuple[DeviceAgent, RecordingEndpoint]:
    endpoint = RecordingEndpoint()
    agent = DeviceAgent("dev_t", load_shard(shard_path), collect_profile(None, 1), endpoint, Workdir(workdir),
                        Topics(DEFAULT_TOPIC_PREFIX, "dev_t"), device_link("dev_t", workdir / "auth"))
    return agent, endpoint


def artifact_files(artifacts) -> dict[str, bytes]:
    return {name: (artifacts.directory / name).read_bytes() for name in ARTIFACT_BLOBS_BY_KIND[TRAINING_KIND]}


def deliver(agent: DeviceAgent, msg) -> None:
    agent.handle(agent.topics.down, seal_down(msg))


def dense_task(model, round_index: int = 1) -> Task:
    fe = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k.startswith("fe.")}
    return Task(round=round_index, weights=fe, lam=0.0, mu=0.0, lr=0.05, phases=(Phase("all", 1),), batch_size=4,
                seed=round_index)


def initial_head(model) -> dict[str, np.ndarray]:
    """What the server's PLAN says a device keeps to itself (FedARA: the head)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k.startswith("head.")}


def plan_for(artifacts, files: dict[str, bytes], model=None) -> Plan:
    return Plan(artifacts.hash, 1.0, "dense", files, {} if model is None else initial_head(model))
