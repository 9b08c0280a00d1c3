"""Specification of the CPU name every benchmark's JSON carries."""
from __future__ import annotations

import platform

from server.outputs.machine import cpu_name


def test_the_cpu_is_named_by_its_model_name_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    assert cpu_name(cpuinfo) == "AMD EPYC 7B13"


def test_the_vector_extensions_that_pick_gemm_kernels_follow_the_name(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 fma avx2 avx512f avx512bw\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu sse2 fma avx2 avx512f avx512bw\n")
    assert cpu_name(cpuinfo) == "AMD EPYC (avx512f, avx2, fma)"


def test_an_arm_cpu_lists_its_features_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm asimdhp cpuid\nCPU implementer\t: 0x41\n")
    assert cpu_name(cpuinfo) == f"{platform.processor() or platform.machine()} (asimd, asimdhp)"


def test_without_cpuinfo_the_platform_names_the_machine(tmp_path):
    assert cpu_name(tmp_path / "absent") == (platform.processor() or platform.machine())
