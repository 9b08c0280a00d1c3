"""What a benchmark says about the machine it ran on: the CPU's model name (absolute times differ 2-3x between
this project's machines, so every benchmark's JSON names its CPU)."""
from __future__ import annotations

import platform
from pathlib import Path


VECTOR_FEATURES = ("avx512f", "avx512_fp16", "avx2", "fma", "asimd", "asimdhp", "sve")  # what GEMM kernels pick


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the platform's word for it, with the vector extensions
    of VECTOR_FEATURES it has in parentheses: machines that share a model name ("AMD EPYC") differ in them, and
    onnxruntime's and PyTorch's kernels with them (e.g. AVX-512 against AVX2 alone)."""
    name, features = platform.processor() or platform.machine(), []
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return name
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() in ("flags", "Features") and not features:
            present = set(value.split())
            features = [f for f in VECTOR_FEATURES if f in present]
    return f"{name} ({', '.join(features)})" if features else name
