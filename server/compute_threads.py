"""The compute threads of a run, set the same way in every process that computes for it.

Float32 kernels pick their code path by thread count: on an AMD EPYC, OpenBLAS's sgemm returns different
last bits with 1 and 2 threads, so a device's Frobenius step (numpy) computed in the server's process at the
machine's default BLAS threads differed from the same step in a device process (which pins its BLAS threads to
``--threads`` before numpy loads). Pinning both to ``--threads`` makes the two paths run the same kernels: an
in-process device computes bit for bit what a device process computes on the same machine.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from threadpoolctl import ThreadpoolController

_CONTROLLER: ThreadpoolController | None = None


def use_server_threads(threads: int) -> None:
    """PyTorch's intra-op threads for the server's math (factorization, aggregation, the reference trainer)."""
    torch.set_num_threads(threads)


def device_blas_threads(threads: int) -> AbstractContextManager:
    """A context in which numpy's BLAS runs at ``threads`` threads, as in a device process started with
    ``--threads threads``; the previous limits are restored on exit."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=threads, user_api="blas")
