"""The simulator's devices: one in-process device (its shard and personal tensors, answering a task as a device
process would) and the trainers they share, one per plan (the PyTorch reference or the device runtime's
onnxruntime trainer). Used by ``server.simulate`` and by the worker processes of ``server.parallel_devices``."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from device_runtime.local_round import Trainer, load_weights, run_task
from device_runtime.messages import Plan
from device_runtime.runtimes import open_trainer
from device_runtime.shard import Shard
from device_runtime.task import Task, Update, non_finite
from fedcore.lowrank import factorize_model
from server.compute_threads import device_blas_threads
from server.run_setup import PlanArtifacts
from server.torch_trainer import TorchTrainer


class InProcessDevice:
    """One simulated device: its shard and personal tensors; trainers are shared by the devices of a plan
    (each device's tensors are written into it before its turn, as a device loads them from disk)."""

    def __init__(self, device_id: str, shard: Shard, trainer_for: Callable[[str], Trainer], threads: int):
        self.device_id, self.shard, self.trainer_for, self.threads = device_id, shard, trainer_for, threads
        self.plan_hash: str | None = None
        self.personal: dict[str, np.ndarray] = {}

    def install(self, plan: Plan) -> None:
        """Take the plan; a device that holds nothing of this run starts from the plan's initial tensors."""
        self.plan_hash = plan.plan_hash
        if not self.personal:
            self.personal = {k: v.copy() for k, v in plan.init.items()}

    def answer(self, task: Task) -> Update:
        trainer = self.trainer_for(self.plan_hash)
        load_weights(trainer, self.personal)
        with device_blas_threads(self.threads):  # a device process's BLAS threads: the same kernels, the same bits
            update = run_task(trainer, self.shard, task, self.personal)
        if not task.evaluate_only and non_finite(update) is None:  # a diverged round keeps the tensors it had
            held = {**trainer.get_fe(), **trainer.get_head()}
            self.personal = {k: held[k] for k in self.personal}
        return update


class Trainers:
    """One trainer per plan: the PyTorch reference or the device runtime's onnxruntime trainer."""

    def __init__(self, backend: str, plans: dict[str, PlanArtifacts], threads: int, device: str = "cpu"):
        self.backend, self.plans, self.threads, self.device = backend, plans, threads, device
        self._trainers: dict[str, Trainer] = {}

    def __call__(self, plan_hash: str) -> Trainer:
        if plan_hash not in self._trainers:
            plan = self.plans[plan_hash]
            if self.backend == "torch":
                model = factorize_model(plan.model, plan.resolved.ranks).to(self.device)
                self._trainers[plan_hash] = TorchTrainer(model)
            else:
                self._trainers[plan_hash] = open_trainer(plan.artifacts.directory, threads=self.threads)
        return self._trainers[plan_hash]
