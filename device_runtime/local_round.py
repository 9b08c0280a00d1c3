"""One local round on a device, transport-free: the same function serves the MQTT device and the simulator.

``Trainer`` is what both the onnxruntime trainers and the simulator's PyTorch reference offer.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import numpy as np

from device_runtime.baseline import majority
from device_runtime.batchnorm import is_statistic
from device_runtime.shard import Shard
from device_runtime.task import Task, Update


class Trainer(Protocol):
    fe_names: tuple[str, ...]
    head_names: tuple[str, ...]

    def get_fe(self) -> dict[str, np.ndarray]: ...
    def set_fe(self, tensors: dict[str, np.ndarray]) -> None: ...
    def get_head(self) -> dict[str, np.ndarray]: ...
    def set_head(self, tensors: dict[str, np.ndarray]) -> None: ...
    def compute_anchors(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def train(self, x: np.ndarray, y: np.ndarray, **settings) -> object: ...
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> object: ...


def load_weights(trainer: Trainer, weights: dict[str, np.ndarray]) -> None:
    """Write received tensors: the FE when they hold FE names, the head when they hold head names (FedAvg). FE
    tensors not among them keep the values the trainer holds: a task's FE lacks the device's personal tensors
    (BatchNorm statistics under ``--bn-stats personal``, a model's ``personal`` layers), and the personal tensors
    a device keeps are only those."""
    fe = {k: v for k, v in weights.items() if k in trainer.fe_names}
    head = {k: v for k, v in weights.items() if k in trainer.head_names}
    unknown = sorted(set(weights) - set(fe) - set(head))
    if unknown:
        raise ValueError(f"received tensors the model does not have: {unknown[:5]}")
    if fe:
        kept = [k for k in trainer.fe_names if k not in fe]
        if kept:
            held = trainer.get_fe()
            fe.update({k: held[k] for k in kept})
        trainer.set_fe(fe)
    if head:
        trainer.set_head(head)


def returned_weights(trainer: Trainer, returns: str, received: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a task asks back: the FE, FE and head, or nothing; BatchNorm statistics only where the task sent
    them (shared statistics), never the device's personal ones."""
    if returns == "none":
        return {}
    fe = {k: v for k, v in trainer.get_fe().items() if k in received or not is_statistic(k)}
    return {**fe, **trainer.get_head()} if returns == "all" else fe


def check_complete(trainer: Trainer, weights: dict[str, np.ndarray], personal: Collection[str]) -> None:
    """ValueError for a task whose FE leaves out a tensor of the plan that is not one of the device's personal
    tensors (those its PLAN gave it to keep): only those may be missing."""
    if not any(k in trainer.fe_names for k in weights):
        return
    missing = [k for k in trainer.fe_names if k not in weights and k not in personal]
    if missing:
        raise ValueError(f"the task lacks tensors of the plan: {missing[:5]}")


def evaluate_received(trainer: Trainer, shard: Shard, task: Task, personal: Collection[str] = ()) -> dict:
    """Load the task's weights (complete but for ``personal``) and evaluate the personalized model they make with
    this device's head; beside the accuracy, the test split's majority-class count and how many classes the model
    answered (device_runtime.baseline: what the accuracy is read against)."""
    check_complete(trainer, task.weights, personal)
    load_weights(trainer, task.weights)
    received = trainer.evaluate(shard.x_test, shard.y_test)
    return dict(eval_correct=received.correct, eval_total=received.total, eval_loss=received.loss,
                eval_majority=majority(shard.y_test)[1], eval_classes=received.classes)


def run_task(trainer: Trainer, shard: Shard, task: Task, personal: Collection[str] = ()) -> Update:
    """Evaluate the received model, take anchors from it (when λ > 0), train each phase, return what is asked.

    The head (and, for local training, the FE) stays in ``trainer``: the caller persists it. The evaluation is
    of the personalized model the last aggregation produced, reported as ``metrics['eval_correct'|
    'eval_total'|'eval_loss'|'eval_majority'|'eval_classes']``; an evaluate-only task (no phases) returns just that.
    """
    metrics = evaluate_received(trainer, shard, task, personal)
    if task.evaluate_only:
        return Update(task.round, {}, 0, 0.0, 0.0, metrics)
    anchors = mask = None
    if task.lam > 0:
        anchors, mask = trainer.compute_anchors(shard.x_train, shard.y_train)
    rng = np.random.default_rng(task.seed)
    steps, result = 0, None
    for phase in task.phases:
        result = trainer.train(shard.x_train, shard.y_train, anchors=anchors, mask=mask, lam=task.lam, mu=task.mu,
                               lr=task.lr, epochs=phase.epochs, batch_size=task.batch_size, rng=rng,
                               params=phase.params)
        steps += result.steps
    metrics.update(steps=steps)
    return Update(task.round, returned_weights(trainer, task.returns, task.weights), result.num_samples, result.loss,
                  result.accuracy, metrics)
