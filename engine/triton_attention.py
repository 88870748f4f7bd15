"""Paged decode attention as a Triton kernel (the CUDA backend of engine.attention).

One program per (sequence, KV head). It loads the `group` query heads that share the KV head
once, then walks the sequence's keys BLOCK_N at a time, finding each key through the page
table (`page = table[b, pos // page_size]`, row `pos % page_size`), with an online softmax in
float32. K and V are read once per KV head and never gathered or copied; there is no mask
tensor. The sequence length is read on the device, so the launch is shape-static and can be
captured in a CUDA graph.

    q      [B, heads, head_dim]
    k, v   [num_pages, page_size, kv_heads, head_dim]   (one layer of the pool, rows contiguous)
    table  [B, max_pages] int64, lens [B] int64 (every length >= 1)
    -> out [B, heads, head_dim]

The torch reference (engine.attention._decode_batch) stays the CPU path and the oracle in
tests; under TRITON_INTERPRET=1 this kernel runs on CPU tensors too (tests/engine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    lens_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + n
        valid = pos < seq_len
        page = tl.load(table_ptr + b * stride_tb + pos // PAGE_SIZE, mask=valid, other=0)
        row = page.to(tl.int64) * stride_kp + (pos % PAGE_SIZE) * stride_ko + kvh * stride_kh
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton decode kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("K/V pages must have contiguous rows and the same strides")
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride() != q.stride():
        raise ValueError("out must be shaped and laid out like q")
    block_n = max(16, min(block_n, triton.next_power_of_2(page_size * table.shape[1])))
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, out, table, lens, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return out

