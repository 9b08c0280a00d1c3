"""server.mqtt.cgroups: memory and CPU groups a device process is started in, what they report, and their removal.

The tests marked ``cgroup`` need root and a writable memory (or cpu) controller (``tests.conftest.needs``); the
others read fake cgroup trees."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from device_runtime.memory_limit import SOURCE_V1, SOURCE_V2
from server.mqtt.cgroups import (CgroupError, Hierarchy, MemoryEvidence, MemoryGroup, available, cpu_available,
                                 create_cpu_group, create_group, find_cpu_hierarchy, find_hierarchy, parse_cpu_limits,
                                 parse_limits, popen_in_group)
from server.mqtt.local_processes import LocalDevices
from tests.support.machine import needs

MIB = 1024 * 1024
CGROUPS = available()


def needs_cgroups(test):
    """Marks ``test`` as a cgroup test, which needs this process to make memory groups."""
    return pytest.mark.cgroup(needs(CGROUPS)(test))

ALLOCATE_200_MIB = "b = bytearray(200 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1"


@pytest.fixture
def group():
    made: list[MemoryGroup] = []

    def make(limit_mb: float) -> MemoryGroup:
        made.append(create_group("test", limit_mb))
        return made[-1]

    yield make
    for g in made:
        g.remove()


@needs_cgroups
def test_a_process_started_in_a_group_reads_the_group_limit_as_its_own(group):
    g = group(96)
    code = "from device_runtime.memory_limit import read_memory_limit as r; m = r(); print(m.mb, m.source)"
    proc = popen_in_group(g, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    limit, source = out.split(maxsplit=1)
    assert float(limit) == 96.0 and source.strip() in (SOURCE_V1, SOURCE_V2)


@needs_cgroups
def test_a_process_over_its_limit_is_oom_killed_and_the_evidence_says_so(group):
    g = group(64)
    proc = popen_in_group(g, [sys.executable, "-c", ALLOCATE_200_MIB])
    assert proc.wait(timeout=60) == -9
    evidence = g.evidence()
    assert evidence.oom_killed and evidence.peak_mb == pytest.approx(64.0, abs=1)


@needs_cgroups
def test_a_process_within_its_limit_completes_without_kills(group):
    g = group(64)
    proc = popen_in_group(g, [sys.executable, "-c", "b = bytearray(8 * 2**20)"])
    assert proc.wait(timeout=60) == 0
    evidence = g.evidence()
    assert not evidence.oom_killed and 0 < evidence.peak_mb < 64


@needs_cgroups
def test_the_child_is_charged_from_before_its_exec(group):
    g = group(64)
    proc = popen_in_group(g, [sys.executable, "-c", "import os; print(open('/proc/self/cgroup').read())"],
                          stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert g.path.name in out  # the interpreter ran in the group from its start


@needs_cgroups
def test_a_group_with_a_live_process_is_not_removed_and_the_error_names_it():
    g = create_group("busy", 64)
    proc = popen_in_group(g, [sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(CgroupError, match=str(proc.pid)):
            g.remove(timeout=0.2)
    finally:
        proc.kill()
        proc.wait()
        g.remove()
    assert not g.path.exists()


def test_v2_evidence_reads_memory_events_and_peak(tmp_path):
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 1\noom_group_kill 0\n")
    (tmp_path / "memory.peak").write_text(f"{100 * MIB}\n")
    assert MemoryGroup(tmp_path, 2, 128.0).evidence() == MemoryEvidence(oom_kills=1, limit_hits=7, peak_mb=100.0)


def test_v1_evidence_reads_oom_control_failcnt_and_max_usage(tmp_path):
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "memory.failcnt").write_text("40\n")
    (tmp_path / "memory.max_usage_in_bytes").write_text(f"{64 * MIB}\n")
    assert MemoryGroup(tmp_path, 1, 64.0).evidence() == MemoryEvidence(oom_kills=3, limit_hits=40, peak_mb=64.0)


def test_v2_is_found_where_the_unified_hierarchy_has_the_memory_controller(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/system.slice/fedara.service\n")
    (tmp_path / "cg" / "system.slice" / "fedara.service").mkdir(parents=True)
    (tmp_path / "cg" / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert find_hierarchy(tmp_path / "cg", tmp_path / "proc") == Hierarchy(
        2, tmp_path / "cg" / "system.slice" / "fedara.service")


def test_v1_is_found_at_the_memory_controller_mount(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")
    (tmp_path / "cg" / "memory" / "job").mkdir(parents=True)
    (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert find_hierarchy(tmp_path / "cg", tmp_path / "proc") == Hierarchy(1, tmp_path / "cg" / "memory" / "job")


def test_no_memory_controller_is_no_hierarchy(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/\n")
    assert find_hierarchy(tmp_path / "cg", tmp_path / "proc") is None


def test_a_group_is_made_with_its_limit_on_a_v2_tree(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("")
    made = create_group("dev_000", 128, Hierarchy(2, tmp_path))
    assert made.path.parent == tmp_path and made.path.name.endswith("-dev_000")
    assert (made.path / "memory.max").read_text() == str(128 * MIB)
    assert "+memory" in (tmp_path / "cgroup.subtree_control").read_text()


def test_a_non_positive_limit_is_refused():
    with pytest.raises(CgroupError, match="positive"):
        create_group("dev_000", 0, Hierarchy(1, "/nonexistent"))


def test_limits_parse_as_comma_separated_mib():
    assert parse_limits("128,192,256") == [128.0, 192.0, 256.0]


@pytest.mark.parametrize("text", ["128,,256", "big", "128,-1"])
def test_bad_limits_are_refused_naming_the_text(text):
    with pytest.raises(ValueError, match=text):
        parse_limits(text)


# -- CPU groups ----------------------------------------------------------------------------------

CPU_CGROUPS = cpu_available()


def test_v1_cpu_hierarchy_is_found_at_the_cpu_controller_mount(tmp_path):
    (tmp_path / "cg" / "cpu" / "job").mkdir(parents=True)
    (tmp_path / "cg" / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("4:memory:/other\n3:cpu,cpuacct:/job\n0::/\n")
    assert find_cpu_hierarchy(tmp_path / "cg", tmp_path / "proc") == Hierarchy(1, tmp_path / "cg" / "cpu" / "job")


def test_a_cpu_group_is_made_with_its_quota_in_cpu_max_on_a_v2_tree(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")
    group = create_cpu_group("dev", 0.5, Hierarchy(2, tmp_path))
    assert (group.path / "cpu.max").read_text() == "50000 100000" and group.limit() == (50_000, 100_000)


@pytest.mark.parametrize("text", ["1,,0.5", "fast", "1,0", "0.001", "nan"])
def test_bad_cpu_limits_are_refused_naming_the_text(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_cpu_limits(text)


@pytest.mark.cgroup
@needs(CPU_CGROUPS)
def test_a_local_device_process_runs_in_its_cpu_group_with_that_quota(tmp_path):
    group = create_cpu_group("test-dev", 0.25)
    devices = LocalDevices()
    devices.spawn("dev_000", [sys.executable, "-c", "import signal\nwhile True: signal.pause()"], tmp_path / "dev.log",
                  cpu_group=group)  # the path --local-cpu-limit's devices take; it runs until stopped
    pid = devices.processes["dev_000"].pid
    try:
        assert devices.processes["dev_000"].poll() is None
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        cpu_line = next(line for line in lines if "cpu" in line.split(":")[1].split(",") or line.startswith("0::"))
        assert group.path.as_posix().endswith(cpu_line.split(":", 2)[2])
        assert pid in [int(p) for p in group.procs_file.read_text().split()]
        assert group.limit() == (25_000, 100_000)
    finally:
        devices.stop()
    assert not group.path.exists()
