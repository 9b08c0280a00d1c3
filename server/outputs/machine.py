"""What a benchmark says about the machine it ran on: the CPU's model name (absolute times differ 2-3x between
this project's machines, so every benchmark's JSON names its CPU)."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the platform's word for it."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
