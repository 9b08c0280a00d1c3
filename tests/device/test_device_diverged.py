"""A device whose round diverges (a NaN or inf loss or tensor: large DP noise on a tiny federation, a too large
learning rate) says so with an ERROR instead of an update, keeps the head it had, and answers the next task."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from device_runtime.envelope import MessageType
from device_runtime.messages import ErrorCode, parse_error, plan_message, task_message
from device_runtime.task import Update, non_finite
from tests.support.device_agent import artifact_files, dense_task, deliver, make_agent, plan_for, tiny_shard

RUN = "run1"


@pytest.mark.parametrize("update, expected", [
    (Update(1, {}, 12, float("nan"), 0.5, {}), "train_loss is nan"),
    (Update(1, {}, 12, 0.5, 0.5, {"eval_loss": np.float32("inf")}), "metrics['eval_loss'] is inf"),
    (Update(1, {"fe.w": np.array([1.0, np.nan, np.inf], np.float32)}, 12, 0.5, 0.5, {}),
     "tensor 'fe.w' has 2 non-finite value(s)"),
    (Update(1, {"fe.w": np.ones(3, np.float32)}, 12, 0.5, 0.5, {"eval_loss": 0.3, "steps": 3}), None),
], ids=["loss", "metric", "tensor", "finite"])
def test_non_finite_names_the_first_number_that_is_not_finite(update: Update, expected: str | None):
    assert non_finite(update) == expected


def test_a_diverged_round_is_an_error_that_keeps_the_head_and_the_device_answers_the_next_task(dense_artifacts,
                                                                                            tmp_path: Path):
    model, artifacts = dense_artifacts
    agent, endpoint = make_agent(tmp_path / "work", tiny_shard(tmp_path / "shard.npz"))
    deliver(agent, plan_message(plan_for(artifacts, artifact_files(artifacts), model), device_id="dev_t", run_id=RUN))
    head = {k: v.copy() for k, v in agent.trainer.get_head().items()}
    sent = len(endpoint.messages())

    diverging = dataclasses.replace(dense_task(model, 1), lr=1e30)  # one step takes every weight past float32
    deliver(agent, task_message(diverging, plan_hash=artifacts.hash, device_id="dev_t", run_id=RUN))
    (reply,) = endpoint.messages()[sent:]
    assert reply.type == MessageType.ERROR and reply.round == 1
    report = parse_error(reply)
    assert report.code == ErrorCode.NON_FINITE and "round 1: " in report.detail
    assert all(np.array_equal(v, head[k]) for k, v in agent.trainer.get_head().items())
    assert agent.workdir.load_answer() is None and agent.state.answered_round == 0

    deliver(agent, task_message(dense_task(model, 1), plan_hash=artifacts.hash, device_id="dev_t", run_id=RUN))
    assert endpoint.last().type == MessageType.UPDATE and endpoint.last().round == 1
