"""Reference local training and evaluation in PyTorch (the oracle the ONNX device path must match)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from device_runtime.batching import epoch_batches
from device_runtime.trainer import EvalResult, TrainResult
from server.objective import local_loss, module_device

EVAL_BATCH = 512


def train_local(model: nn.Module, x: np.ndarray, y: np.ndarray, *, anchors: np.ndarray | None, mask: np.ndarray | None,
                lam: float, mu: float, lr: float, epochs: int, batch_size: int, rng: np.random.Generator,
                params: list[nn.Parameter] | None = None) -> TrainResult:
    """Plain-SGD local epochs of shuffled batches (last partial batch kept) on ``params`` (default: all)."""
    if len(x) == 0:
        raise ValueError("cannot train on an empty shard")
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
        for batch in epoch_batches(len(x), batch_size, rng):
            xb, yb = torch.from_numpy(x[batch]).to(device), torch.from_numpy(y[batch]).to(device)
            loss, logits = local_loss(model, xb, yb, anchors_t, mask_t, lam if anchors is not None else 0.0, mu)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch)
            correct += int((logits.argmax(1) == yb).sum())
            seen += len(batch)
            steps += 1
    return TrainResult(len(x), total_loss / seen, correct / seen, steps)


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = EVAL_BATCH) -> EvalResult:
    device = module_device(model)
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, len(x), batch_size):
        xb = torch.from_numpy(x[start:start + batch_size]).to(device)
        yb = torch.from_numpy(y[start:start + batch_size]).to(device)
        logits = model(xb)
        loss += F.cross_entropy(logits, yb, reduction="sum").item()
        correct += int((logits.argmax(1) == yb).sum())
    model.train()
    return EvalResult(correct, len(x), loss / max(len(x), 1))
