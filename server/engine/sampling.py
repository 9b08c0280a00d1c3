"""The small seeded rules the round engine applies: who is sampled, each
device's batch seed, and the global model factorized once per distinct plan. No I/O."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

from fedcore.lowrank import ResolvedPlan, factorize_state


def sample_clients(client_ids: list[str], join_ratio: float, round_index: int, seed: int) -> list[str]:
    """A seeded, per-round sample of max(1, round(join_ratio·K)) clients, in the original order."""
    k = max(1, round(join_ratio * len(client_ids)))
    if k >= len(client_ids):
        return list(client_ids)
    chosen = np.random.default_rng([seed, round_index]).choice(len(client_ids), size=k, replace=False)
    return [client_ids[i] for i in sorted(chosen)]


def batch_seed(seed: int, round_index: int, device_id: str) -> int:
    """The seed of a device's batch order in a round: a function of its id (never of when it joined), the same
    for every backend and transport."""
    key = int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big")
    return int(np.random.default_rng([seed, round_index, key]).integers(2**31))


def to_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float32 C-ordered copies; a 0-d tensor stays 0-d (np.ascontiguousarray would make it (1,))."""
    return {k: np.array(v.detach().cpu().numpy(), np.float32, order="C") for k, v in tensors.items()}


def to_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in arrays.items()}


def as_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``to_torch`` without the copy where an array already is writable contiguous float32 (an update's decoded
    tensors, which nothing else writes): the tensors share its memory. The read path folds every update through it."""
    return {k: torch.from_numpy(v if v.dtype == np.float32 and v.flags.c_contiguous and v.flags.writeable
                                else np.array(v, dtype=np.float32)) for k, v in arrays.items()}


def plan_key(plan: ResolvedPlan) -> tuple[tuple[str, int], ...]:
    """Clients with equal keys receive identical factors."""
    return tuple(sorted(plan.ranks.items()))


def factorize_per_plan(global_fe: dict[str, torch.Tensor], plans: Iterable[ResolvedPlan]) -> dict[tuple, dict[str, np.ndarray]]:
    """The global FE factorized once per distinct plan, from one SVD per layer shared by every plan."""
    out: dict[tuple, dict[str, np.ndarray]] = {}
    spectra: dict[str, tuple] = {}
    for plan in plans:
        key = plan_key(plan)
        if key not in out:
            out[key] = to_numpy(factorize_state(global_fe, plan.ranks, spectra))
    return out


def weighted_accuracy(correct: list[int], totals: list[int]) -> tuple[float, float]:
    """(Σ correct / Σ total, std over clients of their own accuracies)."""
    total = sum(totals)
    if total == 0:
        return 0.0, 0.0
    per_client = [c / t for c, t in zip(correct, totals) if t]
    return sum(correct) / total, float(np.std(per_client)) if per_client else 0.0
