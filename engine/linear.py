"""The matmul every projection runs through: baton's own on the CPU, `F.linear` elsewhere.

    linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]
    weight = prepare(linear, weight)      once, at load: the layout `linear` reads fastest

On CPU float32 a decode step is a few rows against every weight of the model, so its time is
how fast the weights stream. `panel_linear` (engine/csrc/linear.c, built with the other CPU
kernels) holds each weight in column panels of 64 outputs, one contiguous stream each (in
sub-panels as wide as the ISA's narrowest register tile: `to_panels`), and serves up to four
(AVX-512) or six rows per pass: measured call by call on the 2-core machine, all of
baton-small's projections at one row took 14.6-16.5 ms through oneDNN's packed inner product and
take 10.4-11.8 ms (352 MB of float32 weights, ~32 GB/s), baton-tiny's 0.7-0.9 -> 0.4-0.5 ms,
and the two are level from 16 to 2,048 rows. It
replaced oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, whose one-row call cost ~30 us
even for a 256x256 weight), which in turn had replaced MKL's sgemm (`F.linear`, 1.2-4x slower
than oneDNN for a few rows on these AMD EPYC machines).

`select_linear` takes panel_linear where the kernels build and agree with `F.linear` on a probe,
else oneDNN's where torch has it and it agrees, else `F.linear`; on every other device and dtype
it is `F.linear`. BATON_CPU_LINEAR=panel|onednn|torch forces one (an A/B switch; BENCHMARKS.md's
offline figures name which ran). A prepared weight is for its linear only.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from engine import cpu_kernels, env

logger = logging.getLogger(__name__)


class Linear(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor: ...


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor:
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # type: ignore[no-any-return]


PANEL = 64  # output columns in one panel of panel_linear's layout (linear.c's PANEL)


def panel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor:
    """x [T, in] @ W^T (+ bias) with W prepared by `to_panels`; float32 on the CPU."""
    rows, width = x.shape
    out_features = weight.numel() // width if width > 0 else 0
    if (out_features == 0 or x.dtype != torch.float32 or weight.dtype != torch.float32
            or weight.numel() != out_features * width
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)))):  # fmt: skip
        raise ValueError(f"panel_linear: x {tuple(x.shape)} {x.dtype} does not fit a weight of {weight.numel()}")
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return out
    if x.stride(1) != 1 or x.stride(0) < width:  # the kernel reads whole rows at a stride of at least `in`
        x = x.contiguous()
    rc = cpu_kernels.require(torch.float32, "panel_linear").baton_linear(
        x.data_ptr(), x.stride(0), rows, width, weight.data_ptr(), out_features,
        None if bias is None else bias.contiguous().data_ptr(), out.data_ptr())  # fmt: skip
    if rc != 0:
        raise ValueError(f"panel_linear: the kernel refused x {tuple(x.shape)} (stride {x.stride()})")
    return out


def to_panels(weight: torch.Tensor, sub: int | None = None) -> torch.Tensor:
    """[out, in] -> panel_linear's layout, flat: each PANEL outputs' [in, PANEL] block in turn,
    itself `sub`-column blocks [in, sub] one after the other (the last panel, narrower where PANEL
    does not divide `out`, one [in, width] block). `sub`: the compiled kernel's sub-panel width
    (linear.c's SUBW, by this CPU's ISA) unless given, as a test building for another ISA does."""
    if sub is None:
        sub = subpanel_width()
    if sub <= 0 or PANEL % sub:
        raise ValueError(f"to_panels: a sub-panel of {sub} columns does not divide a panel of {PANEL}")
    out_features, width = weight.shape
    panels = torch.empty(out_features * width, dtype=weight.dtype, device=weight.device)
    for n in range(0, out_features, PANEL):  # one block at a time: no second copy of the whole weight
        w = min(PANEL, out_features - n)
        step = sub if w == PANEL else w
        for j in range(n, n + w, step):
            panels[j * width : (j + step) * width].view(width, step).copy_(weight[j : j + step].t())
    return panels


@functools.cache
def subpanel_width() -> int:
    """The sub-panel width the CPU kernels were built for (to_panels' layout)."""
    return int(cpu_kernels.require(torch.float32, "panel_linear").baton_linear_subpanel())


PACK_ROWS = 64  # the batch oneDNN's packed layout is chosen for; any row count reads it


def prepare(linear: Linear, weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) as `linear` reads it: in panels for panel_linear, packed in oneDNN's
    layout for onednn_linear (tensors only that linear can read), else unchanged."""
    if linear is panel_linear:
        return to_panels(weight)
    if linear is onednn_linear:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)  # type: ignore[no-any-return]
    return weight


@functools.cache
def _panels_agree() -> bool:
    """The CPU kernels build here and panel_linear matches F.linear (bias and no bias, a narrow
    last panel, 1 to 9 rows, a strided input); probed once per process."""
    if cpu_kernels.load(torch.float32) is None:
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(PANEL + 24, 40, generator=gen)
    b = torch.randn(PANEL + 24, generator=gen)
    with torch.inference_mode():
        for rows in (1, 3, 9):
            x = torch.randn(rows, 80, generator=gen)[:, ::2]
            for bias in (None, b):
                if not torch.allclose(panel_linear(x, to_panels(w), bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4):
                    logger.warning("panel_linear disagrees with F.linear on a probe: not used")
                    return False
    return True


@functools.cache
def _onednn_agrees() -> bool:
    """oneDNN's linear exists here and matches F.linear (bias and no bias, 1 and 9 rows);
    probed once per process."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    b = torch.randn(48, generator=gen)
    try:
        with torch.inference_mode():
            for rows in (1, 9):
                x = torch.randn(rows, 40, generator=gen)
                for bias in (None, b):
                    expected = F.linear(x, w, bias)
                    for weight in (w, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)):
                        if not torch.allclose(onednn_linear(x, weight, bias), expected, rtol=1e-4, atol=1e-4):
                            return False
    except RuntimeError as exc:
        logger.info("oneDNN linear unavailable (%s): using F.linear", exc)
        return False
    return True


def select_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    choice = env.cpu_linear()
    if device.type != "cpu" or dtype != torch.float32 or choice == "torch":
        return torch_linear
    if choice in ("auto", "panel") and _panels_agree():
        return panel_linear
    if choice == "panel":
        raise RuntimeError("BATON_CPU_LINEAR=panel, but the CPU kernels cannot be built here (a C compiler is needed)")
    if _onednn_agrees():
        return onednn_linear
    if choice == "onednn":
        raise RuntimeError("BATON_CPU_LINEAR=onednn, but this torch has no working oneDNN linear")
    return torch_linear
