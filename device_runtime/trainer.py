"""On-device local training: what every runtime shares (:class:`LocalTrainer`) and the onnxruntime-training
runtime (:class:`DeviceTrainer`): numpy and the ORT C bindings, never torch or onnx.

The stock-onnxruntime runtime is ``device_runtime.portable_trainer``; ``device_runtime.runtimes.open_trainer``
picks by the artifact kind (``device_runtime.artifact_contract``). A training-kind artifact directory (built by
``export.artifacts``) holds four files and ``manifest.json``:
- ``training_model.onnx``: inputs ``input`` (B×C×H×W float32), ``labels`` (B int64), ``anchors`` (classes×D),
  ``anchor_mask`` (classes), ``lam`` (scalar); outputs ``loss`` (CE + λ·L_FAC) and ``logits``;
- ``eval_model.onnx``: the forward graph alone, ``input`` -> ``logits``, ``features`` (anchors and accuracy);
- ``optimizer_model.onnx``: plain SGD on every parameter (FE and head);
- ``checkpoint``: the parameters; their values are overwritten each round (FE from the server, head from disk).
The graphs hold no weights, so one artifact set serves every round of a rank plan.
The Frobenius term μ·Σ‖U Vᵀ‖²_F is not in the graph: :meth:`LocalTrainer.train` applies it as a decoupled SGD
step on the factors at the end of each local epoch in which the FE trains (``device_runtime.frobenius`` says why).
"""
from __future__ import annotations

import importlib.machinery
import io
import importlib.util
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from device_runtime.artifact_contract import (ANCHOR_MASK, ANCHORS, ARTIFACT_FILES_BY_KIND, EVAL_INPUTS, EVAL_OUTPUTS,
                                              TRAINING_INPUTS, TRAINING_KIND, TRAINING_OUTPUTS, ArtifactError,
                                              read_manifest)
from device_runtime.batching import epoch_batches
from device_runtime.frobenius import factor_pairs, frobenius_decay_step
from device_runtime.task import PARAM_GROUPS
from device_runtime.tensor_check import check_tensors
from device_runtime.atomic_file import write_atomic

LABEL_DTYPE = np.int64
ANCHOR_BATCH = EVAL_BATCH = 64  # forward-only batches: peak RSS grows ~0.15 MB per sample (FedAvgCNN 28×28)
ORT_ERROR_SEVERITY = 3
_CAPI_MODULE = "onnxruntime.capi.onnxruntime_pybind11_state"


@dataclass(frozen=True)
class TrainResult:
    num_samples: int  # local training samples (the aggregation weight)
    loss: float  # mean of CE + λ·L_FAC over every sample seen in all local epochs (the decoupled decay is not in it)
    accuracy: float  # training accuracy over every sample seen in all local epochs (before each step)
    steps: int  # optimizer steps taken


@dataclass(frozen=True)
class EvalResult:
    correct: int
    total: int
    loss: float  # mean cross-entropy per sample
    classes: int  # distinct classes the model answered (1 over several samples: a trivial model, baseline.one_class)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def load_ort_capi() -> ModuleType:
    """The onnxruntime C bindings, loaded without running ``onnxruntime/__init__.py``.

    That ``__init__`` probes ``onnxruntime.training.ortmodule``, which imports torch (and onnx) whenever they are
    installed; the bindings themselves need only numpy. Reuses the bindings if onnxruntime is already loaded.
    """
    if _CAPI_MODULE in sys.modules:
        return sys.modules[_CAPI_MODULE]
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("onnxruntime is not installed (pip install --no-deps onnxruntime-training-cpu)")
    capi = Path(next(iter(spec.submodule_search_locations))) / "capi"
    candidates = [capi / f"onnxruntime_pybind11_state{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise ImportError(f"no onnxruntime C extension in {capi}")
    loader = importlib.machinery.ExtensionFileLoader(_CAPI_MODULE, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(_CAPI_MODULE, path, loader=loader))
    loader.exec_module(module)
    sys.modules[_CAPI_MODULE] = module
    return module


def class_means(sums: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(anchors float32 C×D, mask float32 C) from per-class feature sums and sample counts; absent classes: 0, 0."""
    mask = (counts > 0).astype(np.float32)
    anchors = sums / np.maximum(counts, 1)[:, None]
    return anchors.astype(np.float32), mask


def cross_entropy_sum(logits: np.ndarray, labels: np.ndarray) -> float:
    """Σ_i −log softmax(logits_i)[y_i], computed stably in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return float((log_norm - z[np.arange(len(labels)), labels]).sum())


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def session_options(capi: ModuleType, threads: int):
    """Single-stream, few threads; the CPU arena on and memory patterns off: the lowest peak RSS over a local round.

    Measured by scripts/bench_device.py (docs/benchmarks.md): with the arena, tensors reuse its chunks instead of
    fragmenting the malloc heap: up to 29% below arena-off, 3% above at worst; memory patterns add up to 95 MB.
    """
    options = capi.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = capi.ExecutionMode.ORT_SEQUENTIAL
    options.enable_cpu_mem_arena = True
    options.enable_mem_pattern = False
    options.log_severity_level = ORT_ERROR_SEVERITY
    return options


class LocalTrainer(ABC):
    """Anchors, training, evaluation and the head on disk over one artifact set, whatever runtime runs it.

    A runtime supplies the parameter store (:meth:`_read`, :meth:`_write`), the forward pass and one SGD step.
    """

    def __init__(self, directory: str | os.PathLike, threads: int):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self._fe_shapes = {t["name"]: tuple(t["shape"]) for t in self.manifest["fe"]}
        self._head_shapes = {t["name"]: tuple(t["shape"]) for t in self.manifest["head"]}
        self._state_names = frozenset(t["name"] for t in (*self.manifest["fe"], *self.manifest["head"])
                                      if t.get("state"))
        self._factor_pairs = factor_pairs(tuple(self._fe_shapes))
        self.input_shape = tuple(self.manifest["input_shape"])
        self.num_classes = int(self.manifest["num_classes"])
        self.feature_dim = int(self.manifest["feature_dim"])

    @abstractmethod
    def _read(self, names) -> dict[str, np.ndarray]:
        """Copies of the named parameters."""

    @abstractmethod
    def _write(self, tensors: dict[str, np.ndarray]) -> None:
        """Overwrite the named parameters (already checked)."""

    @abstractmethod
    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits, features) of a batch, copied out."""

    @abstractmethod
    def _step(self, x: np.ndarray, labels: np.ndarray, anchors: np.ndarray, mask: np.ndarray, lam: np.ndarray,
              lr: float, trained: tuple[str, ...]) -> tuple[float, np.ndarray]:
        """One SGD step of CE + λ·L_FAC that changes only the ``trained`` parameters: (loss, logits)."""

    @property
    def fe_names(self) -> tuple[str, ...]:
        return tuple(self._fe_shapes)

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(self._head_shapes)

    def get_fe(self) -> dict[str, np.ndarray]:
        """Copies of the FE tensors (factors ``.u``/``.v`` for factorized layers), by name."""
        return self._read(self._fe_shapes)

    def set_fe(self, tensors: dict[str, np.ndarray]) -> None:
        """Overwrite every FE tensor; names, shapes and dtype (float32) must match the artifacts exactly."""
        check_tensors("FE", tensors, self._fe_shapes)
        self._write(tensors)

    def get_head(self) -> dict[str, np.ndarray]:
        return self._read(self._head_shapes)

    def set_head(self, tensors: dict[str, np.ndarray]) -> None:
        check_tensors("head", tensors, self._head_shapes)
        self._write(tensors)

    def save_head(self, path: str | os.PathLike) -> None:
        """Write the head to an ``.npz`` atomically: it must survive restarts intact."""
        buffer = io.BytesIO()
        np.savez(buffer, **self.get_head())
        write_atomic(path, buffer.getvalue())

    def load_head(self, path: str | os.PathLike) -> None:
        """Restore a head saved by :meth:`save_head` (checked like :meth:`set_head`)."""
        with np.load(path, allow_pickle=False) as archive:
            self.set_head({name: archive[name] for name in archive.files})

    def _check_data(self, x: np.ndarray, y: np.ndarray | None = None) -> None:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape[1:] != self.input_shape:
            got = (x.dtype, x.shape) if isinstance(x, np.ndarray) else type(x).__name__
            raise ValueError(f"x must be float32 N×{'×'.join(map(str, self.input_shape))}, got {got}")
        if len(x) == 0:
            raise ValueError("x holds no samples")
        if y is None:
            return
        if not isinstance(y, np.ndarray) or y.dtype != LABEL_DTYPE or y.shape != (len(x),):
            got = (y.dtype, y.shape) if isinstance(y, np.ndarray) else type(y).__name__
            raise ValueError(f"y must be int64 of shape ({len(x)},), got {got}")
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got [{y.min()}, {y.max()}]")

    def compute_anchors(self, x: np.ndarray, y: np.ndarray, *,
                        batch_size: int = ANCHOR_BATCH) -> tuple[np.ndarray, np.ndarray]:
        """Per-class mean features of the current (received, not yet trained) FE over (x, y), and the class mask."""
        self._check_data(x, y)
        _check_positive(batch_size=batch_size)
        sums = np.zeros((self.num_classes, self.feature_dim), np.float64)
        for start in range(0, len(x), batch_size):
            _, features = self._forward(x[start:start + batch_size])
            np.add.at(sums, y[start:start + batch_size], features.astype(np.float64))
        return class_means(sums, np.bincount(y, minlength=self.num_classes))

    def _anchor_inputs(self, anchors: np.ndarray | None, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        if (anchors is None) != (mask is None):
            raise ValueError("anchors and mask go together: give both or neither")
        if anchors is None:
            return (np.zeros((self.num_classes, self.feature_dim), np.float32),
                    np.zeros(self.num_classes, np.float32))
        check_tensors("anchor", {ANCHORS: anchors, ANCHOR_MASK: mask},
                      {ANCHORS: (self.num_classes, self.feature_dim), ANCHOR_MASK: (self.num_classes,)})
        return np.ascontiguousarray(anchors), np.ascontiguousarray(mask)

    def decay_factors(self, mu: float, step: float) -> None:
        """One decoupled SGD step on μ·Σ‖U Vᵀ‖²_F for every factor pair (``L.u``, ``L.v``) of the FE, step size
        ``step`` (lr × the optimizer steps it stands for); nothing to do for a dense plan or μ = 0."""
        if not mu:
            return
        for u_name, v_name in self._factor_pairs:
            factors = self._read((u_name, v_name))
            u, v = frobenius_decay_step(factors[u_name], factors[v_name], mu, step)
            self._write({u_name: u, v_name: v})

    def _trained_names(self, params: str) -> tuple[str, ...]:
        if params not in PARAM_GROUPS:
            raise ValueError(f"params must be one of {', '.join(PARAM_GROUPS)}, got {params!r}")
        return {"all": (*self._fe_shapes, *self._head_shapes), "fe": tuple(self._fe_shapes),
                "head": tuple(self._head_shapes)}[params]

    def train(self, x: np.ndarray, y: np.ndarray, *, anchors: np.ndarray | None, mask: np.ndarray | None,
              lam: float, mu: float, lr: float, epochs: int, batch_size: int, rng: np.random.Generator,
              params: str = "all") -> TrainResult:
        """Plain SGD over ``epochs`` shuffled passes (batches from ``epoch_batches(.., rng)``) on the ``params``
        group: "all" (FE and head), "fe" or "head"; the other group's tensors stay as they are.

        Each step minimises CE + λ·L_FAC; when the FE trains, each epoch ends with :meth:`decay_factors` at step
        size lr × that epoch's step count. ``anchors``/``mask`` None (both) means no anchor term, whatever ``lam``.
        """
        self._check_data(x, y)
        _check_positive(epochs=epochs, batch_size=batch_size, lr=lr)
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu!r}")
        trained = self._trained_names(params)
        anchor_values, mask_values = self._anchor_inputs(anchors, mask)
        lam_value = np.array(lam, np.float32)
        total_loss, correct, seen, steps = 0.0, 0, 0, 0
        for _ in range(epochs):
            batches = epoch_batches(len(x), batch_size, rng)
            for batch in batches:
                labels = y[batch]
                loss, logits = self._step(x[batch], labels, anchor_values, mask_values, lam_value, lr, trained)
                total_loss += loss * len(batch)
                correct += int((logits.argmax(axis=1) == labels).sum())
                seen += len(batch)
            steps += len(batches)
            if params != "head":
                self.decay_factors(mu, lr * len(batches))
        return TrainResult(len(x), total_loss / seen, correct / seen, steps)

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = EVAL_BATCH) -> EvalResult:
        """Accuracy and mean cross-entropy of the current model (FE and head) on (x, y)."""
        self._check_data(x, y)
        _check_positive(batch_size=batch_size)
        correct, loss, answered = 0, 0.0, set()
        for start in range(0, len(x), batch_size):
            logits, _ = self._forward(x[start:start + batch_size])
            labels = y[start:start + batch_size]
            predicted = logits.argmax(axis=1)
            correct += int((predicted == labels).sum())
            answered.update(predicted.tolist())
            loss += cross_entropy_sum(logits, labels)
        return EvalResult(correct, len(x), loss / len(x), len(answered))


class DeviceTrainer(LocalTrainer):
    """The onnxruntime-training runtime: the parameters live in its checkpoint state; gradients and the SGD update
    come from the training API's graphs."""

    def __init__(self, directory: str | os.PathLike, *, threads: int = 1):
        super().__init__(directory, threads)
        if self.manifest["kind"] != TRAINING_KIND:
            raise ArtifactError(f"{self.directory} holds {self.manifest['kind']!r} artifacts; this trainer runs "
                                f"{TRAINING_KIND!r} (device_runtime.runtimes.open_trainer picks by kind)")
        self._capi = capi = load_ort_capi()
        files = {key: str(self.directory / name) for key, name in ARTIFACT_FILES_BY_KIND[TRAINING_KIND].items()}
        self._device = capi.OrtDevice(capi.OrtDevice.cpu(), capi.OrtDevice.default_memory(), 0)
        options = session_options(capi, threads)
        self._state = capi.load_checkpoint(files["checkpoint"])
        self._module = capi.Module(files["training_model"], self._state, files["eval_model"], self._device, options)
        self._optimizer = capi.Optimizer(files["optimizer_model"], self._state, self._device, options)
        self._check_graph_io()

    def _check_graph_io(self) -> None:
        graphs = {"training": (self._module.input_names(True), self._module.output_names(True), TRAINING_INPUTS,
                               TRAINING_OUTPUTS),
                  "eval": (self._module.input_names(False), self._module.output_names(False), EVAL_INPUTS,
                           EVAL_OUTPUTS)}
        for kind, (inputs, outputs, want_in, want_out) in graphs.items():
            if tuple(inputs) != want_in or tuple(outputs) != want_out:
                raise ArtifactError(f"{kind} graph has inputs {inputs} and outputs {outputs}, "
                                    f"expected {list(want_in)} and {list(want_out)}")
        names = set(self._state.parameter_names())
        if names != set(self._fe_shapes) | set(self._head_shapes):
            raise ArtifactError(f"checkpoint parameters {sorted(names)} differ from the manifest's")

    def _read(self, names) -> dict[str, np.ndarray]:
        return {n: self._state.get_parameter(n).data.numpy().copy() for n in names}  # the getter is a live view

    def _write(self, tensors: dict[str, np.ndarray]) -> None:
        for name, value in tensors.items():
            contiguous = np.asarray(value, order="C")  # outlives the OrtValue, which borrows it; 0-d stays 0-d
            self._state.copy_parameter_from(name, self._capi.OrtValue.ortvalue_from_numpy(contiguous, self._device))

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits, features) copied out: ``OrtValue.numpy()`` is a view that dies with its fetch vector."""
        fetches = self._capi.OrtValueVector()
        self._module.eval_step([np.ascontiguousarray(x)], fetches)
        return fetches[0].numpy().copy(), fetches[1].numpy().copy()

    def _step(self, x, labels, anchors, mask, lam, lr, trained):
        """train_step + optimizer_step (which updates every parameter), then the untrained group put back."""
        kept = self._read(name for name in (*self._fe_shapes, *self._head_shapes) if name not in trained)
        fetches = self._capi.OrtValueVector()  # a reused vector would pin the first batch's output shapes
        self._module.lazy_reset_grad()
        self._module.train_step([x, labels, anchors, mask, lam], fetches)
        self._optimizer.set_learning_rate(float(lr))
        self._optimizer.optimizer_step()
        self._write(kept)
        return float(fetches[0].numpy()), fetches[1].numpy().copy()
