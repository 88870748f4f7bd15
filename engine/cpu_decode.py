"""A decode-only step's decoder layers on CPU in one call (engine/csrc/decode_step.c).

    step = cpu_decode_step_for(model, kv_dtype)   None where it does not apply (below)
    hidden = step(input_ids, positions, meta, pool)   [B, hidden], as CausalLM.forward returns

CausalLM._forward_fused calls nine kernels a layer from Python; at a few decode rows of a small
model that Python (argument checks, ctypes conversion, a fresh tensor per call, ~4 us a call,
~40 calls a step) was a fifth of the step. This makes the same calls from C, in the same order
over the same buffers' values, so its hidden states equal the fused path's bit for bit
(tests/engine/test_cpu_decode.py); the fused path stays the reference, and the torch path
behind it. It is the CPU's counterpart of the CUDA graphs a GPU decode step replays.

It applies where every kernel it drives is the one the model would call: CPU float32 weights
in panel layout (engine.linear's panel_linear), the compiled fused ops and the cpu attention
backend (a DecodePlan per step), and a step with no prefill rows; prefill and mixed steps take
the fused path.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import cpu_kernels
from engine.attention import AttnMetadata
from engine.linear import panel_linear
from kvcache.pool import DevicePool

if TYPE_CHECKING:
    from engine.model import CausalLM

_W_FIELDS = 7  # decode_step.c's W_INPUT_NORM .. W_DOWN, in that order


class _Shape(ctypes.Structure):
    """decode_step.c's decode_shape_t."""

    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("cs_stride", ctypes.c_int64),
        ("max_len", ctypes.c_int64),
        ("kv", ctypes.c_void_p),
        ("layer_stride", ctypes.c_int64),
        ("v_offset", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
    ]


class CpuDecodeStep:
    """One model's decode step through baton_decode_layers. Holds the weights' addresses: the
    model's tensors must outlive it (the model owns both)."""

    def __init__(self, model: CausalLM, kv_dtype: torch.dtype) -> None:
        cfg = model.cfg
        self.lib = cpu_kernels.require(kv_dtype, "the CPU decode step")
        self.kv_dtype = kv_dtype
        self.model = model
        table = np.zeros((len(model.layers), _W_FIELDS), dtype=np.int64)
        for i, layer in enumerate(model.layers):
            tensors = (layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.post_norm, layer.gate_up, layer.down)
            for j, t in enumerate(tensors):
                if t is None:
                    continue  # no bias: NULL
                if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(f"layer {i}: the CPU decode step takes contiguous float32 CPU weights")
                table[i, j] = t.data_ptr()
        self.weights = table
        self.final_norm = model.final_norm.contiguous()
        self.embed = model.embed  # [vocab, hidden]: each row's first residual is its token's row
        if self.embed.dtype != torch.float32 or not self.embed.is_contiguous():
            raise ValueError("the CPU decode step takes a contiguous float32 embedding")
        self.cos, self.sin = model.rope.cos, model.rope.sin
        self.shape = _Shape(
            num_layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, scale=model.scale,
            cos=self.cos.data_ptr(), sin=self.sin.data_ptr(), cs_stride=self.cos.stride(0),
            max_len=self.cos.shape[0],
        )  # fmt: skip
        self._pool_kv: torch.Tensor | None = None  # the pool self.shape points at

    def _bind(self, pool: DevicePool) -> None:
        kv = pool.kv  # [layers, 2, pages, page_size, kv_heads, head_dim]
        cfg = self.model.cfg
        if (kv.dtype != self.kv_dtype or kv.device.type != "cpu" or not kv.is_contiguous()
                or kv.shape[0] != cfg.num_layers or tuple(kv.shape[4:]) != (cfg.num_kv_heads, cfg.head_dim)):  # fmt: skip
            raise ValueError(f"the CPU decode step needs a contiguous {self.kv_dtype} pool of this model's shape")
        s = self.shape
        s.kv, s.layer_stride, s.v_offset = kv.data_ptr(), kv.stride(0), kv.stride(1)
        s.num_slots, s.page_size = kv.shape[2] * kv.shape[3], kv.shape[3]
        self._pool_kv = kv

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, pool: DevicePool
    ) -> torch.Tensor:
        plan = meta.cpu_plan
        rows = input_ids.shape[0]
        if plan is None or meta.num_prefill_tokens or plan.num_rows != rows:
            raise ValueError("the CPU decode step runs decode rows only, with their DecodePlan")
        slots = meta.slot_mapping
        for name, t in (("input_ids", input_ids), ("positions", positions), ("slots", slots)):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (rows,):
                raise ValueError(f"{name}: one contiguous int64 per row")
        if pool.kv is not self._pool_kv:
            self._bind(pool)
        out = torch.empty(rows, self.model.cfg.hidden_size, dtype=torch.float32)
        rc = self.lib.baton_decode_layers(
            ctypes.byref(self.shape), self.weights.ctypes.data, self.embed.data_ptr(), self.embed.shape[0],
            self.final_norm.data_ptr(), input_ids.data_ptr(), out.data_ptr(), rows, positions.data_ptr(),
            slots.data_ptr(), plan.items.ctypes.data, len(plan.items), plan.pages.ctypes.data,
            plan.row_ptr.ctypes.data, plan.row_slots.ctypes.data, plan.partials.ctypes.data,
        )  # fmt: skip
        if rc == -2:
            raise MemoryError("the CPU decode step: out of memory for its activations")
        if rc != 0:
            raise ValueError("the CPU decode step: a token outside the vocabulary, a position outside the RoPE "
                             "tables, a slot outside the pool or a shape the kernels refuse")  # fmt: skip
        return out


def cpu_decode_step_for(model: CausalLM, kv_dtype: torch.dtype) -> CpuDecodeStep | None:
    """The decode step for `model` where every kernel it drives is the one the model's own
    forward calls (engine.cpu_ops' fused ops, panel_linear, the cpu attention backend; the
    engine has set model.fused_ops accordingly); else None."""
    from engine.cpu_ops import CpuOps

    if not isinstance(model.fused_ops, CpuOps) or model.linear is not panel_linear or model.fused_ops.kv_dtype != kv_dtype:
        return None
    return CpuDecodeStep(model, kv_dtype)
