"""Paged attention against a contiguous, per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from engine import attention
from engine.attention import AttnMetadata, PrefillSeq, paged_attention, write_kv

PAGE = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n positions of k/v [ctx, KVH, D]; plain causal softmax attention."""
    n, ctx = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def test_mixed_prefill_and_decode_batch_matches_reference() -> None:
    torch.manual_seed(0)
    num_pages = 40
    k_cache = torch.zeros(num_pages, PAGE, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    # (context_len, new tokens): fresh prefill, prefill after a cached prefix, decodes
    seqs = [(7, 7), (13, 5), (9, 1), (1, 1), (16, 1)]
    perm = torch.randperm(num_pages).tolist()
    pages, full_k, full_v = [], [], []
    for ctx, _ in seqs:
        n_pages = -(-ctx // PAGE)
        pages.append([perm.pop() for _ in range(n_pages)])
        full_k.append(torch.randn(ctx, KV_HEADS, DIM))
        full_v.append(torch.randn(ctx, KV_HEADS, DIM))
    # The cached prefix of each sequence is already in its pages.
    for (ctx, new), pg, k, v in zip(seqs, pages, full_k, full_v, strict=True):
        slots = torch.tensor(
            [pg[p // PAGE] * PAGE + p % PAGE for p in range(ctx - new)], dtype=torch.int64
        )
        write_kv(k_cache, v_cache, k[: ctx - new], v[: ctx - new], slots)

    qs = [torch.randn(new, HEADS, DIM) for _, new in seqs]
    slots, new_k, new_v = [], [], []
    prefills, start = [], 0
    for (ctx, new), pg, k, v in zip(seqs, pages, full_k, full_v, strict=True):
        slots += [pg[p // PAGE] * PAGE + p % PAGE for p in range(ctx - new, ctx)]
        new_k.append(k[ctx - new :])
        new_v.append(v[ctx - new :])
        if new > 1:
            prefills.append(PrefillSeq(start, new, ctx, torch.tensor(pg)))
            start += new
    decodes = [(ctx, pg) for (ctx, new), pg in zip(seqs, pages, strict=True) if new == 1]
    max_pages = max(len(pg) for _, pg in decodes)
    table = torch.tensor([pg + [0] * (max_pages - len(pg)) for _, pg in decodes])
    lens = torch.tensor([ctx for ctx, _ in decodes])
    meta = AttnMetadata(torch.tensor(slots), tuple(prefills), start, table, lens, DIM**-0.5)

    write_kv(k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), meta.slot_mapping)
    out = paged_attention(torch.cat(qs), k_cache, v_cache, meta)

    expected = torch.cat(
        [_reference(q, k, v, DIM**-0.5) for q, k, v in zip(qs, full_k, full_v, strict=True)]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS])  # grouped queries, and one KV head per query head
@pytest.mark.parametrize(("ctx", "new"), [(77, 40), (96, 32), (200, 150)])  # prefix mid-page, page-aligned, short
def test_a_chunk_after_a_cached_prefix_attends_in_two_parts_like_the_reference(
    ctx: int, new: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU a chunk of at least SPLIT_MIN_NEW tokens after a cached prefix attends without a
    mask: the prefix (no mask) and the new tokens (causal), merged by log-sum-exp."""
    assert attention._FLASH_CPU is not None, "this torch has the CPU flash-attention op"
    assert new >= attention.SPLIT_MIN_NEW
    calls = []
    split = attention._prefill_split
    monkeypatch.setattr(attention, "_prefill_split", lambda *a, **kw: calls.append(1) or split(*a, **kw))
    torch.manual_seed(ctx + kv_heads)
    num_pages = -(-ctx // PAGE) + 3
    k_cache = torch.randn(num_pages, PAGE, kv_heads, DIM)  # noise in every slot the sequence does not own
    v_cache = torch.randn_like(k_cache)
    pages = torch.randperm(num_pages)[: -(-ctx // PAGE)]
    k, v = torch.randn(ctx, kv_heads, DIM), torch.randn(ctx, kv_heads, DIM)
    slots = pages[torch.arange(ctx) // PAGE] * PAGE + torch.arange(ctx) % PAGE
    write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(new, HEADS, DIM)
    meta = AttnMetadata(slots[ctx - new :], (PrefillSeq(0, new, ctx, pages),), new, torch.zeros(0, 1, dtype=torch.int64),
                        torch.zeros(0, dtype=torch.int64), DIM**-0.5)  # fmt: skip
    out = paged_attention(q, k_cache, v_cache, meta)
    group = HEADS // kv_heads
    scores = torch.einsum("nhd,chd->hnc", q, k.repeat_interleave(group, 1)) * DIM**-0.5
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > torch.arange(ctx - new, ctx)[:, None], float("-inf"))
    expected = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v.repeat_interleave(group, 1))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert calls == [1]


def test_decode_groups_attend_like_one_padded_batch() -> None:
    from engine.attention import decode_groups, decode_runs

    gen = torch.Generator().manual_seed(3)
    num_pages = 64
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=gen)
    lens = [61, 40, 33, 9, 8, 5, 2]  # longest first, as the runner orders decode rows
    pages = [-(-n // PAGE) for n in lens]
    groups = decode_groups(pages)
    assert groups == ((0, 3, 16), (3, 6, 3), (6, 7, 1))  # pages 16,10,9 | 3,2,2 | 1: within 2x
    table = torch.randint(0, num_pages, (len(lens), max(pages)), generator=gen)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    slots = torch.zeros(len(lens), dtype=torch.int64)
    one = AttnMetadata(slots, (), 0, table, torch.tensor(lens), DIM**-0.5)
    runs = decode_runs(table, torch.tensor(lens), PAGE, q.dtype, groups)
    assert [(r.first, r.end, r.bias.shape[-1]) for r in runs] == [(0, 3, 64), (3, 6, 12), (6, 7, 4)]
    grouped = AttnMetadata(slots, (), 0, table, torch.tensor(lens), DIM**-0.5, decode_runs=runs)
    torch.testing.assert_close(
        paged_attention(q, k_cache, v_cache, grouped), paged_attention(q, k_cache, v_cache, one), rtol=1e-5, atol=1e-5
    )


def _shared_prefix_batch(
    gen: torch.Generator, shared: int, own_lens: list[int], num_pages: int = 96
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Decode rows whose first `shared` pages are the same page ids (a cached prefix), then
    pages of their own; returns K/V pools, the padded page table, lengths and the shared ids."""
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=gen)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    prefix = [perm.pop() for _ in range(shared)]
    rows, lens = [], []
    for own in own_lens:
        n = shared * PAGE + own
        rows.append(prefix + [perm.pop() for _ in range(-(-own // PAGE))])
        lens.append(n)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return k_cache, v_cache, table, torch.tensor(lens), prefix


def test_rows_sharing_a_prefix_attend_in_cascade_like_a_padded_batch() -> None:
    from engine.attention import MIN_SHARED_PAGES, decode_groups, decode_runs

    gen = torch.Generator().manual_seed(5)
    own_lens = [9, 7, 4, 1, 1]  # a row whose only own key is the one it just wrote, too
    k_cache, v_cache, table, lens, prefix = _shared_prefix_batch(gen, MIN_SHARED_PAGES + 2, own_lens)
    q = torch.randn(len(own_lens), HEADS, DIM, generator=gen)
    slots = torch.zeros(len(own_lens), dtype=torch.int64)
    groups = decode_groups([len(r) for r in table.tolist()])
    assert len(groups) == 1
    runs = decode_runs(table, lens, PAGE, q.dtype, groups, cascade=[True])
    assert runs[0].prefix_pages is not None and runs[0].prefix_pages.tolist() == prefix
    assert runs[0].bias.shape[-1] == 3 * PAGE  # only the keys after the prefix are padded
    plain = AttnMetadata(slots, (), 0, table, lens, DIM**-0.5)
    cascade = AttnMetadata(slots, (), 0, table, lens, DIM**-0.5, decode_runs=runs)
    got = paged_attention(q, k_cache, v_cache, cascade)
    torch.testing.assert_close(got, paged_attention(q, k_cache, v_cache, plain), rtol=1e-5, atol=1e-5)
    for row, n in enumerate(lens.tolist()):  # and against the contiguous reference, row by row
        ids = table[row, : -(-n // PAGE)]
        k = k_cache.index_select(0, ids).flatten(0, 1)[:n]
        v = v_cache.index_select(0, ids).flatten(0, 1)[:n]
        torch.testing.assert_close(got[row : row + 1], _reference(q[row : row + 1], k, v, DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_cascade_needs_enough_shared_full_pages_and_float32() -> None:
    from engine.attention import MIN_SHARED_PAGES, decode_runs, shared_pages

    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, table, lens, _ = _shared_prefix_batch(gen, MIN_SHARED_PAGES - 1, [5, 6])
    assert decode_runs(table, lens, PAGE, torch.float32, cascade=[True])[0].prefix_pages is None
    _, _, table, lens, _ = _shared_prefix_batch(gen, MIN_SHARED_PAGES + 1, [5, 6])
    assert shared_pages(table, lens, PAGE) == MIN_SHARED_PAGES + 1
    assert decode_runs(table, lens, PAGE, torch.bfloat16, cascade=[True])[0].prefix_pages is None
    assert decode_runs(table, lens, PAGE, torch.float32, cascade=[False])[0].prefix_pages is None
    assert shared_pages(table[:1], lens[:1], PAGE) == 0  # one row shares nothing
    # A row whose last key sits in the last common page keeps that page as its own.
    lens = torch.tensor([(MIN_SHARED_PAGES + 1) * PAGE, 40])
    assert shared_pages(table, lens, PAGE) == MIN_SHARED_PAGES


def test_the_runner_puts_rows_of_one_prefix_together_and_the_rest_longest_first() -> None:
    from engine.attention import decode_groups
    from engine.runner import order_decodes, prefix_keys
    from engine.scheduler import ScheduledRequest

    class Req:
        def __init__(self, pages: list[int], computed: int) -> None:
            self.page_ids, self.num_computed_tokens = pages, computed

    made = [Req([7, 1], 5), Req([3, 4], 30), Req([9, 2], 6), Req([3, 5], 20), Req([9, 6], 7), Req([8], 2)]
    rows = [ScheduledRequest(r, 1) for r in made]  # type: ignore[arg-type]
    ordered, keys = order_decodes(rows)  # type: ignore[arg-type]
    assert [r.page_ids[0] for r, _ in ordered] == [3, 3, 9, 9, 7, 8]
    assert [r.num_computed_tokens for r, _ in ordered] == [30, 20, 7, 6, 5, 2]
    assert keys == prefix_keys(ordered) == [3, 3, 9, 9, -1, -1]  # type: ignore[arg-type]
    widths = [-(-(r.num_computed_tokens + 1) // PAGE) for r, _ in ordered]
    assert decode_groups(widths, keys) == ((0, 2, 8), (2, 4, 2), (4, 6, 2))
