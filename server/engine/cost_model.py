"""Predicted peak memory and step time of a rank plan on a device, from the device benchmark's measurements.

``scripts/bench_device.py --cost-model device_runtime/cost_model.json`` writes the data: per (model, input shape,
rank ratio), the peak RSS of a device process over a local round at each measured batch size, and the p50 time
of one training step per thread count and batch size, with the probe score (``device_runtime.probe``) of the
process that timed the steps. A prediction for a device:
- interpolates linearly in the rank ratio between the two nearest measured ratios; outside the measured range it
  takes the nearest end (a ratio below the smallest measured one is predicted at that one: an overestimate);
- interpolates linearly in the batch size between measured sizes and extrapolates along the last segment above
  them; below the smallest it takes the smallest (an overestimate);
- takes the fastest of the measured thread counts the device has (the smallest count if it has fewer): on a
  device whose cores are its own, more threads are not slower, while the benchmark machine may be shared;
- scales the step time by ``probe_gflops(benchmark) / probe_gflops(device)``. Memory is not scaled: the same
  graphs and weights take the same bytes (the runtime's own libraries differ by platform; see docs/benchmarks.md).

Where the benchmark also measured memory floors (``--memory-floor``: the smallest cgroup limit under which a fresh
device process completes its rounds, per runtime and batch size), the memory a device needs is that floor plus
FLOOR_MARGIN_MB, not the predicted peak RSS: peak RSS counts shared library pages a cgroup does not charge and
misses nothing the kernel enforces, so a floor is the measured answer to "does it fit a limit of L MiB". Between
measured batch sizes the floor is linear; above them it grows as the peak does; given the device's shard size, it
grows by the bytes of the samples beyond those of the shard it was measured with (float32 images, resident for the
whole run). Floors are kept per runtime (the artifact kind a device names in its profile: the portable step graph
on stock onnxruntime and onnxruntime-training differ by up to 20 MiB, either way, docs/edge_envelope.md): a device
is predicted with its own runtime's floors, a device that names none with the larger of the runtimes' floors. A runtime's floors are used only where every
ratio of the model has one (a mix would compare unlike quantities); without them the need is the predicted peak.
Under --secure-aggregation a device also builds, masks and sends its full-rank change each round: where the benchmark
measured floors with that step (``--memory-floor --secure``: ``secure_floor_mb``) for every ratio of every runtime
the floor is taken from, those are the floors; otherwise the caller adds the step's analytic bound to the plain need.

A model nobody measured (a user's ``--model FILE.py:FN``) is measured on its first compile by
``server.tier_measurement`` with the benchmark's own device worker, and its entries, keyed by the fingerprint of its
graphs, are kept in the user's cache (``measured_path()``: ~/.cache/fedara-edge/cost_model.json) beside the zoo's:
every prediction reads both.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Protocol

from device_runtime.artifact_contract import KINDS

COST_MODEL_FORMAT = 2  # 2: floors per runtime (``floors: {kind: {floor_mb, floor_samples, generated_by}}``, and
# optionally ``secure_floor_mb`` with ``secure_generated_by``: the floors with the secure step)
COST_MODEL_PACKAGE = "device_runtime"
COST_MODEL_FILE = "cost_model.json"
FLOOR_MARGIN_MB = 8.0
"""Added to a measured floor: it is resolved to 4 MiB, and a device's MQTT session and longer run add a little
(measured: docs/edge_envelope.md, "The tier choice and its margin")."""
BYTES_PER_SAMPLE_VALUE = 4  # float32 images
MIB = 1024 * 1024
CACHE_DIR_ENV, CACHE_FOLDER = "XDG_CACHE_HOME", "fedara-edge"
MAX_INPUT_DIMS = 4

class CostModelError(ValueError):
    """A cost-model file that is unreadable or malformed, or a question it has no measurements for."""


class DeviceProfile(Protocol):
    """What a prediction needs from a device's profile (device_runtime.profile.ResourceProfile has these; a
    profile without ``runtime``, or with None, is predicted with the larger of the runtimes' floors)."""

    probe_gflops: float
    threads: int


@dataclass(frozen=True)
class Prediction:
    peak_mb: float  # peak RSS of the device process over a local round, MiB
    step_ms: float  # one training step (forward, backward, SGD update), milliseconds
    floor_mb: float | None = None  # smallest cgroup limit under which the rounds completed, MiB; None: not measured
    floor_runtime: str | None = None  # the runtime (artifact kind) whose floor that is
    secure_floor: bool = False  # the floor was measured with the secure step (asked for, and measured)

    @property
    def need_mb(self) -> float:
        """The memory limit the device needs: the measured floor plus FLOOR_MARGIN_MB, else the predicted peak."""
        return self.peak_mb if self.floor_mb is None else self.floor_mb + FLOOR_MARGIN_MB


@dataclass(frozen=True)
class Floors:
    """The memory floors of one rank ratio on one runtime: of the plain rounds, and of rounds that end with the
    secure step (``--memory-floor --secure``: the full-rank change masked and sent), where measured."""

    floor_mb: dict[int, float]  # batch size -> MiB
    samples: int  # samples (train + test) of the shard they were measured with
    secure_floor_mb: dict[int, float] | None = None  # batch size -> MiB under --secure-aggregation; None: not measured

    def table(self, secure: bool) -> dict[int, float]:
        return self.secure_floor_mb if secure else self.floor_mb


@dataclass(frozen=True)
class CostEntry:
    """The measurements of one rank ratio."""

    ratio: float
    probe_gflops: float
    peak_mb: dict[int, float]  # batch size -> MiB
    step_ms: dict[int, dict[int, float]]  # threads -> batch size -> ms
    floors: dict[str, Floors] = field(default_factory=dict)  # runtime (artifact kind) -> floors; empty: none measured


@dataclass(frozen=True)
class CostModel:
    entries: dict[tuple[str, tuple[int, ...]], tuple[CostEntry, ...]]  # (model, input shape) -> entries by ratio
    generated_by: str


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CostModelError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _sizes(table: object, what: str) -> dict[int, object]:
    """A JSON object keyed by positive integer sizes ("16", "64") as {size: value}, smallest size first."""
    if not isinstance(table, dict) or not table:
        raise CostModelError(f"{what} must be a non-empty object keyed by size, got {table!r}")
    try:
        sizes = {int(size): value for size, value in table.items()}
    except ValueError:
        raise CostModelError(f"{what} must be keyed by integer sizes, got {sorted(table)}") from None
    if min(sizes) < 1:
        raise CostModelError(f"{what} must be keyed by positive sizes, got {sorted(sizes)}")
    return {size: sizes[size] for size in sorted(sizes)}


def _numbers_by_size(table: object, what: str) -> dict[int, float]:
    return {size: _number(value, f"{what}[{size}]") for size, value in _sizes(table, what).items()}


def _floors(record: object, what: str) -> Floors:
    if not isinstance(record, dict) or "floor_mb" not in record:
        raise CostModelError(f"{what} must be an object with floor_mb and floor_samples, got {record!r:.80}")
    samples = record.get("floor_samples")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise CostModelError(f"{what}: floor_samples must be a positive integer, got {samples!r}")
    secure = record.get("secure_floor_mb")
    return Floors(_numbers_by_size(record["floor_mb"], f"{what} floor_mb"), samples,
                  None if secure is None else _numbers_by_size(secure, f"{what} secure_floor_mb"))


def _entry(raw: object, index: int) -> tuple[tuple[str, tuple[int, ...]], CostEntry]:
    if not isinstance(raw, dict):
        raise CostModelError(f"entry {index} must be an object, got {type(raw).__name__}")
    missing = {"model", "input_shape", "ratio", "probe_gflops", "peak_mb", "step_ms"} - set(raw)
    if missing:
        raise CostModelError(f"entry {index} lacks {sorted(missing)}")
    shape = raw["input_shape"]
    if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_INPUT_DIMS or \
            not all(isinstance(d, int) and d > 0 for d in shape):
        raise CostModelError(f"entry {index}: input_shape must be a sample's 1 to {MAX_INPUT_DIMS} sizes (e.g. "
                             f"[C, H, W]), got {shape!r}")
    ratio = _number(raw["ratio"], f"entry {index} ratio")
    if ratio > 1:
        raise CostModelError(f"entry {index}: ratio must be in (0, 1], got {ratio}")
    step = {threads: _numbers_by_size(table, f"entry {index} step_ms[{threads}]")
            for threads, table in _sizes(raw["step_ms"], f"entry {index} step_ms").items()}
    floors = raw.get("floors", {})
    if not isinstance(floors, dict) or set(floors) - set(KINDS):
        raise CostModelError(f"entry {index}: floors must be an object keyed by runtime ({', '.join(KINDS)}), got "
                             f"{sorted(floors) if isinstance(floors, dict) else floors!r}")
    entry = CostEntry(ratio, _number(raw["probe_gflops"], f"entry {index} probe_gflops"),
                      _numbers_by_size(raw["peak_mb"], f"entry {index} peak_mb"), step,
                      {kind: _floors(record, f"entry {index} floors[{kind}]") for kind, record in floors.items()})
    return (str(raw["model"]), tuple(shape)), entry


def parse_cost_model(document: object) -> CostModel:
    """A CostModel from the parsed JSON document; CostModelError names what is wrong."""
    if not isinstance(document, dict) or document.get("format_version") != COST_MODEL_FORMAT:
        got = document.get("format_version") if isinstance(document, dict) else type(document).__name__
        raise CostModelError(f"cost model format must be {COST_MODEL_FORMAT}, got {got!r}")
    if not isinstance(document.get("entries"), list) or not document["entries"]:
        raise CostModelError("cost model has no entries")
    grouped: dict[tuple[str, tuple[int, ...]], list[CostEntry]] = {}
    for index, raw in enumerate(document["entries"]):
        key, entry = _entry(raw, index)
        if any(e.ratio == entry.ratio for e in grouped.get(key, [])):
            raise CostModelError(f"cost model repeats ratio {entry.ratio} for {key[0]} {key[1]}")
        grouped.setdefault(key, []).append(entry)
    return CostModel({key: tuple(sorted(entries, key=lambda e: e.ratio)) for key, entries in grouped.items()},
                     str(document.get("generated_by", "")))


def smallest_floor(model: CostModel) -> tuple[float, str]:
    """The smallest memory floor any measured device needed (MiB) and what it was: below it no tier of any model
    runs, whatever the tier choice."""
    found = [(floor, f"{name} {'x'.join(map(str, shape))} at tier {entry.ratio:g} on {kind}, batch {batch}")
             for (name, shape), entries in model.entries.items() for entry in entries
             for kind, floors in entry.floors.items() for batch, floor in floors.floor_mb.items()]
    return min(found) if found else (0.0, "nothing measured")


def load_cost_model(path: str | os.PathLike | None = None) -> CostModel:
    """Read a cost-model file; None: the one shipped in the device_runtime package."""
    try:
        if path is None:
            text = resources.files(COST_MODEL_PACKAGE).joinpath(COST_MODEL_FILE).read_text()
        else:
            text = Path(path).read_text()
        document = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CostModelError(f"cannot read cost model {path or COST_MODEL_FILE}: {exc}") from None
    return parse_cost_model(document)


def measured_path() -> Path:
    """The user's cost-model file of measured models: $XDG_CACHE_HOME/fedara-edge/cost_model.json (~/.cache)."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / CACHE_FOLDER / COST_MODEL_FILE


def _measured_entries() -> list[dict]:
    """The entries of the user's file; an unreadable or malformed one counts as empty (it is a cache)."""
    try:
        document = json.loads(measured_path().read_text())
        parse_cost_model(document)
    except (OSError, ValueError):
        return []
    return list(document["entries"])


def add_measured(entries: list[dict], generated_by: str) -> None:
    """Keep ``entries`` (cost-model entries, as the file holds them) in the user's file, replacing those of the
    same model, input shape and ratio; the next prediction reads them."""
    new_keys = {(e["model"], tuple(e["input_shape"]), e["ratio"]) for e in entries}
    kept = [e for e in _measured_entries() if (e["model"], tuple(e["input_shape"]), e["ratio"]) not in new_keys]
    document = {"format_version": COST_MODEL_FORMAT, "generated_by": generated_by, "entries": kept + entries}
    parse_cost_model(document)
    path = measured_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(document, indent=1))
    os.replace(temporary, path)
    _shipped.cache_clear()


@lru_cache(maxsize=1)
def _shipped() -> CostModel:
    """The shipped cost model with the user's measured models beside it."""
    shipped = load_cost_model()
    measured = _measured_entries()
    if not measured:
        return shipped
    extra = parse_cost_model({"format_version": COST_MODEL_FORMAT, "entries": measured})
    return CostModel({**shipped.entries, **extra.entries}, shipped.generated_by)


def has_measurements(model_name: str, input_shape: Sequence[int], ratios: Sequence[float]) -> bool:
    """Whether the cost model (shipped and measured) has ``model_name`` on ``input_shape`` at every one of ``ratios``."""
    entries = _shipped().entries.get((model_name, tuple(int(d) for d in input_shape)), ())
    return set(ratios) <= {e.ratio for e in entries}


def _interpolate(points: Sequence[tuple[float, float]], x: float, extrapolate_above: bool) -> float:
    """Piecewise-linear through ``points`` (sorted by x). Below the first point: its value. Above the last: the
    last segment extended when ``extrapolate_above``, else the last value."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        if not extrapolate_above or len(points) == 1:
            return points[-1][1]
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        i = bisect.bisect_left(xs, x)  # xs[i - 1] < x <= xs[i]
        (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _by_batch(table: dict[int, float], batch_size: int) -> float:
    return _interpolate(sorted(table.items()), batch_size, extrapolate_above=True)


def _entry_floor(entry: CostEntry, floors: Floors, batch_size: int, shard_mb: Callable[[int], float],
                 secure: bool = False) -> float:
    """The floor (``secure``: with the secure step) at ``batch_size``: linear between measured batch sizes; above
    the largest measured one b0, the floor at b0 plus what the predicted peak grows from b0 to ``batch_size``; below
    the smallest, the smallest's; plus ``shard_mb(floors.samples)``."""
    table = floors.table(secure)
    b0 = max(table)
    batch_growth = max(0.0, _by_batch(entry.peak_mb, batch_size) - _by_batch(entry.peak_mb, b0))
    at_batch = (table[b0] + batch_growth if batch_size > b0 else
                _interpolate(sorted(table.items()), batch_size, extrapolate_above=False))
    return at_batch + shard_mb(floors.samples)


def _entry_prediction(entry: CostEntry, batch_size: int, threads: int, probe_gflops: float) -> Prediction:
    usable = [t for t in entry.step_ms if t <= threads] or [min(entry.step_ms)]
    step = min(_by_batch(entry.step_ms[t], batch_size) for t in usable) * entry.probe_gflops / probe_gflops
    return Prediction(_by_batch(entry.peak_mb, batch_size), step)


def _floor_runtimes(entries: Sequence[CostEntry], runtime: str | None, secure: bool = False) -> list[str]:
    """The runtimes whose floors (``secure``: with the secure step) predict for a device of ``runtime``: its own
    where every ratio has one (else none); a device that names no runtime: every runtime whose floors cover every
    ratio (the larger one wins)."""
    complete = [kind for kind in KINDS
                if all(kind in e.floors and e.floors[kind].table(secure) is not None for e in entries)]
    return complete if runtime is None else [kind for kind in complete if kind == runtime]


def predict(model_name: str, input_shape: Sequence[int], ratio: float, batch_size: int, profile: DeviceProfile,
            cost_model: CostModel | None = None, shard_samples: int | None = None,
            secure: bool = False) -> Prediction:
    """Peak MiB, step ms and floor MiB of ``model_name`` on ``input_shape`` at rank ``ratio`` and ``batch_size`` on
    the device described by ``profile`` (its probe score, thread count and runtime: the floor is that runtime's,
    or the larger runtime's where the profile names none), whose shard holds ``shard_samples`` samples (train +
    test; None: as many as the floors were measured with); ``cost_model`` None: the shipped one. ``secure``: the
    rounds end with the secure step: the floors measured with it where every runtime the floor is taken from has
    them at every ratio (``Prediction.secure_floor``), else the plain ones (the caller adds the step's bound)."""
    model = _shipped() if cost_model is None else cost_model
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"rank ratio must be in (0, 1], got {ratio!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    probe = _number(profile.probe_gflops, "profile probe_gflops")
    threads = profile.threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"profile threads must be a positive integer, got {threads!r}")
    key = (model_name, tuple(int(d) for d in input_shape))
    if key not in model.entries:
        known = ", ".join(f"{m} {'x'.join(map(str, s))}" for m, s in sorted(model.entries))
        raise CostModelError(f"no measurements for {model_name} {'x'.join(map(str, key[1]))}; the cost model has {known}")
    sample_mb = math.prod(key[1]) * BYTES_PER_SAMPLE_VALUE / MIB

    def shard_mb(floor_samples: int) -> float:
        return 0.0 if shard_samples is None else max(0, shard_samples - floor_samples) * sample_mb

    entries = model.entries[key]
    per_ratio = [(e.ratio, _entry_prediction(e, batch_size, threads, probe)) for e in entries]
    peak = _interpolate([(r, p.peak_mb) for r, p in per_ratio], ratio, extrapolate_above=False)
    step = _interpolate([(r, p.step_ms) for r, p in per_ratio], ratio, extrapolate_above=False)
    runtime = getattr(profile, "runtime", None)
    plain_kinds = _floor_runtimes(entries, runtime)  # secure floors count only where every runtime used has them
    measured_secure = secure and bool(plain_kinds) and _floor_runtimes(entries, runtime, secure=True) == plain_kinds
    floors = {kind: _interpolate([(e.ratio, _entry_floor(e, e.floors[kind], batch_size, shard_mb, measured_secure))
                                  for e in entries], ratio, extrapolate_above=False)
              for kind in _floor_runtimes(entries, runtime, measured_secure)}
    if not floors:
        return Prediction(peak, step)
    kind = max(floors, key=floors.__getitem__)
    return Prediction(peak, step, floors[kind], kind, measured_secure)


def peak_predictor(model_name: str, input_shape: Sequence[int], batch_size: int, profile: DeviceProfile,
                   cost_model: CostModel | None = None, shard_samples: int | None = None,
                   secure_step_mb: float | None = None) -> Callable[[float], float]:
    """``ratio -> the MiB the device needs`` (``Prediction.need_mb``: the measured floor plus margin where the cost
    model has floors, else the predicted peak) for one device: the predictor ``server.engine.rank_assignment.assign_tier``
    compares with the device's budget. ``secure_step_mb`` (under --secure-aggregation): the floors measured with
    the secure step where the cost model has them, else the need plus this bound on the step."""
    secure = secure_step_mb is not None

    def need(ratio: float) -> float:
        p = predict(model_name, input_shape, ratio, batch_size, profile, cost_model, shard_samples, secure)
        return p.need_mb + (secure_step_mb if secure and not p.secure_floor else 0.0)
    return need
