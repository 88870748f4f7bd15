"""prefill.pushes against a real decode-side KV server over gRPC on loopback: pages streamed in
batches as they are computed land whole; a lease, an abort, a hold and a drill each end or damage
a push the way the prefill actor relies on, and the decode side's reservation goes back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from engine.faults import FaultPoints
from kvtransfer.grpc_transport import start_kv_server
from kvtransfer.jobs import TransferReport
from kvtransfer.transport import KVDestination, build_chunks
from prefill.pushes import Pushes
from tests.kvtransfer.test_transports import EPOCH, Decode, _assert_landed, _prefill_pages

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def decode() -> AsyncIterator[tuple[Decode, str]]:
    side = Decode()  # the decode side of the transport tests: a pool, a book, a receiver
    server, port = await start_kv_server(side.receiver, "127.0.0.1:0")
    yield side, f"127.0.0.1:{port}"
    await server.stop(grace=None)


@pytest.fixture
async def pushes() -> AsyncIterator[Pushes]:
    made = Pushes(torch.device("cpu"), FaultPoints(), None, push_deadline_s=5.0, stream_limit_s=10.0)
    yield made
    await made.close()


def _kv(n: int) -> torch.Tensor:
    return torch.stack(_prefill_pages(n))


async def test_pages_fed_while_computing_and_at_the_first_token_land_whole(
    decode: tuple[Decode, str], pushes: Pushes
) -> None:
    side, address = decode
    dest, pages = side.reserve(address, 6), _prefill_pages(6)
    chunks = build_chunks(dest, pages, EPOCH, pages_per_chunk=2)
    push = pushes.open("req-1", dest)
    pushes.feed(dest.transfer_id, tuple(chunks[:2]))  # whole pages of a prompt still computing
    pushes.first_token(push, tuple(chunks[2:]))  # the rest, the last page included
    report = await pushes.result(dest.transfer_id)
    assert report.accepted and report.transport == "grpc" and report.num_pages == 6, report
    assert report.num_bytes == sum(c.header.payload_bytes for c in chunks)
    assert 0 <= report.wire_seconds <= report.seconds
    _assert_landed(side, dest, pages)  # exactly those pages, the reservation complete
    assert pushes.num_transfers == 1 and not pushes.num_failed and pushes.ended == {"ok": 1}
    assert not pushes.in_flight() and not pushes.num_running


async def test_a_push_past_its_lease_is_cancelled_and_the_reservation_goes_back(
    decode: tuple[Decode, str], pushes: Pushes
) -> None:
    side, address = decode
    dest = side.reserve(address, 4)
    chunks = build_chunks(dest, _kv(4), EPOCH, pages_per_chunk=1)
    push = pushes.open("req-1", dest)
    pushes.feed(dest.transfer_id, tuple(chunks[:1]))  # the stream opens; the rest never comes
    async with asyncio.timeout(10):  # its first page proved the token: a cancel now releases
        while _stored(side, dest) < 1:
            await asyncio.sleep(0.02)
    assert [p.req_id for p in pushes.in_flight()] == ["req-1"]
    push.lease_end = 0.0  # as if its lease had run out
    pushes.expire_leases()
    report = await pushes.result(dest.transfer_id)
    assert not report.accepted and report.error == "aborted" and pushes.num_lease_expired == 1
    assert pushes.ended == {"lease": 1}
    async with asyncio.timeout(10):  # the server's handler is cancelled with the stream
        while not side.released:
            await asyncio.sleep(0.02)
    assert side.book.num_open == 0 and [r.transfer_id for r in side.released] == [dest.transfer_id]


async def test_a_held_push_sends_one_chunk_and_an_abort_ends_it(decode: tuple[Decode, str], pushes: Pushes) -> None:
    side, address = decode
    dest = side.reserve(address, 3)
    chunks = build_chunks(dest, _kv(3), EPOCH, pages_per_chunk=1)
    pushes.hold(True)
    push = pushes.open("req-1", dest)
    pushes.first_token(push, tuple(chunks))
    async with asyncio.timeout(10):  # the first chunk arrives; the push then waits
        while _stored(side, dest) < 1:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    assert _stored(side, dest) == 1 and pushes.num_running == 1
    pushes.abort("req-1")
    report = await pushes.result(dest.transfer_id)
    assert not report.accepted and report.error == "aborted" and pushes.ended == {"aborted": 1}


async def test_a_held_push_ends_at_its_deadline_or_when_dropped(decode: tuple[Decode, str]) -> None:
    """How a push ended is told apart (what the fault tests read to know that an abort, and not
    the deadline that would free the same pages a little later, ended a transfer)."""
    side, address = decode
    short = Pushes(torch.device("cpu"), FaultPoints(), None, push_deadline_s=0.3, stream_limit_s=10.0)
    try:
        short.hold(True)
        dest = side.reserve(address, 2)
        push = short.open("late", dest)
        short.first_token(push, tuple(build_chunks(dest, _kv(2), EPOCH, pages_per_chunk=1)))
        report = await short.result(dest.transfer_id)
        assert report.error == "deadline exceeded" and short.ended == {"deadline": 1}, report
        dest = side.reserve(address, 2)
        push = short.open("dropped", dest)  # fed before its first token: no deadline runs yet
        short.feed(dest.transfer_id, tuple(build_chunks(dest, _kv(2), EPOCH, pages_per_chunk=1)))
        async with asyncio.timeout(10):  # under way: its first chunk is stored
            while _stored(side, dest) < 1:
                await asyncio.sleep(0.02)
        short.drop(dest.transfer_id)
        await asyncio.wait_for(asyncio.shield(push.task), 10)
        assert short.ended == {"deadline": 1, "dropped": 1}
    finally:
        await short.close()


async def test_a_push_whose_request_the_decode_side_aborted_first_ends_aborted(
    decode: tuple[Decode, str], pushes: Pushes
) -> None:
    """A client that leaves aborts its request on both sides; the decode side can hear it
    first. Its reservation released, the push's next chunk is told so: the push ends aborted
    (as when this side hears first), never as a refusal (tests/faults/test_cancellation.py)."""
    side, address = decode
    dest = side.reserve(address, 4)
    chunks = build_chunks(dest, _prefill_pages(4), EPOCH, pages_per_chunk=2)
    push = pushes.open("req-1", dest)
    assert side.book.release(dest.transfer_id, aborted=True)  # the decode side's abort
    pushes.first_token(push, tuple(chunks))
    report = await pushes.result(dest.transfer_id)
    assert (report.accepted, report.error) == (False, "aborted") and pushes.ended == {"aborted": 1}
    pushes.abort("req-1")  # this side's abort, after: nothing more to end
    assert pushes.ended == {"aborted": 1} and not pushes.num_running


def _stored(side: Decode, dest: KVDestination) -> int:
    return sum(bool(side.pool.read_page(p).any()) for p in dest.dest_page_ids)


async def test_a_push_that_ends_before_its_first_chunk_is_counted_and_forgotten(
    decode: tuple[Decode, str], pushes: Pushes
) -> None:
    side, address = decode
    for req_id, end in (("req-a", "aborted"), ("req-d", "dropped")):
        dest = side.reserve(address, 2)
        push = pushes.open(req_id, dest)  # no chunk fed: no stream open yet
        await asyncio.sleep(0)
        if end == "aborted":
            pushes.abort(req_id)
        else:
            pushes.drop(dest.transfer_id)
        with pytest.raises(asyncio.CancelledError):
            await push.task
    assert pushes.ended == {"aborted": 1, "dropped": 1} and not pushes._cancelled
    assert pushes.num_transfers == 0  # nothing was transferred, or failed to be


async def _drilled(
    decode: tuple[Decode, str], pushes: Pushes, drill: str, num_pages: int
) -> tuple[KVDestination, TransferReport]:
    """A push of `num_pages` one-page chunks under a transfer drill: its reservation and report."""
    side, address = decode
    dest = side.reserve(address, num_pages)
    pushes.faults.arm(drill)
    push = pushes.open("req-1", dest)
    pushes.first_token(push, tuple(build_chunks(dest, _kv(num_pages), EPOCH, pages_per_chunk=1)))
    return dest, await pushes.result(dest.transfer_id)


async def test_a_corrupt_drill_is_refused_by_the_receiver(decode: tuple[Decode, str], pushes: Pushes) -> None:
    side, _ = decode
    dest, report = await _drilled(decode, pushes, "transfer_corrupt", 2)
    assert not report.accepted and report.error == "checksum mismatch" and pushes.num_failed == 1
    assert pushes.ended == {"refused": 1}  # the decode side's answer, not this side's deadline
    # nothing stored; the reservation waits for the gateway's cancel (an unproven chunk frees nothing)
    assert _stored(side, dest) == 0 and side.book.num_open == 1


async def test_a_corrupt_last_chunk_drill_lets_the_pages_before_it_arrive(
    decode: tuple[Decode, str], pushes: Pushes
) -> None:
    """transfer_corrupt_last: the pages of every chunk but the last arrive verified (a decode
    worker keeps them, decode.worker), the last is refused by its checksum."""
    side, _ = decode
    dest, report = await _drilled(decode, pushes, "transfer_corrupt_last", 3)
    assert not report.accepted and report.error == "checksum mismatch"
    assert [bool(side.pool.read_page(p).any()) for p in dest.dest_page_ids] == [True, True, False]
