"""Fused elementwise kernels for the CUDA forward pass (Triton), with the same roundings as
the torch path, so bf16 results match `transformers` as the unfused code does.

Measured first (bench/gpu_check.py on an H200, ~1 B model): with CUDA graphs a decode step
still took ~3 ms at batch 1 against ~0.5 ms of weight reads, because each layer ran ~40 small
elementwise kernels (RMSNorm's casts and reductions, RoPE's halves, the residual adds, SiLU,
the two KV writes). These three kernels bring a layer to nine launches:

    add_rms_norm(h, delta, w)   h += delta (in h's dtype), then RMSNorm(h) in float32 -> x
    rope_and_cache(qkv, ...)    rotate q and k, write k and v into their page slots -> q
    silu_mul(gate_up)           silu(gate) * up

Each rounds where torch rounds: products and sums of bf16 tensors are computed in float32 and
rounded to bf16 per operation, exactly what torch's elementwise ops do. The torch path in
engine.model stays the CPU path and the reference (tests run these kernels under
TRITON_INTERPRET=1 against it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, delta_ptr, w_ptr, out_ptr, n_cols, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    h = tl.load(h_ptr + row * n_cols + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * n_cols + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n_cols + cols, h, mask=ok)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `h + delta` ([T, hidden], contiguous); `h` is updated in place when delta is
    given (it is the residual stream)."""
    rows, cols = h.shape
    out = torch.empty_like(h)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            h, delta if delta is not None else h, weight, out, cols, eps,
            HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(cols),
        )  # fmt: skip
    return out


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DT: tl.constexpr):  # noqa: ANN001, ANN202
    # out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product and the
    # sum rounded to the activations' dtype, as torch computes it
    a1 = (x1 * c1).to(DT).to(tl.float32)
    b1 = (-x2 * s1).to(DT).to(tl.float32)
    a2 = (x2 * c2).to(DT).to(tl.float32)
    b2 = (x1 * s2).to(DT).to(tl.float32)
    return (a1 + b1).to(DT), (a2 + b2).to(DT)


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    DT = q_out_ptr.dtype.element_ty
    HD = 2 * HALF
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + pos * stride_cs + j).to(DT).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cs + HALF + j).to(DT).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_cs + j).to(DT).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_cs + HALF + j).to(DT).to(tl.float32)
    base = qkv_ptr + t * stride_qkv
    # q: [NUM_HEADS, HD] -> q_out[t]
    h = tl.arange(0, BLOCK_H)
    hm = (h < NUM_HEADS)[:, None]
    q1 = tl.load(base + h[:, None] * HD + j[None, :], mask=hm, other=0.0).to(tl.float32)
    q2 = tl.load(base + h[:, None] * HD + HALF + j[None, :], mask=hm, other=0.0).to(tl.float32)
    r1, r2 = _rotate(q1, q2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], DT)
    q_row = q_out_ptr + t * NUM_HEADS * HD + h[:, None] * HD
    tl.store(q_row + j[None, :], r1, mask=hm)
    tl.store(q_row + HALF + j[None, :], r2, mask=hm)
    # k (rotated) and v -> the slot: [NUM_KV_HEADS, HD] at slot * NUM_KV_HEADS * HD
    g = tl.arange(0, BLOCK_KV)
    gm = (g < NUM_KV_HEADS)[:, None]
    k_base = base + NUM_HEADS * HD
    k1 = tl.load(k_base + g[:, None] * HD + j[None, :], mask=gm, other=0.0).to(tl.float32)
    k2 = tl.load(k_base + g[:, None] * HD + HALF + j[None, :], mask=gm, other=0.0).to(tl.float32)
    r1, r2 = _rotate(k1, k2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], DT)
    dst = slot * NUM_KV_HEADS * HD + g[:, None] * HD
    tl.store(k_cache_ptr + dst + j[None, :], r1, mask=gm)
    tl.store(k_cache_ptr + dst + HALF + j[None, :], r2, mask=gm)
    v_base = k_base + NUM_KV_HEADS * HD
    v1 = tl.load(v_base + g[:, None] * HD + j[None, :], mask=gm, other=0.0)
    v2 = tl.load(v_base + g[:, None] * HD + HALF + j[None, :], mask=gm, other=0.0)
    tl.store(v_cache_ptr + dst + j[None, :], v1, mask=gm)
    tl.store(v_cache_ptr + dst + HALF + j[None, :], v2, mask=gm)


def rope_and_cache(
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
    written to their slots of k_cache/v_cache ([pages, page_size, kv_heads, hd], contiguous)."""
    tokens = qkv.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"the fused RoPE kernel needs head_dim = 2 * a power of two, got {head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.stride(1) == 1):
        raise ValueError("rope_and_cache needs contiguous caches and qkv rows")
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _rope_and_cache_kernel[(tokens,)](
            qkv, cos, sin, positions, slots, q, k_cache, v_cache,
            qkv.stride(0), cos.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    ok = cols < n_cols
    DT = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(DT), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out
