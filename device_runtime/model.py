"""The device's personalized model as files an application loads with stock onnxruntime and numpy alone.

After every round it answers, the agent writes the model it evaluated that round (the global FE it received, at
its rank, and its own head) as one history directory and points ``WORKDIR/model`` at it. A task of round t
evaluates the model aggregated after round t - 1 (evaluation rides on the next round's task), so that model is
named round t - 1: the round whose accuracy the server prints and reports for it (round 0: the initial model). In
``--mode async`` a task carries the version of its weights, and the model is named ``<seq>-version<v>`` instead
(task numbers are not versions):

    model -> models/<seq>-round<round>    a relative symbolic link, replaced atomically (the current model)
    models/<seq>-round<round>/model.onnx  self-contained inference graph: input ``input`` (batch × C × H × W
                                          float32, dynamic batch), outputs ``logits`` and ``probabilities``
    models/<seq>-round<round>/model.json  input shape and dtype, normalization, class ids, run id, round, rank
                                          tier, local test accuracy beside the majority-class baseline,
                                          sha256 of model.onnx

``seq`` counts the writes (rounds restart with every run; a round answered again gets a new directory). A history
directory is complete before the link moves and never changes after, so a crash at any point leaves ``model``
on a loadable model, and a reader that resolved the link reads one consistent pair. The newest ``keep`` histories
stay (``--keep-models``); a directory is self-contained: copying one elsewhere pins (rolls back to) that model.

``load(path).predict(x)`` and ``python -m device_runtime predict`` read the last complete model; they need no
broker and no running agent. ``predict`` puts every accuracy beside the majority-class baseline (what answering
the most common label for everything scores) and flags a model that answers one class for every input: on a
skewed shard a trivial model's accuracy looks like a good one's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_runtime.artifact_contract import EVAL_INPUTS, INPUT, LOGITS
from device_runtime.atomic_file import TMP_PREFIX, fsync_directory, write_atomic
from device_runtime.baseline import describe, majority, one_class, predicted_classes
from device_runtime.help_format import CommandParser, DefaultsHelpFormatter
from device_runtime.onnx_bake import bake

MODEL_LINK = "model"
MODELS_DIR = "models"
GRAPH_FILE = "model.onnx"
INFO_FILE = "model.json"
MODEL_FORMAT = 1
PROBABILITIES = "probabilities"
DEFAULT_KEEP = 2  # --keep-models (device_runtime.__main__.DEFAULT_KEEP_MODELS, which must not import numpy)
PREDICT_BATCH = 64  # the device's evaluation batch (trainer.EVAL_BATCH): the same batches as its accuracy
LOAD_ATTEMPTS = 3  # a history directory can be pruned between resolving the link and reading it: resolve again
NORMALIZATION = ("as the x arrays of this device's shard: per-channel (pixel/max - mean) / std with the dataset's "
                 "statistics, as python -m server.shards writes them")
_HISTORY = re.compile(r"(\d+)-(?:round|version)(\d+)")
EXIT_OK, EXIT_BAD_INPUT = 0, 2


class ModelError(ValueError):
    """No model to load, or a model directory that is incomplete or corrupt."""


# -- writing (the agent) ----------------------------------------------------------------------


def model_info(*, graph_sha256: str, input_shape: tuple[int, ...], num_classes: int, run_id: str, round_index: int,
               rank_tier: float | None, plan_hash: str, plan_description: str, correct: int, total: int,
               seq: int, majority: int | None = None, classes: int | None = None) -> dict:
    """The contents of ``model.json`` (``majority``: the test split's most common label's count; ``classes``: how
    many classes the model answered on it; None where not known)."""
    return {
        "format": MODEL_FORMAT, "graph": GRAPH_FILE, "graph_sha256": graph_sha256,
        "input": {"name": INPUT, "shape": ["batch", *map(int, input_shape)], "dtype": "float32",
                  "normalization": NORMALIZATION},
        "outputs": {LOGITS: ["batch", num_classes], PROBABILITIES: ["batch", num_classes]},
        "class_ids": list(range(num_classes)), "class_names": None,  # a shard carries label ids, not names
        "run_id": run_id, "round": round_index, "rank_tier": rank_tier, "plan": plan_hash,
        "plan_description": plan_description,
        "local_test_accuracy": correct / total if total else None, "local_test_correct": correct,
        "local_test_samples": total,
        "local_test_majority_baseline": majority / total if total and majority is not None else None,
        "local_test_predicted_classes": classes, "local_test_one_class": one_class(classes, total), "seq": seq,
    }


def inference_graph(eval_graph: bytes, weights: dict[str, np.ndarray]) -> bytes:
    """The artifact set's eval graph with ``weights`` baked in as initializers, outputs logits and probabilities."""
    return bake(eval_graph, weights, logits=LOGITS, probabilities=PROBABILITIES, keep_outputs=(LOGITS,))




class ModelStore:
    """``WORKDIR/model`` and ``WORKDIR/models/`` of one device (see the module docstring)."""

    def __init__(self, workdir: str | os.PathLike, keep: int = DEFAULT_KEEP):
        if keep < 1:
            raise ValueError(f"--keep-models must be >= 1, got {keep}")
        self.root = Path(workdir)
        self.history = self.root / MODELS_DIR
        self.link = self.root / MODEL_LINK
        self.keep = keep

    def _entries(self) -> list[tuple[int, str]]:
        if not self.history.is_dir():
            return []
        return sorted((int(m.group(1)), d.name) for d in self.history.iterdir() if (m := _HISTORY.fullmatch(d.name)))

    def current(self) -> Path | None:
        """The history directory ``model`` points at, if any."""
        return Path(os.path.realpath(self.link)) if self.link.is_symlink() else None

    def write(self, eval_graph: Path, weights: dict[str, np.ndarray], name: str | None = None, **info) -> Path:
        """Bake, write and publish one model (``info``: :func:`model_info`'s keywords but the sha and seq) as
        ``<seq>-<name>`` (``name``: ``round<round_index>`` unless given, e.g. ``version<v>`` in async mode); the
        history directory it wrote. Raises OSError or GraphEditError, leaving the current model as it was."""
        if self.link.exists() and not self.link.is_symlink():
            raise FileExistsError(f"{self.link} is not the link this device keeps there (a copy put in its place?): "
                                  f"move it away; the models are in {self.history}")
        graph = inference_graph(eval_graph.read_bytes(), weights)
        entries = self._entries()
        seq = entries[-1][0] + 1 if entries else 1
        name = f"{seq:06d}-{name or 'round' + str(info['round_index'])}"
        self.history.mkdir(parents=True, exist_ok=True)
        tmp = self.history / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_atomic(tmp / GRAPH_FILE, graph)
            details = model_info(graph_sha256=hashlib.sha256(graph).hexdigest(), seq=seq, **info)
            write_atomic(tmp / INFO_FILE, json.dumps(details, indent=1).encode())
            os.rename(tmp, self.history / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_directory(self.history)
        self._point_at(name)
        self._prune()
        return self.history / name

    def _point_at(self, name: str) -> None:
        """Move the ``model`` link to ``models/name`` in one rename."""
        tmp_link = self.root / f"{TMP_PREFIX}{MODEL_LINK}-{uuid.uuid4().hex[:8]}"
        os.symlink(f"{MODELS_DIR}/{name}", tmp_link)
        try:
            os.replace(tmp_link, self.link)
        finally:
            tmp_link.unlink(missing_ok=True)
        fsync_directory(self.root)

    def _prune(self) -> None:
        """Keep the newest ``keep`` histories (and whatever ``model`` points at); drop leftovers of a crash."""
        current = self.current()
        for _, name in self._entries()[:-self.keep]:
            if Path(os.path.realpath(self.history / name)) != current:
                shutil.rmtree(self.history / name, ignore_errors=True)
        for leftover in self.history.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(f"{TMP_PREFIX}{MODEL_LINK}-*"):
            leftover.unlink(missing_ok=True)


# -- reading (applications, the predict command) ----------------------------------------------


def model_directory(path: str | os.PathLike) -> Path:
    """The model directory ``path`` names: a model directory itself, or a device workdir (its current model)."""
    path = Path(path)
    if (path / INFO_FILE).is_file():
        return Path(os.path.realpath(path))
    if (path / MODEL_LINK).exists():
        return Path(os.path.realpath(path / MODEL_LINK))
    if not path.is_dir():
        raise ModelError(f"{path} is not a directory")
    raise ModelError(f"{path} holds no model yet: a device writes {MODEL_LINK}/ after the first round it answers")


@dataclass
class Model:
    """One loaded model: ``predict`` (class ids), ``predict_proba`` and ``info`` (model.json)."""

    directory: Path
    info: dict
    session: object

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.info["input"]["shape"][1:])

    def _batch(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.shape == self.input_shape:
            x = x[None]
        if x.ndim != len(self.input_shape) + 1 or x.shape[1:] != self.input_shape:
            raise ValueError(f"inputs must be N×{'×'.join(map(str, self.input_shape))} (or one sample of "
                             f"{'×'.join(map(str, self.input_shape))}), got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"inputs must be floats, normalized as the shard's x arrays (model.json: "
                             f"input.normalization), got {x.dtype}")
        return x

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """Class probabilities, N × classes, in batches of PREDICT_BATCH (x may be a memory map)."""
        x = self._batch(x)
        parts = [self.session.run([PROBABILITIES], {INPUT: np.ascontiguousarray(x[i:i + PREDICT_BATCH], np.float32)})[0]
                 for i in range(0, len(x), PREDICT_BATCH)]
        return np.concatenate(parts) if parts else np.zeros((0, len(self.info["class_ids"])), np.float32)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Class ids (int64), one per sample, in input order."""
        ids = np.asarray(self.info["class_ids"], np.int64)
        return ids[self.predict_proba(x).argmax(axis=1)]


def _open(directory: Path, threads: int) -> Model:
    from device_runtime.portable_trainer import open_session  # onnxruntime loads only when a model does

    try:
        info = json.loads((directory / INFO_FILE).read_text())
    except ValueError as exc:
        raise ModelError(f"{directory / INFO_FILE} is unreadable: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != MODEL_FORMAT:
        raise ModelError(f"{directory / INFO_FILE}: format {info.get('format') if isinstance(info, dict) else None!r}"
                         f", this runtime reads {MODEL_FORMAT}")
    graph = directory / info.get("graph", GRAPH_FILE)
    data = graph.read_bytes()  # the session is made from these bytes: the directory may be pruned from now on
    if hashlib.sha256(data).hexdigest() != info.get("graph_sha256"):
        raise ModelError(f"{graph} does not match the sha256 in {INFO_FILE}: the copy is damaged")
    session = open_session(data, threads)
    inputs = tuple(i.name for i in session.get_inputs())
    if inputs != EVAL_INPUTS:
        raise ModelError(f"{graph} takes inputs {list(inputs)}, expected {list(EVAL_INPUTS)}")
    return Model(directory, info, session)


def load(path: str | os.PathLike, threads: int = 1) -> Model:
    """The model at ``path``: a device workdir (its current model) or a model directory (e.g. a copy of one
    ``models/`` entry). Raises ModelError when there is none or it is damaged."""
    for attempt in range(LOAD_ATTEMPTS):
        directory = model_directory(path)
        try:
            return _open(directory, threads)
        except FileNotFoundError as exc:  # pruned after we resolved the link: the link has moved on
            if attempt == LOAD_ATTEMPTS - 1:
                raise ModelError(f"{directory}: {exc.strerror}: {exc.filename}") from None
    raise AssertionError("unreachable")


# -- python -m device_runtime predict ---------------------------------------------------------


def read_input(path: str, split: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(images, labels or None) from a .npy of images (memory-mapped) or a shard .npz's ``split``."""
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r", allow_pickle=False), None
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as archive:
            key = f"x_{split}"
            if key not in archive.files:
                raise ValueError(f"holds no {key} (keys: {', '.join(archive.files)}); a shard written by "
                                 f"python -m server.shards holds x_train and x_test, --split names which")
            labels = archive[f"y_{split}"] if f"y_{split}" in archive.files else None
            return archive[key], labels
    raise ValueError("must be a .npy array of images (N×C×H×W float32) or a shard .npz")


def build_predict_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m device_runtime predict", formatter_class=DefaultsHelpFormatter,
                                description="Classify images with this device's personalized model (the last "
                                            "complete one; no broker needed).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--workdir", help="the device's --workdir: its current model")
    where.add_argument("--model", help="a model directory (WORKDIR/models/<seq>-round<r>, or a copy of one)")
    p.add_argument("input", metavar="INPUT", help=".npy of images N×C×H×W float32, or a shard .npz")
    p.add_argument("--split", default="test", choices=("test", "train"), help="which split of a shard .npz")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: predictions (class ids in order), predicted_classes, one_class; "
                        "with a shard's labels also correct, total and majority_baseline")
    p.add_argument("--threads", type=int, default=1, help="compute threads")
    return p


def predict_main(argv: list[str]) -> int:
    """``python -m device_runtime predict``: exit 0, or 2 with one line naming the flag and value at fault."""
    args = build_predict_parser().parse_args(argv)
    if args.threads < 1:
        print(f"error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return EXIT_BAD_INPUT
    flag, where = ("--workdir", args.workdir) if args.workdir is not None else ("--model", args.model)
    try:
        model = load(where, args.threads)
    except (ModelError, OSError, ValueError) as exc:
        print(f"error: {flag} {where}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        x, labels = read_input(args.input, args.split)
        probabilities = model.predict_proba(x)
    except (OSError, ValueError) as exc:
        print(f"error: INPUT {args.input}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    ids = np.asarray(model.info["class_ids"], np.int64)[probabilities.argmax(axis=1)]
    classes = predicted_classes(ids)
    result = {"model": str(model.directory), "run_id": model.info["run_id"], "round": model.info["round"],
              "predictions": ids.tolist(), "confidences": probabilities.max(axis=1).round(6).tolist(),
              "predicted_classes": classes, "one_class": one_class(classes, len(ids))}
    if labels is not None:
        majority_class, majority_count = majority(labels)
        result |= {"correct": int((ids == labels).sum()), "total": len(labels), "majority_class": majority_class,
                   "majority_correct": majority_count,
                   "majority_baseline": majority_count / len(labels) if len(labels) else None}
    if args.json:
        print(json.dumps(result))
        return EXIT_OK
    for i, (cls, confidence) in enumerate(zip(result["predictions"], result["confidences"])):
        print(f"{i}\t{cls}\t{confidence:.4f}")
    summary = f"model {model.directory} (run {result['run_id']}, round {result['round']})"
    if labels is not None:
        summary += ": " + describe(result["correct"], result["total"], result["majority_correct"], classes)
    elif result["one_class"]:
        summary += f": ONE CLASS ({result['predictions'][0]}) predicted for every sample (a trivial model)"
    print(summary, file=sys.stderr)
    return EXIT_OK
