"""torch -> ONNX artifacts for one (model, rank plan) and one runtime kind, cached by a content hash.

Two kinds (``device_runtime.artifact_contract``): ``onnxruntime-training`` (training-API graphs, an SGD optimizer
graph and a checkpoint, built here) and ``onnxruntime`` (one plain SGD-step graph for stock onnxruntime, built by
``export.step_compiler`` and published only after its parity check). One artifact set serves every round of a
plan: the graphs take λ, anchors and mask as inputs and the device overwrites the weights each round. The set
lives in ``cache_dir/<hash>/`` where the hash (sha256) covers everything that shapes the graphs: kind, the model's
fingerprint (``export.fingerprint``: its traced graphs, so its code, not only its name and shapes), ranks, input
shape, classes, opset, tool versions and FORMAT_VERSION. Devices name what they hold by that hash. A model's
tensors are its carried ones (``fedcore.tensors``: parameters and BatchNorm running statistics, by state_dict
name); the per-sample input shape is any positive shape (C×H×W, C×T, T×D, D).

``python -m export.artifacts --model fedavgcnn --input-shape 1,28,28 --classes 10 --ratio 0.5 --out DIR
[--kind onnxruntime]``
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import helper
from onnxruntime.training import artifacts as ort_artifacts
from torch import nn

from device_runtime.artifact_contract import (ARTIFACT_FILES_BY_KIND, FEATURES, FORMAT_VERSION, INPUT, KINDS, LOGITS,
                                              MANIFEST_NAME, PORTABLE_KIND, TRAINING_KIND, ArtifactError, file_sha256,
                                              read_manifest, verify_artifacts)
from export import step_compiler
from export.fingerprint import fingerprint
from export.loss_block import FedAraLoss
from fedcore.lowrank import FE_PREFIX, RankPlan, check_ranks, factorize_model, resolve_plan
from fedcore.models import ARCHITECTURES, SplitModel, build_model
from fedcore.tensors import UnsupportedModel, carried_tensors, state_names

OPSET = 17  # training kind; ONNX IR 8: loadable by onnxruntime-training 1.19.2 (which refuses IR > 10)
TMP_PREFIX = ".building-"
ORT_CHATTER = (b" [I:onnxruntime:", b" [V:onnxruntime:")
DIRECTORY_MODE = 0o755
HEAD_PREFIX = "head."


@dataclass(frozen=True)
class ArtifactSet:
    """A built artifact directory and what a device needs to know about it."""

    hash: str
    kind: str  # device_runtime.artifact_contract.KINDS
    directory: Path
    files: dict[str, Path]  # file key -> path, the keys of ARTIFACT_FILES_BY_KIND[kind]
    sizes: dict[str, int]  # bytes per file
    fe_names: tuple[str, ...]
    fe_shapes: dict[str, tuple[int, ...]]
    head_names: tuple[str, ...]
    head_shapes: dict[str, tuple[int, ...]]
    input_shape: tuple[int, ...]
    num_classes: int
    feature_dim: int

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())


class _ForwardGraph(nn.Module):
    """The model with both outputs the graphs need: logits (for CE) and features (for anchors and L_FAC)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.fe = model.fe
        self.head = model.head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.fe(x)
        return self.head(features), features


def _shapes(module: nn.Module, prefix: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in carried_tensors(module).items() if k.startswith(prefix)}


def artifact_config(model: SplitModel, ranks: dict[str, int], input_shape: tuple[int, ...], num_classes: int,
                    kind: str = TRAINING_KIND) -> dict:
    """Everything that shapes the graphs, as plain JSON-able data (the hash is taken over this)."""
    versions = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    if kind == PORTABLE_KIND:
        versions |= step_compiler.compiler_versions(model)
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": model.name,
        "fingerprint": fingerprint(model, tuple(input_shape)),
        "layers": {k: list(v.shape) for k, v in carried_tensors(model).items()},
        "ranks": {k: int(ranks[k]) for k in sorted(ranks)},
        "input_shape": [int(d) for d in input_shape],
        "num_classes": int(num_classes),
        "opset": step_compiler.OPSET if kind == PORTABLE_KIND else OPSET,
        "versions": versions,
    }


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_request(model: SplitModel, input_shape: tuple[int, ...], num_classes: int) -> None:
    if len(input_shape) < 1 or any(int(d) < 1 for d in input_shape):
        raise ValueError(f"input_shape must be a per-sample shape of positive sizes, got {tuple(input_shape)}")
    if num_classes != model.num_classes:
        raise ValueError(f"num_classes {num_classes} does not match the model's head ({model.num_classes})")


def _export_forward(client: nn.Module, input_shape: tuple[int, ...]) -> onnx.ModelProto:
    """Legacy (TorchScript) export, training mode, no constant folding: parameters keep their state_dict names."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(_ForwardGraph(client), torch.zeros(2, *input_shape), buffer, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          export_params=True, opset_version=OPSET, input_names=[INPUT],
                          output_names=[LOGITS, FEATURES],
                          dynamic_axes={name: {0: "batch"} for name in (INPUT, LOGITS, FEATURES)})
    return onnx.load_from_string(buffer.getvalue())


def _eval_graph(forward: onnx.ModelProto, parameter_names: set[str]) -> onnx.ModelProto:
    """The forward graph with its parameters turned into inputs (fed from the checkpoint): no loss to feed."""
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    params = [init for init in model.graph.initializer if init.name in parameter_names]
    constants = [init for init in model.graph.initializer if init.name not in parameter_names]
    model.graph.input.extend(helper.make_tensor_value_info(p.name, p.data_type, p.dims) for p in params)
    del model.graph.initializer[:]
    model.graph.initializer.extend(constants)
    onnx.checker.check_model(model, full_check=True)
    return model


@contextmanager
def _ort_chatter_filtered() -> Iterator[None]:
    """Drop ORT's per-transformer INFO lines from fd 2 while the graph builders run, replay everything else.

    generate_artifacts builds its own SessionOptions, whose logger prints ~200 INFO lines per export whatever
    the default severity; only a redirect of the file descriptor keeps them off the console.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines = sink.read().splitlines(keepends=True)
            kept = b"".join(line for line in lines if not any(tag in line for tag in ORT_CHATTER))
            sys.stderr.write(kept.decode(errors="replace"))


def _tensor_entries(shapes: dict[str, tuple[int, ...]], state: tuple[str, ...]) -> list[dict]:
    """Manifest entries; ``state`` marks step state (BatchNorm running statistics: updated by every step)."""
    return [{"name": name, "shape": list(shape), "dtype": "float32", "state": name in state}
            for name, shape in shapes.items()]


def _write_training_artifacts(client: SplitModel, input_shape: tuple[int, ...], directory: Path) -> None:
    """The training kind's four files: training/eval/optimizer graphs and the checkpoint."""
    if state_names(client):
        raise UnsupportedModel(f"{state_names(client)[0]}: the onnxruntime-training artifact kind has no step state "
                               "(BatchNorm running statistics): use the onnxruntime kind")
    forward = _export_forward(client, input_shape)
    parameters = list(client.state_dict())
    with _ort_chatter_filtered():
        ort_artifacts.generate_artifacts(
            forward, requires_grad=parameters, loss=FedAraLoss(client.num_classes, client.feature_dim),
            optimizer=ort_artifacts.OptimType.SGD, artifact_directory=directory, additional_output_names=[LOGITS])
    onnx.save(_eval_graph(forward, set(parameters)), directory / ARTIFACT_FILES_BY_KIND[TRAINING_KIND]["eval_model"])


def inference_session(model_bytes: bytes) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])


def _write_portable_artifacts(client: SplitModel, shape: tuple[int, ...], directory: Path) -> None:
    """The portable kind's files: step and eval graphs (after their parity check) and the initial weights."""
    step, evaluate = step_compiler.compile_step(client, shape, client.num_classes, client.feature_dim)
    step_compiler.check_parity(client, step, evaluate, shape, client.num_classes, client.feature_dim,
                               inference_session)
    files = ARTIFACT_FILES_BY_KIND[PORTABLE_KIND]
    onnx.save(step, directory / files["step_model"])
    onnx.save(evaluate, directory / files["eval_model"])
    with open(directory / files["initial_weights"], "wb") as f:
        np.savez(f, **{k: v.detach().numpy() for k, v in carried_tensors(client).items()})


def _write_artifacts(client: SplitModel, config: dict, digest: str, directory: Path) -> None:
    """Generate the kind's artifacts and manifest.json into ``directory`` (empty, private to this builder)."""
    kind = config["kind"]
    writer = _write_portable_artifacts if kind == PORTABLE_KIND else _write_training_artifacts
    writer(client, tuple(config["input_shape"]), directory)
    fe_shapes, head_shapes = _shapes(client, FE_PREFIX), _shapes(client, HEAD_PREFIX)
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "hash": digest,
        "config": config,
        "input_shape": config["input_shape"],
        "num_classes": client.num_classes,
        "feature_dim": client.feature_dim,
        "fe": _tensor_entries(fe_shapes, state_names(client)),
        "head": _tensor_entries(head_shapes, state_names(client)),
        "files": {key: {"path": name, "sha256": file_sha256(directory / name),
                        "bytes": (directory / name).stat().st_size}
                  for key, name in ARTIFACT_FILES_BY_KIND[kind].items()},
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))


def load_artifact_set(directory: str | os.PathLike, expected_hash: str | None = None) -> ArtifactSet:
    """The ArtifactSet of a built directory, its files checked against the manifest (ArtifactError otherwise)."""
    directory = Path(directory)
    manifest = verify_artifacts(directory, expected_hash or read_manifest(directory).get("hash"))
    fe_shapes = {t["name"]: tuple(t["shape"]) for t in manifest["fe"]}
    head_shapes = {t["name"]: tuple(t["shape"]) for t in manifest["head"]}
    files = ARTIFACT_FILES_BY_KIND[manifest["kind"]]
    return ArtifactSet(
        hash=manifest["hash"], kind=manifest["kind"], directory=directory,
        files={key: directory / name for key, name in files.items()},
        sizes={key: int(manifest["files"][key]["bytes"]) for key in files},
        fe_names=tuple(fe_shapes), fe_shapes=fe_shapes, head_names=tuple(head_shapes), head_shapes=head_shapes,
        input_shape=tuple(manifest["input_shape"]), num_classes=int(manifest["num_classes"]),
        feature_dim=int(manifest["feature_dim"]))


def build_artifacts(model: SplitModel, ranks: dict[str, int], input_shape: tuple[int, ...], num_classes: int,
                    cache_dir: str | os.PathLike) -> ArtifactSet:
    """The onnxruntime-training artifact set of ``factorize_model(model, ranks)`` (see build_artifacts_of_kind)."""
    return build_artifacts_of_kind(TRAINING_KIND, model, ranks, input_shape, num_classes, cache_dir)


def build_artifacts_of_kind(kind: str, model: SplitModel, ranks: dict[str, int], input_shape: tuple[int, ...],
                            num_classes: int, cache_dir: str | os.PathLike,
                            on_compile: Callable[[], None] | None = None) -> ArtifactSet:
    """The ``kind`` artifact set of ``factorize_model(model, ranks)``, built only if ``cache_dir`` lacks its hash
    (``on_compile`` is called first then: compiling takes seconds to minutes, a cached set milliseconds).

    Concurrent builders of one hash each write a private temp directory and rename it into place; the first
    rename wins and the others discard their copy. A cached set whose files fail their checksums is refused; a
    portable set whose step fails its parity check is never published (step_compiler.ParityError).
    """
    if kind not in KINDS:
        raise ValueError(f"artifact kind must be one of {', '.join(KINDS)}, got {kind!r}")
    _check_request(model, input_shape, num_classes)
    check_ranks(model, ranks)
    config = artifact_config(model, ranks, input_shape, num_classes, kind)
    digest = config_hash(config)
    cache_dir = Path(cache_dir)
    final = cache_dir / digest
    if not final.exists():
        if on_compile is not None:
            on_compile()
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{digest[:12]}-", dir=cache_dir))
        try:
            _write_artifacts(factorize_model(model, ranks), config, digest, tmp)
            tmp.chmod(DIRECTORY_MODE)
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_artifact_set(final, digest)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (C,H,W / C,T / D), got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=tuple(ARCHITECTURES))
    p.add_argument("--input-shape", required=True, type=_parse_shape, help="per-sample shape, e.g. 1,28,28")
    p.add_argument("--classes", required=True, type=int)
    p.add_argument("--ratio", type=float, default=1.0, help="rank ratio r_k in (0, 1]; 1 keeps every layer dense")
    p.add_argument("--layers", default=None, help="comma-separated FE layers to factorize (default: all but the first)")
    p.add_argument("--out", required=True, help="artifact cache directory")
    p.add_argument("--kind", default=TRAINING_KIND, choices=KINDS, help="the onnxruntime build that runs them")
    args = p.parse_args(argv)
    model = build_model(args.model, args.input_shape, args.classes, seed=0)
    layers = tuple(args.layers.split(",")) if args.layers else None
    plan = resolve_plan(model, RankPlan(args.ratio, layers))
    try:
        built = build_artifacts_of_kind(args.kind, model, plan.ranks, args.input_shape, args.classes, args.out)
    except UnsupportedModel as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ArtifactError, step_compiler.ParityError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"hash {built.hash}")
    print(f"plan {plan.describe()}")
    for key, size in built.sizes.items():
        print(f"{key:16s} {size:>10d} B")
    print(f"{'total':16s} {built.total_bytes:>10d} B")
    print(f"directory {built.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
