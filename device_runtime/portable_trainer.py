"""On-device local training on stock onnxruntime: one ``InferenceSession`` run is one whole SGD step.

The ``onnxruntime`` artifact kind (``export.step_compiler``) holds a step graph that takes the batch, labels,
anchors, mask, λ, lr and every parameter and returns loss, logits and every parameter after the step, and an
eval graph (logits, features). The parameters live here, in numpy arrays: each step feeds them in and takes the
new ones out (free at this size: measured, docs/benchmarks.md). Needs only onnxruntime ≥ 1.17 and numpy, so it
runs wherever onnxruntime ships a wheel (aarch64 included); never torch or onnx.
Step state (tensors the manifest marks ``state``: BatchNorm's running statistics) takes the step's ``.next``
value in every step, whichever group trains, as PyTorch's training-mode forward updates it (``server.training``).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from device_runtime.artifact_contract import (ARTIFACT_FILES_BY_KIND, EVAL_OUTPUTS, INPUT, PORTABLE_KIND,
                                              STEP_DATA_INPUTS, STEP_OUTPUTS, ArtifactError, next_name)
from device_runtime.trainer import LocalTrainer, load_ort_capi, session_options

_PROVIDERS = ["CPUExecutionProvider"]


def training_build_installed() -> bool:
    """Whether the installed onnxruntime is a training build (its ``__init__`` imports torch where it is installed)."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return False
    return (Path(next(iter(spec.submodule_search_locations))) / "training").is_dir()


class _BindingSession:
    """The C binding's InferenceSession behind the public ``run(output_names, feeds)``: the training build's
    public class sits behind an ``__init__`` that imports torch, so there the bindings are used directly."""

    def __init__(self, capi: Any, model: str | bytes, options: Any):
        self._session = capi.InferenceSession(options, model, isinstance(model, str), False)
        self._session.initialize_session(_PROVIDERS, [{}], set())

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self._session.run(output_names or [o.name for o in self.get_outputs()], feeds, None)

    def get_inputs(self):
        return self._session.inputs_meta

    def get_outputs(self):
        return self._session.outputs_meta


def open_session(path: str | bytes, threads: int):
    """An InferenceSession of the model at ``path`` (or of these model bytes): the public
    ``onnxruntime.InferenceSession`` on stock onnxruntime; on the training build (torch-free) the same session
    through its C bindings."""
    if "onnxruntime" not in sys.modules and training_build_installed():
        capi = load_ort_capi()
        return _BindingSession(capi, path, session_options(capi, threads))
    onnxruntime = importlib.import_module("onnxruntime")
    return onnxruntime.InferenceSession(path, session_options(onnxruntime, threads), providers=_PROVIDERS)


class PortableTrainer(LocalTrainer):
    """Local training and evaluation of one ``onnxruntime`` artifact set; the parameters are numpy arrays here."""

    def __init__(self, directory: str | os.PathLike, *, threads: int = 1):
        super().__init__(directory, threads)
        if self.manifest["kind"] != PORTABLE_KIND:
            raise ArtifactError(f"{self.directory} holds {self.manifest['kind']!r} artifacts; this trainer runs "
                                f"{PORTABLE_KIND!r} (device_runtime.runtimes.open_trainer picks by kind)")
        files = {key: str(self.directory / name) for key, name in ARTIFACT_FILES_BY_KIND[PORTABLE_KIND].items()}
        self._names = (*self._fe_shapes, *self._head_shapes)
        with np.load(files["initial_weights"], allow_pickle=False) as archive:
            if set(archive.files) != set(self._names):
                raise ArtifactError(f"initial weights {sorted(archive.files)} differ from the manifest's tensors")
            self._params = {name: np.asarray(archive[name], order="C") for name in self._names}  # 0-d stays 0-d
        self._step_session = open_session(files["step_model"], threads)
        self._eval_session = open_session(files["eval_model"], threads)
        self._step_outputs = [*STEP_OUTPUTS, *(next_name(n) for n in self._names)]
        self._check_graph_io()

    def _check_graph_io(self) -> None:
        graphs = {"step": (self._step_session, [*STEP_DATA_INPUTS, *self._names], self._step_outputs),
                  "eval": (self._eval_session, [INPUT, *self._names], list(EVAL_OUTPUTS))}
        for kind, (session, want_in, want_out) in graphs.items():
            inputs = [i.name for i in session.get_inputs()]
            outputs = [o.name for o in session.get_outputs()]
            if inputs != want_in or outputs != want_out:
                raise ArtifactError(f"{kind} graph has inputs {inputs} and outputs {outputs}, "
                                    f"expected {want_in} and {want_out}")

    def _read(self, names) -> dict[str, np.ndarray]:
        return {n: self._params[n].copy() for n in names}

    def _write(self, tensors: dict[str, np.ndarray]) -> None:
        for name, value in tensors.items():
            self._params[name] = np.array(value, dtype=np.float32, order="C")

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, features = self._eval_session.run(None, {INPUT: np.ascontiguousarray(x), **self._params})
        return logits, features

    def _step(self, x, labels, anchors, mask, lam, lr, trained):
        """One run of the step graph; the ``trained`` tensors and the step state take their new values."""
        feeds = dict(zip(STEP_DATA_INPUTS, (np.ascontiguousarray(x), labels, anchors, mask, lam,
                                            np.array(lr, np.float32))))
        loss, logits, *updated = self._step_session.run(self._step_outputs, feeds | self._params)
        wanted = set(trained) | self._state_names
        for name, value in zip(self._names, updated):
            if name in wanted:
                self._params[name] = value
        return float(loss), logits
