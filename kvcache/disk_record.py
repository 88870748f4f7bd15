"""Bytes on disk for the KV disk tier: the page record format and the segment files of records.

A record is one page = one fixed header + one raw payload. It is self-describing and self-checking, so a segment file can be re-indexed after a
restart and a damaged record is recognised instead of decoded. Little-endian throughout:

    offset  size  field
         0     4  magic           b"BTKV"
         4     2  version         u16 (1)
         6     1  dtype code      u8 (DTYPE_CODES)
         7     1  ndim            u8, 1..8
         8    16  fingerprint     model fingerprint: KV of another model is never served
        24    16  page hash       the page's content address
        40    32  shape           8 x u32; dims past ndim are 0
        72     8  payload length  u64, bytes
        80     4  payload crc32   zlib.crc32 of the payload
        84     4  header crc32    zlib.crc32 of bytes 0..83
        88     …  payload         raw tensor bytes, C order, little-endian

    0    4   6  7  8             24            40          72       80     84     88
    +----+---+--+--+-------------+-------------+-----------+--------+------+------+--------
    |BTKV|ver|dt|nd| fingerprint |  page hash  | shape[8]  | length | pcrc | hcrc | payload
    +----+---+--+--+-------------+-------------+-----------+--------+------+------+--------

The header checksum makes a flipped length or hash detectable before the payload is trusted,
and lets `scan_segment` resynchronise past a damaged header by searching for the next magic.
Decoding rebuilds the tensor from raw bytes with numpy: nothing read from disk is unpickled.

Records are appended to segment files `seg-<n>.bkv` by a `SegmentLog`, which knows files and
byte ranges but not pages (the tier in kvcache.disk keeps the index). Only the newest segment
is ever written; the log holds an flock on the directory, so one process owns it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"BTKV"
VERSION = 1
HASH_BYTES = 16
MAX_NDIM = 8

_BODY = struct.Struct(f"<4sHBB{HASH_BYTES}s{HASH_BYTES}s{MAX_NDIM}IQI")  # bytes 0..83
_CRC = struct.Struct("<I")  # bytes 84..87
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 88

# Codes are part of the format: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# The payload goes through a same-width integer view: numpy has no bfloat16/float8, and an
# integer view is where the byte order is made explicit.
_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_SEGMENT_NAME = re.compile(r"seg-(\d+)\.bkv")


@dataclass(frozen=True, slots=True)
class RecordHeader:
    fingerprint: bytes
    page_hash: bytes
    dtype_code: int
    shape: tuple[int, ...]
    payload_len: int
    payload_crc: int

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.payload_len

    @property
    def dtype(self) -> torch.dtype | None:
        return _CODE_DTYPES.get(self.dtype_code)

    def is_for(self, fingerprint: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether this record holds a page of that model and page spec (length included)."""
        return (
            self.fingerprint == fingerprint
            and self.shape == shape
            and self.dtype_code == DTYPE_CODES.get(dtype)
            and self.payload_len == payload_len(shape, dtype)
        )


class ScannedRecord(NamedTuple):
    offset: int
    header: RecordHeader
    is_intact: bool  # the payload checksum matched


class SegmentScan(NamedTuple):
    records: list[ScannedRecord]
    num_bad_headers: int  # damaged regions skipped by searching for the next magic
    torn_tail_bytes: int  # an incomplete last record (a crash mid-append)


def payload_len(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * torch.empty((), dtype=dtype).element_size()


def check_page_spec(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise ValueError unless pages of this shape and dtype can be recorded."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    if not 1 <= len(shape) <= MAX_NDIM or any(not 0 < d < 2**32 for d in shape):
        raise ValueError(f"unsupported page shape {shape}")


def encode_record(fingerprint: bytes, page_hash: bytes, page: torch.Tensor) -> bytes:
    """Header + payload of `page` (copied to host memory; the caller checked shape/dtype)."""
    payload = _tensor_bytes(page)
    shape = tuple(page.shape)
    dims = shape + (0,) * (MAX_NDIM - len(shape))
    body = _BODY.pack(
        MAGIC, VERSION, DTYPE_CODES[page.dtype], len(shape), fingerprint, page_hash,
        *dims, len(payload), zlib.crc32(payload),
    )  # fmt: skip
    return b"".join((body, _CRC.pack(zlib.crc32(body)), payload))


def decode_header(buf: bytes | memoryview) -> RecordHeader | None:
    """The header at the start of `buf`, or None if it is short, foreign or damaged."""
    if len(buf) < HEADER_SIZE:
        return None
    fields = _BODY.unpack_from(buf, 0)
    (crc,) = _CRC.unpack_from(buf, _BODY.size)
    if fields[0] != MAGIC or fields[1] != VERSION or crc != zlib.crc32(buf[: _BODY.size]):
        return None
    ndim = fields[3]
    dims = fields[6 : 6 + MAX_NDIM]
    if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
        return None
    return RecordHeader(
        fingerprint=fields[4],
        page_hash=fields[5],
        dtype_code=fields[2],
        shape=tuple(dims[:ndim]),
        payload_len=fields[6 + MAX_NDIM],
        payload_crc=fields[7 + MAX_NDIM],
    )


def is_payload_intact(header: RecordHeader, payload: bytes | memoryview) -> bool:
    return len(payload) == header.payload_len and zlib.crc32(payload) == header.payload_crc


def check_record(
    data: bytes, page_hash: bytes, fingerprint: bytes, shape: tuple[int, ...], dtype: torch.dtype
) -> str | None:
    """Why `data` is not exactly the record of `page_hash` for that model, or None if it is."""
    header = decode_header(data)
    if header is None:
        return "short read" if len(data) < HEADER_SIZE else "damaged header"
    if header.page_hash != page_hash or not header.is_for(fingerprint, shape, dtype):
        return "header of another record"
    if len(data) < header.record_len:
        return "short read"
    if not is_payload_intact(header, memoryview(data)[HEADER_SIZE : header.record_len]):
        return "payload checksum mismatch"
    return None


def decode_page(header: RecordHeader, payload: bytes | memoryview) -> torch.Tensor:
    """A fresh, writable CPU tensor from a payload the caller has checked with the header."""
    dtype = header.dtype
    if dtype is None:
        raise ValueError(f"unknown dtype code {header.dtype_code}")
    width = torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(payload, dtype=np.dtype(f"<i{width}"))
    native = raw.astype(raw.dtype.newbyteorder("="), copy=True)  # owned and writable
    return torch.from_numpy(native).view(dtype).reshape(header.shape)


def scan_segment(data: bytes) -> SegmentScan:
    """Every well-formed record in a segment's bytes, in file order; never raises.

    A record whose header checks out but whose payload does not is reported (is_intact=False)
    so its bytes count as dead; a damaged header is skipped by searching for the next magic
    (the header checksum rejects a magic that merely occurs inside a payload).
    """
    view = memoryview(data)
    records: list[ScannedRecord] = []
    num_bad = 0
    pos = 0
    while pos < len(data):
        header = decode_header(view[pos : pos + HEADER_SIZE])
        if header is None:
            if len(data) - pos < HEADER_SIZE and MAGIC.startswith(data[pos : pos + 4]):
                break  # a header cut short by a crash
            nxt = data.find(MAGIC, pos + 1)
            if nxt < 0:
                break
            num_bad += 1
            pos = nxt
            continue
        end = pos + header.record_len
        if end > len(data):
            break  # a payload cut short by a crash
        intact = is_payload_intact(header, view[pos + HEADER_SIZE : end])
        records.append(ScannedRecord(pos, header, intact))
        pos = end
    return SegmentScan(records, num_bad, len(data) - pos)


def _tensor_bytes(page: torch.Tensor) -> bytes:
    host = page.detach().to("cpu").contiguous()
    ints = host.view(_INT_VIEWS[host.element_size()]).numpy()
    return ints.astype(ints.dtype.newbyteorder("<"), copy=False).tobytes()


# ---- segment files ------------------------------------------------------------------------


@dataclass(slots=True)
class Segment:
    """One segment file: `size` counts every byte in it, `live_bytes` only indexed records."""

    seg_id: int
    path: Path
    size: int = 0
    live: set[bytes] = field(default_factory=set)  # hashes the tier indexes here
    live_bytes: int = 0
    is_dir_synced: bool = True  # a new file's directory entry must be fsynced once too

    @property
    def is_mostly_dead(self) -> bool:
        return self.live_bytes * 2 < self.size


class SegmentLog:
    """The segment files of one directory: append to the current one, fsync, read, delete.

    Failures raise OSError and leave the log consistent: a failed fsync closes the current
    segment (its unsynced tail is suspect), so the next append starts a fresh file.
    """

    def __init__(self, directory: Path, segment_bytes: int) -> None:
        # private, like the shm region: the pages hold every tenant's prompts (an existing
        # directory keeps the mode its operator gave it)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.segments: dict[int, Segment] = {}
        self.current: Segment | None = None
        self.is_dirty = False  # bytes appended since the last fsync
        self._fd: int | None = None  # append-only descriptor of `current`
        self._next_id = 0
        self._dir_lock: BinaryIO | None = _lock_directory(directory)

    def load(self) -> Iterator[tuple[Segment, SegmentScan]]:
        """Register the existing segment files and scan each, oldest first."""
        found = []
        for name in os.listdir(self.directory):
            match = _SEGMENT_NAME.fullmatch(name)
            if match:
                found.append((int(match.group(1)), self.directory / name))
        for seg_id, path in sorted(found):
            self._next_id = max(self._next_id, seg_id + 1)  # old files are never appended to
            try:
                data = path.read_bytes()  # one sequential read; segments are bounded in size
            except OSError as exc:
                logger.warning("disk tier: cannot read %s (%s); skipped", path, exc)
                continue
            seg = Segment(seg_id, path, size=len(data))
            self.segments[seg_id] = seg
            yield seg, scan_segment(data)

    def is_full_for(self, num_bytes: int) -> bool:
        seg = self.current
        return seg is not None and seg.size > 0 and seg.size + num_bytes > self.segment_bytes

    def append(self, record: bytes) -> tuple[Segment, int]:
        """Write `record` at the end of the current segment (opening one if needed)."""
        seg = self.current if self.current is not None else self._open()
        fd = self._fd
        assert fd is not None
        view = memoryview(record)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            try:
                os.ftruncate(fd, seg.size)  # best effort: no partial record left behind
            except OSError:
                pass
            raise
        self.is_dirty = True
        offset = seg.size
        seg.size += len(record)
        return seg, offset

    def sync(self) -> None:
        """One fsync for everything appended since the last (a no-op if nothing was)."""
        seg, fd = self.current, self._fd
        if seg is None or fd is None or not self.is_dirty:
            return
        try:
            os.fsync(fd)
        except OSError:
            self.close_current()
            raise
        if not seg.is_dir_synced:
            _fsync_directory(self.directory)
            seg.is_dir_synced = True
        self.is_dirty = False

    def close_current(self) -> Segment | None:
        """Stop appending to the current segment (sync it first to keep its tail)."""
        seg = self.current
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.current, self.is_dirty = None, None, False
        return seg

    def read(self, seg: Segment, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset`; opened per read, so a deleted file is noticed."""
        fd = os.open(seg.path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def delete(self, seg: Segment) -> None:
        if seg is self.current:
            self.close_current()
        del self.segments[seg.seg_id]
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("disk tier: cannot delete %s (%s)", seg.path, exc)

    def close(self) -> None:
        self.close_current()
        if self._dir_lock is not None:
            self._dir_lock.close()  # releases the flock
            self._dir_lock = None

    def _open(self) -> Segment:
        path = self.directory / f"seg-{self._next_id:08d}.bkv"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        seg = Segment(self._next_id, path, is_dir_synced=False)
        self._next_id += 1
        self.segments[seg.seg_id] = seg
        self.current = seg
        return seg


def _fsync_directory(directory: Path) -> None:
    """Make a new segment's directory entry durable; some filesystems cannot, which is logged."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.debug("disk tier: directory fsync of %s unsupported (%s)", directory, exc)


def _lock_directory(directory: Path) -> BinaryIO:
    """An exclusive flock on `directory/LOCK` while the log is open: one owner per directory."""
    handle = open(directory / "LOCK", "ab")  # held open until close()
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(f"disk tier directory {directory} is in use") from None
    return handle
