"""Ray for the tests, on loopback alone: every Ray process of a test runs in a network namespace of its own with
only ``lo`` up (``unshare -n``, as root), because Ray takes this machine's outward interface address even when
told 127.0.0.1 (/work/shared/DESIGN.md, "Ray"); there no Ray traffic can reach another address, and the ports are
the namespace's own. Usage statistics stay off; the cluster's token (Ray's token authentication) and temp folder
are the test's own, so nothing is written to the home folder.

``python -m tests.support.ray_cluster TEMP -- COMMAND...`` (run inside the namespace by ``run_on_loopback``) starts
a two-node cluster (a head and a second node, one CPU each, their own temp folders under TEMP), runs COMMAND with
``--ray`` and the head's address appended, kills every process of the second node as soon as one of them runs a
task named by ``--kill-when`` (mid-round), waits for COMMAND, stops what it started and prints one JSON line: the
command's exit code and output, and whether the node was killed while busy."""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.machine import missing_binary, missing_root
from tests.support.processes import REPO_ROOT, child_env

NAMESPACE_SCRIPT = 'ip link set lo up && exec "$@"'
HEAD_PORT = 6390
RAY = str(Path(sys.executable).with_name("ray"))
SCENARIO_TIMEOUT_S = 900


def missing_loopback_namespace() -> str | None:
    """None where Ray can be run on loopback alone here (root, unshare, ip); else what is missing."""
    return (missing_root("Ray's tests run in a network namespace with loopback alone (unshare -n)")
            or missing_binary("unshare", "util-linux") or missing_binary("ip", "iproute2"))


@contextmanager
def short_temp() -> Iterator[Path]:
    """A temp folder under /tmp: Ray's socket paths under it must stay under the 107 characters of a Unix socket."""
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as folder:
        yield Path(folder)


def ray_settings(temp: Path) -> dict[str, str]:
    """What a test's Ray processes add to the environment: statistics off, their own temp folder and token."""
    return dict(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(temp), RAY_AUTH_MODE="token",
                RAY_AUTH_TOKEN=secrets.token_hex(32))


def run_on_loopback(argv: list[str], temp: Path, timeout: float = SCENARIO_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``argv`` in a new network namespace with loopback alone, from the repository root, with ``ray_settings``."""
    return subprocess.run(["unshare", "-n", "sh", "-c", NAMESPACE_SCRIPT, "sh", *argv], capture_output=True,
                          text=True, env=child_env(**ray_settings(temp)), timeout=timeout, cwd=REPO_ROOT)


def two_node_run(temp: Path, command: list[str], kill_when: str | None = None, kill_after: str = "") -> dict:
    """``command`` against a two-node cluster on loopback (see the module docstring); the scenario's JSON."""
    argv = [sys.executable, "-m", "tests.support.ray_cluster", str(temp)]
    argv += ["--kill-when", kill_when, "--kill-after", kill_after] if kill_when else []
    done = run_on_loopback([*argv, "--", *command], temp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- inside the namespace ------------------------------------------------------------------------------------


def _processes_of(folder: Path) -> list:
    """A node's processes: those whose command line names its temp ``folder`` (its raylet and agents), and their
    children (its workers, which Ray retitles ``ray::TASK`` while they run one)."""
    import psutil

    mark, found = f"{folder}/", {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(mark in part for part in process.info["cmdline"] or ()):
                found[process.pid] = process
                found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def _busy(folder: Path, task: str) -> bool:
    """Whether a worker of the node at ``folder`` runs a task named ``task`` now."""
    import psutil

    for process in _processes_of(folder):
        try:
            if " ".join(process.cmdline()).startswith(f"ray::{task}"):
                return True
        except psutil.NoSuchProcess:
            pass
    return False


def _kill(processes: list) -> None:
    for process in processes:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(args: list[str]) -> None:
    subprocess.run([RAY, "start", "--num-cpus", "1", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
                    *args], check=True, capture_output=True, timeout=180)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("temp", type=Path)
    p.add_argument("--kill-when", default=None)
    p.add_argument("--kill-after", default="", help="kill only once the command has printed this")
    split = sys.argv.index("--")
    args, command = p.parse_args(sys.argv[1:split]), sys.argv[split + 1:]
    head, second = args.temp / "head", args.temp / "second"
    result: dict = {"killed_busy": False}
    try:
        _start(["--head", "--port", str(HEAD_PORT), "--temp-dir", str(head), "--include-dashboard", "false"])
        _start(["--address", f"127.0.0.1:{HEAD_PORT}", "--temp-dir", str(second)])
        run = subprocess.Popen([*command, "--ray", f"127.0.0.1:{HEAD_PORT}"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=child_env(RAY_ADDRESS=""))
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True)
        reader.start()
        if args.kill_when:
            while run.poll() is None and not (args.kill_after in "".join(lines) and _busy(second, args.kill_when)):
                time.sleep(0.01)
            if run.poll() is None:
                _kill(_processes_of(second))
                result["killed_busy"] = True
        run.wait(timeout=SCENARIO_TIMEOUT_S)
        reader.join(timeout=60)
        result.update(returncode=run.returncode, output="".join(lines)[-20000:])
    finally:
        _kill(_processes_of(second) + _processes_of(head))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
