"""Memory cgroups for device processes started on this machine: a board's memory limit, enforced by the kernel.

A device process started inside a group of L MiB sees L as its limit (device_runtime.memory_limit reads it) and
is OOM-killed when it goes over, as it would be on a board under systemd or in a container. This module creates a
group, starts a process inside it, reads what happened (peak usage, limit hits, OOM kills) and removes the group.

Groups are made under this process's own memory cgroup (so every limit above it still applies, and a supervisor
that accounts for this process accounts for its devices too), named ``fedara-<pid>-<name>``:
- cgroup v1 (the memory controller mounted at ``/sys/fs/cgroup/memory``): ``memory.limit_in_bytes``, and the
  same in ``memory.memsw.limit_in_bytes`` where swap accounting exists, so the limit means RAM;
- cgroup v2 (``/sys/fs/cgroup`` with ``memory`` in ``cgroup.controllers``): ``memory.max`` and ``memory.swap.max``
  0. A v2 group can hold child groups with controllers only while it holds no process itself, so on v2 the server
  must run in a delegated group whose ``memory`` controller it may enable (systemd ``Delegate=yes``), or as root
  in the root group; ``available()`` says why not where it cannot.
A process enters its group between fork and exec (``enter_hook``): from its first byte it is charged to the group.
Writing the child's pid after spawn instead would leave a window in which the child runs, and allocates, outside.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_PREFIX = "fedara"
REMOVE_TIMEOUT_S = 5.0
REMOVE_POLL_S = 0.05
PROBE_LIMIT_MB = 64


class CgroupError(RuntimeError):
    """A memory cgroup could not be created, entered, read or removed; the message says what to change."""


@dataclass(frozen=True)
class Hierarchy:
    """Where memory groups are made: cgroup ``version`` 1 or 2, and the group new groups go under."""

    version: int
    parent: Path


@dataclass(frozen=True)
class MemoryEvidence:
    """What a group saw: OOM kills, times usage hit the limit, and peak usage (MiB; None where not reported)."""

    oom_kills: int
    limit_hits: int
    peak_mb: float | None

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0


def _own_path(proc_root: Path, v2: bool, controller: str = "memory") -> str | None:
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (v2 and hierarchy == "0" and controllers == "") or (not v2 and controller in controllers.split(",")):
            return path
    return None


def find_hierarchy(cgroup_root: Path = CGROUP_ROOT, proc_root: Path = Path("/proc")) -> Hierarchy | None:
    """This machine's memory-cgroup hierarchy and this process's group in it; None where it has none.
    v2 where the unified hierarchy has the memory controller, else v1's memory controller."""
    if "memory" in _read(cgroup_root / "cgroup.controllers").split():
        path = _own_path(proc_root, v2=True)
        if path is not None:
            return Hierarchy(2, cgroup_root / path.lstrip("/"))
    mount = cgroup_root / "memory"
    path = _own_path(proc_root, v2=False)
    if (mount / "memory.limit_in_bytes").exists() and path is not None:
        own = mount / path.lstrip("/")
        return Hierarchy(1, own if own.is_dir() else mount)
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise CgroupError(f"cannot write {text.strip()!r} to {path}: {exc.strerror or exc}") from None


def _counter(text: str, key: str) -> int:
    """The value of ``key N`` in a flat-keyed cgroup file (memory.events, memory.oom_control); 0 where absent."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == key:
            return int(fields[1])
    return 0


@dataclass(frozen=True)
class Group:
    """One cgroup (v1 or v2) at ``path``: its processes, and its removal."""

    path: Path
    version: int

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and the threads and children it makes from now on) into the group."""
        _write(self.procs_file, f"{pid}\n")

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.procs_file).split()]

    def remove(self, timeout: float = REMOVE_TIMEOUT_S) -> None:
        """Remove the group once its processes have exited (waits up to ``timeout`` s for the kernel to let them
        go); raises CgroupError naming those still inside. Stop them first: this never kills."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise CgroupError(f"cannot remove {self.path}: {exc.strerror or exc}; processes still inside: "
                                      f"{self.pids()}") from None
            time.sleep(REMOVE_POLL_S)


@dataclass(frozen=True)
class MemoryGroup(Group):
    """One memory cgroup with a limit of ``limit_mb`` MiB."""

    limit_mb: float

    def evidence(self) -> MemoryEvidence:
        """OOM kills, limit hits and peak usage so far (v1: memory.oom_control, memory.failcnt or, with swap
        accounting, memory.memsw.failcnt, memory.max_usage_in_bytes; v2: memory.events oom_kill and max,
        memory.peak where the kernel has it)."""
        if self.version == 1:
            peak = _read(self.path / "memory.max_usage_in_bytes").strip()
            hits = max(int(_read(self.path / name).strip() or 0) for name in ("memory.failcnt", "memory.memsw.failcnt"))
            return MemoryEvidence(_counter(_read(self.path / "memory.oom_control"), "oom_kill"), hits,
                                  int(peak) / MIB if peak else None)
        events = _read(self.path / "memory.events")
        peak = _read(self.path / "memory.peak").strip()
        return MemoryEvidence(_counter(events, "oom_kill"), _counter(events, "max"), int(peak) / MIB if peak else None)


def _new_group_dir(found: Hierarchy, name: str, controller: str) -> Path:
    """The directory of a new group ``fedara-<pid>-<name>`` under ``found``, ``controller`` handed down to it (v2);
    CgroupError saying what it needs."""
    if found.version == 2 and controller not in _read(found.parent / "cgroup.subtree_control").split():
        try:
            _write(found.parent / "cgroup.subtree_control", f"+{controller}")
        except CgroupError as exc:
            raise CgroupError(f"{exc} (cgroup v2 lets a group hand controllers to child groups only while it holds no "
                              "process: run the server in a delegated group of its own, e.g. "
                              "systemd-run --scope -p Delegate=yes ...)") from None
    path = found.parent / f"{GROUP_PREFIX}-{os.getpid()}-{name}"
    try:
        path.mkdir()
    except OSError as exc:
        raise CgroupError(f"cannot create {controller} cgroup {path}: {exc.strerror or exc} (needs root and a "
                          f"writable {controller} controller)") from None
    return path


def create_group(name: str, limit_mb: float, hierarchy: Hierarchy | None = None) -> MemoryGroup:
    """A new memory group ``fedara-<pid>-<name>`` limited to ``limit_mb`` MiB (swap included: none allowed)
    under ``hierarchy`` (None: this machine's, find_hierarchy()). Raises CgroupError saying what to change."""
    if not limit_mb > 0:
        raise CgroupError(f"a memory limit must be positive, got {limit_mb} MiB")
    found = hierarchy or find_hierarchy()
    if found is None:
        raise CgroupError("this machine has no memory cgroup controller (neither cgroup v2 with 'memory' in "
                          f"{CGROUP_ROOT}/cgroup.controllers nor v1 at {CGROUP_ROOT}/memory)")
    path = _new_group_dir(found, name, "memory")
    group = MemoryGroup(path, found.version, float(limit_mb))
    limit = str(int(limit_mb * MIB))
    try:
        if found.version == 1:
            _write(path / "memory.limit_in_bytes", limit)
            if (path / "memory.memsw.limit_in_bytes").exists():
                _write(path / "memory.memsw.limit_in_bytes", limit)
        else:
            _write(path / "memory.max", limit)
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
    except CgroupError:
        group.remove()
        raise
    return group


def available(hierarchy: Hierarchy | None = None) -> str | None:
    """None where this process can confine processes in memory groups; else why not, in words a user can act on.
    Tries it: creates a group, sets a limit, removes it."""
    if os.geteuid() != 0:
        return "memory cgroups need root (run the server as root, or pass no memory limits)"
    try:
        create_group("probe", PROBE_LIMIT_MB, hierarchy).remove()
    except CgroupError as exc:
        return str(exc)
    return None


def enter_hook(group: Group, then: Callable[[], object] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for subprocess.Popen that moves the child into ``group`` before it execs, then calls
    ``then`` (another preexec hook, e.g. a parent-death signal). Only os-level calls: it runs in a forked child."""
    procs = os.fsencode(group.procs_file)

    def hook() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0\n")  # "0": the writing process itself
        finally:
            os.close(fd)
        if then is not None:
            then()

    return hook


def popen_in_group(group: Group, command: Sequence[str], *, preexec_fn: Callable[[], object] | None = None,
                   **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(command, ...) with the child inside ``group`` from before its exec; ``preexec_fn`` runs
    after it has entered. A child that cannot enter fails to start (SubprocessError), nothing runs unconfined."""
    return subprocess.Popen(list(command), preexec_fn=enter_hook(group, preexec_fn), **popen_kwargs)


def parse_limits(text: str) -> list[float]:
    """``"128,192,256"`` -> [128.0, 192.0, 256.0] (MiB); ValueError names the bad value."""
    try:
        limits = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"memory limits must be comma-separated MiB such as 128,192,256, got {text!r}") from None
    if not all(limit > 0 for limit in limits):
        raise ValueError(f"memory limits must be positive MiB, got {text!r}")
    return limits


# -- CPU groups: a board's cores ---------------------------------------------------------------
# A device process in a CPU group of c cores gets at most c·period of CPU time per period (the kernel's CFS
# bandwidth limit: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), so a slow board is
# really slow, not slept. Made like the memory groups: under this process's own group, entered before exec.

CPU_PERIOD_US = 100_000
MIN_CPU_CORES = 0.01
"""The kernel's smallest quota is 1 ms a period: 0.01 core at a 100 ms period."""


@dataclass(frozen=True)
class CpuGroup(Group):
    """One CPU cgroup limited to ``cores`` cores (``quota_us`` µs of CPU time per ``CPU_PERIOD_US``)."""

    cores: float

    @property
    def quota_us(self) -> int:
        return cpu_quota_us(self.cores)

    def limit(self) -> tuple[int, int]:
        """(quota µs, period µs) as the kernel reads them now (v2 ``cpu.max``, v1 the cfs files); quota −1: none."""
        if self.version == 2:
            quota, period = _read(self.path / "cpu.max").split()
            return (-1 if quota == "max" else int(quota)), int(period)
        return int(_read(self.path / "cpu.cfs_quota_us")), int(_read(self.path / "cpu.cfs_period_us"))


def cpu_quota_us(cores: float, period_us: int = CPU_PERIOD_US) -> int:
    """CPU time per period of a limit of ``cores`` cores, in µs."""
    return int(round(cores * period_us))


def find_cpu_hierarchy(cgroup_root: Path = CGROUP_ROOT, proc_root: Path = Path("/proc")) -> Hierarchy | None:
    """This machine's CPU-cgroup hierarchy and this process's group in it (v2 with ``cpu`` in the unified
    hierarchy's controllers, else v1's cpu controller); None where it has none."""
    if "cpu" in _read(cgroup_root / "cgroup.controllers").split():
        path = _own_path(proc_root, v2=True)
        if path is not None:
            return Hierarchy(2, cgroup_root / path.lstrip("/"))
    mount = cgroup_root / "cpu"
    path = _own_path(proc_root, v2=False, controller="cpu")
    if (mount / "cpu.cfs_quota_us").exists() and path is not None:
        own = mount / path.lstrip("/")
        return Hierarchy(1, own if own.is_dir() else mount)
    return None


def create_cpu_group(name: str, cores: float, hierarchy: Hierarchy | None = None) -> CpuGroup:
    """A new CPU group ``fedara-<pid>-<name>`` of ``cores`` cores under ``hierarchy`` (None: this machine's).
    Raises CgroupError saying what to change."""
    if not cores >= MIN_CPU_CORES:
        raise CgroupError(f"a CPU limit must be at least {MIN_CPU_CORES:g} core, got {cores}")
    found = hierarchy or find_cpu_hierarchy()
    if found is None:
        raise CgroupError("this machine has no CPU cgroup controller (neither cgroup v2 with 'cpu' in "
                          f"{CGROUP_ROOT}/cgroup.controllers nor v1 at {CGROUP_ROOT}/cpu)")
    path = _new_group_dir(found, name, "cpu")
    group = CpuGroup(path, found.version, float(cores))
    try:
        if found.version == 2:
            _write(path / "cpu.max", f"{group.quota_us} {CPU_PERIOD_US}")
        else:
            _write(path / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(group.quota_us))
    except CgroupError:
        group.remove()
        raise
    return group


def cpu_available(hierarchy: Hierarchy | None = None) -> str | None:
    """None where this process can put processes in CPU groups; else why not. Tries it."""
    if os.geteuid() != 0:
        return "CPU cgroups need root (run the server as root, or pass no CPU limits)"
    try:
        create_cpu_group("probe", 1.0, hierarchy).remove()
    except CgroupError as exc:
        return str(exc)
    return None


def parse_cpu_limits(text: str) -> list[float]:
    """``"1,0.5,0.1"`` -> [1.0, 0.5, 0.1] (cores); ValueError names the bad value."""
    try:
        limits = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"CPU limits must be comma-separated cores such as 1,0.5,0.1, got {text!r}") from None
    if not all(limit >= MIN_CPU_CORES for limit in limits):  # also NaN
        raise ValueError(f"CPU limits must be at least {MIN_CPU_CORES:g} core each, got {text!r}")
    return limits
