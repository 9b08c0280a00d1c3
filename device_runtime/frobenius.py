"""The Frobenius decay μ·‖U Vᵀ‖²_F as a decoupled SGD step, numpy only: the device's one copy of this math.

FedARA's objective carries μ·Σ_q ‖U_q V_qᵀ‖²_F over the factorized layers. Inside the per-step training graph
it cost 39–79% of a factorized step (docs/benchmarks.md), which made low-rank tiers slower than dense. Its
gradient is tiny (lr·μ ≈ 5e-6 per step), so the trainers leave it out of the step and apply its exact gradient
once per local epoch with step size s = lr·k (k = optimizer steps taken in that epoch). With plain SGD this
differs from the per-step term only at second order in s·μ. ``fedcore.lowrank.frobenius_decay_step`` is the
PyTorch twin; tests hold them equal.
"""
from __future__ import annotations

import numpy as np

FACTOR_SUFFIXES = (".u", ".v")


def _check_factors(u: np.ndarray, v: np.ndarray) -> None:
    if not (isinstance(u, np.ndarray) and isinstance(v, np.ndarray)):
        raise TypeError(f"factors must be numpy arrays, got {type(u).__name__} and {type(v).__name__}")
    if u.ndim != 2 or v.ndim != 2 or u.shape[1] != v.shape[1]:
        raise ValueError(f"factors must be U (m×r) and V (n×r) of one rank r, got U{u.shape} and V{v.shape}")


def frobenius_decay_step(u: np.ndarray, v: np.ndarray, mu: float, step: float) -> tuple[np.ndarray, np.ndarray]:
    """(U − s·2μ·U(VᵀV), V − s·2μ·V(UᵀU)) with s = ``step``: one SGD step on μ‖U Vᵀ‖²_F, both from the inputs.

    ``step`` is lr times the optimizer steps the decay stands for. The inputs are left untouched; the results
    keep their dtype.
    """
    _check_factors(u, v)
    if not mu >= 0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if not step >= 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    scale = np.asarray(2.0 * mu * step, dtype=u.dtype)
    return u - scale * (u @ (v.T @ v)), v - scale * (v @ (u.T @ u))


def factor_pairs(names) -> list[tuple[str, str]]:
    """(``L.u``, ``L.v``) for every layer L whose two factors are both among ``names``, in the order of ``names``."""
    present = set(names)
    u_suffix, v_suffix = FACTOR_SUFFIXES
    return [(name, name[:-len(u_suffix)] + v_suffix) for name in names
            if name.endswith(u_suffix) and name[:-len(u_suffix)] + v_suffix in present]
