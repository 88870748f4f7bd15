"""The nccl transport between two workers (kvtransfer/nccl_link.py): a real KV gRPC server with
KVTransferService/PushNccl, NcclSender and NcclEndpoint, the pages over a real two-rank gloo
communicator (what CPU pools use) or, for the failure drills, the in-memory LoopbackFabric
(which can stall a peer or flip a byte on cue). Only CuPy's NCCL calls are not here:
bench/gpu_check.py runs them on a GPU.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from kvcache.pool import DevicePool, KVLayout
from kvtransfer.codec import DeviceChunk
from kvtransfer.grpc_transport import start_kv_server
from kvtransfer.nccl import ChannelState, LoopbackFabric, device_chunks
from kvtransfer.nccl_comm import GLOO_UID
from kvtransfer.nccl_link import NcclEndpoint, NcclSender, nccl_handler
from kvtransfer.transport import KVDestination, PoolReceiver, Reservation, ReservationBook

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, page_size=8)
EPOCH = 4
CPU = torch.device("cpu")


class Decode:
    """A decode worker's receiving side: pool, reservations, the KV server with PushNccl."""

    def __init__(self, endpoint: NcclEndpoint) -> None:
        self.pool = DevicePool(LAYOUT, 40, torch.bfloat16)
        self.released: list[Reservation] = []
        self.book = ReservationBook(LAYOUT.num_layers, self._release)
        self.endpoint = endpoint
        self.address = ""

    async def start(self) -> None:
        receiver = PoolReceiver(self.pool, self.book)
        self.server, port = await start_kv_server(receiver, "127.0.0.1:0", extra_handlers=[
            nccl_handler(receiver, self.endpoint)])  # fmt: skip
        self.address = f"127.0.0.1:{port}"

    def _release(self, res: Reservation) -> None:
        self.released.append(res)
        self.pool.pages.free(res.page_ids)

    def reserve(self, n: int, req_id: str = "req-1") -> KVDestination:
        pages = self.pool.pages.allocate(n)
        assert pages is not None
        return self.book.reserve(self.address, req_id, pages, EPOCH, 10.0)

    def pages(self, dest: KVDestination) -> torch.Tensor:
        index = torch.tensor(dest.dest_page_ids)
        return self.pool.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5)


def _kv(n: int, seed: int = 1) -> torch.Tensor:
    shape = (n, LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@asynccontextmanager
async def _pair(fabric: LoopbackFabric | None = None) -> AsyncIterator[tuple[Decode, NcclSender]]:
    """A routed pair: the decode side listens, the prefill side joins (gloo unless `fabric`)."""
    if fabric is None:
        endpoint, sender = NcclEndpoint(CPU), NcclSender(CPU)
    else:
        endpoint = NcclEndpoint(CPU, connect=lambda uid, rank, dev: fabric.comm(rank))
        sender = NcclSender(CPU, connect=lambda uid, rank, dev: fabric.comm(rank))
    decode = Decode(endpoint)
    await decode.start()
    try:
        name, uid = await endpoint.listen(deadline_s=10.0)
        await sender.connect(decode.address, name, uid, deadline_s=10.0)  # a push waits for decode's join
        yield decode, sender
    finally:
        await sender.close()
        endpoint.close()
        await decode.server.stop(None)


async def test_pages_cross_a_gloo_communicator_bit_exact() -> None:
    async with _pair() as (decode, sender):
        dest = decode.reserve(5)
        kv = _kv(5)
        result = await sender.send(dest, device_chunks(dest, kv, EPOCH, pages_per_chunk=2), 5.0)
        assert result.accepted and result.pages_received == 5 and result.error == ""
        assert torch.equal(decode.pages(dest), kv)
        assert dest.transfer_id in decode.book.completed and not decode.released


async def test_transfers_sharing_a_pair_interleave_their_chunks_without_crossing() -> None:
    async with _pair() as (decode, sender):
        dests = [decode.reserve(4, f"req-{i}") for i in range(3)]
        blocks = [_kv(4, seed=i + 10) for i in range(3)]
        results = await asyncio.gather(*(
            sender.send(d, device_chunks(d, kv, EPOCH, pages_per_chunk=1), 10.0) for d, kv in zip(dests, blocks, strict=True)
        ))  # fmt: skip
        assert [r.accepted for r in results] == [True, True, True]
        for dest, kv in zip(dests, blocks, strict=True):
            assert torch.equal(decode.pages(dest), kv)


async def test_pages_stream_in_as_the_prefill_computes_them() -> None:
    """The prefill's chunks arrive over time (an async source); the first is sent at once."""
    async with _pair() as (decode, sender):
        dest = decode.reserve(4)
        kv = _kv(4)

        async def computed() -> object:
            for start in (0, 2):
                await asyncio.sleep(0.05)
                for chunk in device_chunks(dest, kv[start : start + 2], EPOCH, first_page=start, pages_per_chunk=1):
                    yield chunk

        result = await sender.send(dest, computed(), 5.0)  # type: ignore[arg-type]
        assert result.accepted and torch.equal(decode.pages(dest), kv)


async def test_a_forged_token_is_refused_before_any_page_moves_and_the_channel_lives_on() -> None:
    fabric = LoopbackFabric()
    async with _pair(fabric) as (decode, sender):
        dest = decode.reserve(2)
        forged = KVDestination(dest.address, dest.req_id, dest.transfer_id, b"\0" * 16, EPOCH, dest.dest_page_ids)
        result = await sender.send(forged, device_chunks(forged, _kv(2), EPOCH), 5.0)
        assert not result.accepted and result.error == "refused"
        assert decode.book.refused_bad_token == 1 and not decode.released  # the real one stands
        assert not any(fabric.queues.values())  # no page was sent
        assert sender.is_open(dest.address)
        result = await sender.send(dest, device_chunks(dest, _kv(2), EPOCH), 5.0)
        assert result.accepted


async def test_a_corrupted_block_fails_its_checksum_and_releases_the_reservation() -> None:
    fabric = LoopbackFabric()
    async with _pair(fabric) as (decode, sender):
        dest = decode.reserve(3)
        before = decode.pool.pages.num_used
        fabric.flip = True  # the next delivered byte
        result = await sender.send(dest, device_chunks(dest, _kv(3), EPOCH, pages_per_chunk=2), 5.0)
        assert not result.accepted and result.error == "checksum mismatch"
        assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
        assert decode.pool.pages.num_used == before - 3
        assert sender.is_open(dest.address)  # the bytes moved; the channel is sound


async def test_a_stalled_peer_is_aborted_at_the_deadline_on_both_sides() -> None:
    fabric = LoopbackFabric()
    async with _pair(fabric) as (decode, sender):
        dest = decode.reserve(2)
        fabric.stall = True
        result = await sender.send(dest, device_chunks(dest, _kv(2), EPOCH), 0.5)
        assert not result.accepted and result.error == "deadline exceeded"
        assert not sender.is_open(dest.address)
        async with asyncio.timeout(5):  # the receiver's group is bounded by the call's deadline
            while not decode.released:
                await asyncio.sleep(0.02)
        assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
        assert sorted(fabric.aborted) == [0, 1]
        later = await sender.send(decode.reserve(1, "req-2"), [], 1.0)
        assert not later.accepted and later.error == "no nccl channel to that worker"


async def test_a_push_naming_no_channel_is_refused() -> None:
    fabric = LoopbackFabric()
    async with _pair(fabric) as (decode, sender):
        dest = decode.reserve(2)
        sender._links[dest.address].name = "not-a-channel"
        result = await sender.send(dest, device_chunks(dest, _kv(2), EPOCH), 5.0)
        assert not result.accepted and result.error == "no such channel"
        assert not decode.released  # the token was never proven: nothing is cancelled


async def test_a_push_that_arrives_before_the_decode_side_has_joined_waits_for_it() -> None:
    """The prefill side's rendezvous can end first (the decode side's join is still coming back
    from its thread on a busy host): its push then finds the channel not yet open, waits for
    the join, and moves its pages. The join is held until the push has seen the channel new."""
    fabric = LoopbackFabric()
    gate = threading.Event()

    def held(uid: bytes, rank: int, dev: torch.device) -> Any:
        assert gate.wait(10)
        return fabric.comm(rank)

    endpoint = NcclEndpoint(CPU, connect=held)
    sender = NcclSender(CPU, connect=lambda uid, rank, dev: fabric.comm(rank))
    decode = Decode(endpoint)
    await decode.start()
    get = endpoint.get
    seen: list[ChannelState] = []

    def get_then_open(name: str) -> Any:
        link = get(name)
        if link is not None and not seen:
            seen.append(link.channel.state)
            gate.set()  # the push has found the channel; now let the decode side's join end
        return link

    endpoint.get = get_then_open  # type: ignore[method-assign]
    try:
        name, uid = await endpoint.listen(deadline_s=10.0)
        await sender.connect(decode.address, name, uid, deadline_s=10.0)
        dest = decode.reserve(3)
        kv = _kv(3)
        result = await sender.send(dest, device_chunks(dest, kv, EPOCH, pages_per_chunk=2), 10.0)
        assert seen == [ChannelState.NEW]  # the case this is about happened
        assert result.accepted and result.pages_received == 3, result.error
        assert torch.equal(decode.pages(dest), kv)
    finally:
        gate.set()
        await sender.close()
        endpoint.close()
        await decode.server.stop(None)


async def test_host_chunks_are_refused_by_the_nccl_sender() -> None:
    fabric = LoopbackFabric()
    async with _pair(fabric) as (decode, sender):
        dest = decode.reserve(1)
        chunk = device_chunks(dest, _kv(1), EPOCH)[0]
        result = await sender.send(dest, [chunk.header], 5.0)  # type: ignore[list-item]
        assert not result.accepted and result.error == "an nccl push takes device chunks"
        assert isinstance(chunk, DeviceChunk)


async def test_the_rendezvous_is_removed_once_the_peer_had_time_to_read_it() -> None:
    endpoint, sender = NcclEndpoint(CPU), NcclSender(CPU)
    name, uid = await endpoint.listen(deadline_s=0.5)
    await sender.connect("decode-0", name, uid, deadline_s=0.5)
    where = uid[len(GLOO_UID) :].decode()
    assert os.path.isdir(where)
    async with asyncio.timeout(5):
        while os.path.exists(where):
            await asyncio.sleep(0.05)
    assert sender.is_open("decode-0") and endpoint.get(name) is not None
    await sender.close()
    endpoint.close()


async def test_a_rendezvous_the_peer_never_joins_times_out_and_is_dropped() -> None:
    endpoint = NcclEndpoint(CPU)
    name, uid = await endpoint.listen(deadline_s=0.3)
    assert uid.startswith(GLOO_UID)
    async with asyncio.timeout(10):
        while endpoint.get(name) is not None:
            await asyncio.sleep(0.05)
    assert not os.path.exists(uid[len(GLOO_UID) :].decode())


@pytest.mark.parametrize("pages_per_chunk", [1, 3])
def test_device_chunks_flag_the_reservations_last_page(pages_per_chunk: int) -> None:
    dest = KVDestination("a", "r", "t", b"k" * 16, EPOCH, tuple(range(10, 16)))
    kv = _kv(6)
    head = device_chunks(dest, kv[:3], EPOCH, 0, pages_per_chunk)
    tail = device_chunks(dest, kv[3:], EPOCH, 3, pages_per_chunk)
    ids = [list(c.header.dest_page_ids) for c in head + tail]
    assert sum(ids, []) == list(range(10, 16))
    assert [c.header.is_last for c in head + tail] == [False] * (len(ids) - 1) + [True]
    with pytest.raises(ValueError):
        device_chunks(dest, kv, EPOCH, first_page=1)
