"""A board's data may be larger than its memory: a device in a 128 MB memory cgroup trains a round on a 147 MB shard
(device_runtime.shard memory-maps the images; each step gathers its batch from the mapped file, and the kernel drops
clean pages under pressure). Reading the shard whole, as np.load does, cannot fit: the file alone exceeds the limit.

Needs root and a writable memory controller (server.mqtt.cgroups.available).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.shard import Shard, save_shard
from export.artifacts import build_artifacts_of_kind
from fedcore.lowrank import RankPlan, resolve_plan
from fedcore.models import build_model
from server.mqtt.cgroups import MIB, available, create_group, popen_in_group
from tests.support.machine import needs
from tests.support.processes import child_env

CGROUPS = available()
pytestmark = [pytest.mark.cgroup, pytest.mark.slow, needs(CGROUPS)]

ROOT = Path(__file__).resolve().parents[2]
MODEL, INPUT_SHAPE, NUM_CLASSES, RATIO = "fedavgcnn", (3, 32, 32), 10, 0.125
LIMIT_MB = 128
# 147 MB of float32 3×32×32 images. A step gathers its batch from pages the kernel keeps dropping under the limit
# (~40 MB of page cache beside the runtime's ~90 MB): 48 000 samples of 1×28×28 (one page each) took over 15 min
# of page faults on a loaded 2-core machine; 12 KB samples need a quarter of the faults for the same bytes.
TRAIN_SAMPLES = 12_000
BATCH_SIZE = 64
RUN_TIMEOUT_S = 1800


def write_shard(path: Path) -> None:
    """The shard, written and then dropped from the page cache: the device's reads are charged to its own group
    (pages this process wrote would stay charged to this process's group)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((TRAIN_SAMPLES, *INPUT_SHAPE), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, TRAIN_SAMPLES).astype(np.int64)
    save_shard(path, Shard(x, y, x[:64].copy(), y[:64].copy(), NUM_CLASSES))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.timeout(2700)  # the artifact build alone takes minutes on a loaded 2-core machine
def test_a_device_trains_a_round_on_a_shard_larger_than_its_memory_cgroup(tmp_path: Path):
    model = build_model(MODEL, INPUT_SHAPE, NUM_CLASSES, seed=0)
    artifacts = build_artifacts_of_kind(PORTABLE_KIND, model, resolve_plan(model, RankPlan(RATIO)).ranks,
                                        INPUT_SHAPE, NUM_CLASSES, tmp_path / "cache").directory
    shard = tmp_path / "big.npz"
    write_shard(shard)
    assert shard.stat().st_size > LIMIT_MB * MIB
    group = create_group("bigshard", LIMIT_MB)
    proc = popen_in_group(group, [sys.executable, "-m", "tests.support.confined_device", str(shard)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env=child_env(repo_on_path=True, OMP_NUM_THREADS="1"))
    try:
        profile = json.loads(proc.stdout.readline())["profile"]
        plan = dict(artifacts=str(artifacts), rounds=1, batch_size=BATCH_SIZE)
        out, err = proc.communicate(json.dumps(plan) + "\n", timeout=RUN_TIMEOUT_S)
        evidence = group.evidence()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        group.remove()
    assert proc.returncode == 0, err[-3000:]
    assert evidence.oom_kills == 0
    assert profile["memory_limit_mb"] <= LIMIT_MB
    assert json.loads(out.strip().splitlines()[-1])["rounds"] == 1
