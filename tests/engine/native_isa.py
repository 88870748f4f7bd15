"""What csrc/linear.c picks for this CPU when built with -march=native (its `#if` chain by ISA),
read from /proc/cpuinfo's flags: the one place the tests map flags to the ISA and its tile."""

from __future__ import annotations

from engine import cpu_kernels

SUBPANEL_WIDTH = {"avx512": 64, "avx2": 16, "avx": 16, "sse2": 8}  # linear.c's narrowest tile per ISA


def native_isa() -> str:
    flags = set(cpu_kernels._cpu_flags().split())
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "avx" if "avx" in flags else "sse2"
