"""Shuffled mini-batch indices, numpy only: the one batching rule shared by the device and the torch reference.

Both trainers draw their batches here from the same ``np.random.Generator``, so equal seeds give equal
batches and the two paths can be compared step for step.
"""
from __future__ import annotations

import numpy as np


def epoch_batches(num_samples: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch: ``rng.permutation(num_samples)`` cut into batches of ``batch_size``, the last partial one kept."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = rng.permutation(num_samples)
    return [order[start:start + batch_size] for start in range(0, num_samples, batch_size)]

