"""The page codec: exact round trips, and every corruption of a chunk is rejected."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.codec import (
    CHUNK_TARGET_BYTES,
    HEADER_FIELD,
    MAX_HEADER_BYTES,
    PAYLOAD_FIELD,
    ChunkMeta,
    CodecLimits,
    TransferError,
    WireChunk,
    chunk_pages,
    decode_chunk,
    encode_chunk,
    field_prefix,
    frame,
    unframe,
)

SHAPE = (2, 2, 4, 1, 8)  # [layers, K|V, page_size, kv_heads, head_dim], small for hypothesis
LIMITS = CodecLimits(max_pages_per_chunk=8, max_chunk_bytes=1 << 20)


def _meta(num_pages: int, **kw: object) -> ChunkMeta:
    fields: dict[str, object] = dict(
        req_id="req-1", transfer_id="t-1", transfer_token=b"k" * 16, sender_epoch=7,
        dest_page_ids=list(range(10, 10 + num_pages)),
        page_hashes=[bytes([i]) * 16 for i in range(num_pages)],
    )  # fmt: skip
    fields.update(kw)
    return ChunkMeta(**fields)  # type: ignore[arg-type]


def _pages(num_pages: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(dtype) for _ in range(num_pages)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact_through_the_wire(dtype: torch.dtype) -> None:
    pages = _pages(3, dtype)
    pages[1][0, 0, 0, 0, 0] = float("nan")  # bits, not values, must survive
    chunk = encode_chunk(_meta(3, layer_start=1), pages)
    wire = unframe(frame(chunk))
    out = decode_chunk(wire, LIMITS)
    assert out.dtype == dtype and tuple(out.shape) == (3, *SHAPE)
    assert wire.header.layer_start == 1 and wire.header.layer_end == 1 + SHAPE[0]
    assert wire.header.payload_bytes == 3 * pages[0].numel() * pages[0].element_size()
    for i, page in enumerate(pages):
        assert torch.equal(_bits(out[i]), _bits(page))


def test_encode_refuses_mixed_or_miscounted_pages() -> None:
    pages = _pages(2, torch.float32)
    with pytest.raises(ValueError):
        encode_chunk(_meta(3), pages)
    with pytest.raises(ValueError):
        encode_chunk(_meta(2), [pages[0], pages[1].to(torch.float16)])


# Each mutation changes one header field to a different value (or damages the payload).
Mutation = Callable[[WireChunk, st.DataObject], None]


def _set_scalar(name: str, values: st.SearchStrategy[object]) -> Mutation:
    def mutate(chunk: WireChunk, data: st.DataObject) -> None:
        new = data.draw(values)
        assume(new != getattr(chunk.header, name))
        setattr(chunk.header, name, new)

    return mutate


def _set_list(name: str, values: st.SearchStrategy[list[object]]) -> Mutation:
    def mutate(chunk: WireChunk, data: st.DataObject) -> None:
        field = getattr(chunk.header, name)
        new = data.draw(values)
        assume(new != list(field))
        del field[:]
        field.extend(new)

    return mutate


def _flip_payload(chunk: WireChunk, data: st.DataObject) -> None:
    raw = bytearray(chunk.payload)
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    chunk.payload = bytes(raw)


def _resize_payload(chunk: WireChunk, data: st.DataObject) -> None:
    cut = data.draw(st.integers(-64, 64).filter(lambda n: n != 0))
    raw = bytes(chunk.payload)
    chunk.payload = raw[:cut] if cut < 0 else raw + b"\0" * cut


u32 = st.integers(0, 2**32 - 1)
MUTATIONS: dict[str, Mutation] = {
    "req_id": _set_scalar("req_id", st.text(max_size=8)),
    "transfer_id": _set_scalar("transfer_id", st.text(max_size=8)),
    "transfer_token": _set_scalar("transfer_token", st.binary(max_size=20)),
    "sender_epoch": _set_scalar("sender_epoch", st.integers(0, 2**64 - 1)),
    "page_hashes": _set_list("page_hashes", st.lists(st.binary(max_size=17), max_size=4)),
    "dest_page_ids": _set_list("dest_page_ids", st.lists(u32, max_size=4)),
    "layer_start": _set_scalar("layer_start", u32),
    "layer_end": _set_scalar("layer_end", u32),
    "dtype": _set_scalar("dtype", st.integers(0, 5)),
    "shape": _set_list("shape", st.lists(st.integers(0, 64), max_size=9)),
    "payload_bytes": _set_scalar("payload_bytes", st.integers(0, 2**64 - 1)),
    "checksum": _set_scalar("checksum", u32),
    "is_last": _set_scalar("is_last", st.booleans()),
    "payload_byte": _flip_payload,
    "payload_length": _resize_payload,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    kind=st.sampled_from(sorted(MUTATIONS)),
    data=st.data(),
)
def test_any_corruption_is_rejected_never_decoded(
    dtype: torch.dtype, kind: str, data: st.DataObject
) -> None:
    chunk = encode_chunk(_meta(3), _pages(3, dtype))
    MUTATIONS[kind](chunk, data)
    wire = unframe(frame(chunk))
    with pytest.raises(TransferError):
        decode_chunk(wire, LIMITS)


def test_lengths_from_the_wire_are_bounded_before_the_payload_is_read() -> None:
    chunk = encode_chunk(_meta(3), _pages(3, torch.float32))
    huge = unframe(frame(chunk))
    huge.header.shape[:] = [2] + [2**32 - 1] * 7  # claims ~10^67 bytes: never allocated
    with pytest.raises(TransferError, match="too large"):
        decode_chunk(huge, LIMITS)
    with pytest.raises(TransferError, match="page count"):
        decode_chunk(chunk, CodecLimits(max_pages_per_chunk=2))
    with pytest.raises(TransferError, match="too large"):
        decode_chunk(chunk, CodecLimits(max_chunk_bytes=chunk.header.payload_bytes - 1))


def test_a_frame_is_a_push_request_as_protobuf_encodes_it() -> None:
    """frame/unframe write and read PushRequest's encoding by hand (the payload never passes
    through protobuf): the library reads what they write, and they read what it writes."""
    chunk = encode_chunk(_meta(3), _pages(3, torch.float32))
    wire = frame(chunk)
    assert wire == pb.PushRequest(header=chunk.header, payload=bytes(chunk.payload)).SerializeToString()
    parsed = pb.PushRequest.FromString(wire)
    assert parsed.header == chunk.header and parsed.payload == bytes(chunk.payload)
    message = pb.PushRequest(header=chunk.header, payload=bytes(chunk.payload)).SerializeToString()
    back = unframe(message)
    assert back.header == chunk.header and bytes(back.payload) == bytes(chunk.payload)
    assert isinstance(back.payload, memoryview) and back.payload.obj is message  # a view, not a copy
    assert torch.equal(decode_chunk(back, LIMITS), decode_chunk(chunk, LIMITS))


def test_malformed_frames_are_refused() -> None:
    chunk = encode_chunk(_meta(3), _pages(3, torch.float32))
    head, payload = chunk.header.SerializeToString(), bytes(chunk.payload)
    header_field = field_prefix(HEADER_FIELD, len(head)) + head
    payload_field = field_prefix(PAYLOAD_FIELD, len(payload)) + payload
    assert frame(chunk) == header_field + payload_field
    bad = {
        "empty": b"",
        "a truncated key": header_field[:1],
        "a length that does not end": b"\x0a" + b"\xff" * 12,
        "payload first": payload_field + header_field,
        "no header": payload_field,
        "two headers": header_field + header_field + payload_field,
        "another field": header_field + payload_field + field_prefix(3, 1) + b"x",
        "another field between": header_field + field_prefix(3, 1) + b"x" + payload_field,
        "header past the end": field_prefix(HEADER_FIELD, len(head) + 1) + head,
        "header over the bound": field_prefix(HEADER_FIELD, MAX_HEADER_BYTES + 1) + b"\0" * (MAX_HEADER_BYTES + 1),
        "payload past the end": header_field + field_prefix(PAYLOAD_FIELD, len(payload) + 1) + payload,
        "bytes after the payload": header_field + payload_field + b"\0",
        "garbage header": field_prefix(HEADER_FIELD, 20) + b"\xff" * 20 + payload_field,
        "no payload": header_field,  # protobuf's empty payload: unframed, then refused by its length
    }
    refused = []
    for name, data in bad.items():
        try:
            decode_chunk(unframe(data), LIMITS)
        except TransferError:
            refused.append(name)
    assert refused == list(bad)


def test_chunk_pages_fit_the_target_and_the_receivers_bounds() -> None:
    assert chunk_pages(393_216) == CHUNK_TARGET_BYTES // 393_216 == 10  # baton-small, float32: 3.9 MB chunks
    assert chunk_pages(16 << 10) == 256  # a small page: the page-count bound, not 4 MiB
    assert chunk_pages(8 << 20) == 1  # a page over the target still travels, one a chunk
    assert chunk_pages(2 << 20, 32) == 16  # asked for: as many as fit in 32 MiB
    assert chunk_pages(2 << 20, 3) == 3
    with pytest.raises(ValueError, match="over the"):
        chunk_pages(64 << 20)
