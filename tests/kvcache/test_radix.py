"""The radix tree over pages: exact scenarios and random sequences against its invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.hashing import ROOT_HASH, cache_salt, page_hash, page_hashes, tenant_of
from kvcache.pool import PagePool
from kvcache.radix import EventKind, KVEvent, PrefixCache

FP = b"f" * 16


def _hashes(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return page_hashes(tokens, 4, salt, FP)


def test_hashes_chain_and_salt() -> None:
    a = _hashes(list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3 and all(len(h) == 16 for h in a)
    assert _hashes(list(range(10))) == a[:2]  # only full pages
    assert _hashes([99, *range(1, 12)])[1] != a[1]  # page 1's hash covers page 0's tokens
    assert _hashes(list(range(12)), b"tenant-b") != a
    assert a[1] == page_hash(a[0], [4, 5, 6, 7], b"", FP)
    assert page_hashes(list(range(4, 12)), 4, b"", FP, parent=a[0]) == a[1:]
    assert ROOT_HASH == bytes(16)
    # a request's own salt narrows its tenant's (kvcache.hashing.cache_salt); the tenant stays findable
    assert cache_salt("acme", "x") == "acme\x1fx" and tenant_of("acme\x1fx") == "acme" == tenant_of("acme")
    assert tenant_of(b"acme\x1fx") == b"acme" and tenant_of(b"acme-x") == b"acme-x"


def test_match_insert_evict_scenario() -> None:
    pool = PagePool(6)
    events: list[KVEvent] = []
    cache = PrefixCache(pool, 4, worker_id="w1", epoch=3, on_event=events.append)
    h = _hashes(list(range(12)))
    pages = pool.allocate(3)
    assert pages == [0, 1, 2]
    cache.insert(h, pages, 0)
    assert [e.kind for e in events] == [EventKind.STORED] and events[0].page_hashes == tuple(h)
    assert (events[0].worker_id, events[0].epoch, events[0].seq) == ("w1", 3, 1)
    pool.free(pages)  # the request finishes: pages stay cached (the tree's reference)
    assert pool.num_free == 3 and cache.num_cached_pages == 3
    got = cache.match(h, max_pages=2)
    assert got == [0, 1] and pool.refcount(0) == 2
    assert cache.evict(3) == 1  # only the leaf nobody holds (page 2) can go
    assert events[-1].kind == EventKind.REMOVED and events[-1].page_hashes == (h[2],)
    pool.free(got)
    assert cache.evict(5) == 2 and pool.num_free == 6  # now the rest, leaf first
    assert [e.seq for e in events] == [1, 2, 3, 4]  # one REMOVED per evicted page
    cache.check_integrity()


def test_allocate_evicts_least_recently_used_first() -> None:
    pool = PagePool(4)
    cache = PrefixCache(pool, 4)
    old, new = _hashes(list(range(8))), _hashes(list(range(100, 108)))
    for hashes in (old, new):
        pages = pool.allocate(2)
        assert pages is not None
        cache.insert(hashes, pages, 0)
        pool.free(pages)
    cache.match(new, 2)
    pool.free([2, 3])  # touch `new`, then let it go
    assert cache.allocate(2) == [1, 0]  # old's pages (leaf first) were evicted
    assert old[0] not in cache and new[0] in cache
    assert cache.allocate(3) is None and pool.num_free == 2  # new's pages freed, still not enough
    cache.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "evict", "release"]), st.integers(0, 5), st.integers(1, 5)), max_size=50))
def test_random_sequences_keep_the_invariants(ops: list[tuple[str, int, int]]) -> None:
    pool = PagePool(24)
    cache = PrefixCache(pool, 4)
    held: list[list[int]] = []  # pages each live "request" holds
    prefixes = [list(range(k * 3, k * 3 + 20)) for k in range(6)]
    for op, which, n in ops:
        if op == "run":  # two tenants; some prefixes are a session's (evicted last within the tenant)
            tokens, salt, session = prefixes[which][: 4 * n], (b"a", b"b")[which % 2], which in (1, 4)
            hashes = _hashes(tokens, salt)
            got = cache.match(hashes, len(hashes), session=session)
            fresh = cache.allocate(len(hashes) - len(got))
            if fresh is None:
                pool.free(got)
            else:
                pages = got + fresh
                cache.insert(hashes, pages, len(got), salt, session)
                held.append(pages)
        elif op == "evict":
            cache.evict(n)
        elif held:
            pool.free(held.pop(which % len(held)))
        cache.check_integrity()
        pool.check_integrity()
        in_use = {p for pages in held for p in pages}
        assert pool.num_free + len(set(cache.cached_page_ids()) - in_use) + len(in_use) == pool.num_pages
    for pages in held:
        pool.free(pages)
    cache.clear()
    assert pool.num_free == pool.num_pages and cache.num_cached_pages == 0


def test_purge_removes_a_tenants_subtree_even_in_use() -> None:
    pool = PagePool(8)
    cache = PrefixCache(pool, 4)
    mine, theirs = _hashes(list(range(8)), b"a"), _hashes(list(range(8)), b"b")
    a_pages, b_pages = pool.allocate(2), pool.allocate(2)
    assert a_pages and b_pages
    cache.insert(mine, a_pages, 0, b"a")
    cache.insert(theirs, b_pages, 0, b"b")
    pool.free(b_pages)  # b's request ended; a's still runs
    assert cache.purge(b"a") == 2
    assert mine[0] not in cache and theirs[0] in cache
    assert pool.refcount(a_pages[0]) == 1  # the running request keeps its own reference
    cache.check_integrity()
    pool.free(a_pages)
    assert pool.num_free == 6


def test_pages_past_their_time_to_live_are_not_reused() -> None:
    pool = PagePool(4)
    cache = PrefixCache(pool, 4, ttl_s=60.0)
    hashes = _hashes(list(range(8)))
    pages = pool.allocate(2)
    assert pages is not None
    cache.insert(hashes, pages, 0)
    pool.free(pages)
    got = cache.match(hashes, 2)
    assert got == pages
    pool.free(got)
    for node in cache._nodes.values():  # age the pages past the TTL
        node.created -= 61.0
    assert cache.match(hashes, 2) == []
    assert hashes[0] not in cache and pool.num_free == 4
    cache.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "extend", "evict", "release"]), st.integers(0, 5), st.integers(1, 5)),
                max_size=60))  # fmt: skip
def test_eviction_takes_the_least_recently_used_evictable_pages(ops: list[tuple[str, int, int]]) -> None:
    """Whatever came before (hits, prefixes extended from the middle, pages held and let go
    without being touched): an eviction takes the oldest pages only the tree holds, leaves
    first, and stops short only when none is left."""
    pool = PagePool(24)
    removed: list[bytes] = []
    cache = PrefixCache(pool, 4, on_event=lambda e: removed.extend(e.page_hashes) if e.kind == EventKind.REMOVED else None)
    held: list[list[int]] = []
    prefixes = [list(range(k * 3, k * 3 + 20)) for k in range(6)]
    for op, which, n in ops:
        if op in ("run", "extend"):
            hashes = _hashes(prefixes[which][: 4 * n])
            got = cache.match(hashes, len(hashes) if op == "run" else min(1, len(hashes)))
            fresh = cache.allocate(len(hashes) - len(got))
            if fresh is None:
                pool.free(got)
            else:
                cache.insert(hashes, got + fresh, len(got))  # "extend": pages after the first are offered untouched
                held.append(got + fresh)
        elif op == "release" and held:
            pool.free(held.pop(which % len(held)))
        elif op == "evict":
            age = {h: node.last_access for h, node in cache._nodes.items()}
            leaves = {h for h, node in cache._nodes.items() if not node.children}
            removed.clear()
            assert cache.evict(n) == len(removed) <= n
            left = [node for node in cache._nodes.values() if pool.refcount(node.page_id) == 1 and not node.children]
            if len(removed) < n:
                assert not left  # it stopped because nothing else could go
            # a page that was a leaf before, and could go, is no younger than any page taken
            # (a parent whose last child was just taken may be older: leaves go first)
            older = [node.last_access for node in left if node.hash in leaves]
            if removed and older:
                assert max(age[h] for h in removed) <= min(older)
        cache.check_integrity()
    for pages in held:
        pool.free(pages)
    cache.clear()
    assert pool.num_free == pool.num_pages


def test_an_eviction_reads_a_few_candidates_not_the_whole_tree() -> None:
    """A full cache of 4,096 pages: making room for one page looks at a handful of them (it
    had scanned every node for each page a step allocated: ~28 ms at 16k pages)."""
    pool = PagePool(4096)
    cache = PrefixCache(pool, 4)
    for s in range(1024):
        pages = pool.allocate(4)
        assert pages is not None
        cache.insert(_hashes(list(range(s * 16, s * 16 + 16))), pages, 0)
        pool.free(pages)
    looked = 0
    refcount = pool.refcount

    def counted(page_id: int) -> int:
        nonlocal looked
        looked += 1
        return refcount(page_id)

    pool.refcount = counted  # type: ignore[method-assign]
    for _ in range(20):
        assert cache.allocate(1) is not None
    assert looked <= 2 * 20  # a leaf per page, at most a stale entry besides


def _cached(cache: PrefixCache, pool: PagePool, tokens: list[int], salt: bytes, session: bool = False) -> list[bytes]:
    """A finished request's pages, left in the cache (only the tree holds them)."""
    hashes = _hashes(tokens, salt)
    pages = pool.allocate(len(hashes))
    assert pages is not None
    cache.insert(hashes, pages, 0, salt, session)
    pool.free(pages)
    return hashes


def test_a_sessions_pages_are_evicted_last_within_its_tenant_and_lru_between_tenants() -> None:
    pool = PagePool(8)
    cache = PrefixCache(pool, 4)
    conv = _cached(cache, pool, list(range(100, 108)), b"acme", session=True)  # oldest: a conversation
    other = _cached(cache, pool, list(range(200, 204)), b"globex")  # another tenant's page
    salted = _cached(cache, pool, list(range(300, 308)), b"acme\x1fteam-a")  # acme's, with a request salt
    cache.check_integrity()
    # LRU would take the conversation's leaf first: acme's least recently used page that no
    # session uses goes in its place; the other tenant's is taken in LRU order.
    assert cache.evict(3) == 3
    assert conv[1] in cache and conv[0] in cache
    assert other[0] not in cache and salted[1] not in cache and salted[0] not in cache
    cache.check_integrity()
    assert cache.evict(2) == 2 and not any(h in cache for h in conv)  # nothing else left: the session's go
    cache.check_integrity()


def test_a_page_a_session_reuses_is_kept_like_the_sessions_own() -> None:
    pool = PagePool(8)
    cache = PrefixCache(pool, 4)
    shared = _cached(cache, pool, list(range(100, 104)), b"acme")  # a system prompt, computed outside a session
    plain = _cached(cache, pool, list(range(200, 204)), b"acme")
    pool.free(cache.match(shared, 1, session=True))  # a session's request reuses it
    pool.free(cache.match(plain, 1))  # and the other page is used after it: LRU would take `shared`
    cache.check_integrity()
    assert cache.evict(1) == 1 and shared[0] in cache and plain[0] not in cache
