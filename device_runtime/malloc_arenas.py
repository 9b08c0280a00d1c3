"""One malloc arena for the whole device process.

glibc (the C library of the Linux boards a device runs on) gives each thread that allocates an arena of its own,
and memory freed in one arena is never handed to another: what the MQTT network thread allocated for the frames it
received (a task, a tier's artifacts) stays charged to the device beside what its training, in the main thread,
allocates afterwards. In real memory-cgroup runs of ResNet-8 that was 3.7 to 4.7 MiB a device, above what a
single-threaded process doing the same rounds was charged (docs/your_model.md, "Each example over MQTT in memory
cgroups"). ``mallopt(M_ARENA_MAX, 1)``, called before any other thread starts, makes every thread allocate from the
main arena (as ``MALLOC_ARENA_MAX=1`` in the environment would); a device computes in one thread and its network
thread allocates little, so they rarely wait on each other. Where the C library has no ``mallopt`` (macOS) or
refuses the option (musl), nothing changes.
"""
from __future__ import annotations

import ctypes

M_ARENA_MAX = -8
"""glibc's malloc.h: the most arenas the process may have."""


def share_one_arena() -> bool:
    """Have every thread that allocates from now on use the main arena; whether the C library took it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_ARENA_MAX, 1) == 1
