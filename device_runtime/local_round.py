"""One local round on a device, transport-free: the same function serves the MQTT device and the simulator."""
from __future__ import annotations

import numpy as np

from device_runtime.shard import Shard
from device_runtime.task import Task, Update
from device_runtime.trainer import DeviceTrainer


def run_task(trainer: DeviceTrainer, shard: Shard, task: Task, *, evaluate_received: bool = False) -> Update:
    """Load the received FE, take anchors from it (when λ > 0), train FE and head, return the FE.

    The head stays in ``trainer`` (the caller persists it). With ``evaluate_received`` the received FE and
    the current head are first evaluated on the local test split: that is the personalized model the last
    aggregation produced, reported as ``metrics['eval_correct'|'eval_total'|'eval_loss']``.
    """
    trainer.set_fe(task.fe)
    metrics: dict = {}
    if evaluate_received:
        received = trainer.evaluate(shard.x_test, shard.y_test)
        metrics.update(eval_correct=received.correct, eval_total=received.total, eval_loss=received.loss)
    anchors = mask = None
    if task.lam > 0:
        anchors, mask = trainer.compute_anchors(shard.x_train, shard.y_train)
    result = trainer.train(shard.x_train, shard.y_train, anchors=anchors, mask=mask, lam=task.lam, mu=task.mu,
                           lr=task.lr, epochs=task.epochs, batch_size=task.batch_size,
                           rng=np.random.default_rng(task.seed))
    metrics.update(steps=result.steps)
    return Update(task.round, trainer.get_fe(), result.num_samples, result.loss, result.accuracy, metrics)
