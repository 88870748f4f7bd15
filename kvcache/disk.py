"""The disk tier of the KV cache: pages evicted from host RAM, kept in local segment files.

Lifecycle of a page (docs/architecture.md, The tiered KV cache):

    put ──append──▶ pending ──fsync (batched)──▶ indexed ──get──▶ hit (LRU refresh)
                       │                            │
                       └──── evict / remove ────────┴──▶ dead bytes ──compaction──▶ reclaimed

- Records (kvcache.disk_record) are appended to `seg-<n>.bkv`; a new segment starts when the
  current one would pass `segment_bytes`. Only the current segment is ever written.
- One fsync covers every record appended since the last one: `put` syncs every
  `sync_every_pages` records or once the oldest pending record is `sync_interval_s` old, and
  `flush` forces it. A record is indexed (visible to get/contains/hashes) only once durable,
  so a crash can never leave the index pointing at bytes that were not on disk.
- Capacity counts indexed + pending records; past it the least-recently-used go, and `put`
  returns their hashes so the radix tree can forget them.
- A closed segment more than half dead is compacted: its live records are copied into the
  current segment, fsynced, re-pointed, and the old file deleted.
- Opening a directory re-indexes its segments (validating every record), so a restarted worker
  serves prefix hits from disk. Records of another model fingerprint are skipped and their
  space reclaimed: a tier directory belongs to one model and one process (an flock says so).
- Eviction and removal are not persisted: after a restart a page dropped earlier may come back
  until compaction deletes it. That is harmless, because a page hash names its content.
- Anything wrong with a record (checksum, short read, missing file, I/O error) is a counted
  miss that drops the record, never an exception and never a wrong tensor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcache.disk_record import (
    HASH_BYTES,
    HEADER_SIZE,
    ScannedRecord,
    Segment,
    SegmentLog,
    check_page_spec,
    check_record,
    decode_header,
    decode_page,
    encode_record,
    payload_len,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DiskStats:
    records: int  # indexed (durable) records
    bytes_on_disk: int
    bytes_written: int
    bytes_read: int
    hits: int
    misses: int
    corrupt: int  # records dropped for a bad checksum, short read or missing file
    evictions: int
    compactions: int
    pending: int = 0  # appended, waiting for the fsync that makes them visible
    foreign: int = 0  # records of another model fingerprint or page spec, skipped on open
    io_errors: int = 0  # failed reads, writes and fsyncs


@dataclass(slots=True)
class _Counters:
    bytes_written: int = 0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    compactions: int = 0
    foreign: int = 0
    io_errors: int = 0


@dataclass(frozen=True, slots=True)
class _Loc:
    segment: int
    offset: int
    length: int


class DiskTier:
    """Durable, checksummed, LRU-bounded page store in one directory. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        fingerprint: bytes,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        capacity_pages: int,
        segment_bytes: int = 64 << 20,
        sync_every_pages: int = 64,
        sync_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_page_spec(tuple(page_shape), dtype)
        if len(fingerprint) != HASH_BYTES:
            raise ValueError(f"fingerprint must be {HASH_BYTES} bytes, got {len(fingerprint)}")
        if capacity_pages < 0 or segment_bytes <= 0 or sync_every_pages <= 0:
            raise ValueError("need capacity_pages >= 0, segment_bytes > 0, sync_every_pages > 0")
        self._fingerprint = fingerprint
        self._page_shape = tuple(page_shape)
        self._dtype = dtype
        self._record_len = HEADER_SIZE + payload_len(self._page_shape, dtype)
        self._capacity = capacity_pages
        self._sync_every = sync_every_pages
        self._sync_interval_s = sync_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        # Every record, least recently used first; those in _pending are not yet durable.
        self._lru: OrderedDict[bytes, _Loc] = OrderedDict()
        self._pending: set[bytes] = set()
        self._pending_since: float | None = None
        self._to_compact: set[int] = set()
        self._counters = _Counters()
        self._sync_failures = 0
        self._is_closed = False
        # A tier of size 0 is off and touches no files.
        self._log = SegmentLog(Path(directory), segment_bytes) if capacity_pages > 0 else None
        if self._log is not None:
            self._reindex(self._log)

    # ---- public interface -------------------------------------------------------------------

    def put(self, page_hash: bytes, page: torch.Tensor) -> list[bytes]:
        """Append a page; returns the hashes no longer stored because of it (LRU victims, or
        the page itself when the tier is off or the write failed)."""
        _check_hash(page_hash)
        if tuple(page.shape) != self._page_shape or page.dtype != self._dtype:
            raise ValueError(f"page {tuple(page.shape)} {page.dtype} does not match the tier")
        if self._capacity == 0:
            return [page_hash]
        with self._lock:
            if self._touch(page_hash):
                return []
        record = encode_record(self._fingerprint, page_hash, page)  # device copy: no lock held
        with self._lock:
            if self._touch(page_hash):  # a hash names its content: a second copy adds nothing
                return []
            loc = self._append(record)
            if loc is None:
                return [page_hash]
            self._link(page_hash, loc)
            self._pending.add(page_hash)
            if self._pending_since is None:
                self._pending_since = self._clock()
            evicted = self._evict_to(self._capacity)
            if (
                len(self._pending) >= self._sync_every
                or self._clock() - self._pending_since >= self._sync_interval_s
            ):
                self._sync()
            self._compact_queued()
            return evicted

    def flush(self) -> None:
        """Make every pending record durable, then index it."""
        with self._lock:
            if not self._is_closed:
                self._sync()
                self._compact_queued()

    def get(self, page_hash: bytes) -> torch.Tensor | None:
        with self._lock:
            self._check_open()
            loc = self._lru.get(page_hash)
            page = None
            if loc is not None and page_hash not in self._pending:
                page = self._read_page(page_hash, loc)
            if page is None:
                self._counters.misses += 1
                self._compact_queued()
                return None
            self._counters.hits += 1
            self._lru.move_to_end(page_hash)
            return page

    def contains(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._lru and page_hash not in self._pending

    def remove(self, page_hash: bytes) -> bool:
        with self._lock:
            self._check_open()
            is_known = self._kill(page_hash) is not None
            self._compact_queued()
            return is_known

    def hashes(self) -> list[bytes]:
        """Every indexed hash, least recently used first."""
        with self._lock:
            return [h for h in self._lru if h not in self._pending]

    @property
    def capacity_pages(self) -> int:
        return self._capacity

    def stats(self) -> DiskStats:
        with self._lock:
            segments = self._log.segments.values() if self._log is not None else ()
            return DiskStats(
                records=len(self._lru) - len(self._pending),
                bytes_on_disk=sum(seg.size for seg in segments),
                pending=len(self._pending),
                **asdict(self._counters),
            )

    def check_integrity(self) -> None:
        """Raise AssertionError if the index and the segment files disagree."""
        with self._lock:
            _require(len(self._lru) <= self._capacity, "more records than capacity")
            _require(self._pending <= self._lru.keys(), "a pending record is not in the index")
            segments = self._log.segments if self._log is not None else {}
            for page_hash, loc in self._lru.items():
                seg = segments.get(loc.segment)
                _require(seg is not None and page_hash in seg.live, "record outside a segment")
                _require(loc.length == self._record_len, "record of the wrong length")
                if page_hash in self._pending:
                    _require(self._log is not None and seg is self._log.current, "stale pending")
            num_live = sum(len(seg.live) for seg in segments.values())
            _require(num_live == len(self._lru), "segments hold records the index does not")
            for seg in segments.values():
                _require(seg.live_bytes == len(seg.live) * self._record_len, "live bytes drift")
                end = max((self._lru[h].offset + self._record_len for h in seg.live), default=0)
                _require(end <= seg.size, f"{seg.path.name}: record past the tracked size")
                actual = seg.path.stat().st_size if seg.path.exists() else -1
                _require(actual >= end, f"{seg.path.name}: file lacks indexed records")

    def close(self) -> None:
        """Flush and close the files (and the directory lock); a closed tier is not reused."""
        with self._lock:
            if self._is_closed or self._log is None:
                return
            self._sync()
            self._log.close()
            self._is_closed = True

    # ---- index ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("disk tier is closed")

    def _touch(self, page_hash: bytes) -> bool:
        self._check_open()
        if page_hash not in self._lru:
            return False
        self._lru.move_to_end(page_hash)
        return True

    def _segment(self, seg_id: int) -> Segment:
        assert self._log is not None  # only a tier with capacity holds records
        return self._log.segments[seg_id]

    def _link(self, page_hash: bytes, loc: _Loc) -> None:
        self._lru[page_hash] = loc
        seg = self._segment(loc.segment)
        seg.live.add(page_hash)
        seg.live_bytes += loc.length

    def _kill(self, page_hash: bytes) -> _Loc | None:
        """Forget a record; its bytes become dead and may make its segment worth compacting."""
        loc = self._lru.pop(page_hash, None)
        if loc is None:
            return None
        self._pending.discard(page_hash)
        seg = self._segment(loc.segment)
        seg.live.discard(page_hash)
        seg.live_bytes -= loc.length
        self._to_compact.add(seg.seg_id)
        return loc

    def _evict_to(self, num_records: int) -> list[bytes]:
        evicted = []
        while len(self._lru) > num_records:
            page_hash = next(iter(self._lru))
            self._kill(page_hash)
            evicted.append(page_hash)
        self._counters.evictions += len(evicted)
        return evicted

    def _reindex(self, log: SegmentLog) -> None:
        for seg, scan in log.load():
            if scan.num_bad_headers or scan.torn_tail_bytes:
                logger.warning(
                    "disk tier: %s has %d damaged region(s) and a torn tail of %d bytes",
                    seg.path, scan.num_bad_headers, scan.torn_tail_bytes,
                )  # fmt: skip
            for record in scan.records:
                self._index_scanned(seg, record)
            self._to_compact.add(seg.seg_id)  # e.g. a segment of another model's records
        # Write order is the best recency the files remember: keep the newest records.
        self._evict_to(self._capacity)
        self._compact_queued()
        logger.info("disk tier: indexed %d pages in %s", len(self._lru), log.directory)

    def _index_scanned(self, seg: Segment, record: ScannedRecord) -> None:
        header = record.header
        if not record.is_intact:
            self._counters.corrupt += 1
        elif not header.is_for(self._fingerprint, self._page_shape, self._dtype):
            self._counters.foreign += 1
        elif header.page_hash not in self._lru:  # a later copy (a compaction cut short) is dead
            self._link(header.page_hash, _Loc(seg.seg_id, record.offset, header.record_len))

    # ---- reads ------------------------------------------------------------------------------

    def _read_page(self, page_hash: bytes, loc: _Loc) -> torch.Tensor | None:
        """The page at `loc`, or None (the record dropped and counted) if it does not check."""
        assert self._log is not None
        seg = self._segment(loc.segment)
        try:
            data = self._log.read(seg, loc.offset, loc.length)
        except FileNotFoundError:
            self._drop_segment(seg)
            return None
        except OSError as exc:
            self._counters.io_errors += 1
            logger.warning("disk tier: read of %s failed (%s); page dropped", seg.path, exc)
            self._kill(page_hash)
            return None
        self._counters.bytes_read += len(data)
        problem = self._check_record(page_hash, data)
        if problem is None:
            header = decode_header(data)
            assert header is not None  # just checked
            return decode_page(header, memoryview(data)[HEADER_SIZE:])
        self._counters.corrupt += 1
        logger.warning("disk tier: %s at %s:%d; dropped", problem, seg.path.name, loc.offset)
        self._kill(page_hash)
        if len(data) < loc.length and seg is self._log.current:
            self._seal()  # the file shrank under us: stop appending to it
        return None

    def _check_record(self, page_hash: bytes, data: bytes) -> str | None:
        return check_record(data, page_hash, self._fingerprint, self._page_shape, self._dtype)

    def _drop_segment(self, seg: Segment) -> None:
        """A segment file vanished: every record in it is lost."""
        assert self._log is not None
        lost = list(seg.live)
        for page_hash in lost:
            self._kill(page_hash)
        self._counters.corrupt += len(lost)
        logger.warning("disk tier: %s is missing; dropped %d pages", seg.path.name, len(lost))
        self._log.delete(seg)

    # ---- writes -----------------------------------------------------------------------------

    def _append(self, record: bytes) -> _Loc | None:
        """Append one record (starting a new segment when the current one is full)."""
        assert self._log is not None
        if self._log.is_full_for(len(record)):
            self._seal()
        try:
            seg, offset = self._log.append(record)
        except OSError as exc:
            self._counters.io_errors += 1
            logger.warning("disk tier: append failed (%s); page not stored", exc)
            self._seal()  # keep what was written before, start a new file next time
            return None
        self._counters.bytes_written += len(record)
        return _Loc(seg.seg_id, offset, len(record))

    def _seal(self) -> None:
        """Sync and close the current segment; the next append starts a new one."""
        assert self._log is not None
        self._sync()
        seg = self._log.close_current()
        if seg is not None:
            self._to_compact.add(seg.seg_id)  # closed now, so compaction may take it

    def _sync(self) -> bool:
        """One fsync for everything appended since the last; then index the pending records."""
        if self._log is not None:
            try:
                self._log.sync()
            except OSError as exc:
                self._counters.io_errors += 1
                self._sync_failures += 1
                logger.error("disk tier: fsync failed (%s); unsynced pages dropped", exc)
                for page_hash in list(self._pending):
                    self._kill(page_hash)
                self._pending_since = None
                return False
        self._pending.clear()
        self._pending_since = None
        return True

    # ---- compaction -------------------------------------------------------------------------

    def _compact_queued(self) -> None:
        while self._to_compact and self._log is not None:
            seg = self._log.segments.get(self._to_compact.pop())
            if seg is not None and seg is not self._log.current and seg.is_mostly_dead:
                self._compact(seg)

    def _compact(self, seg: Segment) -> None:
        """Copy a segment's live records into the current one, durably, then delete it."""
        assert self._log is not None
        try:
            data = seg.path.read_bytes() if seg.live else b""
        except FileNotFoundError:
            self._drop_segment(seg)
            return
        except OSError as exc:
            self._counters.io_errors += 1
            logger.warning("disk tier: cannot compact %s (%s)", seg.path.name, exc)
            return
        self._counters.bytes_read += len(data)
        failures = self._sync_failures
        moves: list[tuple[bytes, _Loc]] = []
        for page_hash in list(seg.live):
            old = self._lru[page_hash]
            record = data[old.offset : old.offset + old.length]
            problem = self._check_record(page_hash, record)
            if problem is not None:
                self._counters.corrupt += 1
                logger.warning("disk tier: %s in %s; dropped", problem, seg.path.name)
                self._kill(page_hash)
                continue
            new = self._append(record)
            if new is None:
                return  # the old copies stay valid; the partial copies are dead bytes
            moves.append((page_hash, new))
        # Re-point only once the copies are durable, so a crash leaves the old file in charge.
        if moves and (not self._sync() or self._sync_failures != failures):
            return
        for page_hash, new in moves:
            self._repoint(page_hash, new)
        self._log.delete(seg)
        self._counters.compactions += 1
        logger.info("disk tier: compacted %s (%d live pages moved)", seg.path.name, len(moves))

    def _repoint(self, page_hash: bytes, new: _Loc) -> None:
        """Move a record to its copy, keeping its place in the LRU order."""
        old = self._lru[page_hash]
        old_seg = self._segment(old.segment)
        old_seg.live.discard(page_hash)
        old_seg.live_bytes -= old.length
        self._lru[page_hash] = new
        new_seg = self._segment(new.segment)
        new_seg.live.add(page_hash)
        new_seg.live_bytes += new.length


def _check_hash(page_hash: bytes) -> None:
    if len(page_hash) != HASH_BYTES:
        raise ValueError(f"page hash must be {HASH_BYTES} bytes, got {len(page_hash)}")


def _require(condition: bool, message: str) -> None:
    if not condition:  # not `assert`: integrity checks must survive python -O
        raise AssertionError(message)
