"""Byte-fuzzing every decoder of network or disk bytes (hypothesis, bounded examples).

Each decoder may only succeed or fail in its documented way:

    KV page frames and headers  kvtransfer.codec.unframe / decode_chunk   TransferError
    a whole push on a receiver  kvtransfer.local.receive_all              a reason string
    shm control messages        kvtransfer.shm._parse_or_none / view      None / TransferError
    shm grants (sender side)    ShmSender._attach                         TransferError
    disk records and segments   kvcache.disk_record.decode_header /       None / a reason /
                                check_record / scan_segment, DiskTier     never raises
    membership values           WorkerInfo.from_json                      ValueError
    gRPC requests               GenerateRequest parse + the API's checks  DecodeError /
                                                                          EdgeError / BatonError

and a single flipped bit anywhere in a valid KV frame or disk record is caught by its
checksums (or changes nothing that is decoded).
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from batonpb.baton.v1 import generation_pb2 as gen_pb
from cluster.edge.grpc_fields import build_sampling, check_prompt
from cluster.errors import EdgeError
from cluster.membership.protocol import Role, WorkerInfo
from engine.errors import BatonError
from kvcache.disk import DiskTier
from kvcache.disk_record import (
    HEADER_SIZE,
    check_record,
    decode_header,
    decode_page,
    encode_record,
    scan_segment,
)
from kvcache.pool import DevicePool, KVLayout
from kvtransfer.codec import (
    HEADER_FIELD,
    PAYLOAD_FIELD,
    ChunkMeta,
    CodecLimits,
    TransferError,
    WireChunk,
    decode_chunk,
    encode_chunk,
    field_prefix,
    frame,
    unframe,
)
from kvtransfer.local import receive_all
from kvtransfer.shm import ShmRegion, ShmSender, _parse_or_none
from kvtransfer.transport import PoolReceiver, Reservation, ReservationBook

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = CodecLimits(max_pages_per_chunk=8, max_chunk_bytes=1 << 16)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2)
PAGE_SHAPE = (LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
FINGERPRINT = bytes(range(16))
u32 = st.integers(0, 2**32 - 1)


def _pages(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *PAGE_SHAPE), generator=torch.Generator().manual_seed(seed)).to(dtype)


def _chunk(n: int = 3, dtype: torch.dtype = torch.float32) -> WireChunk:
    meta = ChunkMeta("req-1", "t-1", b"k" * 16, 7, list(range(4, 4 + n)), [bytes([i]) * 16 for i in range(n)])
    return encode_chunk(meta, _pages(n, dtype))


def _seal(header: pb.PageChunkHeader, payload: bytes) -> None:
    """The checksum the codec documents: crc32 of the header (deterministic, checksum 0),
    continued over the payload; a sealed forgery gets past the codec to the token check."""
    header.checksum = 0
    header.checksum = zlib.crc32(payload, zlib.crc32(header.SerializeToString(deterministic=True)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


# -- KV page frames ----------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=512))
def test_any_bytes_as_a_kv_frame_fail_only_with_transfer_error(data: bytes) -> None:
    try:
        decode_chunk(unframe(data), LIMITS)
    except TransferError as err:
        assert err.reason
    else:  # pragma: no cover - a random frame with a matching crc32 is a 2^-32 event
        pytest.fail("random bytes decoded as a chunk")


@FUZZ
@given(header=st.binary(max_size=256), payload=st.binary(max_size=256))
def test_a_well_framed_garbage_header_fails_only_with_transfer_error(header: bytes, payload: bytes) -> None:
    with pytest.raises(TransferError):
        fields = (field_prefix(HEADER_FIELD, len(header)), header, field_prefix(PAYLOAD_FIELD, len(payload)), payload)
        decode_chunk(unframe(b"".join(fields)), LIMITS)


@FUZZ
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), data=st.data())
def test_a_single_bit_flip_in_a_kv_frame_is_caught(dtype: torch.dtype, data: st.DataObject) -> None:
    chunk = _chunk(3, dtype)
    wire = bytearray(frame(chunk))
    bit = data.draw(st.integers(0, len(wire) * 8 - 1), label="bit")
    wire[bit // 8] ^= 1 << (bit % 8)
    try:
        out = decode_chunk(unframe(bytes(wire)), LIMITS)
    except TransferError:
        return
    # Accepted: only a flip that decodes to the very same message may pass (protobuf reads a
    # bool varint of 3 as true, like 1): the header and every payload bit must be intact.
    again = unframe(bytes(wire))
    assert again.header == chunk.header, f"bit {bit}: a changed header passed the checksum"
    assert torch.equal(_bits(out), _bits(decode_chunk(WireChunk(chunk.header, chunk.payload), LIMITS)))


LAYER_BYTES = 2 * LAYOUT.page_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4  # float32


def _near(valid: object, wild: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """`valid` seven times in eight, else anything `wild` draws."""
    return st.integers(0, 7).flatmap(lambda i: wild if i == 7 else st.just(valid))


@st.composite
def _forgery(draw: st.DrawFn, transfer_id: str, page_ids: list[int]) -> tuple[pb.PageChunkHeader, int]:
    """A header near a valid one, so the fuzz gets past the codec to the token, epoch and
    page checks and to the store (each field is sometimes replaced by anything at all), and
    the payload length the header implies."""
    n = draw(st.integers(1, 3))
    start = draw(st.integers(0, 1))
    layers = draw(st.integers(1, LAYOUT.num_layers - start))
    ids = draw(st.lists(st.sampled_from([*page_ids, 0, 1, 31]), min_size=n, max_size=n, unique=True))
    header = pb.PageChunkHeader(
        req_id=draw(_near("req-1", st.sampled_from(["other", ""]) | st.text(max_size=130))),
        transfer_id=draw(_near(transfer_id, st.sampled_from(["t", ""]) | st.text(max_size=130))),
        sender_epoch=draw(_near(7, st.sampled_from([6, 8, 0, 2**64 - 1]))),
        page_hashes=draw(_near([b"\xee" * 16] * n, st.just([]) | st.lists(st.binary(max_size=70), max_size=4))),
        dest_page_ids=draw(_near(ids, st.lists(u32, max_size=4))),
        layer_start=draw(_near(start, u32)),
        layer_end=draw(_near(start + layers, st.integers(0, 3) | u32)),
        dtype=draw(_near(pb.KV_DTYPE_FLOAT32, st.integers(0, 4))),
        shape=draw(_near([layers, *PAGE_SHAPE[1:]], st.lists(st.integers(0, 70_000), max_size=9))),
        is_last=draw(st.booleans()),
    )  # fmt: skip
    return header, len(header.dest_page_ids) * layers * LAYER_BYTES


@FUZZ
@given(data=st.data(), with_token=st.booleans(), seal=st.booleans())
def test_forged_chunks_never_touch_pages_outside_their_reservation(
    data: st.DataObject, with_token: bool, seal: bool
) -> None:
    # Given a decode pool with one open reservation of pages 4..6
    pool = DevicePool(LAYOUT, 32, torch.float32)
    released: list[Reservation] = []
    book = ReservationBook(LAYOUT.num_layers, released.append)
    reserved = pool.pages.allocate(7)
    assert reserved is not None
    dest = book.reserve("decode-0", "req-1", reserved[4:], 7, 10.0)
    # When a stream of forged chunks arrives: headers near valid ones and far from them, with
    # or without the real token, sealed with a matching checksum or not
    chunks = []
    for _ in range(data.draw(st.integers(1, 3), label="chunks")):
        header, size = data.draw(_forgery(dest.transfer_id, list(dest.dest_page_ids)), label="header")
        header.transfer_token = dest.token if with_token else data.draw(st.binary(max_size=20), label="token")
        assume(with_token or header.transfer_token != dest.token)
        size = data.draw(_near(size, st.integers(0, 2 * size)), label="size")
        payload = b"\x01" * size if seal else data.draw(st.binary(min_size=1, max_size=600).map(lambda b: b"\x01" + b))
        header.payload_bytes = len(payload) if seal else data.draw(st.integers(0, 2**64 - 1))
        if seal:
            _seal(header, payload)
        chunks.append(WireChunk(header, payload))
    reason = receive_all(PoolReceiver(pool, book), chunks, LIMITS)
    # Then no page outside the reservation changed, and without the token nothing did
    outside = [p for p in range(pool.num_pages) if p not in dest.dest_page_ids]
    assert not pool.kv[:, :, outside].any()
    event(f"with_token={with_token} sealed={seal}: {reason or 'complete'}")
    if not with_token:
        assert reason and not released
    if not reason:  # every page arrived (only possible with the token): complete
        assert dest.transfer_id in book.completed and not released
    elif book.get(dest.transfer_id) is not None:  # still open: nothing was stored
        assert not released and not pool.kv.any()
    else:  # a failure after the token was proven: released, once
        assert [r.transfer_id for r in released] == [dest.transfer_id]


# -- shm control messages and grants -----------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=400))
def test_shm_chunk_messages_parse_or_are_none(data: bytes) -> None:
    msg = _parse_or_none(data)
    assert msg is None or isinstance(msg, pb.PushShmRequest)


def test_shm_slot_references_stay_inside_one_slot() -> None:
    with ShmRegion(num_slots=3, slot_bytes=4096) as region:

        @FUZZ
        @given(offset=st.integers(-(2**64), 2**64) | st.integers(0, 3 * 4096 + 1),
               length=st.integers(-(2**64), 2**64) | st.integers(0, 4097))  # fmt: skip
        def check(offset: int, length: int) -> None:
            try:
                view = region.view(offset, length)
            except TransferError:
                return
            assert offset % 4096 == 0 and 0 <= offset < region.size and 0 < length <= 4096
            assert len(view) == length

        check()


@FUZZ
@given(region=st.text(max_size=60) | st.sampled_from(["../../etc/passwd", "baton-kv-4026531836-1-" + "0" * 32, "/dev/shm/x"]),
       region_bytes=st.integers(0, 2**64 - 1), slot_bytes=st.integers(0, 2**64 - 1))  # fmt: skip
def test_a_hostile_shm_grant_is_refused_before_anything_is_opened(
    tmp_path_factory: pytest.TempPathFactory, region: str, region_bytes: int, slot_bytes: int
) -> None:
    sender = ShmSender(directory=str(tmp_path_factory.getbasetemp() / "no-shm-here"))
    grant = pb.PushShmResponse(region=region, region_bytes=region_bytes, slot_bytes=slot_bytes)
    with pytest.raises(TransferError):
        sender._attach("decode-0", grant)
    assert not sender._maps


# -- disk records ------------------------------------------------------------------------------

DISK_PAGE = torch.arange(32, dtype=torch.float32).reshape(PAGE_SHAPE)
PAGE_HASH = bytes([7]) * 16


@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_disk_header_or_record_never_raise(data: bytes) -> None:
    header = decode_header(data)
    assert header is None or len(data) >= HEADER_SIZE
    problem = check_record(data, PAGE_HASH, FINGERPRINT, PAGE_SHAPE, torch.float32)
    if problem is None:  # pragma: no cover - needs two matching crc32s
        assert header is not None
        decode_page(header, memoryview(data)[HEADER_SIZE : header.record_len])


@FUZZ
@given(data=st.binary(max_size=2000), records=st.integers(0, 3), cut=st.integers(0, 2000))
def test_scanning_any_segment_bytes_never_raises(data: bytes, records: int, cut: int) -> None:
    good = b"".join(encode_record(FINGERPRINT, bytes([i]) * 16, DISK_PAGE) for i in range(records))
    blob = (good + data)[: len(good) + cut] if cut % 2 else data[:cut] + good + data[cut:]
    scan = scan_segment(blob)
    pos = -1
    for record in scan.records:
        assert record.offset > pos and record.offset + record.header.record_len <= len(blob)
        pos = record.offset
    assert 0 <= scan.torn_tail_bytes <= len(blob)


@FUZZ
@given(data=st.data())
def test_a_single_bit_flip_in_a_disk_record_is_caught(data: st.DataObject) -> None:
    record = bytearray(encode_record(FINGERPRINT, PAGE_HASH, DISK_PAGE))
    bit = data.draw(st.integers(0, len(record) * 8 - 1), label="bit")
    record[bit // 8] ^= 1 << (bit % 8)
    assert check_record(bytes(record), PAGE_HASH, FINGERPRINT, PAGE_SHAPE, torch.float32) is not None
    assert not any(r.is_intact for r in scan_segment(bytes(record)).records)


@settings(max_examples=25, deadline=None)
@given(junk=st.binary(max_size=600), flip=st.integers(0, 2**31))
def test_a_disk_tier_opens_any_segment_file(tmp_path_factory: pytest.TempPathFactory, junk: bytes, flip: int) -> None:
    directory = tmp_path_factory.mktemp("tier")
    good = bytearray(encode_record(FINGERPRINT, PAGE_HASH, DISK_PAGE))
    good[flip % len(good)] ^= 1 << (flip % 8)
    (directory / "seg-00000000.bkv").write_bytes(junk + bytes(good) + junk)
    tier = DiskTier(directory, FINGERPRINT, PAGE_SHAPE, torch.float32, capacity_pages=8)
    try:
        assert tier.hashes() == [] and tier.get(PAGE_HASH) is None
        tier.check_integrity()
    finally:
        tier.close()


# -- membership values -------------------------------------------------------------------------

GOOD_INFO = WorkerInfo("d-0", Role.DECODE, "d-0.actor", "node-a", "127.0.0.1:7000", 0, 64, 16, 8)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def _parse_info(data: bytes) -> WorkerInfo | None:
    try:
        return WorkerInfo.from_json(data, epoch=3)
    except ValueError:
        return None


@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_as_worker_info_fail_only_with_value_error(data: bytes) -> None:
    _parse_info(data)


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(sorted(json.loads(GOOD_INFO.to_json()))) | st.text(max_size=8), JSON,
                           max_size=10),
       base=st.booleans())  # fmt: skip
def test_any_json_as_worker_info_fails_only_with_value_error(doc: dict[str, object], base: bool) -> None:
    merged = {**json.loads(GOOD_INFO.to_json()), **doc} if base else doc
    info = _parse_info(json.dumps(merged).encode())
    if info is not None:  # whatever parsed is a valid WorkerInfo, not just any object
        assert WorkerInfo.from_json(info.to_json(), epoch=3) == info


@pytest.mark.parametrize("data", [
    b"[" * 16_000, b'{"a":' * 3_000 + b"1" + b"}" * 3_000, b'{"worker_id":' + b"[" * 5_000,
], ids=["array", "object", "field"])  # fmt: skip
def test_deeply_nested_worker_info_is_a_value_error(data: bytes) -> None:
    # json.loads raises RecursionError (not a ValueError) past ~1,000 levels: the etcd watcher
    # only skips ValueErrors, so one such value used to stall membership for good
    with pytest.raises(ValueError):
        WorkerInfo.from_json(data, epoch=1)


# -- gRPC requests -----------------------------------------------------------------------------


def _open_request(data: bytes) -> None:
    request = gen_pb.GenerateRequest.FromString(data)
    check_prompt(request, 64)
    build_sampling(request.sampling, 63)


@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_generate_request_fail_only_with_documented_errors(data: bytes) -> None:
    try:
        _open_request(data)
    except (DecodeError, EdgeError, BatonError):
        pass


FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1.0, 2.0, -0.0])


@FUZZ
@given(
    sampling=st.builds(
        gen_pb.Sampling, max_tokens=u32, min_tokens=u32, temperature=FLOATS, top_p=FLOATS, top_k=u32,
        min_p=FLOATS, repetition_penalty=FLOATS, presence_penalty=FLOATS, frequency_penalty=FLOATS,
        seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=300), max_size=20),
        stop_token_ids=st.lists(u32, max_size=70), ignore_eos=st.booleans(), logprobs=u32,
    ),
    text=st.text(max_size=20), ids=st.lists(u32, max_size=70), chat=st.booleans(),
    roles=st.lists(st.sampled_from(["user", "system", "root", ""]), max_size=3),
)
def test_any_generate_request_fields_fail_only_with_documented_errors(
    sampling: gen_pb.Sampling, text: str, ids: list[int], chat: bool, roles: list[str]
) -> None:
    request = gen_pb.GenerateRequest(model="baton-tiny", sampling=sampling, chat=chat)
    request.messages.extend(gen_pb.ChatMessage(role=r, content=text) for r in roles)
    if ids:
        request.token_ids.ids.extend(ids)
    elif text:
        request.text = text
    try:
        _open_request(request.SerializeToString())
    except (EdgeError, BatonError):
        pass
