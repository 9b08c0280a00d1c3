"""The resource profile a device reports when it joins: its memory budget and limit, threads, CPU, a short probe
and the onnxruntime it trains with.

The server picks the device's rank tier from it (server/engine/rank_assignment.py) and sends artifacts of its runtime's
kind (device_runtime.artifact_contract.KINDS). The probe is
``device_runtime.probe``'s, the score the device benchmark records, so the server's cost model can scale a
measured step time to this device. numpy and the stdlib only.
"""
from __future__ import annotations

import math
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

from device_runtime.artifact_contract import KINDS, PORTABLE_KIND
from device_runtime.memory_limit import SOURCE_NONE, MemoryLimit, read_memory_limit
from device_runtime.probe import probe_gflops

MAX_FIELD_CHARS = 64
MB = 1024 * 1024


class ProfileError(ValueError):
    """A resource profile with a missing or out-of-range field."""


@dataclass(frozen=True)
class ResourceProfile:
    """What a device can spend on training and how fast it computes."""

    memory_budget_mb: float | None  # the whole device process may use this much: --memory-budget-mb, else the limit
    threads: int  # compute threads it will train with
    cpu_count: int  # logical CPUs the OS reports
    machine: str  # platform.machine(), e.g. x86_64, aarch64
    system: str  # platform.system()
    total_memory_mb: float | None  # physical memory, where the OS tells
    probe_gflops: float  # one core's float32 matmul score, measured at start (device_runtime.probe)
    memory_limit_mb: float | None = None  # what the OS enforces (device_runtime.memory_limit); None: unknown
    memory_limit_source: str = SOURCE_NONE  # where that limit was read, e.g. "cgroup1 memory.limit_in_bytes"
    runtime: str = PORTABLE_KIND  # the artifact kind it runs (device_runtime.runtimes.detect)

    def to_meta(self) -> dict[str, Any]:
        """The profile as plain JSON for a JOIN message."""
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: object) -> ResourceProfile:
        """Parse and check a profile received in a JOIN; raises ProfileError naming the bad field."""
        if not isinstance(meta, dict) or set(meta) != set(cls.__dataclass_fields__):
            got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise ProfileError(f"profile must have exactly the fields {sorted(cls.__dataclass_fields__)}, got {got}")
        return cls(memory_budget_mb=_optional_positive(meta, "memory_budget_mb"),
                   threads=_positive_int(meta, "threads"), cpu_count=_positive_int(meta, "cpu_count"),
                   machine=_short_text(meta, "machine"), system=_short_text(meta, "system"),
                   total_memory_mb=_optional_positive(meta, "total_memory_mb"),
                   probe_gflops=_positive(meta, "probe_gflops"),
                   memory_limit_mb=_optional_positive(meta, "memory_limit_mb"),
                   memory_limit_source=_short_text(meta, "memory_limit_source"), runtime=_runtime_kind(meta, "runtime"))


def _positive(meta: dict, key: str) -> float:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"profile field {key} must be a positive finite number, got {value!r:.40}")
    return float(value)


def _optional_positive(meta: dict, key: str) -> float | None:
    return None if meta[key] is None else _positive(meta, key)


def _positive_int(meta: dict, key: str) -> int:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"profile field {key} must be a positive integer, got {value!r:.40}")
    return value


def _short_text(meta: dict, key: str) -> str:
    value = meta[key]
    if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS:
        raise ProfileError(f"profile field {key} must be text of at most {MAX_FIELD_CHARS} chars, got {value!r:.40}")
    return value


def _runtime_kind(meta: dict, key: str) -> str:
    value = meta[key]
    if value not in KINDS:
        raise ProfileError(f"profile field {key} must be one of {', '.join(KINDS)}, got {value!r:.40}")
    return value


def total_memory_mb() -> float | None:
    """Physical memory in MiB, or None where the OS does not report it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MB
    except (AttributeError, ValueError, OSError):
        return None


def collect_profile(memory_budget_mb: float | None, threads: int, limit: MemoryLimit | None = None,
                    runtime: str = PORTABLE_KIND, probe_score: float | None = None) -> ResourceProfile:
    """This machine's profile with the given thread count and runtime kind. Its budget is ``memory_budget_mb``
    (the --memory-budget-mb flag) where given, else the memory ``limit`` (None: read it from the OS now); its probe
    score is ``probe_score`` where the caller measured it already (the device's main does, first: see
    ``device_runtime.probe``), else the probe runs now."""
    if memory_budget_mb is not None and not memory_budget_mb > 0:
        raise ProfileError(f"memory budget must be positive, got {memory_budget_mb}")
    if threads < 1:
        raise ProfileError(f"threads must be >= 1, got {threads}")
    if runtime not in KINDS:
        raise ProfileError(f"runtime must be one of {', '.join(KINDS)}, got {runtime!r}")
    limit = read_memory_limit() if limit is None else limit
    budget = memory_budget_mb if memory_budget_mb is not None else limit.mb
    return ResourceProfile(memory_budget_mb=budget, threads=threads, cpu_count=os.cpu_count() or 1,
                           machine=platform.machine()[:MAX_FIELD_CHARS] or "unknown",
                           system=platform.system()[:MAX_FIELD_CHARS] or "unknown",
                           total_memory_mb=total_memory_mb(),
                           probe_gflops=probe_gflops() if probe_score is None else probe_score,
                           memory_limit_mb=limit.mb, memory_limit_source=limit.source[:MAX_FIELD_CHARS],
                           runtime=runtime)
