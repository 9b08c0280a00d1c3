"""The simulator's ``--backend ort``: every client trains through the device runtime's onnxruntime trainer.

Clients that share a rank plan share one artifact set and one trainer; each client's head is swapped in
before its turn and read back after, as a device would keep it on disk.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from device_runtime.local_round import run_task
from device_runtime.task import Task, Update
from device_runtime.trainer import DeviceTrainer, EvalResult
from export.artifacts import build_artifacts
from server.simulate import SimClient
from server.strategy import plan_key


class OrtBackend:
    def __init__(self, clients: list[SimClient], cache_dir: Path, threads: int = 1):
        self._trainers: dict[tuple, DeviceTrainer] = {}
        self._heads: dict[str, dict[str, np.ndarray]] = {}
        for client in clients:
            key = plan_key(client.plan)
            if key not in self._trainers:
                shard = client.shard
                artifacts = build_artifacts(client.template, client.plan.ranks, shard.input_shape,
                                            shard.num_classes, cache_dir)
                self._trainers[key] = DeviceTrainer(artifacts.directory, threads=threads)
            head = client.model.head
            self._heads[client.cid] = {f"head.{k}": v.detach().numpy().copy() for k, v in head.state_dict().items()}

    def _trainer_for(self, client: SimClient) -> DeviceTrainer:
        trainer = self._trainers[plan_key(client.plan)]
        trainer.set_head(self._heads[client.cid])
        return trainer

    def fit(self, client: SimClient, task: Task, algo: str) -> Update:
        trainer = self._trainer_for(client)
        update = run_task(trainer, client.shard, task)
        self._heads[client.cid] = trainer.get_head()
        return update

    def evaluate(self, client: SimClient, shared: dict[str, np.ndarray] | None) -> EvalResult:
        trainer = self._trainer_for(client)
        trainer.set_fe(shared)
        return trainer.evaluate(client.shard.x_test, client.shard.y_test)
