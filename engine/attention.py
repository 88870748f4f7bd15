"""Paged attention over the KV pool, in plain torch (the CPU path and the reference).

A step's tokens are flattened into one batch, prefill tokens first, then decode tokens:

    tokens: [ seq A: 5 new tokens | seq B: 3 new tokens | dec C | dec D | dec E ]
             <----- prefill (looped per sequence) ----> <--- decode (batched) --->

Every new token's K and V are first written to its slot in the pool; attention then reads a
sequence's whole context (cached prefix + new tokens) back from its pages. So a prefill with
a cached prefix and a chunk of a long prompt are the same case: queries at positions
[ctx - n, ctx) attend causally to keys [0, ctx).

Decode is the hot path: one query per sequence. Three backends, chosen per engine:

- `cpu` (CPU float32, the default there where a C compiler is found): engine.cpu_kernels'
  compiled kernel reads K/V in place through the page table, a shared prefix's pages once for
  all the rows that start with them, long contexts split across cores; no gather, no mask.

- `torch` (CPU, and the reference): gather every sequence's pages with one index op per
  layer and attend with one masked SDPA call, GQA expressed as a reshape (no repeat of K/V).
  Rows that start with the same cached pages (a RAG document, a system prompt: the prefix
  cache hands every request the same page ids) attend in cascade: the shared pages are
  gathered once and read by all their rows' queries in one matmul, each row's own pages
  after them as before, and the two softmaxes merged under one running max. Without it
  32 rows of a 2k-token shared prefix gathered 32 copies of it per layer (~36 ms a layer
  for baton-tiny's shapes; cascade ~2 ms).
- `triton` (CUDA): engine.triton_attention reads K/V straight from the pages through the page
  table, one program per (sequence, KV head), online softmax; no gather, no mask tensor.

Both take only shape-static inputs (the page table and the sequence lengths), so a decode
step can be captured in a CUDA graph (engine.cuda_graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.cpu_kernels import DecodePlan


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence whose new tokens (more than one, or a first token) run as a prefill."""

    start: int  # first index of its new tokens in the flat batch
    num_new: int  # new tokens this step
    context_len: int  # cached + new tokens, i.e. keys attended
    page_ids: torch.Tensor  # [ceil(context_len / page_size)] int64


# Cascade only pays once the shared pages outweigh its extra launches (a dozen small ops per
# layer); below this many shared pages a run attends the plain way.
MIN_SHARED_PAGES = 4


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Decode rows [first, end) that the torch path attends together, padded to their own
    longest context; built once per step (decode_runs), read by every layer."""

    first: int
    end: int
    pages: torch.Tensor  # [n * width] int64: the rows' page ids, flattened (one gather per layer)
    bias: torch.Tensor  # [n, 1, 1, width * page_size]: 0 where attended, -inf beyond a row's length
    # Cascade: full pages that every row of the run starts with; `pages` and `bias` then cover
    # only the keys after them.
    prefix_pages: torch.Tensor | None = None  # [p] int64


def decode_groups(
    pages: Sequence[int], keys: Sequence[int] | None = None
) -> tuple[tuple[int, int, int], ...]:
    """(first row, end row, pages) of runs of decode rows, sorted longest first, whose lengths
    stay within 2x of the run's longest: so one long sequence does not pad every short one to
    its length. With `keys` (rows ordered by key, see order_decodes), a run also ends where the
    key changes, so rows that share a prefix form runs of their own."""
    groups: list[tuple[int, int, int]] = []
    start = 0
    for row in range(1, len(pages) + 1):
        if (
            row == len(pages)
            or pages[row] * 2 < pages[start]
            or (keys is not None and keys[row] != keys[start])
        ):
            groups.append((start, row, pages[start]))
            start = row
    return tuple(groups)


def shared_pages(table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> int:
    """Leading page ids that every row of `table` has in common, counting only pages that lie
    wholly before each row's last key (so every row keeps at least one key of its own); 0
    when that is fewer than MIN_SHARED_PAGES or there is one row."""
    if table.shape[0] < 2:
        return 0
    limit = min(int((seq_lens.min() - 1) // page_size), table.shape[1])
    if limit < MIN_SHARED_PAGES:
        return 0
    same = (table[:, :limit] == table[:1, :limit]).all(0)
    shared = int(same.cumprod(0).sum())
    return shared if shared >= MIN_SHARED_PAGES else 0


def decode_runs(
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    dtype: torch.dtype,
    groups: Sequence[tuple[int, int, int]] = (),
    cascade: Sequence[bool] = (),
) -> tuple[DecodeRun, ...]:
    """The runs of `groups` (default: every row at the table's width) with their gather index
    and key mask; a run whose `cascade` flag is set, and whose rows share at least
    MIN_SHARED_PAGES leading pages, attends in cascade (float32 only: the merge is computed
    explicitly, and float32 keeps it at SDPA's accuracy)."""
    runs = []
    spans = groups or ((0, table.shape[0], table.shape[1]),)
    for i, (first, end, width) in enumerate(spans):
        lens = seq_lens[first:end]
        rows = table[first:end, :width]
        shared = 0
        if i < len(cascade) and cascade[i] and dtype == torch.float32:
            shared = shared_pages(rows, lens, page_size)
        key_pos = torch.arange(shared * page_size, width * page_size, device=table.device)
        bias = torch.zeros(end - first, 1, 1, key_pos.numel(), dtype=dtype, device=table.device)
        bias.masked_fill_((key_pos[None, :] >= lens[:, None]).view(bias.shape), float("-inf"))
        prefix = rows[0, :shared].clone() if shared else None
        runs.append(DecodeRun(first, end, rows[:, shared:].flatten(), bias, prefix))
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
    decode_backend: str = "torch"  # "torch" | "triton" | "cpu"
    # torch path: the decode rows in runs of similar length; () builds one run of every row
    # in each layer (tests; the runner builds them once per step)
    decode_runs: tuple[DecodeRun, ...] = ()
    cpu_plan: DecodePlan | None = None  # cpu path: the step's kernel items (engine.cpu_kernels)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_page_table.shape[0])


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new K/V ([T, kv_heads, head_dim]) into the pages ([pages, page_size, kv_heads, head_dim])."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    # rounded to the pool's dtype when that is narrower (kv_cache_dtype); a no-op otherwise
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache[pages] ([n, page_size, kv_heads, head_dim]) in `dtype` (default: the cache's),
    copied as whole rows: index_select on the pool viewed 2-D takes torch's row-copy path, ~3x
    faster on CPU than on the 4-D pool (measured with baton-small's decode batch at c=32). A
    pool stored narrower than the compute dtype (kv_cache_dtype) is widened here, once per read."""
    rows = cache.view(cache.shape[0], -1).index_select(0, pages)
    if dtype is not None and dtype != rows.dtype:
        rows = rows.to(dtype)
    return rows.view(pages.shape[0], *cache.shape[1:])


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
        elif meta.decode_backend == "cpu":
            from engine import cpu_kernels

            kernel = cpu_kernels.load(k_cache.dtype)
            assert kernel is not None and meta.cpu_plan is not None  # the engine chose cpu: it loaded
            dst = out[meta.num_prefill_tokens :]
            cpu_kernels.paged_decode(kernel, qd, k_cache, v_cache, meta.cpu_plan, meta.scale, dst)
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
    k = _gather(k_cache, seq.page_ids, q.dtype).flatten(0, 1)[: seq.context_len]
    v = _gather(v_cache, seq.page_ids, q.dtype).flatten(0, 1)[: seq.context_len]
    # [1, heads, n, hd] against [1, kv_heads, ctx, hd]: with a batch dimension (and GQA left to
    # SDPA) torch picks its fused CPU kernel, ~8x faster than the 3-D call on a 1,500-token prompt.
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = num_heads != num_kv_heads
    if seq.context_len == num_new:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.device.type == "cpu" and num_new >= SPLIT_MIN_NEW and _FLASH_CPU is not None:
        o = _prefill_split(qh, kh, vh, seq.context_len - num_new, scale)
    else:
        # Bottom-right causal: query i sits at position ctx - n + i.
        q_pos = torch.arange(seq.context_len - num_new, seq.context_len, device=q.device)
        k_pos = torch.arange(seq.context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


# The CPU flash-attention op behind SDPA, which also returns each query's log-sum-exp: what
# merging two partial attentions takes. Absent in a torch without it (the masked path then).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# A chunk of fewer new tokens attends with the mask: its [n, ctx] mask is small, and two
# kernel calls and a merge cost more than they save (measured at 16 tokens over 1k keys).
SPLIT_MIN_NEW = 32


def _prefill_split(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, num_prefix: int, scale: float) -> torch.Tensor:
    """Queries [1, heads, n, hd] at positions [P, P + n) over keys [1, kv_heads, P + n, hd]:
    the cached prefix (every query sees every key: no mask) and the new tokens (square causal)
    as two flash-attention calls, merged by their log-sum-exps. Without it SDPA turns the
    boolean [n, ctx] mask into a float one per layer and reads it in its inner loop: a third
    of a 4k-context prefill's attention on CPU (issue 21's profile: aten::where). In the
    prefix part the G query heads of one KV head stand as G * n rows of that head (no mask
    means no positions to keep apart), so K/V are read once per KV head, not repeated."""
    assert _FLASH_CPU is not None
    _, num_heads, num_new, head_dim = qh.shape
    num_kv_heads = kh.shape[1]
    stacked = qh.reshape(1, num_kv_heads, (num_heads // num_kv_heads) * num_new, head_dim)
    o_pre, lse_pre = _FLASH_CPU(stacked, kh[:, :, :num_prefix], vh[:, :, :num_prefix], 0.0, False, scale=scale)
    o_pre = o_pre.reshape(1, num_heads, num_new, head_dim)
    lse_pre = lse_pre.reshape(1, num_heads, num_new, 1)
    o_new, lse_new = _FLASH_CPU(qh, kh[:, :, num_prefix:], vh[:, :, num_prefix:], 0.0, True, scale=scale)
    lse_new = lse_new.unsqueeze(-1)
    m = torch.maximum(lse_pre, lse_new)  # both finite: every query sees a prefix key and itself
    w_pre, w_new = torch.exp(lse_pre - m), torch.exp(lse_new - m)
    merged: torch.Tensor = (o_pre * w_pre + o_new * w_new) / (w_pre + w_new)
    return merged


def _decode_batch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, run: DecodeRun, scale: float
) -> torch.Tensor:
    if run.prefix_pages is not None:
        return _decode_cascade(q, k_cache, v_cache, run, run.prefix_pages, scale)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_keys = run.bias.shape[-1]
    # One gather per layer: [B * width, page_size, kvh, hd] -> [B, kvh, L, hd]
    k = _gather(k_cache, run.pages, q.dtype).view(batch, num_keys, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather(v_cache, run.pages, q.dtype).view(batch, num_keys, num_kv_heads, head_dim).transpose(1, 2)
    # GQA as a reshape: query head h reads KV head h // group, so the `group` query heads of
    # one KV head become the query rows of one attention ([B, kvh, group, hd]); measured ~3x
    # faster on CPU than expanding K/V (see BENCHMARKS.md's decode-step profile).
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=run.bias, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def _decode_cascade(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    run: DecodeRun,
    prefix_pages: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode rows that share `prefix_pages`: softmax(q K^T) V over [shared keys | own keys],
    with the shared K/V gathered once and the two parts merged under one max per query."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_shared = prefix_pages.numel() * k_cache.shape[1]
    num_own = run.bias.shape[-1]
    # Shared part: every row's queries against one copy of the prefix, as one batched matmul
    # per KV head: [kvh, B * group, hd] x [kvh, hd, Ls].
    k_shared = _gather(k_cache, prefix_pages, q.dtype).view(num_shared, num_kv_heads, head_dim).transpose(0, 1)
    v_shared = _gather(v_cache, prefix_pages, q.dtype).view(num_shared, num_kv_heads, head_dim).transpose(0, 1)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    q_by_head = qg.transpose(0, 1).reshape(num_kv_heads, batch * group, head_dim)
    s_shared = torch.bmm(q_by_head, k_shared.transpose(1, 2)).mul_(scale)  # [kvh, B * group, Ls]
    # Own part: each row's keys after the prefix, padded and masked as in _decode_batch.
    k_own = _gather(k_cache, run.pages, q.dtype).view(batch, num_own, num_kv_heads, head_dim).transpose(1, 2)
    v_own = _gather(v_cache, run.pages, q.dtype).view(batch, num_own, num_kv_heads, head_dim).transpose(1, 2)
    s_own = torch.matmul(qg, k_own.transpose(-1, -2)).mul_(scale).add_(run.bias)  # [B, kvh, group, Lo]
    # One max per query over both parts; every row has an own key, so it is finite.
    m_shared = s_shared.amax(-1).view(num_kv_heads, batch, group).transpose(0, 1)
    m = torch.maximum(m_shared, s_own.amax(-1))  # [B, kvh, group]
    p_shared = torch.exp(s_shared.sub_(m.transpose(0, 1).reshape(num_kv_heads, batch * group, 1)))
    p_own = torch.exp(s_own.sub_(m[..., None]))
    denom = p_shared.sum(-1).view(num_kv_heads, batch, group).transpose(0, 1) + p_own.sum(-1)
    o_shared = torch.bmm(p_shared, v_shared).view(num_kv_heads, batch, group, head_dim).transpose(0, 1)
    o = torch.matmul(p_own, v_own).add_(o_shared).div_(denom[..., None])
    return o.reshape(batch, num_heads, head_dim)
