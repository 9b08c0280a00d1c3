"""Device and aggregator processes the broker loop starts on this machine (``--local-devices``, ``--aggregators``):
their command lines, each device in its memory and CPU cgroups where it has them, a device killed for memory started again
at a lower tier, and every child stopped (SIGTERM, then SIGKILL) with the server, even when it dies by SIGKILL."""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from server.mqtt import cgroups

LOG = logging.getLogger("fedara.server")
DEVICE_STOP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1
MAX_OOM_RESTARTS = 2


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that makes the child get SIGTERM when the server dies, even by SIGKILL (Linux only).

    prctl is looked up here, in the parent: the hook runs between fork and exec, where loading a library
    could deadlock on a lock another thread held at fork time."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalDevices:
    """Device processes spawned on this machine, one per shard, each in its memory and CPU cgroups where it has them
    (``what="aggregator"``: the local aggregator processes, no cgroups).

    A device the kernel killed for memory is started again (as systemd's Restart= would on a board), at most
    ``MAX_OOM_RESTARTS`` times: it rejoins, and ``on_oom`` (the engine's demote) gives it a lower tier than the one
    it died at. One killed before it had a tier, or at the lowest, is not restarted (no tier fits its limit): it is
    named once, and ``out_of_memory`` holds it."""

    def __init__(self, what: str = "device", on_oom: Callable[[str, str], bool] | None = None) -> None:
        self.what = what
        self.on_oom = on_oom
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.groups: dict[str, cgroups.MemoryGroup] = {}
        self.cpu_groups: dict[str, cgroups.CpuGroup] = {}
        self._commands: dict[str, list[str]] = {}
        self._restarts: dict[str, int] = {}
        self._reported: set[str] = set()
        self.out_of_memory: set[str] = set()  # killed at their memory limit with no lower tier to restart at
        self._pre_exec = _parent_death_signal()

    def spawn(self, device_id: str, command: list[str], log_path: Path,
              group: cgroups.MemoryGroup | None = None, env: dict[str, str] | None = None,
              cpu_group: cgroups.CpuGroup | None = None) -> None:
        repo = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        if group is not None:
            self.groups[device_id] = group
        if cpu_group is not None:
            self.cpu_groups[device_id] = cpu_group
        pre_exec = self._pre_exec
        for entered in (self.cpu_groups.get(device_id), self.groups.get(device_id)):  # memory first, then CPU
            if entered is not None:
                pre_exec = cgroups.enter_hook(entered, pre_exec)
        with open(log_path, "ab") as log:
            self.processes[device_id] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=pre_exec)
        self.logs[device_id], self._commands[device_id] = log_path, command

    def check(self) -> bool:
        """Log each device that exited (once), restart one killed for memory; returns whether any runs."""
        for device_id, proc in list(self.processes.items()):
            if proc.poll() is None or device_id in self._reported:
                continue
            group = self.groups.get(device_id)
            evidence = group.evidence() if group is not None else None
            killed = evidence is not None and evidence.oom_killed
            lower = killed and self.on_oom is not None and bool(
                self.on_oom(device_id, f"was killed at its {group.limit_mb:g} MiB memory limit"))
            if killed and not lower:
                self._reported.add(device_id)
                self.out_of_memory.add(device_id)
                LOG.error("local %s %s was killed at its %g MiB memory limit (peak %s MiB) before it had a tier, or "
                          "at the lowest: no tier fits; raise --local-memory-limit-mb", self.what, device_id,
                          group.limit_mb, evidence.peak_mb)
                continue
            if lower and self._restarts.get(device_id, 0) < MAX_OOM_RESTARTS:
                self._restarts[device_id] = self._restarts.get(device_id, 0) + 1
                LOG.warning("local device %s was killed at its %g MiB memory limit (peak %s MiB): starting it "
                            "again at a lower tier", device_id, group.limit_mb, evidence.peak_mb)
                group.remove()  # a fresh group: nothing the killed process left is charged to its successor
                self.groups[device_id] = cgroups.create_group(f"{device_id}-{self._restarts[device_id]}", group.limit_mb)
                self.spawn(device_id, self._commands[device_id], self.logs[device_id])
                continue
            self._reported.add(device_id)
            LOG.warning("local %s %s exited with status %s (log: %s)", self.what, device_id, proc.returncode,
                        self.logs[device_id])
        return any(proc.poll() is None for proc in self.processes.values())

    def stop(self, timeout: float = DEVICE_STOP_TIMEOUT_S) -> None:
        """SIGTERM every device, then SIGKILL those still running after ``timeout`` seconds; remove their groups."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
                proc.send_signal(signal.SIGCONT)  # a stopped device (SIGSTOP: a board that hangs) takes its SIGTERM
        deadline = time.monotonic() + timeout
        for device_id, proc in self.processes.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                LOG.warning("local %s %s ignored SIGTERM; killing it", self.what, device_id)
                proc.kill()
                proc.wait()
        for device_id, group in self.groups.items():  # what the kernel charged: the figure a predicted need is held to
            try:
                LOG.info("local %s %s: cgroup peak %s MiB under its %g MiB limit", self.what, device_id,
                         group.evidence().peak_mb, group.limit_mb)
            except cgroups.CgroupError as exc:
                LOG.warning("%s", exc)
        for group in [*self.groups.values(), *self.cpu_groups.values()]:
            try:
                group.remove()
            except cgroups.CgroupError as exc:
                LOG.warning("%s", exc)


def device_command(args: argparse.Namespace, url: str, device_id: str, shard: Path, workdir: Path,
                   budget: float | None, key_file: Path, max_message_bytes: int) -> list[str]:
    command = [sys.executable, "-m", "device_runtime", "--broker", url, "--device-id", device_id, "--data", str(shard),
               "--workdir", str(workdir), "--threads", str(args.threads), "--prefix", args.prefix,
               "--max-message-bytes", str(max_message_bytes),
               "--key-file", str(key_file)]
    if budget is not None:
        command += ["--memory-budget-mb", str(budget)]
    if args.tls_ca:
        command += ["--tls-ca", args.tls_ca]
    return command


def aggregator_command(args: argparse.Namespace, url: str, name: str, enrollment: Path, workdir: Path) -> list[str]:
    """A local aggregator process (its MQTT password, if any, goes through the environment)."""
    command = [sys.executable, "-m", "server.aggregator", "--broker", url, "--prefix", args.prefix, "--name", name,
               "--enroll", str(enrollment), "--workdir", str(workdir),
               "--max-message-bytes", str(args.max_message_bytes)]
    for flag, value in (("--username", args.username), ("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key)):
        if value:
            command += [flag, value]
    return command
