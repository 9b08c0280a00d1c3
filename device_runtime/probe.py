"""A short, fixed compute probe (numpy only): how fast this machine's one core multiplies small matrices.

The device reports it in its profile and the device benchmark records it for the machine it ran on, so the
server can scale a measured step time to a device by the ratio of the two scores (``server.engine.cost_model``).
The work is a stack of 64×64 float32 matmuls: OpenBLAS runs a product that small on one thread whatever its
thread setting, so the score measures one core, like a training step at ``threads=1``.

Its three arrays (two operands and the product) are 4 MiB each: 12 MiB touched in full while it runs, freed when it
returns, more than a small model's whole training step adds. A device therefore runs it first
(``device_runtime.__main__``), while it holds little more than numpy; run beside its agent's modules and the
onnxruntime bindings, it set the peak of a device training a small model (docs/your_model.md, "Each example over
MQTT in memory cgroups").
"""
from __future__ import annotations

import time

import numpy as np

PROBE_SIZE = 64
PROBE_STACK = 256
PROBE_REPEATS = 9
PROBE_SEED = 0


def probe_gflops(repeats: int = PROBE_REPEATS) -> float:
    """Best of ``repeats`` timings of one fixed matmul stack, in GFLOP/s (higher is faster).

    The best, not the mean: a busy machine only ever slows the probe down, and the score should describe
    the hardware. One repeat is 134 MFLOP: ~3 ms on a desktop core, ~30 ms on a small ARM board.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rng = np.random.default_rng(PROBE_SEED)
    a = rng.standard_normal((PROBE_STACK, PROBE_SIZE, PROBE_SIZE), dtype=np.float32)
    b = rng.standard_normal((PROBE_STACK, PROBE_SIZE, PROBE_SIZE), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)
    flops = 2.0 * PROBE_STACK * PROBE_SIZE**3
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9
