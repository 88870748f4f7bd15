"""A decoder layer's elementwise work on CPU in one pass each (engine/csrc/fused_ops.c): the
same three calls as engine.triton_ops on CUDA, so CausalLM's fused forward runs on either.

    ops = CpuOps(kv_dtype)                      the library for a pool of kv_dtype (RuntimeError
                                                where it cannot be built)
    x = ops.add_rms_norm(h, delta, weight, eps) h += delta (in place), then RMSNorm(h)
    q = ops.rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, num_heads)
    a = ops.silu_mul(gate_up)                   silu(gate) * up

On the torch path a layer's elementwise work is ~25 ops, each a dispatch and a pass over its
tensor with a new one allocated: per-op overhead in a decode step, memory traffic in a long
prefill chunk (SiLU and its product over the strided halves of [T, 2I] alone took 3-12 ms a
layer in a 2,048-token step of baton-tiny). Float32 activations, the pool float32 or 16-bit
(kv_cache_dtype); the library is engine.cpu_kernels' (one build per KV dtype). The torch path
is the reference: tests/engine/test_cpu_ops.py compares the two.
"""

from __future__ import annotations

import torch

from engine import cpu_kernels


def _check(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: a contiguous float32 CPU tensor is needed, got {t.dtype} on {t.device}")


class CpuOps:
    """The three calls over the library built for a pool of `kv_dtype`."""

    def __init__(self, kv_dtype: torch.dtype = torch.float32) -> None:
        self.lib = cpu_kernels.require(kv_dtype, "the fused CPU ops (use the torch path)")
        self.kv_dtype = kv_dtype

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of `h + delta` ([T, hidden], contiguous); `h` is updated in place when delta is
        given (it is the residual stream)."""
        _check(h, "h")
        _check(weight, "weight")
        rows, cols = h.shape
        if delta is not None:
            _check(delta, "delta")
            if delta.shape != h.shape:
                raise ValueError(f"delta {tuple(delta.shape)} is not h's shape {tuple(h.shape)}")
        if weight.shape != (cols,):
            raise ValueError(f"weight {tuple(weight.shape)} does not match hidden {cols}")
        out = torch.empty_like(h)
        self.lib.baton_add_rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                  out.data_ptr(), rows, cols, eps)  # fmt: skip
        return out


    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
        _check(gate_up, "gate_up")
        rows, width = gate_up.shape
        if width % 2:
            raise ValueError(f"gate_up's width {width} is odd")
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self.lib.baton_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out


    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) * hd] -> rotated q [T, heads, hd]; rotated k and v are
        written to their slots of k_cache/v_cache ([pages, page_size, kv_heads, hd], contiguous).
        cos/sin are the whole tables ([max_len, hd], engine.rope), read at `positions`."""
        tokens = qkv.shape[0]
        pages, page_size, num_kv_heads, head_dim = k_cache.shape
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv {tuple(qkv.shape)}: float32 rows of (heads + 2 kv_heads) * head_dim are needed")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape:
            raise ValueError("rope_and_cache needs two contiguous caches of one shape")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            raise ValueError(f"these ops write a {self.kv_dtype} pool, not {k_cache.dtype}/{v_cache.dtype}")
        _check(cos, "cos")
        _check(sin, "sin")
        if cos.shape != sin.shape or cos.shape[1] != head_dim:
            raise ValueError(f"cos/sin {tuple(cos.shape)} do not match head_dim {head_dim}")
        if positions.dtype != torch.int64 or slots.dtype != torch.int64 or not (positions.is_contiguous() and slots.is_contiguous()):
            raise ValueError("positions and slots are contiguous int64")
        if positions.shape != (tokens,) or slots.shape != (tokens,):
            raise ValueError("one position and one slot per token")
        q = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
        rc = self.lib.baton_rope_and_cache(
            qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[0],
            positions.data_ptr(), slots.data_ptr(), pages * page_size, q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), tokens, num_heads, num_kv_heads, head_dim,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"rope_and_cache: head_dim {head_dim}, a position outside the tables or a slot outside the pool")
        return q
