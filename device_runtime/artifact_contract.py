"""What an artifact directory holds, by kind: file names, graph input/output names, manifest keys and checks.

The one place both sides read it: ``export/`` writes artifact sets to this contract and ``device_runtime/``
loads them by it (stdlib and numpy only, so the device imports it without torch or onnx).

Two kinds, named after the onnxruntime build that runs them (a device's JOIN profile names the one it has):
- ``onnxruntime-training`` (training API): ``training_model.onnx`` (loss and logits; gradients by ORT),
  ``eval_model.onnx``, ``optimizer_model.onnx`` (plain SGD), ``checkpoint`` (the parameters);
- ``onnxruntime`` (stock onnxruntime, any platform with a wheel): ``step_model.onnx``, one whole SGD step of
  CE + λ·L_FAC as a plain default-domain graph (inputs: batch, labels, anchors, mask, λ, lr and every
  parameter; outputs: loss, logits and every updated parameter, named ``<param>.next``), ``eval_model.onnx``
  (inputs: batch and every parameter; outputs: logits, features) and ``initial_weights.npz``.
Every manifest carries ``format_version``, ``kind``, ``hash``, ``config``, ``input_shape``, ``num_classes``,
``feature_dim``, ``fe`` and ``head`` (tensor name, shape, dtype) and ``files`` (path, sha256, bytes per key).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FORMAT_VERSION = 3  # 3: manifests name their kind; the portable (stock onnxruntime) kind exists
MANIFEST_NAME = "manifest.json"
TRAINING_KIND = "onnxruntime-training"
PORTABLE_KIND = "onnxruntime"
KINDS = (PORTABLE_KIND, TRAINING_KIND)
ARTIFACT_FILES_BY_KIND: dict[str, dict[str, str]] = {
    TRAINING_KIND: {
        "training_model": "training_model.onnx",
        "eval_model": "eval_model.onnx",
        "optimizer_model": "optimizer_model.onnx",
        "checkpoint": "checkpoint",
    },
    PORTABLE_KIND: {
        "step_model": "step_model.onnx",
        "eval_model": "eval_model.onnx",
        "initial_weights": "initial_weights.npz",
    },
}
ARTIFACT_FILE_NAMES = frozenset(name for files in ARTIFACT_FILES_BY_KIND.values() for name in files.values())

INPUT, LABELS, ANCHORS, ANCHOR_MASK, LAM, LR = "input", "labels", "anchors", "anchor_mask", "lam", "lr"
LOSS, LOGITS, FEATURES = "loss", "logits", "features"
TRAINING_INPUTS = (INPUT, LABELS, ANCHORS, ANCHOR_MASK, LAM)  # training kind; parameters live in the checkpoint
TRAINING_OUTPUTS = (LOSS, LOGITS)
EVAL_INPUTS = (INPUT,)  # training kind
EVAL_OUTPUTS = (LOGITS, FEATURES)
STEP_DATA_INPUTS = (INPUT, LABELS, ANCHORS, ANCHOR_MASK, LAM, LR)  # portable kind: then every parameter
STEP_OUTPUTS = (LOSS, LOGITS)  # portable kind: then every parameter's NEXT_SUFFIX output
NEXT_SUFFIX = ".next"
BATCH_DIM = "batch"


class ArtifactError(ValueError):
    """An artifact directory that is missing files, corrupt, or not the one expected."""


def next_name(parameter: str) -> str:
    """The step graph's output name for ``parameter`` after the step."""
    return parameter + NEXT_SUFFIX


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of an artifact directory (ArtifactError if absent, unreadable or foreign)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: not an artifact directory") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path} is unreadable: {e}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {version!r}, this runtime reads {FORMAT_VERSION}")
    if manifest.get("kind") not in KINDS:
        raise ArtifactError(f"{path}: kind {manifest.get('kind')!r}, this runtime reads {' or '.join(KINDS)}")
    return manifest


def artifact_files(manifest: dict) -> dict[str, str]:
    """File key -> file name of the manifest's kind."""
    return ARTIFACT_FILES_BY_KIND[manifest["kind"]]


def verify_artifacts(directory: str | os.PathLike, expected_hash: str) -> dict:
    """The manifest, once the directory is shown to hold artifact set ``expected_hash`` with intact files."""
    manifest = read_manifest(directory)
    if manifest.get("hash") != expected_hash:
        raise ArtifactError(f"{directory} holds artifact set {manifest.get('hash')!r}, expected {expected_hash!r}")
    for key, filename in artifact_files(manifest).items():
        entry = manifest.get("files", {}).get(key)
        path = Path(directory) / filename
        if entry is None:
            raise ArtifactError(f"manifest of {directory} does not list {key}")
        if not path.is_file():
            raise ArtifactError(f"{path} is missing")
        actual = file_sha256(path)
        if actual != entry["sha256"]:
            raise ArtifactError(f"{path} is corrupt: sha256 {actual[:12]}… != manifest {entry['sha256'][:12]}…")
    return manifest
