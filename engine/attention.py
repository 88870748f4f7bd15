"""Paged attention over the KV pool, in plain torch (the CPU path and the reference).

A step's tokens are flattened into one batch, prefill tokens first, then decode tokens:

    tokens: [ seq A: 5 new tokens | seq B: 3 new tokens | dec C | dec D | dec E ]
             <----- prefill (looped per sequence) ----> <--- decode (batched) --->

Every new token's K and V are first written to its slot in the pool; attention then reads a
sequence's whole context (cached prefix + new tokens) back from its pages. So a prefill with
a cached prefix and a chunk of a long prompt are the same case: queries at positions
[ctx - n, ctx) attend causally to keys [0, ctx).

Decode is the hot path: one query per sequence. Two backends, chosen per call:

- `torch` (CPU, and the reference): gather every sequence's pages with one index op per
  layer and attend with one masked SDPA call, GQA expressed as a reshape (no repeat of K/V).
- `triton` (CUDA): engine.triton_attention reads K/V straight from the pages through the page
  table, one program per (sequence, KV head), online softmax; no gather, no mask tensor.

Both take only shape-static inputs (the page table and the sequence lengths), so a decode
step can be captured in a CUDA graph (engine.cuda_graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence whose new tokens (more than one, or a first token) run as a prefill."""

    start: int  # first index of its new tokens in the flat batch
    num_new: int  # new tokens this step
    context_len: int  # cached + new tokens, i.e. keys attended
    page_ids: torch.Tensor  # [ceil(context_len / page_size)] int64


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Decode rows [first, end) that the torch path attends together, padded to their own
    longest context; built once per step (decode_runs), read by every layer."""

    first: int
    end: int
    pages: torch.Tensor  # [n * width] int64: the rows' page ids, flattened (one gather per layer)
    bias: torch.Tensor  # [n, 1, 1, width * page_size]: 0 where attended, -inf beyond a row's length


def decode_groups(pages: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """(first row, end row, pages) of runs of decode rows, sorted longest first, whose lengths
    stay within 2x of the run's longest: so one long sequence does not pad every short one to
    its length."""
    groups: list[tuple[int, int, int]] = []
    start = 0
    for row in range(1, len(pages) + 1):
        if row == len(pages) or pages[row] * 2 < pages[start]:
            groups.append((start, row, pages[start]))
            start = row
    return tuple(groups)


def decode_runs(
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    dtype: torch.dtype,
    groups: Sequence[tuple[int, int, int]] = (),
) -> tuple[DecodeRun, ...]:
    """The runs of `groups` (default: every row at the table's width) with their gather index
    and key mask."""
    runs = []
    for first, end, width in groups or ((0, table.shape[0], table.shape[1]),):
        lens = seq_lens[first:end]
        key_pos = torch.arange(width * page_size, device=table.device)
        bias = torch.zeros(end - first, 1, 1, width * page_size, dtype=dtype, device=table.device)
        bias.masked_fill_((key_pos[None, :] >= lens[:, None]).view(bias.shape), float("-inf"))
        runs.append(DecodeRun(first, end, table[first:end, :width].flatten(), bias))
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class AttnMetadata:
    """Everything attention needs to know about a step, passed explicitly to the model."""

    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset of each new token
    prefills: tuple[PrefillSeq, ...]
    num_prefill_tokens: int
    decode_page_table: torch.Tensor  # [B_d, max_pages] int64, padded with any valid page id
    decode_seq_lens: torch.Tensor  # [B_d] int64: keys each decode attends (its context length)
    scale: float
    decode_backend: str = "torch"  # "torch" | "triton"
    # torch path: the decode rows in runs of similar length; () builds one run of every row
    # in each layer (tests; the runner builds them once per step)
    decode_runs: tuple[DecodeRun, ...] = ()

    @property
    def num_decodes(self) -> int:
        return int(self.decode_page_table.shape[0])


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new K/V ([T, kv_heads, head_dim]) into the pages ([pages, page_size, kv_heads, head_dim])."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]; K/V of the new tokens already written."""
    out = torch.empty_like(q)
    for seq in meta.prefills:
        end = seq.start + seq.num_new
        out[seq.start : end] = _prefill_one(q[seq.start : end], k_cache, v_cache, seq, meta.scale)
    if meta.num_decodes:
        qd = q[meta.num_prefill_tokens :]
        if meta.decode_backend == "triton":
            from engine.triton_attention import paged_decode

            dst = out[meta.num_prefill_tokens :]  # written in place: rows of `out` are contiguous
            paged_decode(qd, k_cache, v_cache, meta.decode_page_table, meta.decode_seq_lens, meta.scale, out=dst)
        else:
            runs = meta.decode_runs or decode_runs(
                meta.decode_page_table, meta.decode_seq_lens, k_cache.shape[1], q.dtype
            )
            for run in runs:
                rows = slice(meta.num_prefill_tokens + run.first, meta.num_prefill_tokens + run.end)
                out[rows] = _decode_batch(q[rows], k_cache, v_cache, run, meta.scale)
    return out


def _prefill_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    num_new, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    # [pages, page_size, kv_heads, hd] -> [ctx, kv_heads, hd]
    k = k_cache.index_select(0, seq.page_ids).flatten(0, 1)[: seq.context_len]
    v = v_cache.index_select(0, seq.page_ids).flatten(0, 1)[: seq.context_len]
    # [1, heads, n, hd] against [1, kv_heads, ctx, hd]: with a batch dimension (and GQA left to
    # SDPA) torch picks its fused CPU kernel, ~8x faster than the 3-D call on a 1,500-token prompt.
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = num_heads != num_kv_heads
    if seq.context_len == num_new:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Bottom-right causal: query i sits at position ctx - n + i.
        q_pos = torch.arange(seq.context_len - num_new, seq.context_len, device=q.device)
        k_pos = torch.arange(seq.context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _decode_batch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, run: DecodeRun, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_keys = run.bias.shape[-1]
    # One gather per layer: [B * width, page_size, kvh, hd] -> [B, kvh, L, hd]
    k = k_cache.index_select(0, run.pages).view(batch, num_keys, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, run.pages).view(batch, num_keys, num_kv_heads, head_dim).transpose(1, 2)
    # GQA as a reshape: query head h reads KV head h // group, so the `group` query heads of
    # one KV head become the query rows of one attention ([B, kvh, group, hd]); measured ~3x
    # faster on CPU than expanding K/V (see BENCHMARKS.md's decode-step profile).
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=run.bias, scale=scale)
    return o.reshape(batch, num_heads, head_dim)
