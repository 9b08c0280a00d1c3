"""The environment a test gives the processes it starts: this one's, passed on whole, with the test's own settings.

A child started with an environment built from scratch loses what this machine sets for a reason (e.g.
``OPENBLAS_CORETYPE``, which older OpenBLAS builds need on some CPUs to compute right): its results then differ
from the real device processes', which inherit everything. ``tests/architecture/test_child_env.py`` holds every test to this.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(drop: Iterable[str] = (), repo_on_path: bool = False, **settings: str) -> dict[str, str]:
    """This process's environment without the names in ``drop``, with ``settings`` on top; ``repo_on_path`` puts
    the repository first on PYTHONPATH (a child run from another folder imports this tree)."""
    env = {k: v for k, v in os.environ.items() if k not in set(drop)}
    if repo_on_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return env | settings


def stop_processes(processes: Iterable[subprocess.Popen | None], timeout_s: float) -> None:
    """End every one of ``processes`` still running: SIGTERM to all, then SIGKILL to any still there after
    ``timeout_s``; waits for each."""
    running = [p for p in processes if p is not None and p.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
