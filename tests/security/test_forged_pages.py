"""Forged KV pages pushed at a decode worker are refused and never enter a cache.

A real DecodeWorker (baton-tiny engine, prefix cache warm with another prompt's pages) serves
KV pushes on a real gRPC server with its shm region beside it. Each forgery arrives over gRPC
and over shm and must be refused with its reason counted, leaving:

- no hash from a forged header in the prefix cache, ever; the cache exactly as it was when the
  forgery failed before proving the token,
- every page outside the open reservation bit-for-bit as it was (cached pages included),
- the reservation open and untouched when the forgery failed before proving the token, or
  released (its pages back in the pool) when the token's holder sent a broken transfer -- the
  leading pages that arrived whole and verified stay cached under the hashes the decode worker
  computes itself, as they would have after a complete transfer (decode.worker keeps them).

The reservation still completes for its real sender afterwards, its pages are cached under
hashes the decode worker computes itself (prompt, tenant salt, model), and its spent token
is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from kvcache.events import Tier
from kvcache.hashing import page_hashes
from kvtransfer.codec import ChunkMeta, WireChunk, encode_chunk
from kvtransfer.grpc_transport import GrpcSender, start_kv_server
from kvtransfer.shm import ShmRegion, ShmSender, shm_handler
from kvtransfer.transport import KVDestination, build_chunks

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
WARM = tuple(range(1000, 1050))  # another prompt, served first: 3 full pages in the cache
PROMPT = tuple(range(200, 280))  # 80 tokens: 5 pages of 16
EPOCH = 7
FORGED_HASH = b"\xee" * 16  # what a forger claims its pages are
COUNTERS = ("refused_bad_token", "refused_stale_epoch", "refused_bad_page")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=32, max_model_len=256))


@dataclass
class Side:
    worker: DecodeWorker
    senders: dict[str, Any]


@pytest.fixture
async def side(engine: Engine) -> AsyncIterator[Side]:
    assert engine.prefix_cache is not None
    engine.prefix_cache.clear()
    worker = DecodeWorker(engine, reservation_ttl_s=30.0)
    worker.start_local(Job("warm", WARM, GREEDY))  # the cache holds someone's pages
    while engine.has_unfinished():
        worker.step()
    assert engine.prefix_cache.num_cached_pages == 3
    region = ShmRegion(num_slots=2, slot_bytes=1 << 20)
    server, port = await start_kv_server(worker.receiver, "127.0.0.1:0", extra_handlers=[shm_handler(worker.receiver, region)])
    worker.address = f"127.0.0.1:{port}"
    senders = {"grpc": GrpcSender(), "shm": ShmSender()}
    try:
        yield Side(worker, senders)
    finally:
        for sender in senders.values():
            await sender.close()
        await server.stop(None)
        region.close()
        for dest in list(worker._dests.values()):
            worker.cancel(dest)
        engine.check_integrity()
        assert engine.free_pages_at_idle() == engine.pool.num_pages


def _pages(worker: DecodeWorker, n: int, seed: int = 1) -> torch.Tensor:
    lay = worker.engine.pool.layout
    shape = (n, lay.num_layers, 2, lay.page_size, lay.num_kv_heads, lay.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + 1.0


def _chunk(dest: KVDestination, pages: torch.Tensor, **changes: Any) -> WireChunk:
    """One chunk of `pages` for `dest`, the last, with forged fields; sealed with a valid
    checksum, so only the decode side's own checks can refuse it."""
    meta = ChunkMeta(dest.req_id, dest.transfer_id, dest.token, EPOCH, dest.dest_page_ids[: len(pages)],
                     [FORGED_HASH] * len(pages), is_last=True)  # fmt: skip
    return encode_chunk(meta._replace(**changes), pages)


def _corrupt(chunk: WireChunk) -> WireChunk:
    payload = bytearray(chunk.payload)
    payload[100] ^= 0x01
    return WireChunk(chunk.header, bytes(payload))


def _short_payload(chunk: WireChunk) -> WireChunk:
    """A header that claims one more page than the payload holds."""
    header = pb.PageChunkHeader()
    header.CopyFrom(chunk.header)
    header.dest_page_ids.append(max(header.dest_page_ids) + 1)
    header.page_hashes.append(FORGED_HASH)
    return WireChunk(header, chunk.payload)


Forgery = Callable[[KVDestination, KVDestination, torch.Tensor, int], list[WireChunk]]
# name -> (the chunks, the counter that must count it (None: a codec or completeness error),
#          whether the reservation stays open (the token was never proven))
FORGERIES: dict[str, tuple[Forgery, str | None, bool]] = {
    "no token": (lambda d, o, p, c: [_chunk(d, p, transfer_token=b"")], "refused_bad_token", True),
    "wrong token": (lambda d, o, p, c: [_chunk(d, p, transfer_token=bytes(16))], "refused_bad_token", True),
    "another transfer's token": (lambda d, o, p, c: [_chunk(d, p, transfer_token=o.token)], "refused_bad_token", True),
    "unknown transfer id": (lambda d, o, p, c: [_chunk(d, p, transfer_id="f" * 16)], "refused_bad_token", True),
    "stale epoch": (lambda d, o, p, c: [_chunk(d, p, sender_epoch=EPOCH - 1)], "refused_stale_epoch", True),
    "newer epoch": (lambda d, o, p, c: [_chunk(d, p, sender_epoch=EPOCH + 1)], "refused_stale_epoch", True),
    "another request's id": (lambda d, o, p, c: [_chunk(d, p, req_id="someone-else")], "refused_stale_epoch", True),
    "a cached page's id": (lambda d, o, p, c: [_chunk(d, p[:1], dest_page_ids=[c])], "refused_bad_page", True),
    "layers past the model": (lambda d, o, p, c: [_chunk(d, p[:, :2], layer_start=3)], "refused_bad_page", True),
    "corrupt payload": (lambda d, o, p, c: [_corrupt(_chunk(d, p))], None, True),
    "page count off by one": (lambda d, o, p, c: [_short_payload(_chunk(d, p[:4]))], None, True),
    # the token's holder sending a broken transfer: it is released, not left half-written
    # (its verified leading pages are kept: KEPT)
    "too few pages": (lambda d, o, p, c: [_chunk(d, p[:4])], None, False),
    "a page twice": (lambda d, o, p, c: [_chunk(d, p[:3], is_last=False), _chunk(d, p[2:3], dest_page_ids=[d.dest_page_ids[2]])],
                     "refused_bad_page", False),  # fmt: skip
}


KEPT = {"too few pages": 4, "a page twice": 3}  # leading pages that arrived whole before the transfer broke


def _cache_state(engine: Engine) -> list[tuple[bytes, Any]]:
    assert engine.prefix_cache is not None
    return sorted(engine.prefix_cache.snapshot()[1])


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("name", sorted(FORGERIES))
async def test_a_forged_push_is_refused_and_changes_no_cache(side: Side, transport: str, name: str) -> None:
    worker, engine = side.worker, side.worker.engine
    free_before = engine.pool.pages.num_free
    # Given an open reservation for PROMPT (and another request's, whose token may be stolen)
    job = Job("victim", PROMPT, GREEDY)
    dest, other = worker.reserve(job, EPOCH), worker.reserve(Job("other", PROMPT[:40], GREEDY), EPOCH)
    assert dest is not None and other is not None
    cached_page = engine.prefix_cache.cached_page_ids()[0] if engine.prefix_cache else 0
    cache, kv = _cache_state(engine), engine.pool.kv.clone()
    counts = {c: getattr(worker.book, c) for c in COUNTERS}
    # When a forged push arrives
    forge, counter, stays_open = FORGERIES[name]
    chunks = forge(dest, other, _pages(worker, len(dest.dest_page_ids)), cached_page)
    result = await side.senders[transport].send(dest, chunks, 10.0)
    # Then it is refused, with its reason counted
    assert not result.accepted and result.error, result
    for c in COUNTERS:
        assert getattr(worker.book, c) == counts[c] + (c == counter), (c, counts)
    # and no forged hash entered the cache, no page outside the reservation was written, and
    # the cache changed only by the verified pages of a broken transfer, under this worker's hashes
    assert FORGED_HASH not in engine.prefix_cache  # type: ignore[operator]
    own = page_hashes(list(PROMPT), engine.cfg.page_size, b"", engine.fingerprint)
    kept = sorted((h, Tier.DEVICE) for h in own[: KEPT.get(name, 0)])
    assert _cache_state(engine) == sorted(cache + kept)
    outside = [p for p in range(engine.pool.num_pages) if p not in dest.dest_page_ids]
    assert torch.equal(engine.pool.kv[:, :, outside], kv[:, :, outside])
    worker.cancel(other)
    if stays_open:  # refused before the token was proven: the reservation is untouched
        assert worker.book.get(dest.transfer_id) is not None
        assert torch.equal(engine.pool.kv, kv)
    else:  # the token holder broke its own transfer: released, its pages back in the pool
        assert worker.is_settled(dest) and not worker.is_complete(dest)
        assert engine.pool.pages.num_free == free_before - len(kept) and worker.num_kept_pages == len(kept)
        engine.check_integrity()
        return
    # When the real sender then pushes, the transfer completes; the spent token is refused
    await _complete_and_admit(side, transport, job, dest)


async def _complete_and_admit(side: Side, transport: str, job: Job, dest: KVDestination) -> None:
    worker, engine = side.worker, side.worker.engine
    pages = _pages(worker, len(dest.dest_page_ids), seed=2)
    chunks = build_chunks(dest, pages, EPOCH, pages_per_chunk=2, page_hashes=[FORGED_HASH] * len(pages))
    assert (await side.senders[transport].send(dest, chunks, 10.0)).accepted
    bad_token = worker.book.refused_bad_token
    replay = await side.senders[transport].send(dest, chunks, 10.0)
    assert not replay.accepted and worker.book.refused_bad_token == bad_token + 1
    worker.start_prefilled(job, dest, first_token=5)
    while engine.has_unfinished():
        worker.step()
    # the pages are cached under the hashes this worker computes (prompt, tenant, model),
    # never under what the chunks' headers claimed
    assert engine.prefix_cache is not None and FORGED_HASH not in engine.prefix_cache
    expected = page_hashes(list(PROMPT), engine.cfg.page_size, b"", engine.fingerprint)
    assert all(h in engine.prefix_cache for h in expected)
    engine.check_integrity()


async def test_a_replay_after_completion_cannot_overwrite_the_pages(side: Side) -> None:
    worker, engine = side.worker, side.worker.engine
    job = Job("done", PROMPT, GREEDY)
    dest = worker.reserve(job, EPOCH)
    assert dest is not None
    sender = side.senders["grpc"]
    assert (await sender.send(dest, build_chunks(dest, _pages(worker, 5), EPOCH), 10.0)).accepted
    landed = engine.pool.kv.clone()
    # a complete transfer waiting for admission: the same token, new bytes
    forged = build_chunks(replace(dest), _pages(worker, 5, seed=9), EPOCH)
    assert not (await sender.send(dest, forged, 10.0)).accepted
    assert torch.equal(engine.pool.kv, landed) and worker.is_complete(dest)
    worker.cancel(dest)


async def test_tokenless_shm_streams_cannot_hold_every_slot(engine: Engine) -> None:
    """Slots go only to a stream that proved its transfer's token (its open): connections that
    send nothing, or open with a guessed token, hold no slot, and a real push gets through."""
    import grpc

    from kvtransfer.shm import PUSH_SHM

    worker = DecodeWorker(engine)
    region = ShmRegion(num_slots=4, slot_bytes=1 << 20)
    server, port = await start_kv_server(worker.receiver, "127.0.0.1:0", extra_handlers=[shm_handler(worker.receiver, region)])
    worker.address = f"127.0.0.1:{port}"
    channels = [grpc.aio.insecure_channel(worker.address) for _ in range(4)]
    sender = ShmSender()
    try:
        calls = [channel.stream_stream(PUSH_SHM, request_serializer=None, response_deserializer=pb.PushShmResponse.FromString)()
                 for channel in channels]  # fmt: skip
        victim = worker.reserve(Job("victim", PROMPT[:32], GREEDY), EPOCH)
        assert victim is not None
        guessed = pb.PageChunkHeader(req_id="victim", transfer_id=victim.transfer_id, transfer_token=b"\x00" * 16,
                                     sender_epoch=EPOCH)  # fmt: skip
        for call in calls[2:]:  # two open with a guessed token: refused, no grant
            await call.write(pb.PushShmRequest(header=guessed).SerializeToString())
            reply = await call.read()
            assert reply.HasField("ack") and reply.ack.error == "refused" and not reply.free_offsets
        # two more say nothing at all; meanwhile every slot is still free
        assert region.num_free == 4 and worker.book.refused_bad_token == 2
        dest = worker.reserve(Job("starved", PROMPT[:32], GREEDY), EPOCH)
        assert dest is not None
        result = await sender.send(dest, build_chunks(dest, _pages(worker, 2), EPOCH), 1.0)
        worker.cancel(dest)
        worker.cancel(victim)
        assert result.accepted, result.error
    finally:
        await sender.close()
        for channel in channels:
            await channel.close()
        await server.stop(None)
        region.close()
