"""What both drivers build before round 1, from the same flags, in one assembly (``assemble``; the drivers differ
only in their ``Deployment``): the data and its partition into device shards, the initial model, the rank plans
each device may get (with or without ONNX artifacts), the engine, and the run folder's files (checkpoint,
metrics, report)."""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_runtime.artifact_contract import MANIFEST_NAME, PORTABLE_KIND
from device_runtime.profile import ResourceProfile
from device_runtime.secagg_client import secure_step_bytes
from device_runtime.shard import Shard
from export.artifacts import ArtifactSet
from server.algorithms.base import Algorithm
from server.outputs.checkpoint import CHECKPOINT_NAME, Checkpoint, folder_taken, load_checkpoint, save_checkpoint
from device_runtime.batchnorm import is_counter, is_statistic
from fedcore.lowrank import FE_PREFIX, ResolvedPlan, factorize_model, resolve_plan
from fedcore.model_probe import probe_model
from fedcore.models import SplitModel, build_model, rank_plan
from server.cli import parse_tiers
from server.compute_threads import use_server_threads
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.cost_model import CostModelError, peak_predictor
from server.engine.round_engine import Predictor, RoundEngine, algorithm_for
from server.engine.rank_assignment import check_tiers, load_overrides, tier_predictor
from server.engine.async_engine import AsyncEngine
from server.engine.run_config import (DEFAULT_TIERS, FederationConfig, RunError, async_rule_from_args, dp_from_args,
                                      norm_bound_from_args, secure_from_args)
from server.outputs.report import METRICS_CSV, METRICS_FILE, write_metrics, write_metrics_csv, write_report
from server.data.shards import DEVICE_ID, data_from_args, partition_from_args
from server.engine.sampling import to_numpy
from server.tier_measurement import build_tier, cost_key

LOG = logging.getLogger("fedara.setup")
RESUME_IGNORED = ("rounds",)
"""Settings a resumed run may change (a run can be extended); every other setting must match."""
DP_SETTINGS = ("dp_noise_multiplier", "dp_clip", "dp_clip_quantile", "dp_clip_lr", "dp_target_epsilon", "dp_delta",
               "dp_accountant", "dp_test_seed")
"""The differential-privacy flags a resumed run must match, where DP is on (its budget too: a resume keeps spending it)."""
SECAGG_SETTINGS = ("secure_aggregation", "secagg_neighbors", "secagg_threshold", "secagg_range",
                   "secagg_dropout_rate", "secagg_corrupt_rate")
"""The secure-aggregation flags a resumed run must match, where it is on."""


def device_ids(count: int) -> list[str]:
    return [DEVICE_ID.format(i) for i in range(count)]


def model_names(args: argparse.Namespace) -> list[str]:
    """--model: one model, or (local training in-process) several, assigned round-robin by device id."""
    return args.model.split(",")  # checked by server.cli.check_args


def load_shards(args: argparse.Namespace, count: int) -> tuple[SplitModel, tuple[int, ...], dict[str, Shard]]:
    """The initial model (the first of --model), its input shape and ``count`` device shards by device id (the
    same for both drivers given the same flags: a seeded subset of --max-samples, then the partition)."""
    data = data_from_args(args)
    model = checked_model(model_names(args)[0], data.input_shape, data.num_classes, args.seed)
    if not count:
        return model, tuple(data.input_shape), {}
    return model, tuple(data.input_shape), dict(zip(device_ids(count), partition_from_args(data, args, count)))


def all_models(args: argparse.Namespace, first: SplitModel, input_shape: tuple[int, ...]) -> dict[str, SplitModel]:
    """Every model --model names, by name, each initialised from --seed (the first is ``first``)."""
    models = {first.name: first}
    for name in model_names(args)[1:]:
        models.setdefault(name, checked_model(name, input_shape, first.num_classes, args.seed))
    return models


def checked_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int) -> SplitModel:
    """The model --model names, built for the data and probed against the contract (``fedcore.model_probe``:
    a misfit is a ValueError naming it, before anything compiles)."""
    model = build_model(name, input_shape, num_classes, seed=seed)
    probe_model(model, input_shape, num_classes)
    return model


def personal_names(model: SplitModel, bn_stats: str) -> frozenset[str]:
    """The FE tensors that stay on the devices: the model's ``personal`` layers and, under --bn-stats personal,
    every BatchNorm's running statistics (counters are never federated: device_runtime.batchnorm)."""
    names = {k for k in model.state_dict() if k.startswith(FE_PREFIX) and not is_counter(k)}
    prefixes = tuple(FE_PREFIX + p for p in model.personal)
    return frozenset(k for k in names if (bn_stats == "personal" and is_statistic(k))
                     or any(k == p or k.startswith(p + ".") for p in prefixes))


def has_batchnorm(model: SplitModel) -> bool:
    return any(is_statistic(k) for k in model.state_dict())




def device_models(ids: list[str], names: list[str]) -> dict[str, str]:
    """Models round-robin over the devices in id order (one model: every device has it)."""
    return {d: names[i % len(names)] for i, d in enumerate(sorted(ids))}


def tiers_from_args(args: argparse.Namespace) -> tuple[float, ...]:
    if args.rank_ratio is not None:
        return check_tiers([args.rank_ratio])
    return check_tiers(parse_tiers(args.rank_tiers) or DEFAULT_TIERS)


def initial_personal(models: list[SplitModel], algorithm: Algorithm) -> dict[str, dict[str, np.ndarray]]:
    """By model name: what every device of that model starts from and keeps to itself (the algorithm's
    ``personal_tensors``)."""
    return {m.name: to_numpy(algorithm.personal_tensors(m.state_dict())) for m in models}


def global_state(model: SplitModel, algorithm: Algorithm) -> dict[str, torch.Tensor]:
    """What the server keeps and aggregates (the algorithm's ``global_tensors``; empty: no global model)."""
    return algorithm.global_tensors(model.state_dict())


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
                 others: dict[str, SplitModel] | None = None, emit: Callable[[str], None] | None = None,
                 tiers: tuple[float, ...] = DEFAULT_TIERS):
        self.model, self.input_shape, self.cache_dir, self.onnx = model, input_shape, cache_dir, onnx
        self.emit = emit  # progress lines while artifacts compile (the first run of a tier takes tens of seconds)
        self.models = {model.name: model, **(others or {})}
        self.tiers = tiers
        self._plans: dict[tuple[float, str, str], PlanArtifacts] = {}
        self._cost_key: str | None = None

    def cost_key(self) -> str:
        """The name the cost model knows the model by (``server.tier_measurement``: a model nobody measured is
        measured at the run's tiers the first time this is asked)."""
        if self._cost_key is None:
            self._cost_key = cost_key(self.model, self.input_shape, self.cache_dir, self.tiers, self.emit)
        return self._cost_key

    def get(self, ratio: float, kind: str = PORTABLE_KIND, model: str | None = None) -> PlanArtifacts:
        key = (ratio, kind, model or self.model.name)
        if key not in self._plans:
            return self._build(key)
        return self._plans[key]

    def _build(self, key: tuple[float, str, str]) -> PlanArtifacts:
        ratio, kind, name = key
        model = self.models[name]
        resolved = resolve_plan(model, rank_plan(model, ratio))
        if self.onnx:
            started: list[float] = []

            def announce() -> None:
                started.append(time.monotonic())
                self.emit(f"compiling the {kind} artifacts of {name} at rank ratio {ratio:g} (once: later runs "
                          f"take them from {self.cache_dir}) ...")
            built = build_tier(kind, model, ratio, resolved.ranks, self.input_shape, self.cache_dir,
                               on_compile=announce if self.emit else None)
            if started:
                self.emit(f"  compiled in {time.monotonic() - started[0]:.1f} s")
            paths = [*built.files.values(), built.directory / MANIFEST_NAME]
            plan = PlanArtifacts(ratio, resolved, built.hash, dict(built.fe_shapes),
                                 {p.name: p.read_bytes() for p in paths}, built, model)
            LOG.info("plan ratio %g: %s, %s artifacts %s (%d bytes)", ratio, resolved.describe(), kind,
                     built.hash[:12], built.total_bytes)
        else:
            client = factorize_model(model, resolved.ranks)
            shapes = {k: tuple(v.shape) for k, v in client.state_dict().items()
                      if k.startswith(FE_PREFIX) and not is_counter(k)}
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
            raise RunError(folder_taken(self.path, resume))
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
    if args.dp_noise_multiplier is not None:  # DP's settings where it is on (a run without DP resumes as before)
        keys += DP_SETTINGS
    if getattr(args, "secure_aggregation", False):
        keys += SECAGG_SETTINGS
    settings = dict(config_dict, **{k: getattr(args, k) for k in keys})
    if args.rank_ratio is None:  # the tiers offered, also when they are the defaults
        settings["rank_tiers"] = ",".join(f"{t:g}" for t in tiers_from_args(args))
    return settings


# -- the one run assembly of both drivers -------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """Where a driver's devices run, which is all the drivers differ in when a run is set up: how many devices it
    starts itself (each on a shard of --dataset), how many a round needs, how long a round waits, whether the
    devices run ONNX artifacts, whether they report memory budgets (tiers by the cost model; else round-robin by
    device id), whether aggregator processes fold, and the settings of its own that a resumed run must match."""

    devices: int
    min_devices: int
    round_deadline_s: float
    onnx: bool = True
    budgets: bool = True
    remote: bool = False
    shared_payloads: bool = False  # tasks name their plan's payload, published once per plan (engine/plan_payloads.py)
    settings_keys: tuple[str, ...] = ()


@dataclass
class Assembly:
    """A run set up from its flags, resumed from its checkpoint where there is one: the engine the driver talks
    to, the devices' shards (by id), the settings and the saved checkpoint."""

    engine: RoundEngine
    shards: dict[str, Shard]
    settings: dict[str, Any]
    saved: Checkpoint | None

    @property
    def run_id(self) -> str:
        return self.engine.run_id

    def first_round(self) -> int:
        return self.saved.round + 1 if self.saved else 1


def round_robin_tiers(ids: list[str], tiers: tuple[float, ...], overrides: dict[str, float]) -> dict[str, float]:
    """Devices without a memory budget: tiers go round-robin by device id (overrides win)."""
    return {d: overrides.get(d, tiers[i % len(tiers)]) for i, d in enumerate(ids)}


def predictor_for(plans: PlanBook, batch_size: int, extra_mb: float = 0.0) -> Predictor:
    """(profile, shard samples) -> (ratio -> MiB the device needs): the measured cost model
    (device_runtime/cost_model.json: memory floors, else peaks scaled by the device's probe) where it has the
    model and input, else the analytic footprint. ``extra_mb`` (under --secure-aggregation: ``secure_step_mb``, the
    secure step's bound): the floors measured with the secure step where the cost model has them, else the need
    plus ``extra_mb`` at every tier."""
    analytic = tier_predictor(plans.model, plans.input_shape, batch_size)

    def for_profile(profile: ResourceProfile, shard_samples: int) -> Callable[[float], float]:
        predict = peak_predictor(plans.cost_key(), plans.input_shape, batch_size, profile,
                                 shard_samples=shard_samples, secure_step_mb=extra_mb or None)
        try:
            predict(1.0)
        except CostModelError as exc:
            LOG.info("cost model: %s; using the analytic footprint", exc)
            return analytic if not extra_mb else (lambda ratio: analytic(ratio) + extra_mb)
        return predict
    return for_profile


def secure_step_mb(model: SplitModel, algorithm: Algorithm) -> float:
    """MiB a device's secure step allocates beyond its training round (``secagg_client.secure_step_bytes`` of the
    shared model at full rank, whatever its tier: it masks the full-rank change). The measured floors do not
    include it, so under --secure-aggregation every tier needs this much more."""
    return secure_step_bytes({k: tuple(v.shape) for k, v in global_state(model, algorithm).items()}) / (1 << 20)


def assemble(args: argparse.Namespace, config: FederationConfig, out: RunFolder, deployment: Deployment,
             emit: Callable[[str], None] | None = None) -> Assembly:
    """Set the run up from its flags and their checked ``config`` (``server.cli.check_args``), for either driver:
    the algorithm, the tiers, the data and its shards, the models and plans, the engine (restored from --out's
    checkpoint with --resume)."""
    use_server_threads(args.threads)
    algorithm = algorithm_for(config)
    tiers = tiers_from_args(args)
    overrides = load_overrides(args.rank_overrides) if args.rank_overrides else {}
    settings = run_settings(args, config.to_dict(), deployment.settings_keys)
    rule = async_rule_from_args(args)
    if rule is not None:  # only then: a sync run's settings (and the checkpoints it resumes) stay as they were
        settings["async"] = rule.to_dict()
    model, input_shape, shards = load_shards(args, deployment.devices)
    if has_batchnorm(model):  # only then: the zoo's settings (and the checkpoints they resume) stay as they were
        settings["bn_stats"] = args.bn_stats
    algorithm.keep_personal(personal_names(model, args.bn_stats))
    saved = out.resume_from(args.resume, settings)
    run_id = saved.state["run_id"] if saved else uuid.uuid4().hex[:16]
    coordinator = Coordinator(CoordinatorConfig(
        input_shape=input_shape, num_classes=model.num_classes, min_devices=deployment.min_devices,
        join_ratio=config.join_ratio, seed=config.seed, round_deadline_s=deployment.round_deadline_s,
        min_completion=config.min_completion), run_id)
    models = all_models(args, model, input_shape)
    plans = PlanBook(model, input_shape, Path(args.cache_dir), onnx=deployment.onnx, others=models, emit=emit,
                     tiers=tiers)
    models_of = device_models(list(shards), model_names(args))
    if not deployment.budgets:
        overrides = round_robin_tiers(sorted(shards), tiers, overrides)
    engine_kind, mode = ((RoundEngine, {"secure": secure_from_args(args)}) if rule is None
                         else (AsyncEngine, {"rule": rule}))
    engine = engine_kind(algorithm, config, coordinator, plans, global_state(model, algorithm),
                         initial_personal(list(models.values()), algorithm), tiers=tiers, overrides=overrides,
                         device_models=models_of,
                         predictor=predictor_for(plans, config.batch_size,
                                                 secure_step_mb(model, algorithm) if secure_from_args(args) else 0.0)
                         if deployment.budgets else None,
                         norm_bound=norm_bound_from_args(args), remote=deployment.remote,
                         shared_payloads=deployment.shared_payloads,
                         privacy=dp_from_args(args, deployment.devices), **mode)
    if mode.get("secure") is not None and engine.dp is not None:  # distributed DP: the Skellam accountant's check
        engine.dp.settings.check_first_round(engine.dp.accountant.epsilon_after(1), "skellam")  # and plan
        (emit or print)(engine.dp.accountant.plan(args.rounds))
    for device_id in shards:
        engine.register(device_id)
    if saved:  # the global model's tensors (the simulator's checkpoint also holds its devices')
        engine.restore(saved.state["engine"], saved.tensors)
    return Assembly(engine, shards, settings, saved)
