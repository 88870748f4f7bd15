"""The page codec: a chunk of KV pages <-> a `baton.kv.v1.PushRequest` (a PageChunkHeader and
the raw payload), whose protobuf encoding `frame` and `unframe` write and read by hand.

A chunk carries `n = len(dest_page_ids)` pages of one shape and dtype, stacked and laid out
C order, little-endian (bfloat16 travels through a same-width integer view, as numpy has no
bfloat16):

    payload = page[0] bytes | page[1] bytes | ... | page[n-1] bytes      (n * page_bytes)

The checksum is XXH3-64 (xxhash) over the header (serialized deterministically with checksum
= 0) continued over the payload, so a corrupted shape, dtype, page id or token is rejected like a
corrupted byte. Decoding trusts nothing from the wire: every count and length is bounded by
`CodecLimits` and checked against the others before the payload is read, and the payload is
only ever reinterpreted as an array of the header's dtype (never unpickled)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash
from google.protobuf.message import DecodeError

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb

MAX_NDIM = 8
MAX_ID_CHARS = 128
MAX_TOKEN_BYTES = 64
MAX_HASH_BYTES = 64

# The wire enum <-> torch dtype. Codes are the proto's: never renumber, only append.
DTYPES: dict[torch.dtype, pb.KVDtype.ValueType] = {
    torch.float32: pb.KV_DTYPE_FLOAT32,
    torch.float16: pb.KV_DTYPE_FLOAT16,
    torch.bfloat16: pb.KV_DTYPE_BFLOAT16,
}
_WIRE_DTYPES = {code: dtype for dtype, code in DTYPES.items()}
# decode_chunk's pages over an immutable payload are a read-only view that only store() reads
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning, __name__)
INT_VIEWS = {2: torch.int16, 4: torch.int32}  # same-width integer views: numpy has no bfloat16


CHECKSUM_MISMATCH = "checksum mismatch"  # a chunk's bytes changed on the way: the sender's copy is still good


class TransferError(Exception):
    """A chunk or transfer that must not be used; `reason` is safe to show the sender."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds on what one chunk may claim, checked before its payload is touched."""

    max_pages_per_chunk: int = 256
    max_chunk_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if self.max_pages_per_chunk <= 0 or self.max_chunk_bytes <= 0:
            raise ValueError("codec limits must be positive")


CHUNK_TARGET_BYTES = 4 << 20  # pages_per_chunk unset: chunks of about this size


def chunk_pages(page_bytes: int, wanted: int | None = None, limits: CodecLimits | None = None) -> int:
    """Pages per chunk: `wanted`, or fewer, so that a chunk stays within what a receiver
    accepts (max_chunk_bytes, max_pages_per_chunk): 32 pages of a Llama-3-8B-sized model (2 MiB
    a page of 16 tokens) would be 64 MiB, a chunk every receiver refuses. ValueError when one
    page alone is over the byte bound.

    `wanted` None: as many pages as fit in CHUNK_TARGET_BYTES (at least one). A push is a
    pipeline -- the sender encodes chunk i+1 while i is on the wire, the receiver checks and
    stores i while i+1 arrives -- whose fill and drain (the first chunk's encode, the last one's
    store) nothing hides; 4 MiB chunks keep those short while a chunk's fixed cost stays small
    (bench.link, 49 MB of baton-small KV between two hosts: 12.6 MB chunks 0.061-0.095 s a
    push, 3.1 MB chunks 0.048-0.053 s)."""
    limits = limits or CodecLimits()
    if wanted is None:
        wanted = max(1, CHUNK_TARGET_BYTES // page_bytes)
    fit = min(wanted, limits.max_pages_per_chunk, limits.max_chunk_bytes // page_bytes)
    if fit < 1:
        raise ValueError(f"a KV page of {page_bytes} bytes is over the {limits.max_chunk_bytes}-byte chunk bound")
    return fit


class ChunkMeta(NamedTuple):
    """Who a chunk is for; the codec adds dtype, shape, lengths and the checksum."""

    req_id: str
    transfer_id: str
    transfer_token: bytes
    sender_epoch: int
    dest_page_ids: Sequence[int]
    page_hashes: Sequence[bytes] = ()
    layer_start: int = 0
    is_last: bool = False


@dataclass(slots=True)
class WireChunk:
    """One chunk: the protobuf header and the raw payload (bytes, or a view of them)."""

    header: pb.PageChunkHeader
    payload: bytes | memoryview


@dataclass(slots=True)
class DeviceChunk:
    """One chunk that stays where its pages live (the nccl transport): the header, whose
    checksum covers a digest of the block computed there, and the page-major block itself."""

    header: pb.PageChunkHeader
    block: torch.Tensor


MAX_HEADER_BYTES = 64 << 10  # a header is small: ids, a token, hashes and a shape
# A frame is a PushRequest exactly as protobuf encodes it, so any protobuf reader (reflection,
# grpcurl) decodes it, while the payload never passes through the protobuf library:
#
#     0x0a varint(len(header)) header | 0x12 varint(len(payload)) payload
#     field 1 (header), length-delimited  field 2 (payload), length-delimited
HEADER_FIELD = pb.PushRequest.DESCRIPTOR.fields_by_name["header"].number
PAYLOAD_FIELD = pb.PushRequest.DESCRIPTOR.fields_by_name["payload"].number
_LENGTH_DELIMITED = 2  # protobuf's wire type of messages and bytes
_MAX_VARINT_BYTES = 10  # a 64-bit varint


def field_prefix(number: int, size: int) -> bytes:
    """What precedes a length-delimited field of `size` bytes: its key (field number, wire
    type) and its length, both varints."""
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(size)


def frame(chunk: WireChunk) -> bytes:
    """The chunk as PushRequest bytes: the one copy of the payload on the way out."""
    head = chunk.header.SerializeToString()
    size = memoryview(chunk.payload).nbytes
    return b"".join((field_prefix(HEADER_FIELD, len(head)), head,
                     field_prefix(PAYLOAD_FIELD, size), chunk.payload))  # fmt: skip


def unframe(data: bytes) -> WireChunk:
    """The inverse of `frame`, without copying the payload; TransferError if malformed.

    Only what `frame` writes is read: the header field, then the payload field, then nothing
    (protobuf leaves an empty payload out: a frame may end after its header). Another field,
    a repeated one, the two out of order or a length past the end is refused."""
    start = _after_key(data, 0, HEADER_FIELD)
    size, start = _read_varint(data, start)
    if size > MAX_HEADER_BYTES or size > len(data) - start:
        raise TransferError("header length out of bounds")
    end = start + size
    try:
        header = pb.PageChunkHeader.FromString(data[start:end])
    except DecodeError:
        raise TransferError("malformed header") from None
    if end == len(data):
        return WireChunk(header, b"")
    size, start = _read_varint(data, _after_key(data, end, PAYLOAD_FIELD))
    if size != len(data) - start:
        raise TransferError("payload length out of bounds")
    return WireChunk(header, memoryview(data)[start:])


def _after_key(data: bytes, pos: int, number: int) -> int:
    """Past the key at data[pos], which must be field `number`'s (one byte: fields 1 and 2)."""
    if pos >= len(data) or data[pos] != number << 3 | _LENGTH_DELIMITED:
        raise TransferError("malformed frame")
    return pos + 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at data[pos:] and the position after it; TransferError if it does not end."""
    value = 0
    for i, byte in enumerate(data[pos : pos + _MAX_VARINT_BYTES]):
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value, pos + i + 1
    raise TransferError("malformed frame")


def damaged(chunk: WireChunk) -> WireChunk:
    """Drills only (engine.faults' transfer_corrupt): `chunk` with one payload byte flipped
    after its checksum, as a damaged link would deliver it."""
    payload = bytearray(chunk.payload)
    payload[len(payload) // 2] ^= 0x40
    return WireChunk(chunk.header, bytes(payload))


def encode_chunk(meta: ChunkMeta, pages: Sequence[torch.Tensor] | torch.Tensor) -> WireChunk:
    """One chunk holding `pages` (each [layers, 2, page_size, kv_heads, head_dim]): a list of
    pages, or a page-major block [n, ...] — a contiguous block is sent without a copy."""
    if len(pages) == 0 or len(pages) != len(meta.dest_page_ids):
        raise ValueError(f"{len(pages)} pages for {len(meta.dest_page_ids)} destination pages")
    if meta.page_hashes and len(meta.page_hashes) != len(pages):
        raise ValueError("page_hashes must be empty or one per page")
    first = pages[0]
    if first.dtype not in DTYPES or not 1 <= first.dim() <= MAX_NDIM:
        raise ValueError(f"cannot encode pages of {first.dtype}, shape {tuple(first.shape)}")
    if any(p.shape != first.shape or p.dtype != first.dtype for p in pages):
        raise ValueError("all pages of a chunk must share one shape and dtype")
    block = pages.detach().cpu() if isinstance(pages, torch.Tensor) else torch.stack([p.detach().cpu() for p in pages])
    payload = _tensor_bytes(block)
    header = pb.PageChunkHeader(
        req_id=meta.req_id,
        transfer_id=meta.transfer_id,
        transfer_token=meta.transfer_token,
        sender_epoch=meta.sender_epoch,
        page_hashes=list(meta.page_hashes),
        dest_page_ids=list(meta.dest_page_ids),
        layer_start=meta.layer_start,
        layer_end=meta.layer_start + first.shape[0],
        dtype=DTYPES[first.dtype],
        shape=list(first.shape),
        payload_bytes=len(payload),
        is_last=meta.is_last,
    )
    header.checksum = _checksum(header, payload)
    return WireChunk(header, payload)


def decode_chunk(chunk: WireChunk, limits: CodecLimits) -> torch.Tensor:
    """The chunk's pages as a CPU tensor [n, *shape]; TransferError if anything is off.

    Over an immutable payload (a gRPC message's bytes) the tensor is a read-only view: no copy,
    the receiver's store is the one copy into its pool. A payload that can change under us (a
    shm slot another process writes) is copied first and the copy is what gets checked."""
    header = chunk.header
    dtype = _WIRE_DTYPES.get(header.dtype)
    if dtype is None:
        raise TransferError("unknown dtype")
    expected = check_header(header, torch.empty((), dtype=dtype).element_size(), limits)
    if header.payload_bytes != expected or len(chunk.payload) != expected:
        raise TransferError("payload length does not match the header")
    width = torch.empty((), dtype=dtype).element_size()
    wire = np.dtype(f"<i{width}")
    data = np.frombuffer(chunk.payload, dtype=wire)
    if not _is_immutable(chunk.payload):
        data = data.copy()  # what is checked is what gets stored
    if _checksum(header, data.data.cast("B")) != header.checksum:
        raise TransferError(CHECKSUM_MISMATCH)
    if not wire.isnative:
        data = data.astype(wire.newbyteorder("="))
    shape = (len(header.dest_page_ids), *header.shape)
    return torch.from_numpy(data).view(dtype).reshape(shape)  # read-only when over bytes (never written)


def _is_immutable(payload: bytes | memoryview) -> bool:
    return isinstance(payload.obj if isinstance(payload, memoryview) else payload, bytes)


def check_header(header: pb.PageChunkHeader, elem_bytes: int, limits: CodecLimits) -> int:
    """The payload length the header implies, after bounding every field it comes from."""
    num_pages = len(header.dest_page_ids)
    if not 0 < num_pages <= limits.max_pages_per_chunk:
        raise TransferError("page count out of bounds")
    if len(set(header.dest_page_ids)) != num_pages:
        raise TransferError("duplicate destination page")
    if header.page_hashes and len(header.page_hashes) != num_pages:
        raise TransferError("page hash count does not match the page count")
    if any(len(h) > MAX_HASH_BYTES for h in header.page_hashes):
        raise TransferError("page hash too long")
    if len(header.req_id) > MAX_ID_CHARS or not 0 < len(header.transfer_id) <= MAX_ID_CHARS:
        raise TransferError("id length out of bounds")
    if len(header.transfer_token) > MAX_TOKEN_BYTES:
        raise TransferError("token too long")
    shape = list(header.shape)
    if not 1 <= len(shape) <= MAX_NDIM or any(d == 0 for d in shape):
        raise TransferError("page shape out of bounds")
    if header.layer_end <= header.layer_start or header.layer_end - header.layer_start != shape[0]:
        raise TransferError("layer range does not match the page shape")
    total = num_pages * elem_bytes
    for dim in shape:  # Python ints: no overflow, and stop as soon as the bound is passed
        total *= dim
        if total > limits.max_chunk_bytes:
            raise TransferError("chunk too large")
    return total


def _checksum(header: pb.PageChunkHeader, payload: bytes | memoryview) -> int:
    blank = pb.PageChunkHeader()
    blank.CopyFrom(header)
    blank.checksum = 0
    digest = xxhash.xxh3_64(blank.SerializeToString(deterministic=True))
    digest.update(payload)  # XXH3 runs at memory speed: zlib.crc32 was a third of a push's CPU
    return digest.intdigest()


def _tensor_bytes(pages: torch.Tensor) -> memoryview:
    # [n, *shape] -> same-width integer view -> explicit little-endian bytes, as a view: the
    # only copy on the way out is the framing's join (or none at all in-process)
    as_int = pages.contiguous().view(INT_VIEWS[pages.element_size()])
    array = as_int.numpy().astype(f"<i{pages.element_size()}", copy=False)
    return memoryview(array.data).cast("B")
