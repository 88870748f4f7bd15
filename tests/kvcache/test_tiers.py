"""The prefix cache over device, host and disk tiers, driven by random sequences: invariants hold
after every operation, and every page handed back has exactly the contents written for it --
with and without pages written back to disk as they are cached (write_back_pages)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.disk import DiskTier
from kvcache.events import Tier
from kvcache.hashing import page_hashes
from kvcache.host import HostTier
from kvcache.pool import DevicePool, KVLayout
from kvcache.radix import PrefixCache

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4)
SHAPE = (1, 2, 4, 1, 2)
FP = b"t" * 16


def _content(page_hash: bytes) -> torch.Tensor:
    """What page `page_hash` holds: a function of the hash, so any mix-up is visible."""
    return torch.tensor(list(page_hash[:16]), dtype=torch.float32).view(SHAPE)


def _cache(directory: Path, write_back: int = 0) -> tuple[PrefixCache, DevicePool]:
    device = DevicePool(LAYOUT, 6, torch.float32)
    host = HostTier(LAYOUT, 3, torch.float32)
    disk = DiskTier(directory, FP, SHAPE, torch.float32, capacity_pages=6, sync_every_pages=1)
    return PrefixCache(device.pages, 4, device=device, host=host, disk=disk, write_back_pages=write_back), device


ops = st.lists(
    st.tuples(st.sampled_from(["run", "run", "release", "evict", "purge"]), st.integers(0, 4), st.integers(1, 4)),
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(ops, st.sampled_from([0, 0, 1, 2]))
def test_random_sequences_over_three_tiers(sequence: list[tuple[str, int, int]], write_back: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cache, device = _cache(Path(tmp), write_back)
        pool = device.pages
        held: list[list[int]] = []
        for op, which, n in sequence:
            salt = b"ab"[which % 2 : which % 2 + 1]
            if op == "run":
                tokens = list(range(which * 5, which * 5 + 4 * n))
                hashes = page_hashes(tokens, 4, salt, FP)
                got = cache.match(hashes, len(hashes))
                for page_hash, page_id in zip(hashes, got, strict=False):
                    assert torch.equal(device.read_page(page_id), _content(page_hash))
                fresh = cache.allocate(len(hashes) - len(got))
                if fresh is None:
                    pool.free(got)
                    continue
                for page_hash, page_id in zip(hashes[len(got):], fresh, strict=True):
                    device.write_page(page_id, _content(page_hash))  # "compute" the page
                cache.insert(hashes, got + fresh, len(got), salt)
                held.append(got + fresh)
            elif op == "release" and held:
                pool.free(held.pop(which % len(held)))
            elif op == "evict":
                cache.evict(n)
            elif op == "purge":
                cache.purge(salt)
                assert salt not in cache._disk_salts.values()  # its written-back copies went too
            cache.check_integrity()
            pool.check_integrity()
            assert cache.disk is not None
            cache.disk.check_integrity()
        for pages in held:
            pool.free(pages)
        cache.clear()
        assert pool.num_free == pool.num_pages
        if not write_back:
            assert cache.stats.written_back_pages == 0
        cache.disk.close()


def test_written_back_pages_stay_on_the_device_and_are_on_disk(tmp_path: Path) -> None:
    """write_back_pages=2: each whole block of two cached pages is copied to disk as it is
    inserted; the pages are still device pages (a match reads them there, the snapshot says
    so once), the records are on disk for a restarted process, and a purge removes both."""
    cache, device = _cache(tmp_path, write_back=2)
    hashes = page_hashes(list(range(12)), 4, b"a", FP)  # 3 pages
    pages = cache.allocate(3)
    assert pages is not None
    for page_hash, page_id in zip(hashes, pages, strict=True):
        device.write_page(page_id, _content(page_hash))
    cache.insert(hashes[:1], pages[:1], 0, b"a")  # one page: no whole block yet
    assert cache.stats.written_back_pages == 0
    cache.insert(hashes, pages, 1, b"a")  # pages 1-2: the block 0-1 is whole
    assert cache.stats.written_back_pages == 2 and cache.disk is not None
    cache.disk.flush()
    assert cache.disk.hashes() == hashes[:2] and [cache.tier_of(h) for h in hashes] == [Tier.DEVICE] * 3
    assert dict(cache.snapshot()[1]) == dict.fromkeys(hashes, Tier.DEVICE)
    record = cache.disk.get(hashes[1])
    assert record is not None and torch.equal(record, _content(hashes[1]))
    device.pages.free(pages)
    assert cache.purge(b"a") == 3 and cache.disk.hashes() == []
    cache.check_integrity()
    cache.disk.close()


def test_a_page_travels_down_and_back_up(tmp_path: Path) -> None:
    cache, device = _cache(tmp_path)
    hashes = page_hashes(list(range(8)), 4, b"", FP)
    pages = cache.allocate(2)
    assert pages is not None
    for page_hash, page_id in zip(hashes, pages, strict=True):
        device.write_page(page_id, _content(page_hash))
    cache.insert(hashes, pages, 0)
    device.pages.free(pages)
    cache.clear()  # both to host
    assert [cache.tier_of(h) for h in hashes] == [Tier.HOST, Tier.HOST]
    assert cache.host is not None and cache._make_host_room(2)
    cache.disk.flush()  # type: ignore[union-attr]
    assert [cache.tier_of(h) for h in hashes] == [Tier.DISK, Tier.DISK]
    got = cache.match(hashes, 2)
    assert [torch.equal(device.read_page(p), _content(h)) for p, h in zip(got, hashes, strict=True)] == [True, True]
    assert [cache.tier_of(h) for h in hashes] == [Tier.DEVICE, Tier.DEVICE]
    assert cache.stats.hit_pages_by_tier == [0, 0, 2] and cache.stats.promoted_pages == 2
    cache.check_integrity()
    device.pages.free(got)
    cache.evict(1)  # the leaf goes back down to the host: the snapshot shows both tiers
    seq, pages = cache.snapshot()
    assert dict(pages) == {hashes[0]: Tier.DEVICE, hashes[1]: Tier.HOST}
    assert seq == cache._seq > 0  # the index rebuilds from here and follows events after seq


def test_load_many_copies_runs_of_slots_into_scattered_pages() -> None:
    """Host promotions in one go (PrefixCache.match): runs of consecutive slots and gaps, device
    pages in any order; every other page untouched."""
    import pytest

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4)
    host = HostTier(layout, 8, torch.float32)
    host.slab.copy_(torch.arange(host.slab.numel(), dtype=torch.float32).view(host.slab.shape) + 1)
    pool = DevicePool(layout, 10, torch.float32)
    slots, pages = [2, 3, 4, 0, 6, 7], [9, 1, 5, 3, 0, 8]
    host.load_many(slots, pool.kv, pages)
    for slot, page in zip(slots, pages, strict=True):
        assert torch.equal(pool.read_page(page), host.slab[slot])
    assert all(not pool.read_page(p).any() for p in range(10) if p not in pages)
    assert host.bytes_out == len(slots) * host.slab[0].numel() * 4
    with pytest.raises(ValueError, match="2 pages"):
        host.load_many([1], pool.kv, [1, 2])


def test_store_many_takes_what_fits_in_order() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4)
    host = HostTier(layout, 3, torch.float32)
    pool = DevicePool(layout, 10, torch.float32)
    pool.kv.copy_(torch.arange(pool.kv.numel(), dtype=torch.float32).view(pool.kv.shape))
    slots = host.store_many(pool.kv, [6, 1, 8, 3])
    assert slots == [0, 1, 2] and host.num_free == 0
    for slot, page in zip(slots, [6, 1, 8], strict=True):
        assert torch.equal(host.load(slot), pool.read_page(page))
    assert host.store_many(pool.kv, [4]) == []
