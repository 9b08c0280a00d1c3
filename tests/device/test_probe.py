"""device_runtime.probe: the fixed compute probe the device reports and the benchmark records."""
from __future__ import annotations

import math

import pytest

from device_runtime.probe import probe_gflops


def test_the_probe_reports_a_positive_finite_score():
    score = probe_gflops(repeats=2)
    assert score > 0 and math.isfinite(score)


def test_the_probe_needs_at_least_one_repeat():
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        probe_gflops(repeats=0)
