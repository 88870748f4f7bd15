"""Which kernels an engine runs on, for operators: `/status`, `baton status` and
`baton_node_kernels_info` on /metrics.

    kernels_of(engine) -> EngineKernels(attention="cpu", linear="panel", decode_step="fused",
                                        isa="avx2", kv_dtype="float32", device="cpu")

The engine reads it once when it is built (`engine.kernels`); workers and /status report that.

A CPU engine whose kernels could not be built (no C compiler in the image, a failed build) still
serves, on the torch path: correct and several times slower. The build failure is one WARNING
in the log at start-up; this is where it stays visible afterwards (attention "torch", linear
"onednn" or "torch", decode_step "per-layer" on a float32 CPU engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.engine import Engine


@dataclass(frozen=True, slots=True)
class EngineKernels:
    attention: str = ""  # the attention backend: cpu (baton's C kernels), torch, triton
    linear: str = ""  # the projections: panel (baton's C kernel), onednn, torch
    decode_step: str = ""  # fused (a decode-only step's layers in one C call) or per-layer
    isa: str = ""  # the instruction set baton's C kernels were built for ("" where none were)
    kv_dtype: str = ""  # the KV cache's element type
    device: str = ""  # cpu, cuda


def kernels_of(engine: Engine) -> EngineKernels:
    """What `engine` runs on; cheap (no build: a library is only asked if it is already loaded)."""
    import torch  # here: the dataclass above crosses into processes that never load a model

    from engine import cpu_kernels
    from engine.linear import onednn_linear, panel_linear

    linear = engine.model.linear
    isa = ""
    if engine.device.type == "cpu":
        lib = cpu_kernels.loaded(torch.float32) or cpu_kernels.loaded(engine.kv_dtype)
        isa = lib.baton_linear_isa().decode() if lib is not None else ""
    return EngineKernels(
        attention=engine.runner.decode_backend,
        linear="panel" if linear is panel_linear else "onednn" if linear is onednn_linear else "torch",
        decode_step="fused" if engine.model.decode_step is not None else "per-layer",
        isa=isa,
        kv_dtype=str(engine.kv_dtype).removeprefix("torch."),
        device=engine.device.type,
    )
