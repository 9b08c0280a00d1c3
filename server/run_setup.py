"""What both drivers build before round 1, from the same flags: the data and its partition into device shards,
the initial model, the rank plans each device may get (with or without ONNX artifacts), and the run folder's
files (checkpoint, metrics, report)."""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_runtime.shard import Shard
from device_runtime.artifact_contract import MANIFEST_NAME, PORTABLE_KIND
from export.artifacts import ArtifactSet, build_artifacts_of_kind
from server.algorithms.base import Algorithm
from server.checkpoint import CHECKPOINT_NAME, Checkpoint, load_checkpoint, save_checkpoint
from server.cli import parse_tiers
from fedcore.lowrank import FE_PREFIX, RankPlan, ResolvedPlan, factorize_model, resolve_plan
from fedcore.models import SplitModel, build_model
from server.rank_assignment import DEFAULT_TIERS, check_tiers
from server.report import METRICS_CSV, METRICS_FILE, write_metrics, write_metrics_csv, write_report
from server.shards import DEVICE_ID, data_from_args, partition_from_args
from server.strategy import to_numpy

LOG = logging.getLogger("fedara.setup")
RESUME_IGNORED = ("rounds",)
"""Settings a resumed run may change (a run can be extended); every other setting must match."""


class RunError(RuntimeError):
    """The run cannot go on: not enough devices, every local device died, a bad resume."""


def device_ids(count: int) -> list[str]:
    return [DEVICE_ID.format(i) for i in range(count)]


def model_names(args: argparse.Namespace) -> list[str]:
    """--model: one model, or (local training in-process) several, assigned round-robin by device id."""
    return args.model.split(",")  # checked by server.cli.check_args


def load_shards(args: argparse.Namespace, count: int) -> tuple[SplitModel, tuple[int, ...], dict[str, Shard]]:
    """The initial model (the first of --model), its input shape and ``count`` device shards by device id (the
    same for both drivers given the same flags: a seeded subset of --max-samples, then the partition)."""
    data = data_from_args(args)
    model = build_model(model_names(args)[0], data.input_shape, data.num_classes, seed=args.seed)
    if not count:
        return model, tuple(data.input_shape), {}
    return model, tuple(data.input_shape), dict(zip(device_ids(count), partition_from_args(data, args, count)))


def all_models(args: argparse.Namespace, first: SplitModel, input_shape: tuple[int, ...]) -> dict[str, SplitModel]:
    """Every model --model names, by name, each initialised from --seed (the first is ``first``)."""
    models = {first.name: first}
    for name in model_names(args)[1:]:
        models.setdefault(name, build_model(name, input_shape, first.num_classes, seed=args.seed))
    return models


def device_models(ids: list[str], names: list[str]) -> dict[str, str]:
    """Models round-robin over the devices in id order (one model: every device has it)."""
    return {d: names[i % len(names)] for i, d in enumerate(sorted(ids))}


def tiers_from_args(args: argparse.Namespace) -> tuple[float, ...]:
    if args.rank_ratio is not None:
        return check_tiers([args.rank_ratio])
    return check_tiers(parse_tiers(args.rank_tiers) or DEFAULT_TIERS)


def initial_personal(models: list[SplitModel], algorithm: Algorithm) -> dict[str, dict[str, np.ndarray]]:
    """By model name: :func:`personal_tensors` of that model."""
    return {m.name: personal_tensors(m, algorithm) for m in models}


def personal_tensors(model: SplitModel, algorithm: Algorithm) -> dict[str, np.ndarray]:
    """What every device starts from and keeps to itself: the initial head, and the whole model for local
    training (the server sends it in the PLAN, so no device depends on the weights in its artifact cache)."""
    state = to_numpy(model.state_dict())
    return {k: v for k, v in state.items() if algorithm.returns == "none" or not k.startswith(FE_PREFIX)}


def global_state(model: SplitModel, algorithm: Algorithm) -> dict[str, torch.Tensor]:
    """What the server aggregates: the FE, FE and head for FedAvg, nothing for local training."""
    if not algorithm.aggregates:
        return {}
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if algorithm.shares_head or k.startswith(FE_PREFIX)}


@dataclass(frozen=True)
class PlanArtifacts:
    """A rank tier resolved on the model, the hash that names it and the files a device is sent (none for the
    simulator's PyTorch devices)."""

    ratio: float
    resolved: ResolvedPlan
    hash: str
    fe_shapes: dict[str, tuple[int, ...]]
    files: dict[str, bytes] = field(default_factory=dict)
    artifacts: ArtifactSet | None = None
    model: SplitModel | None = None  # the dense model the plan factorizes

    @property
    def description(self) -> str:
        return self.resolved.describe()


class PlanBook:
    """Plans per rank ratio (and model, where devices differ), built the first time a device needs one: with
    ONNX artifacts (in the cache) for onnxruntime devices, or as PyTorch models only for the simulator's
    reference devices."""

    def __init__(self, model: SplitModel, input_shape: tuple[int, ...], cache_dir: Path, *, onnx: bool = True,
                 others: dict[str, SplitModel] | None = None, emit: Callable[[str], None] | None = None):
        self.model, self.input_shape, self.cache_dir, self.onnx = model, input_shape, cache_dir, onnx
        self.emit = emit  # progress lines while artifacts compile (the first run of a tier takes tens of seconds)
        self.models = {model.name: model, **(others or {})}
        self._plans: dict[tuple[float, str, str], PlanArtifacts] = {}

    def get(self, ratio: float, kind: str = PORTABLE_KIND, model: str | None = None) -> PlanArtifacts:
        key = (ratio, kind, model or self.model.name)
        if key not in self._plans:
            return self._build(key)
        return self._plans[key]

    def _build(self, key: tuple[float, str, str]) -> PlanArtifacts:
        ratio, kind, name = key
        model = self.models[name]
        resolved = resolve_plan(model, RankPlan(ratio))
        if self.onnx:
            started: list[float] = []

            def announce() -> None:
                started.append(time.monotonic())
                self.emit(f"compiling the {kind} artifacts of {name} at rank ratio {ratio:g} (once: later runs "
                          f"take them from {self.cache_dir}) ...")
            built = build_artifacts_of_kind(kind, model, resolved.ranks, self.input_shape, model.num_classes,
                                            self.cache_dir, on_compile=announce if self.emit else None)
            if started:
                self.emit(f"  compiled in {time.monotonic() - started[0]:.1f} s")
            paths = [*built.files.values(), built.directory / MANIFEST_NAME]
            plan = PlanArtifacts(ratio, resolved, built.hash, dict(built.fe_shapes),
                                 {p.name: p.read_bytes() for p in paths}, built, model)
            LOG.info("plan ratio %g: %s, %s artifacts %s (%d bytes)", ratio, resolved.describe(), kind,
                     built.hash[:12], built.total_bytes)
        else:
            client = factorize_model(model, resolved.ranks)
            shapes = {k: tuple(v.shape) for k, v in client.state_dict().items() if k.startswith(FE_PREFIX)}
            digest = hashlib.sha256(json.dumps([model.name, sorted(resolved.ranks.items())]).encode())
            plan = PlanArtifacts(ratio, resolved, digest.hexdigest(), shapes, model=model)
        self._plans[key] = plan
        return plan


class RunFolder:
    """A run's folder: checkpoint.npz after every round, metrics.jsonl (and .csv), report.md with plots."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_NAME

    def resume_from(self, resume: bool, settings: dict[str, Any]) -> Checkpoint | None:
        """The checkpoint to continue from (--resume), None to start; raises RunError for a clash."""
        if not self.checkpoint_path.exists():
            if resume:
                LOG.warning("--resume: no checkpoint in %s; starting the run from round 1", self.path)
            return None
        if not resume:
            raise RunError(f"--out {self.path} holds a run ({CHECKPOINT_NAME}); pass --resume to continue it, or "
                           "leave --out out to start a new run in a fresh folder")
        saved = load_checkpoint(self.checkpoint_path)
        current, before = settings, saved.state["settings"]
        differing = sorted(k for k in set(before) | set(current)
                           if k not in RESUME_IGNORED and before.get(k) != current.get(k))
        if differing:
            raise RunError(f"--resume with other settings than the checkpoint's: {differing} "
                           f"(checkpoint: {[before.get(k) for k in differing]}, "
                           f"now: {[current.get(k) for k in differing]})")
        return saved

    def save(self, round_index: int, tensors: dict[str, np.ndarray], state: dict[str, Any],
             records: list[dict[str, Any]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_metrics(self.path / METRICS_FILE, records)
        write_metrics_csv(self.path / METRICS_CSV, records)
        save_checkpoint(self.checkpoint_path, Checkpoint(round_index, tensors, state))

    def report(self, records: list[dict[str, Any]], settings: dict[str, Any]) -> Path:
        return write_report(self.path, records, settings)


def run_settings(args: argparse.Namespace, config_dict: dict[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything that defines the run's math; a resumed run must match (except RESUME_IGNORED)."""
    keys = ("dataset", "partition", "alpha", "classes_per_client", "min_samples", "max_samples", "model",
            "rank_ratio", "rank_tiers", "update_norm_bound", "update_norm_action", *extra)
    settings = dict(config_dict, **{k: getattr(args, k) for k in keys})
    if args.rank_ratio is None:  # the tiers offered, also when they are the defaults
        settings["rank_tiers"] = ",".join(f"{t:g}" for t in tiers_from_args(args))
    return settings
