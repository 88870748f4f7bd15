"""The disk tier: record codec, batched fsync, LRU capacity, re-index, faults, compaction."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.disk import DiskTier
from kvcache.disk_record import (
    HEADER_SIZE,
    decode_header,
    decode_page,
    encode_record,
    is_payload_intact,
    scan_segment,
)

SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, page_size, kv_heads, head_dim]: 256 elements
FP = hashlib.blake2b(b"model-a", digest_size=16).digest()
OTHER_FP = hashlib.blake2b(b"model-b", digest_size=16).digest()
RECORD = HEADER_SIZE + 256 * 4  # one float32 record


def h(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def page(i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A page whose content is a function of `i` (a page hash names its content)."""
    gen = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=gen).to(dtype)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-exact equality (so -0.0 and NaN payloads count too)."""
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("seg-*.bkv"))


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    opened: list[DiskTier] = []

    def make(**kwargs: object) -> DiskTier:
        args: dict[str, object] = dict(
            directory=tmp_path / "disk", fingerprint=FP, page_shape=SHAPE,
            dtype=torch.float32, capacity_pages=100, sync_every_pages=1000, sync_interval_s=1e9,
        )  # fmt: skip
        args.update(kwargs)
        tier = DiskTier(**args)  # type: ignore[arg-type]
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


# ---- record codec ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_record_round_trips_every_dtype_bit_exactly(dtype: torch.dtype) -> None:
    src = page(7, dtype)
    src.view(-1)[0] = float("nan")
    record = encode_record(FP, h(7), src)
    header = decode_header(record)
    assert header is not None
    assert (header.fingerprint, header.page_hash, header.shape) == (FP, h(7), SHAPE)
    assert header.record_len == len(record) == HEADER_SIZE + src.numel() * src.element_size()
    payload = memoryview(record)[HEADER_SIZE:]
    assert is_payload_intact(header, payload)
    out = decode_page(header, payload)
    assert same(out, src)
    out.add_(1)  # the decoded page owns writable memory


def test_a_flipped_header_byte_is_rejected() -> None:
    record = bytearray(encode_record(FP, h(1), page(1)))
    for offset in (5, 30, 75):  # version, page hash, payload length
        damaged = bytearray(record)
        damaged[offset] ^= 0x01
        assert decode_header(bytes(damaged)) is None


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3 * RECORD - 1), st.integers(1, 255), st.integers(0, 3 * RECORD))
def test_scan_never_yields_a_damaged_record_as_intact(flip: int, xor: int, cut: int) -> None:
    records = [encode_record(FP, h(i), page(i)) for i in range(3)]
    data = bytearray(b"".join(records))
    data[flip] ^= xor
    scan = scan_segment(bytes(data[:cut]))
    for rec in scan.records:
        i = rec.offset // RECORD
        assert rec.offset == i * RECORD
        if rec.is_intact:
            assert data[rec.offset : rec.offset + RECORD] == records[i]
    assert not any(r.offset // RECORD == flip // RECORD and r.is_intact for r in scan.records)


def test_scan_resynchronises_after_a_damaged_header() -> None:
    records = [encode_record(FP, h(i), page(i)) for i in range(3)]
    data = bytearray(b"".join(records))
    data[RECORD + 10] ^= 0xFF  # the second record's fingerprint
    scan = scan_segment(bytes(data))
    assert [r.offset for r in scan.records] == [0, 2 * RECORD]
    assert scan.num_bad_headers == 1 and scan.torn_tail_bytes == 0


# ---- the tier ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_put_flush_get_round_trip(open_tier: Callable[..., DiskTier], dtype: torch.dtype) -> None:
    tier = open_tier(dtype=dtype)
    for i in range(5):
        assert tier.put(h(i), page(i, dtype)) == []
    tier.flush()
    for i in range(5):
        assert same(tier.get(h(i)), page(i, dtype))
    assert tier.get(h(99)) is None
    stats = tier.stats()
    assert (stats.records, stats.hits, stats.misses, stats.corrupt) == (5, 5, 1, 0)
    tier.check_integrity()


def test_one_fsync_covers_a_batch_of_records(
    open_tier: Callable[..., DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    tier = open_tier(sync_every_pages=16)
    for i in range(15):
        tier.put(h(i), page(i))
    # Given 15 appended records, none is durable yet, so none is visible.
    assert calls == [] and tier.hashes() == [] and not tier.contains(h(0))
    assert tier.get(h(0)) is None and tier.stats().pending == 15
    # When the 16th arrives, one fsync (plus one for the new file's directory entry) covers all.
    tier.put(h(15), page(15))
    assert len(calls) <= 2
    assert sorted(tier.hashes()) == sorted(h(i) for i in range(16))
    for i in range(16, 20):
        tier.put(h(i), page(i))
    assert not tier.contains(h(19))
    tier.flush()
    assert len(calls) <= 3 and tier.contains(h(19)) and tier.stats().pending == 0
    tier.flush()  # nothing new: no fsync
    assert len(calls) <= 3


def test_put_syncs_once_the_oldest_pending_record_is_old_enough(
    open_tier: Callable[..., DiskTier],
) -> None:
    now = [100.0]
    tier = open_tier(sync_interval_s=0.5, clock=lambda: now[0])
    tier.put(h(0), page(0))
    now[0] += 0.4
    tier.put(h(1), page(1))
    assert tier.hashes() == []
    now[0] += 0.2  # h(0) has now waited 0.6 s
    tier.put(h(2), page(2))
    assert tier.hashes() == [h(0), h(1), h(2)]


def test_capacity_evicts_least_recently_used(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier(capacity_pages=3)
    for i in range(3):
        assert tier.put(h(i), page(i)) == []
    tier.flush()
    assert tier.get(h(0)) is not None  # h(0) is now the most recent
    assert tier.put(h(3), page(3)) == [h(1)]
    assert tier.put(h(2), page(2)) == []  # already stored: only refreshed
    assert tier.put(h(4), page(4)) == [h(0)]
    assert tier.put(h(5), page(5)) == [h(3)]  # a pending record can be evicted too
    tier.flush()
    assert sorted(tier.hashes()) == sorted([h(2), h(4), h(5)])
    assert tier.stats().evictions == 3
    assert tier.remove(h(4)) and not tier.remove(h(4)) and tier.get(h(4)) is None
    tier.check_integrity()


def test_a_tier_of_size_zero_is_off(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "off", FP, SHAPE, torch.float32, capacity_pages=0)
    assert tier.put(h(0), page(0)) == [h(0)]
    tier.flush()
    assert tier.get(h(0)) is None and tier.hashes() == []
    assert not (tmp_path / "off").exists()
    tier.close()


def test_reopened_directory_serves_hits(open_tier: Callable[..., DiskTier], tmp_path: Path) -> None:
    tier = open_tier(segment_bytes=4 * RECORD)
    for i in range(10):
        tier.put(h(i), page(i))
    tier.close()
    with pytest.raises(RuntimeError):
        tier.get(h(0))
    reopened = open_tier()
    assert sorted(reopened.hashes()) == sorted(h(i) for i in range(10))
    assert all(same(reopened.get(h(i)), page(i)) for i in range(10))
    assert len(segments(tmp_path / "disk")) == 3
    reopened.put(h(10), page(10))
    reopened.flush()
    assert len(segments(tmp_path / "disk")) == 4  # old files are never appended to
    assert same(reopened.get(h(10)), page(10))
    reopened.check_integrity()


def test_a_second_tier_cannot_share_a_directory(open_tier: Callable[..., DiskTier]) -> None:
    open_tier()
    with pytest.raises(RuntimeError, match="in use"):
        open_tier()


def test_records_of_another_model_are_ignored(open_tier: Callable[..., DiskTier]) -> None:
    old = open_tier(fingerprint=OTHER_FP)
    for i in range(4):
        old.put(h(i), page(i))
    old.close()
    tier = open_tier()
    assert tier.hashes() == [] and tier.get(h(0)) is None
    stats = tier.stats()
    assert stats.foreign == 4 and stats.corrupt == 0
    assert stats.bytes_on_disk == 0  # a directory belongs to one model: the space is reclaimed


def test_a_flipped_payload_byte_is_a_counted_miss(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    tier = open_tier()
    for i in range(3):
        tier.put(h(i), page(i))
    tier.flush()
    (seg,) = segments(tmp_path / "disk")
    data = bytearray(seg.read_bytes())
    data[RECORD + HEADER_SIZE + 100] ^= 0x10  # inside h(1)'s payload
    seg.write_bytes(bytes(data))
    assert seg.read_bytes() != b"".join(encode_record(FP, h(i), page(i)) for i in range(3))
    assert tier.get(h(1)) is None
    stats = tier.stats()
    assert (stats.corrupt, stats.misses) == (1, 1)
    assert not tier.contains(h(1))
    assert same(tier.get(h(0)), page(0)) and same(tier.get(h(2)), page(2))
    tier.check_integrity()


def test_a_truncated_segment_loses_only_its_tail(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    tier = open_tier()
    for i in range(4):
        tier.put(h(i), page(i))
    tier.flush()
    (seg,) = segments(tmp_path / "disk")
    os.truncate(seg, 2 * RECORD + 50)
    with pytest.raises(AssertionError, match="lacks"):
        tier.check_integrity()  # the fault happened
    assert tier.get(h(2)) is None and tier.get(h(3)) is None
    assert tier.stats().corrupt == 2
    assert same(tier.get(h(0)), page(0)) and same(tier.get(h(1)), page(1))
    tier.check_integrity()
    tier.put(h(4), page(4))  # appends go to a fresh segment, not the damaged one
    tier.flush()
    assert same(tier.get(h(4)), page(4)) and len(segments(tmp_path / "disk")) == 2


def test_a_deleted_segment_drops_its_records(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    tier = open_tier(segment_bytes=3 * RECORD)
    for i in range(6):
        tier.put(h(i), page(i))
    tier.flush()
    first, second = segments(tmp_path / "disk")
    first.unlink()
    assert tier.get(h(1)) is None
    assert tier.stats().corrupt == 3  # the whole file is gone, not just the page asked for
    assert not any(tier.contains(h(i)) for i in range(3))
    assert all(same(tier.get(h(i)), page(i)) for i in range(3, 6))
    tier.check_integrity()


def test_a_torn_tail_is_ignored_on_reopen(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    tier = open_tier()
    for i in range(3):
        tier.put(h(i), page(i))
    tier.close()
    (seg,) = segments(tmp_path / "disk")
    with seg.open("ab") as f:  # a crash halfway through appending h(3)
        f.write(encode_record(FP, h(3), page(3))[: HEADER_SIZE + 100])
    reopened = open_tier()
    assert sorted(reopened.hashes()) == sorted(h(i) for i in range(3))
    assert reopened.stats().corrupt == 0
    assert all(same(reopened.get(h(i)), page(i)) for i in range(3))
    reopened.put(h(3), page(3))
    reopened.flush()
    assert same(reopened.get(h(3)), page(3))
    reopened.check_integrity()


def test_compaction_reclaims_a_mostly_dead_segment(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    tier = open_tier(segment_bytes=4 * RECORD)
    for i in range(12):
        tier.put(h(i), page(i))
    tier.flush()
    first = segments(tmp_path / "disk")[0]
    before = tier.stats().bytes_on_disk
    assert before == 12 * RECORD
    tier.remove(h(0))
    tier.remove(h(1))  # exactly half dead: kept
    assert first.exists() and tier.stats().compactions == 0
    tier.remove(h(2))  # three quarters dead: h(3) moves, the file goes
    stats = tier.stats()
    assert not first.exists() and stats.compactions == 1
    assert stats.bytes_on_disk == before - 4 * RECORD + RECORD
    assert all(same(tier.get(h(i)), page(i)) for i in range(3, 12))
    tier.check_integrity()
    tier.close()
    reopened = open_tier()
    assert sorted(reopened.hashes()) == sorted(h(i) for i in range(3, 12))


def test_a_failed_write_stores_nothing_and_raises_nothing(
    open_tier: Callable[..., DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    tier.put(h(0), page(0))
    tier.flush()

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", full_disk)
        assert tier.put(h(1), page(1)) == [h(1)]
    tier.flush()
    assert tier.hashes() == [h(0)] and tier.stats().io_errors == 1
    tier.put(h(2), page(2))
    tier.flush()
    assert same(tier.get(h(2)), page(2)) and same(tier.get(h(0)), page(0))
    tier.check_integrity()


def test_a_failed_fsync_drops_the_unsynced_records(
    open_tier: Callable[..., DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    tier.put(h(0), page(0))
    tier.flush()
    tier.put(h(1), page(1))

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", failing_fsync)
        tier.flush()
    assert tier.hashes() == [h(0)] and tier.stats().pending == 0
    assert same(tier.get(h(0)), page(0))
    tier.check_integrity()


def test_concurrent_callers_keep_the_index_consistent(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier(capacity_pages=40, segment_bytes=8 * RECORD, sync_every_pages=4)
    wrong: list[int] = []

    def work(base: int) -> None:
        for i in range(base, base + 30):
            tier.put(h(i), page(i))
            got = tier.get(h(i - 3))
            if got is not None and not same(got, page(i - 3)):
                wrong.append(i - 3)
            if i % 5 == 0:
                tier.remove(h(i - 1))

    threads = [threading.Thread(target=work, args=(k * 100 + 10,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and tier.stats().hits > 0
    tier.flush()
    tier.check_integrity()
    assert tier.stats().corrupt == 0


# ---- property: random operation sequences against a model -------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "get", "get", "remove", "flush", "reopen"]),
        st.integers(0, 9),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(OPS)
def test_random_operations_match_a_model(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:

        def fresh() -> DiskTier:
            return DiskTier(
                Path(tmp), FP, SHAPE, torch.float32, capacity_pages=4,
                segment_bytes=3 * RECORD, sync_every_pages=3, sync_interval_s=1e9,
            )  # fmt: skip

        tier = fresh()
        held: set[bytes] = set()  # what the tier must hold, durable or pending
        ever: set[bytes] = set()
        for op, i in ops:
            if op == "put":
                evicted = tier.put(h(i), page(i))
                assert h(i) not in evicted and set(evicted) <= held
                held = (held - set(evicted)) | {h(i)}
                ever.add(h(i))
            elif op == "get":
                visible = tier.contains(h(i))
                got = tier.get(h(i))
                assert got is None or same(got, page(i))
                assert (got is not None) == visible and (not visible or h(i) in held)
            elif op == "remove":
                assert tier.remove(h(i)) == (h(i) in held)
                held.discard(h(i))
            elif op == "flush":
                tier.flush()
                assert set(tier.hashes()) == held
            else:
                tier.close()
                tier = fresh()
                found = set(tier.hashes())
                # Removals are not persisted, so old pages may return; but a page that was
                # held is only missing if re-indexing had to evict to fit the capacity.
                assert found <= ever
                assert held <= found or tier.stats().evictions > 0
                key_of = {h(j): j for j in range(10)}
                assert all(same(tier.get(x), page(key_of[x])) for x in found)
                held = found
            assert set(tier.hashes()) <= held and len(held) <= 4
            tier.check_integrity()
        assert tier.stats().corrupt == 0
        tier.close()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted for this test (root only): a file system that really fills up."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a real full file system needs root to mount a small tmpfs (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        if os.environ.get("BATON_REQUIRE_MULTIHOST") == "1":  # CI: root, and mounts must work
            pytest.fail(f"could not mount a tmpfs: {done.stderr.strip()}", pytrace=False)
        pytest.skip(f"could not mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_really_full_file_system_stores_nothing_and_raises_nothing(small_fs: Path) -> None:
    """No patched write: records go to a 256 KiB tmpfs until the kernel says ENOSPC. What did not
    fit is refused and counted, what fit reads back bit for bit, and once the file system has
    room again (a filler file removed, from outside the tier) writes go on."""
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (64 << 10))
    tier = DiskTier(directory=small_fs / "disk", fingerprint=FP, page_shape=SHAPE, dtype=torch.float32,
                    capacity_pages=10_000, sync_every_pages=1, sync_interval_s=1e9)  # fmt: skip
    try:
        stored, refused = [], []
        for i in range(4 * (256 << 10) // RECORD):  # bounded: four times what could fit
            (refused if tier.put(h(i), page(i)) == [h(i)] else stored).append(i)
            if len(refused) >= 3:
                break
        assert stored and len(refused) == 3, (len(stored), len(refused))
        assert tier.stats().io_errors >= 3  # each ENOSPC counted, none raised
        tier.flush()
        assert sorted(tier.hashes()) == sorted(h(i) for i in stored)  # nothing half-written is indexed
        on_disk = sum(f.stat().st_size for f in (small_fs / "disk").iterdir() if f.is_file())
        assert on_disk == tier.stats().bytes_on_disk  # ... nor left on the disk: no torn tail
        assert all(same(tier.get(h(i)), page(i)) for i in stored)
        tier.check_integrity()

        filler.unlink()  # room again
        later = [10_000 + i for i in range(8)]
        assert all(tier.put(h(i), page(i)) == [] for i in later)
        tier.flush()
        assert all(same(tier.get(h(i)), page(i)) for i in [*stored, *later])
        tier.check_integrity()
    finally:
        tier.close()
    reopened = DiskTier(directory=small_fs / "disk", fingerprint=FP, page_shape=SHAPE, dtype=torch.float32,
                        capacity_pages=10_000, sync_every_pages=1, sync_interval_s=1e9)  # fmt: skip
    try:  # what the disk holds after a full file system is exactly what was stored
        assert sorted(reopened.hashes()) == sorted(h(i) for i in [*stored, *later])
        assert reopened.stats().corrupt == 0
    finally:
        reopened.close()
