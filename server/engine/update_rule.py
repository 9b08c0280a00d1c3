"""The one rule of which update answers a round, for the engine and for the aggregator processes alike.

An update answers the open round's ask of a device when it came under that device's own topic, for the open
round, from a device asked in it, for the first time; and when its body is well formed, for the device's plan,
with exactly the tensors a training update of that plan carries (finite), and the sample count the device
declared at join (0 for an evaluation). The engine (``server.engine.coordinator``) adds what only it knows (the run,
the deadline, the evaluation's fit to the test set, the robust screen); an aggregator adds the device's
signature. An update reaches the rule as an :class:`Answer`: the device's UPDATE message, or an aggregator's
receipt of one (the aggregator checked and holds its tensors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from device_runtime.messages import parse_update_fields
from device_runtime.envelope import Message, MessageType
from device_runtime.protocol import ProtocolError
from device_runtime.task import Update
from device_runtime.tensor_check import tensor_problem
from device_runtime.topics import check_topic_device


@dataclass(frozen=True)
class Asked:
    """One device asked in a round: its plan, the samples its update must declare (0: it only evaluates),
    whether it trains."""

    plan_hash: str
    num_samples: int
    trains: bool


@dataclass(frozen=True)
class Answer:
    """An update as it reached a judge: the device's header (who, which run and round) and its fields, with its
    tensors, or None where an aggregator verified and holds them."""

    device_id: str
    run_id: str
    round: int
    fields: dict[str, Any]
    tensors: dict[str, np.ndarray] | None

    @classmethod
    def of_message(cls, msg: Message) -> Answer:
        """The device's UPDATE itself (ValueError for another type: only updates are judged)."""
        if msg.type != MessageType.UPDATE:
            raise ValueError(f"only UPDATE messages are judged, got {msg.type}")
        return cls(msg.device_id, msg.run_id, msg.round, msg.meta, dict(msg.tensors))

    def parse(self) -> tuple[str, Update]:
        """(plan hash, Update); raises MessageError for a malformed body."""
        return parse_update_fields(self.fields, self.round, dict(self.tensors or {}))


def header_problem(topic_device: str, answer: Answer, open_round: int | None, asked: bool,
                   answered: bool) -> str | None:
    """Why ``answer`` does not answer the open round's ask of ``topic_device`` (None: it may)."""
    try:
        check_topic_device(topic_device, answer.device_id)
    except ProtocolError as exc:
        return str(exc)
    if open_round is None:
        return f"stale: update for round {answer.round}, no round is open"
    if answer.round != open_round:
        return f"stale: update for round {answer.round}, round {open_round} is open"
    if not asked:
        return f"not asked in round {open_round}"
    if answered:
        return f"duplicate update for round {open_round}"
    return None


def body_problem(plan_hash: str, update: Update, asked: Asked, shapes: dict[str, tuple[int, ...]] | None,
                 tensors_checked: bool) -> str | None:
    """Why a well-formed body does not answer ``asked`` (None: it does). ``shapes``: the tensors a training update
    of the device's plan carries; ``tensors_checked``: an aggregator checked them already (a receipt)."""
    if plan_hash != asked.plan_hash:
        return f"update for plan {plan_hash[:12]}, the device's plan is {(asked.plan_hash or 'none')[:12]}"
    if not tensors_checked:
        problem = tensor_problem(update.weights, (shapes or {}) if asked.trains else {}, finite=True)
        if problem is not None:
            return problem
    if update.num_samples != asked.num_samples:
        return f"num_samples {update.num_samples}, expected {asked.num_samples}"
    return None
