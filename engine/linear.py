"""The matmul every projection runs through: `F.linear`, or oneDNN's on the CPU.

On CPU float32, torch's `F.linear` goes to MKL's sgemm, which on the AMD EPYC machines baton
is measured on runs 1.2-4x slower than oneDNN's inner-product kernel for the shapes that
matter (a few rows against a large weight: decode steps and the LM head). torch ships oneDNN's
linear as `torch.ops.mkldnn._linear_pointwise` (the op its compiler's CPU backend emits).
`select_linear` takes it when it exists, runs, and agrees with `F.linear` on a probe;
otherwise, and on every other device and dtype, it is `F.linear`. BATON_CPU_LINEAR=torch
turns it off (an A/B switch; BENCHMARKS.md's offline figures name which ran).

    linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]
    weight = prepare(linear, weight)      once, at load: the layout `linear` reads fastest

oneDNN reads a weight in its own blocked layout; handed a plain [out, in] tensor it reorders it
on every call. `prepare` reorders each weight once at load (as torch's compiler does for the
CPU), for decode-sized batches (PACK_ROWS): measured on the 2-core machine with baton-tiny's
shapes at 16 rows, the LM head 1.9 -> 0.7 ms and a layer's four projections 325 -> 225 us; at
1 and 512 rows it is no slower.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from engine import env

logger = logging.getLogger(__name__)


class Linear(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor: ...


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor:
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # type: ignore[no-any-return]


PACK_ROWS = 64  # the batch oneDNN's packed layout is chosen for; any row count reads it


def prepare(linear: Linear, weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) as `linear` reads it: packed in oneDNN's layout for onednn_linear
    (a tensor only onednn_linear can read), else unchanged."""
    if linear is onednn_linear:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)  # type: ignore[no-any-return]
    return weight


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
    if _onednn_agrees():
        return onednn_linear
    if choice == "onednn":
        raise RuntimeError("BATON_CPU_LINEAR=onednn, but this torch has no working oneDNN linear")
    return torch_linear
