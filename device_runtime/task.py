"""What a device is asked to do in a round and what it answers: plain data, shared by every transport.

A task names what to train as a sequence of phases (FedRep trains its head, then its FE; FedARA and FedAvg
train both at once) and which of its tensors the device returns, so the device needs no notion of the
algorithm: an empty phase list asks only for an evaluation of the received model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PARAM_GROUPS = ("all", "fe", "head")
"""What a phase trains: every tensor, the feature extractor only, or the head only."""
RETURNS = ("fe", "all", "none")
"""What the device sends back: its FE tensors, FE and head, or nothing (local training)."""


@dataclass(frozen=True)
class Phase:
    """``epochs`` passes over the local training set updating only ``params``."""

    params: str
    epochs: int

    def __post_init__(self) -> None:
        if self.params not in PARAM_GROUPS:
            raise ValueError(f"phase params must be one of {PARAM_GROUPS}, got {self.params!r}")
        if self.epochs < 1:
            raise ValueError(f"phase epochs must be >= 1, got {self.epochs}")


@dataclass
class Task:
    """Round ``round``: load ``weights`` (the shared tensors, factorized at the device's plan), train ``phases``.

    ``weights`` may be empty (local training: the device keeps its own model). ``aggregator`` names the aggregator
    process whose update topic takes the answer (``Topics.update_via``); None: the server's own update topic.
    ``secure``: the round's SecAgg+ parameters for this device (``device_runtime.secagg_client.SecureSpec``), or
    None; its change then travels masked and its update carries no tensor."""

    round: int
    weights: dict[str, np.ndarray]
    lam: float
    mu: float
    lr: float
    phases: tuple[Phase, ...]
    batch_size: int
    seed: int
    returns: str = "fe"
    deadline: float | None = None
    aggregator: str | None = None
    secure: Any = None  # a device_runtime.secagg_client.SecureSpec: the round aggregates securely
    version: int | None = None  # async mode: the model version ``weights`` are; None: round ``round - 1``'s model

    @property
    def model_name(self) -> str:
        """What the model this task evaluates is named after: ``version<v>`` in async mode (task numbers are not
        versions), else ``round<t - 1>`` (a task of round t evaluates round t - 1's model)."""
        return f"round{self.round - 1}" if self.version is None else f"version{self.version}"

    @property
    def evaluate_only(self) -> bool:
        return not self.phases

    @property
    def epochs(self) -> int:
        return sum(p.epochs for p in self.phases)


@dataclass
class Update:
    """The device's answer: the tensors its task asked back (never a head unless FedAvg asks), sample count
    and metrics (``eval_correct``/``eval_total``/``eval_loss`` of the received model)."""

    round: int
    weights: dict[str, np.ndarray]
    num_samples: int
    train_loss: float
    train_accuracy: float
    metrics: dict = field(default_factory=dict)


def non_finite(update: Update) -> str | None:
    """What in ``update`` is not a finite number (its loss, accuracy, a metric, a tensor), or None: a model that
    diverged (large DP noise on a small federation, a too large learning rate) gives NaN or inf, which the wire
    cannot carry and no aggregate may take; the device says so instead of answering."""
    numbers = {"train_loss": update.train_loss, "train_accuracy": update.train_accuracy,
               **{f"metrics[{k!r}]": v for k, v in update.metrics.items()}}
    for name, value in numbers.items():
        if isinstance(value, (float, np.floating)) and not math.isfinite(value):
            return f"{name} is {value}"
    for name, tensor in update.weights.items():
        if not np.isfinite(tensor).all():
            return f"tensor {name!r} has {int(np.count_nonzero(~np.isfinite(tensor)))} non-finite value(s)"
    return None


def tensor_bytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(int(a.nbytes) for a in tensors.values())
