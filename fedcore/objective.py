"""The FedARA local objective, PyTorch reference: anchors, the anchor (FAC) loss, the λ schedule.

L = CE + λ·L_FAC + μ·Σ_q ‖U_q V_qᵀ‖²_F, minimised by plain SGD in two parts:
- every step descends CE + λ·L_FAC (``local_loss``);
- the Frobenius term is decoupled: once per local epoch, its exact gradient step is applied to every trained
  factor pair, U ← U − s·2μ·U(VᵀV), V ← V − s·2μ·V(UᵀU), with s = lr·k (k = steps taken in that epoch), from
  the values before the step (``fedcore.lowrank.frobenius_decay_step``; the device's numpy twin is
  ``device_runtime.frobenius``). Decision and measurement: inside every step the term cost 39–79% of a
  factorized step and made ratio-0.5 tiers 1.6–4.8× slower than dense, while its gradient moves a weight by
  only lr·μ ≈ 5e-6 per step. For SGD the epoch-level step differs from the per-step term only at second
  order in s·μ (README "Frobenius decay", docs/benchmarks.md).
- Anchors a_c are the per-class mean features of the *received, frozen* FE over the local training set;
  a class with no local sample has no anchor (mask 0) and contributes no FAC term.
- L_FAC = Σ_i m_{y_i} · mean_d (F(x_i)_d − a_{y_i,d})² / max(Σ_i m_{y_i}, 1): a per-sample MSE over the
  feature dimensions averaged over the samples whose class has an anchor. The summed form diverges with
  plain SGD once λ passes ~2 (measured: lr 5e-3, 512-d features), so the paper's λ values assume the mean.
- λ is 0 at round 1 (no aggregated FE yet) and ramps linearly to its target over the warm-up rounds.
The ONNX training graph (export/loss_block.py) builds the same per-step expression; tests/export/test_parity.py holds
the two trainers equal.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ANCHOR_BATCH = 256


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters live (CPU for a parameter-free module)."""
    return next(module.parameters(), torch.empty(0)).device


def lam_at_round(round_index: int, target: float, warmup: int) -> float:
    """λ for 1-based ``round_index``: 0 at round 1, linear to ``target`` at round warmup+1, then flat."""
    if round_index < 1:
        raise ValueError(f"rounds are numbered from 1, got {round_index}")
    if warmup <= 0:
        return 0.0 if round_index == 1 else float(target)
    return float(target) * min(1.0, (round_index - 1) / warmup)


@torch.no_grad()
def compute_anchors(fe: nn.Module, x: np.ndarray, y: np.ndarray, num_classes: int,
                    batch_size: int = ANCHOR_BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Per-class mean features (C×D float32) of the frozen ``fe`` over (x, y), and the 0/1 mask of classes seen."""
    was_training = fe.training
    device = module_device(fe)
    fe.eval()
    sums: torch.Tensor | None = None
    counts = np.bincount(y, minlength=num_classes).astype(np.float64)
    for start in range(0, len(x), batch_size):
        feats = fe(torch.from_numpy(x[start:start + batch_size]).to(device)).double().cpu()
        labels = torch.from_numpy(y[start:start + batch_size])
        if sums is None:
            sums = torch.zeros(num_classes, feats.shape[1], dtype=torch.float64)
        sums.index_add_(0, labels, feats)
    fe.train(was_training)
    if sums is None:
        raise ValueError("cannot compute anchors from an empty training set")
    mask = (counts > 0).astype(np.float32)
    anchors = sums.numpy() / np.maximum(counts, 1.0)[:, None]
    return anchors.astype(np.float32), mask


def fac_loss(features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Anchor alignment: per-sample MSE to the sample's class anchor, averaged over samples with an anchor."""
    weights = mask[labels]
    per_sample = ((features - anchors[labels]) ** 2).mean(dim=1)
    return (weights * per_sample).sum() / weights.sum().clamp(min=1.0)


def local_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor, mask: torch.Tensor,
               lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) for one batch: CE + λ·L_FAC (the Frobenius term is applied per epoch, not here)."""
    features = model.fe(x)
    logits = model.head(features)
    loss = F.cross_entropy(logits, y)
    if lam:
        loss = loss + lam * fac_loss(features, y, anchors, mask)
    return loss, logits
