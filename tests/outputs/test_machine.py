"""Specification of the CPU name every benchmark's JSON carries."""
from __future__ import annotations

import platform

from server.outputs.machine import cpu_name


def test_the_cpu_is_named_by_its_model_name_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    assert cpu_name(cpuinfo) == "AMD EPYC 7B13"


def test_without_cpuinfo_the_platform_names_the_machine(tmp_path):
    assert cpu_name(tmp_path / "absent") == (platform.processor() or platform.machine())
