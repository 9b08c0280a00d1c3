"""Which onnxruntime this device has, which artifact kind that runs, and the trainer for an artifact directory.

- ``onnxruntime`` (portable): stock onnxruntime's InferenceSession runs one compiled SGD step per call. Any
  onnxruntime build has an InferenceSession, so ``auto`` takes this one whenever onnxruntime is installed.
- ``onnxruntime-training``: the training API (``onnxruntime-training-cpu`` only; x86_64, CPython ≤ 3.12).
Detection never imports torch or onnx: the training build's ``import onnxruntime`` would (where torch is
installed), so both are probed through the C bindings.
"""
from __future__ import annotations

import importlib.util
import os

from device_runtime.artifact_contract import KINDS, PORTABLE_KIND, TRAINING_KIND, read_manifest
from device_runtime.portable_trainer import PortableTrainer
from device_runtime.trainer import DeviceTrainer, LocalTrainer, load_ort_capi

AUTO = "auto"
PREFERENCES = (AUTO, *KINDS)


class RuntimeUnavailable(RuntimeError):
    """The runtime asked for is not installed here; the message names what to install or which flag to change."""


def _has_training_api() -> bool:
    try:
        capi = load_ort_capi()
    except ImportError:
        return False
    return all(hasattr(capi, name) for name in ("Module", "Optimizer", "load_checkpoint"))


def available() -> tuple[str, ...]:
    """The artifact kinds this device can run, portable first."""
    if importlib.util.find_spec("onnxruntime") is None:
        return ()
    return (PORTABLE_KIND, TRAINING_KIND) if _has_training_api() else (PORTABLE_KIND,)


def detect(preference: str = AUTO) -> str:
    """The kind to run for ``--runtime preference``: ``auto`` takes the portable runtime whenever onnxruntime is
    installed; a named kind must be available (RuntimeUnavailable otherwise)."""
    if preference not in PREFERENCES:
        raise ValueError(f"--runtime must be one of {', '.join(PREFERENCES)}, got {preference!r}")
    kinds = available()
    if not kinds:
        raise RuntimeUnavailable("onnxruntime is not installed: pip install 'fedara-edge[device]' (stock "
                                 "onnxruntime) or 'fedara-edge[training]' (onnxruntime-training-cpu)")
    if preference == AUTO:
        return kinds[0]
    if preference not in kinds:
        raise RuntimeUnavailable(f"--runtime {preference}: this onnxruntime has no training API (stock build); "
                                 f"use --runtime {PORTABLE_KIND} or auto, or install onnxruntime-training-cpu")
    return preference


def open_trainer(directory: str | os.PathLike, threads: int = 1) -> LocalTrainer:
    """The trainer for the artifact directory, by its manifest's kind."""
    kind = read_manifest(directory)["kind"]
    return (PortableTrainer if kind == PORTABLE_KIND else DeviceTrainer)(directory, threads=threads)
