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

Split-KV (flash-decoding): with one program per (sequence, KV head), a batch of 1 on a model
with 4 KV heads runs 4 programs on a 132-SM GPU, each walking its whole context one block
after another; the 2026-11-29 H200 run spent ~1.4 ms a step at batch 1 on the ~1 B model
against ~0.5 ms of weight reads. So the keys are cut into partitions of `partition` keys,
one program per (sequence, KV head, partition), each writing its unnormalised output, max and
sum in float32; a second kernel merges a row's partitions under one max. The grid is sized by
the table's width, which is static in a CUDA graph; partitions past a row's length skip their
loop and are not read by the merge.

    partial: acc [B, heads, P, head_dim], ml [B, heads, P, 2] (max, sum), float32
    merge:   out[b, h] = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p

`decode_partition` chooses the partition from shapes only (so a graph's choice is fixed);
bench/gpu_check.py's `kernels` stage times the choices on a device, and its figures set
the rule.

The torch reference (engine.attention._decode_batch) stays the CPU path and the oracle in
tests; under TRITON_INTERPRET=1 these kernels run on CPU tensors too (tests/engine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, acc_ptr, ml_ptr, table_ptr, lens_ptr, scale,
    stride_qb, stride_qh, stride_kp, stride_ko, stride_kh, stride_tb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, MAX_PARTS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # SPLIT: keys [part * PARTITION, +PARTITION) -> unnormalised acc, max, sum per head;
    # else (one partition, the whole context) -> the normalised output.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    begin = part * PARTITION
    end = seq_len
    if SPLIT:
        end = tl.minimum(begin + PARTITION, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start in range(begin, end, BLOCK_N):  # empty for a partition past the row's length
        pos = start + n
        valid = pos < end
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
    if SPLIT:
        slot = (b.to(tl.int64) * NUM_HEADS + heads) * MAX_PARTS + part  # [BLOCK_G]
        tl.store(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml_ptr + slot * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + slot * 2 + 1, l_i, mask=g_ok)
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _merge_partitions_kernel(
    acc_ptr, ml_ptr, out_ptr, lens_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, MAX_PARTS: tl.constexpr, PARTITION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    num_parts = (seq_len + PARTITION - 1) // PARTITION  # >= 1: every length is >= 1
    p = tl.arange(0, BLOCK_P)
    ok = p < num_parts
    d = tl.arange(0, HEAD_DIM)
    slot = (b.to(tl.int64) * NUM_HEADS + h) * MAX_PARTS + p
    m = tl.load(ml_ptr + slot * 2, mask=ok, other=float("-inf"))
    l = tl.load(ml_ptr + slot * 2 + 1, mask=ok, other=0.0)  # noqa: E741
    w = tl.where(ok, tl.exp(m - tl.max(m, 0)), 0.0)
    acc = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


MAX_SPLITS = 32  # partitions per row at most: bounds the grid when the table is wide


def decode_partition(batch: int, kv_heads: int, max_keys: int, block_n: int = 64) -> int:
    """Keys per partition for a decode batch, from shapes only (a CUDA graph fixes it at
    capture); 0 means no split: one program walks a row's whole context.

    Rows x KV heads below 64 programs (a small batch) split finer (128 keys) than a full one
    (256); a table wider than MAX_SPLITS partitions widens them instead. Not yet set by a
    measurement: the `kernels` stage of bench/gpu_check.py times 0, 64 ... 512 on a device."""
    partition = 128 if batch * kv_heads < 64 else 256
    partition = max(partition, block_n, -(-max_keys // MAX_SPLITS))
    partition = -(-partition // block_n) * block_n
    return partition if max_keys > partition else 0


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    partition: int | None = None,
) -> torch.Tensor:
    """Decode attention for q [B, heads, head_dim] over the paged K/V; `partition` keys per
    split (None: decode_partition's choice, 0: no split; else a multiple of block_n)."""
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
    max_keys = page_size * table.shape[1]
    block_n = max(16, min(block_n, triton.next_power_of_2(max_keys)))
    if partition is None:
        partition = decode_partition(batch, num_kv_heads, max_keys, block_n)
    elif partition and (partition % block_n or partition < block_n):
        raise ValueError(f"partition ({partition}) must be a multiple of block_n ({block_n})")
    split = 0 < partition < max_keys
    parts = -(-max_keys // partition) if split else 1
    if split:
        acc = torch.empty(batch, num_heads, parts, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(batch, num_heads, parts, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    _paged_decode_kernel[(batch, num_kv_heads, parts)](
        q, k_cache, v_cache, out, acc, ml, table, lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, MAX_PARTS=parts,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=block_n, PARTITION=partition if split else max_keys, SPLIT=split,
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    if split and batch:
        _merge_partitions_kernel[(batch, num_heads)](
            acc, ml, out, lens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, MAX_PARTS=parts, PARTITION=partition, HEAD_DIM=head_dim,
            BLOCK_P=max(2, triton.next_power_of_2(parts)),
        )  # fmt: skip
    return out
