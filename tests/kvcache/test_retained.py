"""Retained copies (kvcache.retained): references on cached pages, under a lease and a budget;
released, the pages stay cached and the pool is back where it was."""

from __future__ import annotations

import pytest

from kvcache.hashing import page_hashes
from kvcache.pool import PagePool
from kvcache.radix import PrefixCache
from kvcache.retained import RetainedCopies

FP = b"f" * 16
PS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cached(cache: PrefixCache, pool: PagePool, start: int, n_pages: int) -> list[bytes]:
    """n_pages of a prompt computed and finished: cached, nobody holding them."""
    hashes = page_hashes(list(range(start, start + n_pages * PS)), PS, b"", FP)
    pages = pool.allocate(n_pages)
    assert pages is not None
    cache.insert(hashes, pages, 0)
    pool.free(pages)
    return hashes


def test_a_copy_is_held_until_its_lease_then_stays_cached() -> None:
    pool, clock = PagePool(16), Clock()
    cache = PrefixCache(pool, PS)
    copies = RetainedCopies(cache, pool, max_pages=8, clock=clock)
    hashes = _cached(cache, pool, 0, 3)
    assert copies.hold("a", hashes, lease_s=60) == 3 and copies.num_held_pages == 3
    assert cache.evict(16) == 0  # held: the cache can evict none of them
    clock.now = 10
    copies.lease("a", 5)  # its push ended: 5 s from now, not 60 from the hold
    clock.now = 14.9
    assert copies.expire() == 0 and "a" in copies
    clock.now = 15
    assert copies.expire() == 1 and "a" not in copies and copies.released["lease"] == 1
    assert copies.num_held_pages == 0 and cache.num_cached_pages == 3  # cached still, evictable again
    assert pool.num_free == 16 - 3 and cache.evict(16) == 3 and pool.num_free == 16
    cache.check_integrity()


def test_the_budget_lets_the_oldest_copies_go_first() -> None:
    pool, clock = PagePool(32), Clock()
    cache = PrefixCache(pool, PS)
    copies = RetainedCopies(cache, pool, max_pages=5, clock=clock)
    a, b, c = (_cached(cache, pool, 1000 * i, 2) for i in range(3))
    assert copies.hold("a", a, 60) == 2 and copies.hold("b", b, 60) == 2
    assert copies.hold("c", c, 60) == 2  # 6 > 5: a goes
    assert "a" not in copies and "b" in copies and "c" in copies and copies.released == {"budget": 1}
    big = _cached(cache, pool, 9000, 7)
    assert copies.hold("big", big, 60) == 5  # never more than the budget: its leading 5 pages
    assert len(copies) == 1 and copies.num_held_pages == 5 and copies.released["budget"] == 3
    copies.clear()
    assert copies.num_held_pages == 0 and copies.released["released"] == 1
    assert pool.num_free + cache.num_cached_pages == 32  # every page free or only cached
    cache.check_integrity()


def test_only_the_pages_the_cache_still_has_are_held() -> None:
    pool = PagePool(8)
    cache = PrefixCache(pool, PS)
    copies = RetainedCopies(cache, pool, max_pages=8)
    hashes = _cached(cache, pool, 0, 4)
    cache.evict(1)  # the last page left (a leaf, least recently used)
    assert copies.hold("a", hashes, 60) == 3  # the leading pages it has; the rest is recomputed
    assert copies.hold("a", hashes[:2], 60) == 2 and copies.num_held_pages == 2  # held again: replaced
    assert copies.release("a") and not copies.release("a")
    assert pool.num_free + cache.num_cached_pages == 8


def test_without_a_cache_or_a_budget_nothing_is_held() -> None:
    pool = PagePool(8)
    assert RetainedCopies(None, pool, max_pages=8).hold("a", [b"x" * 16], 60) == 0
    cache = PrefixCache(pool, PS)
    assert RetainedCopies(cache, pool, max_pages=0).hold("a", _cached(cache, pool, 0, 2), 60) == 0
    with pytest.raises(ValueError):
        RetainedCopies(cache, pool, max_pages=-1)


def test_a_prefix_copies_share_counts_once_in_the_budget() -> None:
    """RAG and agent prompts share a long header: copies of such prompts hold its pages once,
    and the budget counts them once, so it keeps as many copies as their distinct pages allow."""
    pool, clock = PagePool(32), Clock()
    cache = PrefixCache(pool, PS)
    copies = RetainedCopies(cache, pool, max_pages=5, clock=clock)
    header = list(range(3 * PS))  # 3 pages every prompt starts with

    def prompt(tail: int) -> list[bytes]:
        hashes = page_hashes(header + [tail] * PS, PS, b"", FP)
        pages = pool.allocate(4)
        assert pages is not None
        taken = cache.insert(hashes, pages, 0)  # the header's pages are cached already after the first
        pool.free(pages)
        assert taken >= 1
        return hashes

    a, b, c = prompt(7001), prompt(7002), prompt(7003)
    assert copies.hold("a", a, 60) == 4 and copies.hold("b", b, 60) == 4
    assert len(copies) == 2 and copies.num_held_pages == 5  # 3 shared + 1 + 1: within the budget
    assert copies.hold("c", c, 60) == 4  # 6 distinct > 5: the oldest goes, and only it
    assert list(copies.released.elements()) == ["budget"] and "b" in copies and "c" in copies
    assert copies.num_held_pages == 5
    copies.release("b", "released")
    assert copies.num_held_pages == 4 and cache.evict(32) == 2  # a's and b's own pages; c holds the rest
    copies.clear()
    assert copies.num_held_pages == 0 and pool.num_free + cache.num_cached_pages == 32
    cache.check_integrity()
