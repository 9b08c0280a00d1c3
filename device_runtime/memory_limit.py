"""The memory this device process may use, as the operating system enforces it: its cgroup's limit, else MemAvailable.

A board runs the agent under systemd or in a container, which confine it to a memory cgroup; over that limit the
kernel OOM-kills it. The effective limit is the smallest limit on the path from the process's own cgroup up to the
root of the mounted hierarchy (a parent's limit binds its children too):
- cgroup v2: ``memory.max`` ("max": no limit) of the unified hierarchy, the ``0::PATH`` line of /proc/self/cgroup;
- cgroup v1: ``memory.limit_in_bytes`` of the memory controller's hierarchy (``N:memory:PATH``); an unlimited group
  reports a huge number (PAGE_COUNTER_MAX pages, 9223372036854771712 on x86_64), which counts as no limit;
- neither: ``MemAvailable`` from /proc/meminfo, what the process could get now without swapping.
Inside a cgroup namespace /proc/self/cgroup says ``/`` and the mount is the process's own group; where the path it
names does not exist under the mount (a container that sees the host's path), the mount's root is the group.
The stdlib only: roots are parameters, so tests read fake trees.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
UNLIMITED_BYTES = 1 << 60  # v1 limits at or above this are "no limit" (the kernel's is ~2**63)
SOURCE_V2 = "cgroup2 memory.max"
SOURCE_V1 = "cgroup1 memory.limit_in_bytes"
SOURCE_MEMINFO = "meminfo MemAvailable"
SOURCE_NONE = "none"
SOURCES = (SOURCE_V2, SOURCE_V1, SOURCE_MEMINFO, SOURCE_NONE)


@dataclass(frozen=True)
class MemoryLimit:
    """The limit in MiB (None: nothing reports one) and where it was read."""

    mb: float | None
    source: str


def _cgroup_paths(proc_root: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process from /proc/self/cgroup; None where it is in no such hierarchy."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    v2 = v1 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _own_group(mount: Path, path: str) -> Path:
    """The directory of the group ``path`` names under ``mount``; the mount itself where it lacks that path."""
    group = mount / path.lstrip("/")
    return group if group.is_dir() else mount


def _read_bytes(path: Path, unlimited_word: str | None) -> int | None:
    """The integer in a limit file; None when it is missing, unreadable, the ``unlimited_word`` or unlimited."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == unlimited_word:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < UNLIMITED_BYTES else None


def _smallest_limit(mount: Path, path: str, filename: str, unlimited_word: str | None) -> int | None:
    """The smallest limit in ``filename`` from the process's own group up to the mount's root; None: none set."""
    group = _own_group(mount, path)
    limits = []
    while True:
        limit = _read_bytes(group / filename, unlimited_word)
        if limit is not None:
            limits.append(limit)
        if group == mount or mount not in group.parents:
            break
        group = group.parent
    return min(limits, default=None)


def mem_available_bytes(proc_root: Path) -> int | None:
    """MemAvailable from ``proc_root``/meminfo in bytes; None where the kernel does not report it."""
    try:
        lines = (proc_root / "meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            fields = line.split()
            try:
                return int(fields[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def read_memory_limit(proc_root: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup") -> MemoryLimit:
    """This process's memory limit: cgroup v2, then v1, then MemAvailable (see the module docstring).

    ``cgroup_root`` is where the hierarchies are mounted: the unified (v2) hierarchy at the root itself (or at
    ``unified/`` on a hybrid system) and the v1 memory controller at ``memory/``."""
    proc_root, cgroup_root = Path(proc_root), Path(cgroup_root)
    v2_path, v1_path = _cgroup_paths(proc_root)
    if v2_path is not None:
        for mount in (cgroup_root, cgroup_root / "unified"):
            limit = _smallest_limit(mount, v2_path, "memory.max", "max")
            if limit is not None:
                return MemoryLimit(limit / MIB, SOURCE_V2)
    if v1_path is not None:
        limit = _smallest_limit(cgroup_root / "memory", v1_path, "memory.limit_in_bytes", None)
        if limit is not None:
            return MemoryLimit(limit / MIB, SOURCE_V1)
    available = mem_available_bytes(proc_root)
    if available is not None:
        return MemoryLimit(available / MIB, SOURCE_MEMINFO)
    return MemoryLimit(None, SOURCE_NONE)
