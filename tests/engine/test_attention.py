"""Paged attention against a contiguous, per-sequence reference."""

from __future__ import annotations

import torch

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
