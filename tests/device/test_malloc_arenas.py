"""device_runtime.malloc_arenas: a device process's threads allocate from one malloc arena (glibc), so what its
network thread freed is reused by its training instead of staying charged beside it."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.machine import needs
from tests.support.processes import child_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs(None if platform.libc_ver()[0] == "glibc" else "glibc (malloc arenas are glibc's)")

THREAD_ALLOCATES = """
import ctypes, sys, threading
from device_runtime.malloc_arenas import share_one_arena
took = share_one_arena() if sys.argv[1] == "one" else None
kept = []
thread = threading.Thread(target=lambda: kept.extend(bytearray(20000) for _ in range(50)))  # below mmap's threshold
thread.start()
thread.join()
print(took)
ctypes.CDLL(None).malloc_stats()  # to stderr: an "Arena N:" block per arena
"""


def arenas(mode: str) -> tuple[str, int]:
    """What share_one_arena answered and how many arenas the process had after a second thread allocated."""
    done = subprocess.run([sys.executable, "-c", THREAD_ALLOCATES, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=child_env(repo_on_path=True))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_after_share_one_arena_a_second_thread_allocates_from_the_main_arena():
    assert arenas("one") == ("True", 1)


def test_by_default_a_second_thread_that_allocates_gets_an_arena_of_its_own():
    """What share_one_arena changes: glibc's default, two arenas for two allocating threads."""
    assert arenas("default") == ("None", 2)
