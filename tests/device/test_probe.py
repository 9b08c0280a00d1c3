"""device_runtime.probe: the fixed compute probe the device reports and the benchmark records."""
from __future__ import annotations

import pytest

from device_runtime import probe
from device_runtime.probe import PROBE_SIZE, PROBE_STACK, probe_gflops


def test_the_probe_reports_the_flops_of_its_stack_over_its_fastest_repeat(monkeypatch: pytest.MonkeyPatch):
    """Repeats timed 3, 2 and 5 ms by a scripted clock: 2·256·64³ FLOP in the fastest 2 ms is 67.108864 GFLOP/s."""
    ticks = iter([0.0, 0.003, 1.0, 1.002, 2.0, 2.005])
    monkeypatch.setattr(probe.time, "perf_counter", lambda: next(ticks))
    assert probe_gflops(repeats=3) == pytest.approx(2 * PROBE_STACK * PROBE_SIZE**3 / 0.002 / 1e9, rel=1e-12)
    assert next(ticks, None) is None  # one start and one stop per repeat


def test_the_probe_needs_at_least_one_repeat():
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        probe_gflops(repeats=0)
