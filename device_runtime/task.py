"""What a device is asked to do in a round and what it answers: plain data, shared by every transport."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Task:
    """Round ``round``: start from ``fe`` (factorized at the device's plan), train with these settings."""

    round: int
    fe: dict[str, np.ndarray]
    lam: float
    mu: float
    lr: float
    epochs: int
    batch_size: int
    seed: int
    deadline: float | None = None


@dataclass
class Update:
    """The device's answer: its updated FE tensors (never its head), sample count and metrics."""

    round: int
    fe: dict[str, np.ndarray]
    num_samples: int
    train_loss: float
    train_accuracy: float
    metrics: dict = field(default_factory=dict)


def tensor_bytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(int(a.nbytes) for a in tensors.values())
