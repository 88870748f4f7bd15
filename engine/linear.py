"""The matmul every projection runs through: `F.linear`, or oneDNN's on the CPU.

On CPU float32, torch's `F.linear` goes to MKL's sgemm, which on the AMD EPYC machines baton
is measured on runs 1.2-4x slower than oneDNN's inner-product kernel for the shapes that
matter (a few rows against a large weight: decode steps and the LM head). torch ships oneDNN's
linear as `torch.ops.mkldnn._linear_pointwise` (the op its compiler's CPU backend emits).
`select_linear` takes it when it exists, runs, and agrees with `F.linear` on a probe;
otherwise, and on every other device and dtype, it is `F.linear`. BATON_CPU_LINEAR=torch
turns it off (an A/B switch; BENCHMARKS.md's offline figures name which ran).

    linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]
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
                    if not torch.allclose(onednn_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4):
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
