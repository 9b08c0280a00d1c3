"""Tiers for a model nobody measured: the first run of a user's model (``--model FILE.py:FN``) that needs the cost
model (memory budgets, ``--device-speed``) measures each rank tier's step peak memory (batch 16 and 64) and step
time in a fresh process with the onnxruntime a device runs, using the device benchmark's own worker
(``scripts/bench_device.py``'s ``ort-memory``: a device process's local rounds on the portable step graph, peak RSS
after each batch size, the p50 of single steps, the probe score), and keeps them in the user's cost-model file under
the fingerprint of the model's graphs and the step compiler's versions for it (:func:`measured_key`;
``server.engine.cost_model.add_measured``). Later runs, and the virtual clock,
read them there; the zoo's measurements ship with the package.

Where this process can make memory cgroups (root), each tier also runs the benchmark's ``floor-portable`` worker
(a device process's rounds, MQTT framing included) in an open group at batch 16 and at 64, and keeps the group's
charged peak as the tier's floor: what the kernel charges, the figure a limit is held to (peak RSS also counts
shared library pages no cgroup charges). It is the upper bracket ``--memory-floor``'s bisection starts from, so an
upper bound of the bisected floor (``bound`` in the entry says so); the bisection itself (minutes per tier) is left
to ``scripts/bench_device.py --memory-floor``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.shard import Shard, save_shard
from export.artifacts import ArtifactSet, build_artifacts_of_kind
from export.fingerprint import fingerprint
from export.step_compiler import ParityError, compiler_versions
from fedcore.lowrank import resolve_plan
from fedcore.models import ARCHITECTURES, SplitModel, rank_plan
from fedcore.tokens import random_samples, token_vocabulary
from server.engine.cost_model import MIB, add_measured, has_measurements
from server.mqtt import cgroups

BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_device.py"
MEASURE_TRAIN_SAMPLES = 128
"""Synthetic training samples of the measuring device: two steps at batch 64 (a step's cost does not depend on
the values; the shard's own bytes are what the cost model adds per sample)."""
MEASURE_TEST_SAMPLES = 16
KEY_PREFIX = "graphs-"
MEASURED_BY = "server.tier_measurement (scripts/bench_device.py ort-memory worker, portable step graph)"
CHARGED_PEAK_BOUND = ("the charged peak of an open memory cgroup (scripts/bench_device.py floor-portable worker): an "
                      "upper bound of the bisected floor")
OPEN_GROUP_TIMEOUT_S = 600
MEASUREMENT_VERSION = 2
"""How the device worker measures, in the measured key: a tier measured by an older worker is measured again.
2: the worker imports the benchmark as a module and runs the compute probe first, as a device does (4 MiB less
than version 1's workers held, which no device holds: ``scripts/bench_device.py`` ``worker_command``)."""


class MeasurementError(ValueError):
    """The device worker could not run a tier's step graph (the message names the tier and the worker's error)."""


def _bench() -> ModuleType:
    """The device benchmark's module (only the stdlib and numpy load with it)."""
    if "fedara_bench_device" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fedara_bench_device", BENCH_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["fedara_bench_device"] = module
    return sys.modules["fedara_bench_device"]


def cost_key(model: SplitModel, input_shape: tuple[int, ...], cache_dir: Path, tiers: Sequence[float],
             emit: Callable[[str], None] | None = None) -> str:
    """The name the cost model knows ``model`` by: a zoo name, or its :func:`measured_key`, measured at every tier
    first where the cost model lacks one of them."""
    if model.name in ARCHITECTURES:
        return model.name
    key = measured_key(model, input_shape)
    missing = [t for t in tiers if not has_measurements(key, input_shape, [t])]
    if missing:
        if emit:
            emit(f"measuring {model.name} at rank ratios {', '.join(f'{t:g}' for t in missing)} (once: later runs "
                 "take them from the cost model's cache) ...")
        for tier in missing:  # each kept as it is measured: a tier that fails leaves the others measured
            add_measured([measure_tier(model, tier, input_shape, cache_dir, key)], MEASURED_BY)
    return key


def measured_key(model: SplitModel, input_shape: tuple[int, ...]) -> str:
    """``graphs-`` and a hash of the model's fingerprint (its traced forward graphs, so its code), of the step
    compiler's versions for it (``export.step_compiler.compiler_versions``) and of :data:`MEASUREMENT_VERSION`: a
    change of how the compiler emits the model's step (a new form of one of its ops) is a new key, so its tiers are
    measured again on the graphs the devices will run, as the artifacts are compiled again; so is a change of how
    the worker measures."""
    versions = json.dumps(dict(compiler_versions(model), measurement=MEASUREMENT_VERSION), sort_keys=True)
    return KEY_PREFIX + hashlib.sha256(f"{fingerprint(model, tuple(input_shape))} {versions}".encode()).hexdigest()[:20]


def build_tier(kind: str, model: SplitModel, ratio: float, ranks: dict[str, int], input_shape: tuple[int, ...],
               cache_dir: Path, on_compile: Callable[[], None] | None = None) -> ArtifactSet:
    """A tier's artifacts (``export.artifacts``, cached). A tier whose compiled step fails the parity gate is refused
    as a ValueError naming the model and the tier (one line; nothing is published); a model the compiler cannot take
    is its ``UnsupportedModel`` (a ValueError naming the layer and the op)."""
    try:
        return build_artifacts_of_kind(kind, model, ranks, input_shape, model.num_classes, cache_dir,
                                       on_compile=on_compile)
    except ParityError as exc:
        raise ValueError(f"--model {model.name} at rank ratio {ratio:g}: {exc}") from None


def _portable(model: SplitModel, ratio: float, input_shape: tuple[int, ...], cache_dir: Path) -> Path:
    ranks = resolve_plan(model, rank_plan(model, ratio)).ranks
    return build_tier(PORTABLE_KIND, model, ratio, ranks, input_shape, cache_dir).directory


def measure_tier(model: SplitModel, ratio: float, input_shape: tuple[int, ...], cache_dir: Path, key: str) -> dict:
    """One cost-model entry: the tier's step graph run by the benchmark's device worker in a fresh process."""
    bench = _bench()
    directory = _portable(model, ratio, input_shape, cache_dir)
    with tempfile.TemporaryDirectory(prefix="fedara-measure-") as folder:
        shard = Path(folder) / "shard.npz"
        generator, vocabulary = torch.Generator().manual_seed(0), token_vocabulary(model)
        classes = model.num_classes

        def split(n: int) -> tuple[np.ndarray, np.ndarray]:  # token ids for a model that embeds them
            return (random_samples(tuple(input_shape), n, generator, vocabulary).numpy(),
                    np.arange(n, dtype=np.int64) % classes)

        save_shard(shard, Shard(*split(MEASURE_TRAIN_SAMPLES), *split(MEASURE_TEST_SAMPLES), classes))
        try:
            result = bench.run_worker("ort-memory", dict(
                label=f"{model.name} at {ratio:g}", portable=True, artifacts=str(directory),
                portable_artifacts=str(directory), shard=str(shard),
                session=list(bench.SESSION_VARIANTS[bench.shipped_session_variant()])))
            charged = _charged_peaks(bench, directory, shard) if cgroups.available() is None else None
        except RuntimeError as exc:  # the worker's traceback: its last line says what failed
            last = str(exc).strip().splitlines()[-1]
            raise MeasurementError(f"measuring {model.name} at rank ratio {ratio:g} failed in the device "
                                   f"worker: {last}") from None
    entry = cost_entry(result, key, input_shape, ratio)
    if charged:
        entry["floors"] = {PORTABLE_KIND: dict(floor_mb=charged, floor_samples=MEASURE_TRAIN_SAMPLES +
                                               MEASURE_TEST_SAMPLES, bound=CHARGED_PEAK_BOUND)}
    return entry


def _charged_peaks(bench: ModuleType, directory: Path, shard: Path) -> dict[str, float]:
    """Batch size -> the charged peak (MiB) of the benchmark's device-process worker in an open memory cgroup."""
    peaks = {}
    for batch_size in bench.BATCH_SIZES:
        run = bench.run_in_group("floor-portable", dict(
            label=f"open group, batch {batch_size}", artifacts=str(directory), portable_artifacts=str(directory),
            shard=str(shard), batch_size=batch_size, rounds=bench.FLOOR_ROUNDS),
            bench.FLOOR_OPEN_LIMIT_MB, OPEN_GROUP_TIMEOUT_S)
        if not run["completed"]:
            raise RuntimeError(run["error"] or "the device worker did not complete in an open memory cgroup")
        peaks[str(batch_size)] = run["group_peak_mb"]
    return peaks


def cost_entry(result: dict, key: str, input_shape: tuple[int, ...], ratio: float) -> dict:
    """A cost-model entry from an ``ort-memory`` worker's result: the peak RSS after the rounds at each batch size;
    the p50 single step at batch 16, and at 64 that scaled by the two rounds' time per step."""
    rounds = result["rounds"]
    small, large = sorted(rounds, key=int)[:2]
    per_step = {size: rounds[size]["seconds"] / rounds[size]["steps"] for size in (small, large)}
    step_small = result["step_ms"]["p50"]
    return dict(model=key, input_shape=[int(d) for d in input_shape], ratio=ratio,
                probe_gflops=result["probe_gflops"],
                peak_mb={size: rounds[size]["peak_rss_bytes"] / MIB for size in (small, large)},
                step_ms={"1": {small: step_small, large: step_small * per_step[large] / per_step[small]}})
