"""A chunked prefill hands over each step's whole pages while the rest of the prompt computes
(PrefillWorker.take_ready): one reservation, one token, one push stream; the decode side has
pages before the last chunk is computed, and the tokens still equal one engine's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from kvcache.hashing import page_hashes
from kvtransfer.codec import CodecLimits, DeviceChunk, WireChunk
from kvtransfer.local import LocalSender, receive_all
from kvtransfer.nccl import NcclReceiver
from kvtransfer.transport import KVDestination
from prefill.worker import PrefillDone, PrefillWorker, Retention

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHUNK = 64  # prefill tokens per step: 4 pages of 16


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Engine, Engine, Engine]:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=128)
    return Engine(cfg), Engine(replace(cfg, max_prefill_chunk=CHUNK)), Engine(cfg)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(100, 16_384, size=n).tolist())


def _complete_pages(decode: DecodeWorker, dest: KVDestination) -> int:
    res = decode.book.get(dest.transfer_id) or decode.book.completed.get(dest.transfer_id)
    assert res is not None
    full = (1 << decode.book.num_layers) - 1
    return sum(1 for mask in res.layers.values() if mask == full)


async def _stream(queue: asyncio.Queue[WireChunk]) -> AsyncIterator[WireChunk]:
    while True:
        chunk = await queue.get()
        yield chunk
        if chunk.header.is_last:
            return


async def _prefill_streaming(
    prefill: PrefillWorker, decode: DecodeWorker, job: Job
) -> tuple[PrefillDone, KVDestination, list[int]]:
    """Prefill `job` into a reservation on `decode`, pushing what each step finished at once;
    the decode side's complete pages after each step."""
    dest = decode.reserve(job, prefill.epoch)
    assert dest is not None
    queue: asyncio.Queue[WireChunk] = asyncio.Queue()
    push = asyncio.ensure_future(LocalSender({dest.address: decode.receiver}).send(dest, _stream(queue), 10.0))
    prefill.submit(job, dest)
    done, arrived = None, []
    for _ in range(100):  # bounded: a step computes at least one chunk
        finished = prefill.step()
        for ready in prefill.take_ready():
            for chunk in ready.chunks:
                queue.put_nowait(chunk)
        for done in finished:
            for chunk in done.chunks:
                queue.put_nowait(chunk)
        for _ in range(20):  # the push takes what is queued
            await asyncio.sleep(0)
        arrived.append(_complete_pages(decode, dest))
        if done is not None:
            break
    assert done is not None
    result = await push
    assert result.accepted, result.error
    return done, dest, arrived


def _decode(decode: DecodeWorker, job: Job, dest: KVDestination, done: PrefillDone) -> list[int]:
    decode.start_prefilled(job, dest, done.first_token)
    tokens = [done.first_token]
    while decode.engine.has_unfinished():
        for out in decode.step():
            tokens.extend(out.token_ids)
    return tokens


async def test_pages_arrive_before_the_last_chunk_is_computed(engines: tuple[Engine, Engine, Engine]) -> None:
    single, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine), DecodeWorker(d_engine, address="decode-0")
    job = Job("stream", _prompt(1, 200), GREEDY)  # 13 pages, 4 steps of 64 tokens
    done, dest, arrived = await _prefill_streaming(prefill, decode, job)
    assert arrived == [4, 8, 12, 13]  # the partial last page comes with the first token
    assert [c.header.dest_page_ids for c in done.chunks] == [list(dest.dest_page_ids[12:])]
    assert done.chunks[-1].header.is_last
    assert _decode(decode, job, dest, done) == single.generate([list(job.prompt_ids)], GREEDY)[0]
    assert d_engine.free_pages_at_idle() == d_engine.pool.num_pages


async def test_a_cached_prefix_goes_with_the_first_step(engines: tuple[Engine, Engine, Engine]) -> None:
    single, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine), DecodeWorker(d_engine, address="decode-0")
    shared = _prompt(2, 160)  # 10 pages
    first = Job("warm", shared + _prompt(3, 20), GREEDY)
    _, dest, _ = await _prefill_streaming(prefill, decode, first)
    decode.cancel(dest)  # only the prefill side's cache matters here

    job = Job("hit", shared + _prompt(4, 100), GREEDY)  # 17 pages, 10 of them cached
    done, dest, arrived = await _prefill_streaming(prefill, decode, job)
    assert done.output.num_cached_tokens == 160
    assert arrived == [14, 17]  # the cached 10 and the 4 computed in step 1, then the rest
    assert _decode(decode, job, dest, done) == single.generate([list(job.prompt_ids)], GREEDY)[0]


def test_device_chunks_stream_as_computed_and_verify_on_the_decode_side(engines: tuple[Engine, Engine, Engine]) -> None:
    """An nccl route's transfer: chunks stay where the pages live (DeviceChunk), each header's
    checksum covers the block's device digest; the decode side's NcclReceiver checks and stores
    what a recv would land, step by step as the prefill computes."""
    single, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine), DecodeWorker(d_engine, address="decode-0")
    job = Job("device", _prompt(7, 200), GREEDY)
    dest = decode.reserve(job, prefill.epoch)
    assert dest is not None
    prefill.submit(job, dest, on_device=True)
    receiver = NcclReceiver(decode.receiver, d_engine.device)
    arrived, done = [], None
    for _ in range(100):  # bounded: a step computes at least one chunk
        finished = prefill.step()
        chunks = [c for r in prefill.take_ready() for c in r.chunks] + [c for d in finished for c in d.chunks]
        for chunk in chunks:
            assert isinstance(chunk, DeviceChunk) and chunk.block.device == p_engine.device
            staging = receiver.prepare(chunk.header)
            staging.copy_(chunk.block)  # what the recv lands
            receiver.finish(chunk.header, staging)
        arrived.append(_complete_pages(decode, dest))
        if finished:
            done = finished[0]
            break
    assert done is not None and done.chunks[-1].header.is_last
    assert arrived == [4, 8, 12, 13]
    assert _decode(decode, job, dest, done) == single.generate([list(job.prompt_ids)], GREEDY)[0]


def test_chunks_stay_within_what_a_receiver_accepts(engines: tuple[Engine, Engine, Engine]) -> None:
    """Pages per chunk shrink to the receiver's byte bound: 32 pages of a Llama-3-8B-sized model
    (2 MiB a page) would be a 64 MiB chunk that every receiver refuses. Here the bound is set to
    three of baton-tiny's pages; every chunk passes the same limits on the decode side."""
    _, p_engine, d_engine = engines
    kv = p_engine.pool.kv
    page_bytes = kv[:, :, 0].numel() * kv.element_size()
    limits = CodecLimits(max_chunk_bytes=3 * page_bytes)
    prefill, decode = PrefillWorker(p_engine, pages_per_chunk=32, limits=limits), DecodeWorker(d_engine, "decode-0")
    assert prefill.pages_per_chunk == 3
    job = Job("bounded", _prompt(8, 200), GREEDY)  # 13 pages
    dest = decode.reserve(job, prefill.epoch)
    assert dest is not None
    prefill.submit(job, dest)
    chunks = [c for _ in range(100) for d in prefill.step() for c in d.chunks]
    assert [len(c.header.dest_page_ids) for c in chunks] == [3, 3, 3, 3, 1]
    assert all(isinstance(c, WireChunk) and len(c.payload) <= limits.max_chunk_bytes for c in chunks)
    assert receive_all(decode.receiver, chunks, limits) == ""  # type: ignore[arg-type]
    assert decode.is_complete(dest)
    decode.cancel(dest)
    with pytest.raises(ValueError, match="chunk bound"):
        PrefillWorker(p_engine, limits=CodecLimits(max_chunk_bytes=page_bytes - 1))


def test_a_caller_that_never_takes_gets_every_page_at_the_end(engines: tuple[Engine, Engine, Engine]) -> None:
    _, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine), DecodeWorker(d_engine, address="decode-0")
    job = Job("whole", _prompt(5, 200), GREEDY)
    dest = decode.reserve(job, prefill.epoch)
    assert dest is not None
    prefill.submit(job, dest)
    done = next(d for _ in range(100) for d in prefill.step())
    pages = [p for c in done.chunks for p in c.header.dest_page_ids]
    assert pages == list(dest.dest_page_ids) and [c.header.is_last for c in done.chunks] == [True]
    decode.cancel(dest)


def test_an_aborted_prompt_hands_out_nothing_more(engines: tuple[Engine, Engine, Engine]) -> None:
    _, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine), DecodeWorker(d_engine, address="decode-0")
    job = Job("gone", _prompt(6, 300), GREEDY)
    dest = decode.reserve(job, prefill.epoch)
    assert dest is not None
    prefill.submit(job, dest)
    prefill.step()
    assert [r.req_id for r in prefill.take_ready()] == ["gone"]
    prefill.abort("gone")
    assert not prefill.has_work() and prefill.take_ready() == []
    decode.cancel(dest)
    assert p_engine.free_pages_at_idle() == p_engine.pool.num_pages


async def test_a_pushed_prompt_is_retained_until_its_lease_and_a_no_reuse_job_computes_all(
    engines: tuple[Engine, Engine, Engine],
) -> None:
    """KV-preserving failover's first half: the prompt a prefill worker pushed stays held here
    (its pages can be neither evicted nor demoted) until a lease past the push's end, so a
    request that moves after losing its decode worker finds it; a job that reuses nothing
    (recovery.preserve_kv off) computes every page and still gets the same tokens."""
    single, p_engine, d_engine = engines
    retention = Retention(max_pages=32, lease_s=0.0, hold_s=60.0)
    prefill, decode = PrefillWorker(p_engine, retention=retention), DecodeWorker(d_engine, address="decode-0")
    prompt = _prompt(11, 150)  # 9 whole pages + 6 tokens
    done, dest, _ = await _prefill_streaming(prefill, decode, Job("kept", prompt, GREEDY))
    tokens = _decode(decode, Job("kept", prompt, GREEDY), dest, done)
    assert prefill.retained.num_held_pages == 9 and "kept" in prefill.retained
    assert p_engine.prefix_cache is not None and p_engine.prefix_cache.evict(128) < 128  # held pages stay
    assert all(h in p_engine.prefix_cache for h in page_hashes(list(prompt), 16, b"", p_engine.fingerprint))

    moved = Job("kept@1", prompt + tuple(tokens[:5]), replace(GREEDY, max_tokens=GREEDY.max_tokens - 5))
    done, dest, _ = await _prefill_streaming(prefill, decode, moved)
    assert done.output.num_cached_tokens == 9 * 16  # the whole retained prompt; only 15 tokens computed
    assert _decode(decode, moved, dest, done) == tokens[5:]

    prefill.pushed("kept")  # its push ended: the lease (0 s here) runs from now
    assert prefill.retained.expire() >= 1 and "kept" not in prefill.retained
    prefill.abort("kept@1")  # a request whose caller left lets its copy go at once
    assert prefill.retained.num_held_pages == 0 and prefill.retained.released["released"] == 1

    fresh = replace(moved, req_id="recompute", reuse_cache=False)
    done, dest, _ = await _prefill_streaming(prefill, decode, fresh)
    assert done.output.num_cached_tokens == 0  # its prefix is cached, and computed anyway
    assert _decode(decode, fresh, dest, done) == tokens[5:] == single.generate([list(moved.prompt_ids)], moved.sampling)[0]
    prefill.retained.clear()
    assert d_engine.free_pages_at_idle() == d_engine.pool.num_pages
    assert p_engine.free_pages_at_idle() == p_engine.pool.num_pages
