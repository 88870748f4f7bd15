"""The CPU kernels build for every x86-64 level, and each build this CPU can run agrees with
F.linear: csrc/linear.c picks its register tile by ISA (AVX-512, AVX2, SSE), and a machine
builds only its own (-march=native), so without this a tile for another CPU would go untested
until a user's machine failed to build it (2026-12-07: the AVX-512 tile did not compile on an
AVX2-only EPYC, and every kernel fell back to torch's path)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels, linear

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 levels; other CPUs build only natively"),
]

# each level, and the /proc/cpuinfo flags a CPU needs to run code built for it
X86_LEVELS = {
    "x86-64-v2": ("sse4_2", "popcnt"),
    "x86-64-v3": ("avx2", "fma", "bmi2"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


def _runs_here(march: str) -> bool:
    flags = set(cpu_kernels._cpu_flags().split())
    return all(flag in flags for flag in X86_LEVELS[march])


@pytest.mark.parametrize("march", list(X86_LEVELS))
def test_the_kernels_build_for_each_level_and_agree_where_they_run(march: str, tmp_path: Path) -> None:
    target = tmp_path / f"kernels-{march}.so"
    cpu_kernels._build(target, march=march)  # RuntimeError with the compiler's message if it fails
    assert target.stat().st_size > 0
    if not _runs_here(march):
        return  # built, as a CPU of that level would build it; this one cannot run it
    lib = cpu_kernels.bind(ctypes.CDLL(str(target)))
    # the layout the build reads: its ISA's narrowest tile (linear.c's SUBW)
    assert lib.baton_linear_subpanel() == {"x86-64-v2": 8, "x86-64-v3": 16, "x86-64-v4": 64}[march]
    assert lib.baton_linear_isa() == {"x86-64-v2": b"sse2", "x86-64-v3": b"avx2", "x86-64-v4": b"avx512"}[march]
    gen = torch.Generator().manual_seed(7)
    # every row count the tiles split differently (1-6 alone, a tile and a remainder, a block of
    # 64 and one more), full panels and a narrow last one (200 = 3 x 64 + 8), bias or none
    for rows in (*range(1, 14), 64, 65):
        for with_bias in (False, True):
            w = torch.randn(200, 96, generator=gen) * 0.05
            b = torch.randn(200, generator=gen) if with_bias else None
            x = torch.randn(rows, 96, generator=gen)
            panels = linear.to_panels(w, sub=lib.baton_linear_subpanel())  # the layout of that build
            out = torch.empty(rows, 200)
            rc = lib.baton_linear(x.data_ptr(), x.stride(0), rows, 96, panels.data_ptr(), 200,
                                  None if b is None else b.data_ptr(), out.data_ptr())  # fmt: skip
            assert rc == 0
            torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_this_cpu_runs_its_own_level_or_a_lower_one() -> None:
    """The levels above are the ones the tiles are chosen by; a CI machine runs at least one,
    so the agreement half of the test above runs somewhere, not only the builds."""
    assert any(_runs_here(march) for march in X86_LEVELS)
