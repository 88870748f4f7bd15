"""The shm transport for real: a /dev/shm region, the KV server on 127.0.0.1, PoolReceiver pages."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import torch

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.codec import WireChunk
from kvtransfer.grpc_transport import start_kv_server
from kvtransfer.shm import PUSH_SHM, REGION_DIR, ShmRegion, ShmSender, shm_handler
from kvtransfer.transport import ABORTED, KVDestination, build_chunks
from tests.kvtransfer.test_transports import EPOCH, Decode, _assert_landed, _prefill_pages

ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = 4 * 2 * 16 * 2 * 64 * 4  # test_transports.LAYOUT in float32: 64 KiB
SLOT_BYTES = 5 * PAGE_BYTES  # one chunk of 5 pages per slot


@dataclass
class Side:
    decode: Decode
    region: ShmRegion
    address: str


async def _side(num_slots: int = 3) -> tuple[Side, grpc.aio.Server]:
    decode, region = Decode(), ShmRegion(num_slots, SLOT_BYTES)
    handler = shm_handler(decode.receiver, region, slots_per_stream=2)
    server, port = await start_kv_server(decode.receiver, "127.0.0.1:0", extra_handlers=[handler])
    return Side(decode, region, f"127.0.0.1:{port}"), server


@pytest.fixture
async def side() -> AsyncIterator[Side]:
    made, server = await _side()
    yield made
    await server.stop(grace=None)
    made.region.check_integrity()
    made.region.close()
    assert not os.path.exists(made.region.path)  # nothing left in /dev/shm


@pytest.fixture
async def sender() -> AsyncIterator[ShmSender]:
    made = ShmSender()
    yield made
    await made.close()


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(200):  # the server learns of a cancellation asynchronously
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


async def _stalled(chunks: list[WireChunk]) -> AsyncIterator[WireChunk]:
    yield chunks[0]
    await asyncio.sleep(60)  # the prefill side stalls before the rest
    yield chunks[1]


@pytest.mark.parametrize("pages_per_chunk", [1, 3, 5])
async def test_pages_round_trip_bit_exact_through_shm(
    side: Side, sender: ShmSender, pages_per_chunk: int
) -> None:
    mode = os.stat(side.region.path).st_mode
    assert stat.S_IMODE(mode) == 0o600 and side.region.path.startswith(REGION_DIR)
    pages = _prefill_pages(12)
    pages[4][1, 0, 3, 1, 7] = float("nan")  # bits, not values
    for _ in range(2):  # a second transfer reuses the sender's channel and mapping
        dest = side.decode.reserve(side.address, 12)
        result = await sender.send(dest, build_chunks(dest, pages, EPOCH, pages_per_chunk), 10.0)
        assert (result.accepted, result.pages_received, result.error) == (True, 12, "")
        got = [side.decode.pool.read_page(p) for p in dest.dest_page_ids]
        assert all(
            torch.equal(g.view(torch.int32), p.view(torch.int32))
            for g, p in zip(got, pages, strict=True)
        )
        assert side.region.num_free == 3  # the call ended after the slots came back
        side.decode.book.completed.clear()
        side.decode.pool.pages.free(dest.dest_page_ids)


async def test_concurrent_transfers_share_one_region(side: Side, sender: ShmSender) -> None:
    transfers = [(side.decode.reserve(side.address, 10), _prefill_pages(10)) for _ in range(4)]
    results = await asyncio.gather(*(
        sender.send(dest, build_chunks(dest, pages, EPOCH, pages_per_chunk=5), 10.0) for dest, pages in transfers
    ))  # fmt: skip
    assert [r.accepted for r in results] == [True] * 4  # 4 streams x 2 slots > 3 slots: some waited
    for dest, pages in transfers:
        for page_id, page in zip(dest.dest_page_ids, pages, strict=True):
            assert torch.equal(side.decode.pool.read_page(page_id), page)
    assert len(side.decode.book.completed) == 4 and side.region.num_free == 3


async def test_wrong_reused_token_and_stale_epoch_are_refused_and_counted(
    side: Side, sender: ShmSender
) -> None:
    decode, pages = side.decode, _prefill_pages(4)
    dest = decode.reserve(side.address, 4)
    forged = replace(dest, token=b"f" * 16)
    assert (await sender.send(forged, build_chunks(forged, pages, EPOCH), 5.0)).error == "refused"
    stale = await sender.send(dest, build_chunks(dest, pages, EPOCH - 1), 5.0)
    assert not stale.accepted and stale.error == "refused"
    assert (decode.book.refused_bad_token, decode.book.refused_stale_epoch) == (1, 1)
    assert decode.book.num_open == 1 and not decode.released
    assert not any(decode.pool.read_page(p).any() for p in dest.dest_page_ids)
    assert (await sender.send(dest, build_chunks(dest, pages, EPOCH), 5.0)).accepted
    replay = await sender.send(dest, build_chunks(dest, pages, EPOCH), 5.0)  # the token is spent
    assert not replay.accepted and decode.book.refused_bad_token == 2
    _assert_landed(decode, dest, pages)
    assert side.region.num_free == 3


async def test_a_push_whose_request_was_aborted_on_the_decode_side_ends_aborted(
    side: Side, sender: ShmSender
) -> None:
    decode, pages = side.decode, _prefill_pages(4)
    dest = decode.reserve(side.address, 4)
    assert decode.book.release(dest.transfer_id, aborted=True)
    result = await sender.send(dest, build_chunks(dest, pages, EPOCH), 5.0)
    assert (result.accepted, result.error) == (False, ABORTED)
    assert side.region.num_free == 3


class RawStream:
    """A hand-driven PushShm call: what a broken or hostile sender could put on the wire."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = self.channel.stream_stream(PUSH_SHM, request_serializer=bytes,
                                               response_deserializer=pb.PushShmResponse.FromString)(timeout=10)  # fmt: skip

    async def grant(self, dest: KVDestination) -> pb.PushShmResponse:
        """Open the stream with dest's token (as ShmSender does), then read the slots granted."""
        opening = pb.PageChunkHeader(req_id=dest.req_id, transfer_id=dest.transfer_id, transfer_token=dest.token,
                                     sender_epoch=dest.epoch)  # fmt: skip
        await self.call.write(pb.PushShmRequest(header=opening).SerializeToString())
        grant: pb.PushShmResponse = await self.call.read()
        assert list(grant.free_offsets) and grant.slot_bytes == SLOT_BYTES
        return grant

    async def ack(self) -> pb.PushResponse:
        while not (reply := await self.call.read()).HasField("ack"):
            pass
        await self.channel.close()
        ack: pb.PushResponse = reply.ack
        return ack


async def test_bytes_corrupted_in_shm_fail_the_checksum_and_release(side: Side) -> None:
    decode, region = side.decode, side.region
    dest = decode.reserve(side.address, 10)
    chunks = build_chunks(dest, _prefill_pages(10), EPOCH, pages_per_chunk=5)
    raw = RawStream(side.address)
    grant = await raw.grant(dest)
    for chunk, offset in zip(chunks, grant.free_offsets, strict=True):
        slot = region.view(offset, len(chunk.payload))
        slot[:] = chunk.payload
        if chunk is chunks[1]:  # the sender's header (and its checksum) describe other bytes
            slot[100] ^= 0x10
        slot.release()
        msg = pb.PushShmRequest(header=chunk.header, offset=offset, length=len(chunk.payload))
        await raw.call.write(msg.SerializeToString())
    ack = await raw.ack()
    assert (ack.accepted, ack.pages_received, ack.error) == (False, 5, "checksum mismatch")
    # the first chunk proved the token, so the failure of the second releases the reservation
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    assert decode.book.num_open == 0 and decode.pool.pages.num_used == 3
    await _until(lambda: region.num_free == 3)


@pytest.mark.parametrize("where", ["past the region", "inside a slot", "slot not granted", "longer than a slot",
                                   "length not the header's", "malformed message"])  # fmt: skip
async def test_offsets_and_lengths_outside_the_grant_are_refused_before_any_read(
    side: Side, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode, region = side.decode, side.region
    reads: list[tuple[int, int]] = []
    real_view = region.view

    def spy(offset: int, length: int) -> memoryview:
        view = real_view(offset, length)  # raises, reading nothing, when out of bounds
        reads.append((offset, length))
        return view

    monkeypatch.setattr(region, "view", spy)
    dest = decode.reserve(side.address, 5)
    (chunk,) = build_chunks(dest, _prefill_pages(5), EPOCH, pages_per_chunk=5)
    raw = RawStream(side.address)
    grant = await raw.grant(dest)
    assert sorted(grant.free_offsets) == [0, SLOT_BYTES]  # slot 2 belongs to nobody here
    offset, length = grant.free_offsets[0], len(chunk.payload)
    if where == "longer than a slot":
        chunk.header.payload_bytes = length = SLOT_BYTES + 1
    bad = {"past the region": (region.size, length), "inside a slot": (offset + 64, length),
           "slot not granted": (2 * SLOT_BYTES, length), "longer than a slot": (offset, length),
           "length not the header's": (offset, length - 4), "malformed message": (offset, length)}[where]  # fmt: skip
    msg = pb.PushShmRequest(header=chunk.header, offset=bad[0], length=bad[1]).SerializeToString()
    await raw.call.write(b"\x0a\x7f" if where == "malformed message" else msg)  # truncated field 1
    ack = await raw.ack()
    expected = {"longer than a slot": "payload outside the shm region's slots",
                "malformed message": "malformed header"}.get(where, "payload outside this stream's shm slots")  # fmt: skip
    assert (ack.accepted, ack.error) == (False, expected)
    assert reads == [] and decode.book.get(dest.transfer_id) is not None and not decode.released
    await _until(lambda: region.num_free == 3)


async def test_deadline_releases_the_reservation_and_the_slots(
    side: Side, sender: ShmSender
) -> None:
    decode, region = side.decode, side.region
    dest = decode.reserve(side.address, 10)
    chunks = build_chunks(dest, _prefill_pages(10), EPOCH, pages_per_chunk=5)
    result = await sender.send(dest, _stalled(chunks), deadline_s=0.5)
    assert (result.accepted, result.error) == (False, "deadline exceeded")
    await _until(lambda: bool(decode.released) and region.num_free == 3)
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    assert decode.book.num_open == 0 and decode.pool.pages.num_used == 3
    assert any(decode.pool.read_page(p).any() for p in dest.dest_page_ids[:5])  # it did start


async def test_a_full_region_makes_senders_wait_within_their_deadline(sender: ShmSender) -> None:
    side, server = await _side(num_slots=1)
    try:
        decode = side.decode
        first, second = decode.reserve(side.address, 10), decode.reserve(side.address, 5)
        holding = asyncio.create_task(sender.send(
            first, _stalled(build_chunks(first, _prefill_pages(10), EPOCH, 5)), deadline_s=2.0))  # fmt: skip
        await _until(lambda: side.region.num_free == 0)
        waited = await sender.send(
            second, build_chunks(second, _prefill_pages(5), EPOCH, 5), deadline_s=0.3
        )
        assert (waited.accepted, waited.error) == (False, "deadline exceeded")
        # it never got a slot, so it never proved its token: the reservation stays open
        assert decode.book.get(second.transfer_id) is not None
        assert (await holding).error == "deadline exceeded"
        await _until(lambda: side.region.num_free == 1)
        retry = await sender.send(
            second, build_chunks(second, _prefill_pages(5), EPOCH, 5), deadline_s=5.0
        )
        assert retry.accepted
    finally:
        await server.stop(grace=None)
        side.region.close()


async def test_oversized_empty_and_short_transfers_fail_with_their_reason(
    side: Side, sender: ShmSender
) -> None:
    decode = side.decode
    dest = decode.reserve(side.address, 10)
    chunks = build_chunks(dest, _prefill_pages(10), EPOCH, pages_per_chunk=5)
    big = build_chunks(dest, _prefill_pages(10), EPOCH, pages_per_chunk=6)
    assert (await sender.send(dest, big, 5.0)).error == "chunk larger than an shm slot"
    assert (await sender.send(dest, [], 5.0)).error == "empty stream"
    assert decode.book.get(dest.transfer_id) is not None and not decode.released  # untouched
    short = await sender.send(dest, chunks[:1], 5.0)  # no last chunk: the token was proven
    assert (short.accepted, short.error) == (False, "stream ended before every page arrived")
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    await _until(lambda: side.region.num_free == 3)


_DYING_SENDER = """
import asyncio, sys, torch
from kvtransfer.shm import ShmSender
from kvtransfer.transport import ABORTED, KVDestination, build_chunks
address, req_id, transfer_id, token, epoch, ids = sys.argv[1:]
dest = KVDestination(address, req_id, transfer_id, bytes.fromhex(token), int(epoch),
                     tuple(int(i) for i in ids.split(",")))
pages = torch.randn(len(dest.dest_page_ids), 4, 2, 16, 2, 64)
chunks = build_chunks(dest, pages, int(epoch), pages_per_chunk=5)
async def stalled():
    yield chunks[0]
    print("first chunk sent", flush=True)
    await asyncio.sleep(600)
    yield chunks[1]
asyncio.run(ShmSender().send(dest, stalled(), 600.0))
"""


async def test_a_sender_killed_mid_transfer_leaks_no_slot_and_no_reservation(side: Side) -> None:
    decode, region = side.decode, side.region
    dest: KVDestination = decode.reserve(side.address, 10)
    args = [side.address, dest.req_id, dest.transfer_id, dest.token.hex(), str(EPOCH),
            ",".join(map(str, dest.dest_page_ids))]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DYING_SENDER, *args, cwd=ROOT, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"first chunk sent\n"
        res = decode.book.get(dest.transfer_id)
        assert res is not None
        await _until(lambda: any(res.layers.values()))  # the first chunk landed: token proven
        assert region.num_free == 1  # the stream holds two slots
    finally:
        proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL  # the fault happened
    await _until(lambda: bool(decode.released) and region.num_free == 3)
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    assert decode.book.num_open == 0 and decode.pool.pages.num_used == 3


def test_the_region_is_private_and_unlinked_on_close(tmp_path: Path) -> None:
    region = ShmRegion(num_slots=2, slot_bytes=4096)
    assert os.path.exists(region.path) and os.path.basename(region.path) == region.name
    view = region.view(4096, 10)
    region.close()  # a live view does not keep the file
    assert not os.path.exists(region.path) and region.is_closed
    view.release()
    region.close()  # idempotent
    with ShmRegion(num_slots=1, slot_bytes=4096, directory=str(tmp_path)) as scoped:
        assert stat.S_IMODE(os.stat(scoped.path).st_mode) == 0o600
    assert list(tmp_path.iterdir()) == []


_DYING_OWNER = """
import os, signal, sys
from kvtransfer.shm import ShmRegion
region = ShmRegion(num_slots=1, slot_bytes=4096, directory=sys.argv[1])
print(region.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_region_whose_owner_was_killed_is_swept_by_the_next_one(tmp_path: Path) -> None:
    """A decode worker SIGKILLed never closes its region; the next region made in its pid
    namespace (the restarted worker's) unlinks it, and leaves a live owner's alone."""
    dead = subprocess.run([sys.executable, "-c", _DYING_OWNER, str(tmp_path)], cwd=ROOT, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, check=False)  # fmt: skip
    assert dead.returncode == -signal.SIGKILL  # the owner died without closing its region
    orphan = tmp_path / dead.stdout.decode().strip()
    assert orphan.exists() and orphan.name.startswith("baton-kv-")
    alive = ShmRegion(num_slots=1, slot_bytes=4096, directory=str(tmp_path))  # this process: alive
    assert not orphan.exists()
    foreign = tmp_path / orphan.name.replace("baton-kv-", "baton-kv-1", 1)  # another pid namespace
    foreign.write_bytes(b"")
    unrelated = tmp_path / "baton-kv-notours"
    unrelated.write_bytes(b"")
    with ShmRegion(num_slots=1, slot_bytes=4096, directory=str(tmp_path)) as second:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, second.name, foreign.name,
                                                                      unrelated.name])  # fmt: skip
    alive.close()
