"""A device process in a fresh memory cgroup, driven from a test: ``tests/support/confined_device.py`` run under a
given interpreter inside a group of ``limit_mb``, which reports its profile, then does the rounds it is handed."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from device_runtime.profile import ResourceProfile
from server.mqtt.cgroups import create_group, popen_in_group
from tests.support.processes import REPO_ROOT, child_env

RUN_TIMEOUT_S = 240
"""How long a confined device's rounds may take (two rounds of a small shard, on a loaded machine)."""


class ConfinedDevice:
    """The device in its group: ``profile()`` (what it read of its limit), then ``train(artifacts)`` (its rounds)."""

    def __init__(self, group_name: str, shard_path: Path, limit_mb: float, *, rounds: int, batch_size: int,
                 python: str = sys.executable, runtime: str | None = None) -> None:
        self.rounds, self.batch_size = rounds, batch_size
        self.group = create_group(group_name, limit_mb)
        command = [python, "-m", "tests.support.confined_device", str(shard_path)]
        command += ["--runtime", runtime] if runtime else []
        self.proc = popen_in_group(self.group, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                   env=child_env(drop=("VIRTUAL_ENV",), repo_on_path=True, OMP_NUM_THREADS="1"))

    def profile(self) -> ResourceProfile:
        return ResourceProfile.from_meta(json.loads(self.proc.stdout.readline())["profile"])

    def train(self, artifacts: str | Path) -> tuple[int, dict | None, str]:
        """Send the plan; (exit status, its result or None, stderr) once it has exited."""
        plan = dict(artifacts=str(artifacts), rounds=self.rounds, batch_size=self.batch_size)
        out, err = self.proc.communicate(json.dumps(plan) + "\n", timeout=RUN_TIMEOUT_S)
        lines = out.strip().splitlines()
        return self.proc.returncode, json.loads(lines[-1]) if lines else None, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.group.remove()


@contextlib.contextmanager
def confined_devices(group_name: str, shard_path: Path, **options: Any) -> Iterator[Callable[[float], ConfinedDevice]]:
    """``start(limit_mb)`` starts a ConfinedDevice of these options in a group of that limit; all are closed at the end
    (a test's fixture yields ``start``)."""
    devices: list[ConfinedDevice] = []

    def start(limit_mb: float) -> ConfinedDevice:
        devices.append(ConfinedDevice(group_name, shard_path, limit_mb, **options))
        return devices[-1]

    try:
        yield start
    finally:
        for device in devices:
            device.close()
