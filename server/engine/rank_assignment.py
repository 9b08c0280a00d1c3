"""Which rank tier a device trains at: the largest tier predicted to fit its memory budget.

Pure functions. ``assign_tier`` takes any predictor ``ratio -> peak MiB``, so a calibrated cost model can
replace the analytical one here without touching the server:

    peak ≈ runtime base + 4 B × (2 × parameters + 2 × activations per sample × batch)

i.e. every parameter and its gradient (plain SGD keeps no optimizer state), and every layer output kept
for the backward pass plus its gradient. An override file (JSON ``{device_id: ratio}``) takes precedence.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from fedcore.lowrank import FactorizedConv1d, FactorizedLayer, FactorizedLinear, factorize_model, resolve_plan
from fedcore.models import rank_plan

RUNTIME_BASE_MB = 60.0
"""Resident memory of the device runtime before any model: onnxruntime's C bindings, numpy and Python
(56 MB measured after import, docs/benchmarks.md)."""
BYTES_PER_FLOAT = 4
COPIES_PER_PARAMETER = 2  # the value and its gradient
COPIES_PER_ACTIVATION = 2  # the stored output and its gradient
MIB = 1024 * 1024


class OverrideError(ValueError):
    """A rank override file that is unreadable or holds something other than {device_id: ratio in (0, 1]}."""


@dataclass(frozen=True)
class Footprint:
    """The sizes that drive training memory: parameter count and activation floats per sample."""

    parameters: int
    activations_per_sample: int


def check_tiers(tiers: Sequence[float]) -> tuple[float, ...]:
    """The tiers, largest first; raises ValueError on an empty list, a repeat, or a ratio outside (0, 1]."""
    if not tiers:
        raise ValueError("at least one rank tier is needed")
    bad = [t for t in tiers if not (isinstance(t, (int, float)) and 0.0 < t <= 1.0)]
    if bad:
        raise ValueError(f"rank tiers must lie in (0, 1], got {bad}")
    if len(set(tiers)) != len(tiers):
        raise ValueError(f"rank tiers repeat a value: {list(tiers)}")
    return tuple(sorted((float(t) for t in tiers), reverse=True))


def _factor_intermediate(module: nn.Module, x: torch.Tensor) -> int:
    """Floats per sample of the rank-r tensor between a factorized layer's two halves (not a module output)."""
    rank = module.u.shape[1]
    if isinstance(module, FactorizedLinear):
        return rank
    if isinstance(module, FactorizedConv1d):
        _, _, k = module.weight_shape
        return rank * ((x.shape[2] + 2 * module.padding[0] - k) // module.stride[0] + 1)
    _, _, _, kw = module.weight_shape
    width = (x.shape[3] + 2 * module.padding[1] - kw) // module.stride[1] + 1
    return rank * x.shape[2] * width


def plan_footprint(model: nn.Module, ranks: Mapping[str, int], input_shape: tuple[int, ...]) -> Footprint:
    """Parameters and activations per sample of ``model`` factorized at ``ranks`` (one forward on a zero input)."""
    client = factorize_model(model, dict(ranks))
    counts: list[int] = []

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        counts.append(output[0].numel())
        if isinstance(module, FactorizedLayer):
            counts.append(_factor_intermediate(module, inputs[0]))

    leaves = [m for m in client.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            client(torch.zeros(1, *input_shape))
    finally:
        for hook in hooks:
            hook.remove()
    parameters = sum(p.numel() for p in client.parameters())
    return Footprint(parameters, math.prod(input_shape) + sum(counts))


def predict_peak_mb(footprint: Footprint, batch_size: int, base_mb: float = RUNTIME_BASE_MB) -> float:
    """Predicted peak training memory in MiB at ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    floats = (COPIES_PER_PARAMETER * footprint.parameters
              + COPIES_PER_ACTIVATION * footprint.activations_per_sample * batch_size)
    return base_mb + floats * BYTES_PER_FLOAT / MIB


def tier_predictor(model: nn.Module, input_shape: tuple[int, ...], batch_size: int) -> Callable[[float], float]:
    """``ratio -> predicted peak MiB`` for ``model``'s default rank plan at that ratio (memoized)."""

    @lru_cache(maxsize=None)
    def predict(ratio: float) -> float:
        plan = resolve_plan(model, rank_plan(model, ratio))
        return predict_peak_mb(plan_footprint(model, plan.ranks, input_shape), batch_size)

    return predict


def assign_tier(budget_mb: float | None, tiers: Sequence[float], predict: Callable[[float], float]) -> float:
    """The largest tier whose predicted peak fits ``budget_mb``; no budget: the largest tier.

    When no tier fits, the tier predicted to need the least (the closest the device can get; the larger of equals):
    the smallest for the zoo, but a model whose factors hold more than its dense layers (a depthwise-separable net's
    pointwise convolutions) can be leanest dense. The caller says so."""
    ordered = check_tiers(tiers)
    if budget_mb is None:
        return ordered[0]
    return next((t for t in ordered if predict(t) <= budget_mb), None) or min(ordered, key=predict)


def unchosen_tiers(tiers: Sequence[float], predict: Callable[[float], float]) -> list[tuple[float, float]]:
    """Each tier that no memory budget selects, with the larger tier predicted to need no more (which ``assign_tier``
    picks wherever the first fits): factorizing that model at that ratio saves no memory; only an override sends a
    device there."""
    ordered = check_tiers(tiers)
    unchosen = []
    for i, tier in enumerate(ordered):
        larger = next((b for b in ordered[:i] if predict(b) <= predict(tier)), None)
        if larger is not None:
            unchosen.append((tier, larger))
    return unchosen


def choose_ratio(device_id: str, budget_mb: float | None, tiers: Sequence[float],
                 predict: Callable[[float], float], overrides: Mapping[str, float]) -> float:
    """The device's ratio: its override if it has one, else ``assign_tier``."""
    if device_id in overrides:
        return overrides[device_id]
    return assign_tier(budget_mb, tiers, predict)


def parse_overrides(document: object) -> dict[str, float]:
    """Check a parsed override document: a JSON object of device id -> ratio in (0, 1]."""
    if not isinstance(document, dict):
        raise OverrideError(f"rank overrides must be a JSON object {{device_id: ratio}}, got {type(document).__name__}")
    for device_id, ratio in document.items():
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
            raise OverrideError(f"rank override for {device_id!r} must be a ratio in (0, 1], got {ratio!r}")
    return {device_id: float(ratio) for device_id, ratio in document.items()}


def load_overrides(path: str | os.PathLike) -> dict[str, float]:
    """Read a rank override file (see parse_overrides)."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise OverrideError(f"cannot read rank overrides {path}: {exc}") from None
    return parse_overrides(document)
