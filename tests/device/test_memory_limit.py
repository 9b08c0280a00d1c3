"""The device's memory limit, read from fake /proc and /sys/fs/cgroup trees, and the profile that reports it."""
from __future__ import annotations

from pathlib import Path

import pytest

from device_runtime.memory_limit import (SOURCE_MEMINFO, SOURCE_NONE, SOURCE_V1, SOURCE_V2, MemoryLimit,
                                         read_memory_limit)
from device_runtime.profile import ProfileError, ResourceProfile, collect_profile

MIB = 1024 * 1024
V1_UNLIMITED = "9223372036854771712"
MEMINFO = "MemTotal:       32000000 kB\nMemFree:        1000 kB\nMemAvailable:    2097152 kB\n"  # 2048 MiB


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_proc(root: Path, cgroup_lines: str, meminfo: str = MEMINFO) -> Path:
    write(root / "proc" / "self" / "cgroup", cgroup_lines)
    write(root / "proc" / "meminfo", meminfo)
    return root / "proc"


def read(tmp_path: Path) -> MemoryLimit:
    return read_memory_limit(tmp_path / "proc", tmp_path / "cg")


def test_v2_group_limit_is_read_from_memory_max(tmp_path):
    fake_proc(tmp_path, "0::/system.slice/fedara.service\n")
    write(tmp_path / "cg" / "system.slice" / "fedara.service" / "memory.max", f"{128 * MIB}\n")
    assert read(tmp_path) == MemoryLimit(128.0, SOURCE_V2)


def test_v2_parent_limit_binds_a_child_with_max(tmp_path):
    fake_proc(tmp_path, "0::/box/agent\n")
    write(tmp_path / "cg" / "box" / "memory.max", f"{96 * MIB}\n")
    write(tmp_path / "cg" / "box" / "agent" / "memory.max", "max\n")
    assert read(tmp_path) == MemoryLimit(96.0, SOURCE_V2)


def test_v2_unlimited_everywhere_falls_back_to_mem_available(tmp_path):
    fake_proc(tmp_path, "0::/user.slice\n")
    write(tmp_path / "cg" / "user.slice" / "memory.max", "max\n")
    assert read(tmp_path) == MemoryLimit(2048.0, SOURCE_MEMINFO)


def test_v2_in_a_cgroup_namespace_reads_the_mount_root(tmp_path):
    fake_proc(tmp_path, "0::/\n")
    write(tmp_path / "cg" / "memory.max", f"{200 * MIB}\n")
    assert read(tmp_path) == MemoryLimit(200.0, SOURCE_V2)


def test_v1_memory_controller_limit_is_read(tmp_path):
    fake_proc(tmp_path, "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n")
    write(tmp_path / "cg" / "memory" / "memory.limit_in_bytes", V1_UNLIMITED)
    write(tmp_path / "cg" / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{192 * MIB}\n")
    assert read(tmp_path) == MemoryLimit(192.0, SOURCE_V1)


def test_v1_huge_unlimited_value_is_no_limit(tmp_path):
    fake_proc(tmp_path, "4:memory:/docker/abc\n")
    for group in ("", "docker", "docker/abc"):
        write(tmp_path / "cg" / "memory" / group / "memory.limit_in_bytes", V1_UNLIMITED)
    assert read(tmp_path) == MemoryLimit(2048.0, SOURCE_MEMINFO)


def test_v1_host_path_missing_under_the_mount_reads_the_mount_root(tmp_path):
    fake_proc(tmp_path, "4:memory:/kubepods/pod1/ctr\n")
    write(tmp_path / "cg" / "memory" / "memory.limit_in_bytes", f"{64 * MIB}\n")
    assert read(tmp_path) == MemoryLimit(64.0, SOURCE_V1)


def test_hybrid_system_without_a_v2_memory_controller_uses_v1(tmp_path):
    fake_proc(tmp_path, "4:memory:/job\n0::/job\n")
    write(tmp_path / "cg" / "unified" / "job" / "cgroup.procs", "")
    write(tmp_path / "cg" / "memory" / "job" / "memory.limit_in_bytes", f"{128 * MIB}\n")
    assert read(tmp_path) == MemoryLimit(128.0, SOURCE_V1)


def test_nothing_readable_reports_no_limit(tmp_path):
    assert read(tmp_path) == MemoryLimit(None, SOURCE_NONE)


def test_profile_budget_defaults_to_the_limit():
    profile = collect_profile(None, 1, limit=MemoryLimit(128.0, SOURCE_V1))
    assert (profile.memory_budget_mb, profile.memory_limit_mb, profile.memory_limit_source) == (128.0, 128.0, SOURCE_V1)


def test_budget_flag_overrides_the_limit():
    profile = collect_profile(96.0, 1, limit=MemoryLimit(128.0, SOURCE_V1))
    assert (profile.memory_budget_mb, profile.memory_limit_mb) == (96.0, 128.0)


def test_profile_with_its_limit_round_trips_through_a_join():
    profile = collect_profile(None, 1, limit=MemoryLimit(128.0, SOURCE_V2))
    assert ResourceProfile.from_meta(profile.to_meta()) == profile


def test_profile_with_a_negative_limit_is_refused():
    meta = collect_profile(None, 1, limit=MemoryLimit(128.0, SOURCE_V1)).to_meta()
    with pytest.raises(ProfileError, match="memory_limit_mb"):
        ResourceProfile.from_meta(dict(meta, memory_limit_mb=-1))


def test_profile_without_a_limit_source_is_refused():
    meta = collect_profile(None, 1, limit=MemoryLimit(128.0, SOURCE_V1)).to_meta()
    del meta["memory_limit_source"]
    with pytest.raises(ProfileError, match="memory_limit_source"):
        ResourceProfile.from_meta(meta)
