"""Local and gRPC transports moving baton-tiny-shaped pages into a DevicePool's reserved ids."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvcache.pool import DevicePool, KVLayout
from kvtransfer.codec import WireChunk
from kvtransfer.grpc_transport import PUSH, GrpcSender, start_kv_server
from kvtransfer.local import LocalSender
from kvtransfer.nccl_link import PUSH_NCCL
from kvtransfer.shm import PUSH_SHM
from kvtransfer.transport import (
    ABORTED,
    KVDestination,
    KVSender,
    PoolReceiver,
    Reservation,
    ReservationBook,
    build_chunks,
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16)  # page [4,2,16,2,64]
EPOCH = 9


class Decode:
    """The decode side: a pool, a book whose releases free pages, and a receiver."""

    def __init__(self, num_pages: int = 160) -> None:
        self.pool = DevicePool(LAYOUT, num_pages, torch.float32)
        self.released: list[Reservation] = []
        self.book = ReservationBook(LAYOUT.num_layers, self._release)
        self.receiver = PoolReceiver(self.pool, self.book)
        self.pool.pages.allocate(3)  # so reserved ids are not simply 0..n-1

    def _release(self, res: Reservation) -> None:
        self.released.append(res)
        self.pool.pages.free(res.page_ids)

    def reserve(self, address: str, n: int, ttl_s: float = 10.0) -> KVDestination:
        pages = self.pool.pages.allocate(n)
        assert pages is not None
        return self.book.reserve(address, "req-1", pages, EPOCH, ttl_s)


def _prefill_pages(n: int) -> list[torch.Tensor]:
    src = DevicePool(LAYOUT, n, torch.float32)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(1)))
    return [src.read_page(i) for i in range(n)]


@pytest.fixture
async def grpc_decode() -> AsyncIterator[tuple[Decode, str]]:
    decode = Decode()
    server, port = await start_kv_server(decode.receiver, "127.0.0.1:0")
    yield decode, f"127.0.0.1:{port}"
    await server.stop(grace=None)


@pytest.fixture
async def grpc_sender() -> AsyncIterator[GrpcSender]:
    sender = GrpcSender()
    yield sender
    await sender.close()


def _assert_landed(decode: Decode, dest: KVDestination, pages: list[torch.Tensor]) -> None:
    for page_id, page in zip(dest.dest_page_ids, pages, strict=True):
        assert torch.equal(decode.pool.read_page(page_id), page)
    others = set(range(decode.pool.num_pages)) - set(dest.dest_page_ids)
    assert all(not decode.pool.read_page(p).any() for p in others)
    assert dest.transfer_id in decode.book.completed and decode.book.num_open == 0
    decode.pool.check_integrity()


async def _push(sender: KVSender, dest: KVDestination, pages: list[torch.Tensor]) -> None:
    result = await sender.send(dest, build_chunks(dest, pages, EPOCH, pages_per_chunk=5), 10.0)
    assert (result.accepted, result.pages_received, result.error) == (True, len(pages), "")


async def test_local_transport_lands_pages_in_the_reserved_ids() -> None:
    decode, pages = Decode(), _prefill_pages(12)
    dest = decode.reserve("decode-0", 12)
    assert dest.dest_page_ids == tuple(range(3, 15))
    await _push(LocalSender({"decode-0": decode.receiver}), dest, pages)
    _assert_landed(decode, dest, pages)


async def test_grpc_transport_lands_pages_in_the_reserved_ids(
    grpc_decode: tuple[Decode, str], grpc_sender: GrpcSender
) -> None:
    decode, address = grpc_decode
    pages = _prefill_pages(12)
    dest = decode.reserve(address, 12)
    await _push(grpc_sender, dest, pages)
    _assert_landed(decode, dest, pages)


def test_the_kv_server_hosts_the_declared_service() -> None:
    """KVTransferService (proto/baton/kv/v1/kvtransfer.proto) declares every method the KV
    server hosts, with the messages each one really carries."""
    service = pb.DESCRIPTOR.services_by_name["KVTransferService"]
    assert service.full_name == "baton.kv.v1.KVTransferService"
    declared = {f"/{service.full_name}/{m.name}": (m.input_type.name, m.output_type.name, m.client_streaming,
                                                   m.server_streaming) for m in service.methods}  # fmt: skip
    assert declared == {
        PUSH: ("PushRequest", "PushResponse", True, False),
        PUSH_SHM: ("PushShmRequest", "PushShmResponse", True, True),
        PUSH_NCCL: ("PushNcclRequest", "PushNcclResponse", True, True),
    }


async def test_a_push_of_protobuf_encoded_push_requests_lands(grpc_decode: tuple[Decode, str]) -> None:
    """Push's messages are PushRequests: any protobuf client that writes them (not only
    kvtransfer.codec.frame) pushes pages."""
    decode, address = grpc_decode
    pages = _prefill_pages(6)
    dest = decode.reserve(address, 6)
    requests = [pb.PushRequest(header=c.header, payload=bytes(c.payload))
                for c in build_chunks(dest, pages, EPOCH, pages_per_chunk=4)]  # fmt: skip
    async with grpc.aio.insecure_channel(address) as channel:
        push = channel.stream_unary(PUSH, pb.PushRequest.SerializeToString, pb.PushResponse.FromString)
        ack = await push(iter(requests), timeout=10)
    assert (ack.accepted, ack.pages_received, ack.error) == (True, 6, "")
    _assert_landed(decode, dest, pages)


async def test_grpc_wrong_token_is_refused_and_the_reservation_untouched(
    grpc_decode: tuple[Decode, str], grpc_sender: GrpcSender
) -> None:
    decode, address = grpc_decode
    pages = _prefill_pages(4)
    dest = decode.reserve(address, 4)
    forged = KVDestination(
        address, dest.req_id, dest.transfer_id, b"f" * 16, EPOCH, dest.dest_page_ids
    )
    result = await grpc_sender.send(forged, build_chunks(forged, pages, EPOCH), 5.0)
    assert not result.accepted and result.error == "refused"
    assert decode.book.refused_bad_token == 1 and not decode.released
    assert not any(decode.pool.read_page(p).any() for p in dest.dest_page_ids)
    await _push(grpc_sender, dest, pages)  # the real sender still gets through
    _assert_landed(decode, dest, pages)


@pytest.mark.parametrize("kind", ["local", "grpc"])
async def test_a_push_whose_request_was_aborted_on_the_decode_side_ends_aborted(
    kind: str, grpc_decode: tuple[Decode, str], grpc_sender: GrpcSender
) -> None:
    """The client left and the decode side's abort came before the prefill side's: the push's
    ack says aborted (prefill.pushes ends it as such), not a refusal."""
    decode, address = grpc_decode
    pages = _prefill_pages(4)
    dest = decode.reserve(address, 4)
    assert decode.book.release(dest.transfer_id, aborted=True)
    sender: KVSender = grpc_sender if kind == "grpc" else LocalSender({address: decode.receiver})
    result = await sender.send(dest, build_chunks(dest, pages, EPOCH), 5.0)
    assert (result.accepted, result.error) == (False, ABORTED)
    assert not any(decode.pool.read_page(p).any() for p in dest.dest_page_ids)


async def test_grpc_corrupt_chunk_after_acceptance_releases_the_reservation(
    grpc_decode: tuple[Decode, str], grpc_sender: GrpcSender
) -> None:
    decode, address = grpc_decode
    dest = decode.reserve(address, 10)
    chunks = build_chunks(dest, _prefill_pages(10), EPOCH, pages_per_chunk=5)
    raw = bytes(chunks[1].payload)
    chunks[1].payload = raw[:-1] + bytes([raw[-1] ^ 1])
    result = await grpc_sender.send(dest, chunks, 5.0)
    assert (result.accepted, result.pages_received, result.error) == (False, 5, "checksum mismatch")
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    assert decode.book.num_open == 0 and decode.pool.pages.num_used == 3


@pytest.mark.parametrize("kind", ["local", "grpc"])
async def test_deadline_passing_mid_stream_fails_and_releases_the_reservation(
    kind: str, grpc_decode: tuple[Decode, str], grpc_sender: GrpcSender
) -> None:
    decode, address = grpc_decode
    dest = decode.reserve(address, 10)
    chunks = build_chunks(dest, _prefill_pages(10), EPOCH, pages_per_chunk=5)

    async def stalled() -> AsyncIterator[WireChunk]:
        yield chunks[0]
        await asyncio.sleep(30)  # the prefill side stalls before the last chunk
        yield chunks[1]

    sender: KVSender = grpc_sender if kind == "grpc" else LocalSender({address: decode.receiver})
    result = await sender.send(dest, stalled(), deadline_s=0.5)
    assert not result.accepted and result.error == "deadline exceeded"
    for _ in range(100):  # the server learns of the cancellation asynchronously
        if decode.released:
            break
        await asyncio.sleep(0.02)
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    assert decode.book.num_open == 0 and decode.pool.pages.num_used == 3
    assert any(decode.pool.read_page(p).any() for p in dest.dest_page_ids[:5])  # it did start


async def test_grpc_refuses_a_chunk_over_the_message_limit(grpc_decode: tuple[Decode, str]) -> None:
    _, address = grpc_decode
    async with grpc.aio.insecure_channel(address) as channel:
        push = channel.stream_unary(PUSH, request_serializer=bytes, response_deserializer=pb.PushResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await push(iter([b"\0" * (40 << 20)]), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
