"""The one check that a set of named tensors is exactly what a plan expects: the same names, float32, the
expected shapes, and (for what arrives from elsewhere) finite values."""
from __future__ import annotations

import numpy as np

PARAM_DTYPE = np.float32


class TensorMismatchError(ValueError):
    """Tensors whose names, shapes or dtype do not fit the model or plan."""


def tensor_problem(tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]], *,
                   finite: bool = False) -> str | None:
    """Why ``tensors`` are not exactly float32 tensors of ``expected``'s names and shapes (and all finite with
    ``finite``), or None."""
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        return f"tensors do not match the plan: missing {missing[:5]}, unknown {unknown[:5]}"
    for name, shape in expected.items():
        value = tensors[name]
        if not isinstance(value, np.ndarray) or value.dtype != PARAM_DTYPE:
            got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            return f"tensor {name}: dtype {got}, expected float32"
        if value.shape != tuple(shape):
            return f"tensor {name}: shape {value.shape}, expected {tuple(shape)}"
        if finite and not np.isfinite(value).all():
            return f"tensor {name} holds NaN or infinity"
    return None


def check_tensors(kind: str, tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise TensorMismatchError naming the first tensor that does not fit ``expected``."""
    problem = tensor_problem(tensors, expected)
    if problem is not None:
        raise TensorMismatchError(f"{kind} {problem}")
