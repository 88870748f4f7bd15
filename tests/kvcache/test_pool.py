from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.pool import DevicePool, KVLayout, PagePool


def test_allocate_hands_out_pages_in_order_and_refuses_overflow() -> None:
    pool = PagePool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None  # no partial allocation
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None
    pool.check_integrity()


def test_freed_pages_are_reused_last() -> None:
    pool = PagePool(4)
    first = pool.allocate(2)
    assert first == [0, 1]
    pool.free([0])
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [0]


def test_shared_page_returns_only_when_every_reference_is_dropped() -> None:
    pool = PagePool(2)
    pages = pool.allocate(1)
    assert pages == [0]
    pool.share(pages)
    assert pool.refcount(0) == 2
    pool.free(pages)
    assert pool.num_free == 1 and pool.refcount(0) == 1
    pool.free(pages)
    assert pool.num_free == 2
    pool.check_integrity()


def test_double_free_and_share_of_free_page_are_errors() -> None:
    pool = PagePool(2)
    pool.free(pool.allocate(1) or [])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([0])
    with pytest.raises(RuntimeError, match="not held"):
        pool.share([1])


def test_integrity_check_catches_corruption() -> None:
    pool = PagePool(3)
    pool.allocate(1)
    pool._refcount[0] = 0  # simulate a lost reference
    with pytest.raises(AssertionError):
        pool.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 6)), max_size=60))
def test_random_operations_keep_the_invariants(ops: list[tuple[str, int]]) -> None:
    pool = PagePool(16)
    held: list[int] = []  # one entry per reference
    for op, n in ops:
        if op == "alloc":
            got = pool.allocate(n)
            if n > pool.num_free + (len(got) if got else 0):
                assert got is None
            if got is not None:
                held.extend(got)
        elif op == "free" and held:
            victims = held[: min(n, len(held))]
            del held[: len(victims)]
            # a page may be listed twice when shared; free one reference per listing
            for page in victims:
                pool.free([page])
        elif op == "share" and held:
            page = held[n % len(held)]
            pool.share([page])
            held.append(page)
        pool.check_integrity()
        assert pool.num_used == len(set(held))
    for page in held:
        pool.free([page])
    pool.check_integrity()
    assert pool.num_free == 16


def test_device_pool_layout_and_budget() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16)
    # 4 layers * K,V * 16 tokens * 2 heads * 64 dims * 4 bytes
    assert layout.page_bytes(torch.float32) == 4 * 2 * 16 * 2 * 64 * 4
    assert layout.num_pages_for_budget(10 * layout.page_bytes(torch.float32) + 1, torch.float32) == 10
    pool = DevicePool(layout, 8, torch.float32)
    assert pool.kv.shape == (4, 2, 9, 16, 2, 64)  # + the scratch page
    assert pool.scratch_page == 8 and pool.num_pages == 8
    k, v = pool.layer(1)
    assert k.shape == (9, 16, 2, 64) and k.data_ptr() != v.data_ptr()
    pool.check_integrity()
