"""A device's change to the shared model at full rank, numpy only: Δ = reconstruct(returned) − reconstruct(sent)
over every shared tensor, what the engine computes for ``--aggregate updates`` and DP (``fedcore.lowrank
.reconstruct_state`` is the PyTorch twin; tests hold them equal). Secure aggregation needs it on the device: a sum
of masked factors is not Σ U·Vᵀ, while a sum of masked Δ is the sum of the Δ.

A factorized layer ``L`` travels as ``L.u`` (m×r) and ``L.v`` (n×r) with W = U·Vᵀ in the matrix view of its weight
(a Conv2d weight (c_out, c_in, kh, kw) is viewed as (c_out·kh) × (c_in·kw)).
"""
from __future__ import annotations

import math

import numpy as np

FACTOR_SUFFIXES = (".u", ".v")


def from_matrix(matrix: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A weight of ``shape`` from its matrix view (the inverse of the layout ``fedcore.lowrank.to_matrix`` takes)."""
    if len(shape) == 2:
        return matrix.reshape(shape)
    if len(shape) != 4:
        raise ValueError(f"only 2-D and 4-D weights are factorized, got shape {tuple(shape)}")
    c_out, c_in, kh, kw = shape
    return matrix.reshape(c_out, kh, c_in, kw).transpose(0, 2, 1, 3)


def reconstruct(tensors: dict[str, np.ndarray], dense_shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Full-rank float64 tensors of exactly ``dense_shapes``'s keys: dense ones passed through, factors multiplied
    back. ValueError for a tensor missing, of another shape, or extra."""
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for key, shape in dense_shapes.items():
        layer = key.rsplit(".", 1)[0]
        u_key, v_key = layer + FACTOR_SUFFIXES[0], layer + FACTOR_SUFFIXES[1]
        if key in tensors:
            value = np.asarray(tensors[key], dtype=np.float64)
            if value.shape != tuple(shape):
                raise ValueError(f"{key}: shape {value.shape} != expected {tuple(shape)}")
            out[key] = value
            used.add(key)
        elif key.endswith(".weight") and u_key in tensors and v_key in tensors:
            u, v = np.asarray(tensors[u_key], np.float64), np.asarray(tensors[v_key], np.float64)
            out[key] = from_matrix(u @ v.T, tuple(shape))
            if out[key].shape != tuple(shape):
                raise ValueError(f"{key}: factors {u.shape}, {v.shape} do not make shape {tuple(shape)}")
            used |= {u_key, v_key}
        else:
            raise ValueError(f"the update lacks {key} (neither dense nor as factors)")
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"the update has tensors the shared model does not: {extra[:5]}")
    return out


def unflatten(vector: np.ndarray, dense_shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The tensors of a vector laid out over ``dense_shapes``'s keys in sorted order (``secagg_client.secure_input``'s
    layout)."""
    out, at = {}, 0
    for key in sorted(dense_shapes):
        size = math.prod(dense_shapes[key])
        out[key] = vector[at:at + size].reshape(dense_shapes[key])
        at += size
    if at != vector.size:
        raise ValueError(f"a vector of {vector.size} values does not lay out as {at}")
    return out


def dimension(dense_shapes: dict[str, tuple[int, ...]]) -> int:
    """d: the shared model's size at full rank (what a secure upload carries)."""
    return sum(math.prod(s) for s in dense_shapes.values())
