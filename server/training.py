"""Reference local training and evaluation in PyTorch (the oracle the ONNX device path must match).

Each step minimises CE + λ·L_FAC; each local epoch ends with one decoupled Frobenius decay step on the trained
factors at step size lr × that epoch's step count, as the device does (``fedcore.objective`` says why).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from device_runtime.batching import epoch_batches
from device_runtime.trainer import EvalResult, TrainResult
from fedcore.lowrank import decay_factors
from fedcore.objective import local_loss, module_device

EVAL_BATCH = 512


def train_local(model: nn.Module, x: np.ndarray, y: np.ndarray, *, anchors: np.ndarray | None, mask: np.ndarray | None,
                lam: float, mu: float, lr: float, epochs: int, batch_size: int, rng: np.random.Generator,
                params: list[nn.Parameter] | None = None) -> TrainResult:
    """Plain-SGD local epochs of shuffled batches (last partial batch kept) on ``params`` (default: all), each
    epoch closed by the Frobenius decay step (μ, s = lr × steps in the epoch) on the factors among ``params``."""
    if len(x) == 0:
        raise ValueError("cannot train on an empty shard")
    if not mu >= 0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    trainable = list(model.parameters()) if params is None else params
    optimizer = torch.optim.SGD(trainable, lr=lr)
    anchors_t = torch.from_numpy(anchors) if anchors is not None else None
    mask_t = torch.from_numpy(mask) if mask is not None else None
    device = module_device(model)
    anchors_t = anchors_t.to(device) if anchors_t is not None else None
    mask_t = mask_t.to(device) if mask_t is not None else None
    model.train()
    total_loss, correct, seen, steps = 0.0, 0, 0, 0
    for _ in range(epochs):
        batches = epoch_batches(len(x), batch_size, rng)
        for batch in batches:
            xb, yb = torch.from_numpy(x[batch]).to(device), torch.from_numpy(y[batch]).to(device)
            loss, logits = local_loss(model, xb, yb, anchors_t, mask_t, lam if anchors is not None else 0.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch)
            correct += int((logits.argmax(1) == yb).sum())
            seen += len(batch)
        steps += len(batches)
        decay_factors(model, mu, lr * len(batches), trainable)
    return TrainResult(len(x), total_loss / seen, correct / seen, steps)


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = EVAL_BATCH) -> EvalResult:
    device = module_device(model)
    model.eval()
    correct, loss, answered = 0, 0.0, set()
    for start in range(0, len(x), batch_size):
        xb = torch.from_numpy(x[start:start + batch_size]).to(device)
        yb = torch.from_numpy(y[start:start + batch_size]).to(device)
        logits = model(xb)
        loss += F.cross_entropy(logits, yb, reduction="sum").item()
        predicted = logits.argmax(1)
        correct += int((predicted == yb).sum())
        answered.update(predicted.tolist())
    model.train()
    return EvalResult(correct, len(x), loss / max(len(x), 1), len(answered))
