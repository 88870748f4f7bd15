"""Prefill worker -> KV transfer -> decode worker, in one process, over the local and the gRPC
transports: the tokens equal one engine's; forged, reused and stale pushes are refused."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from kvtransfer.codec import CodecLimits, decode_chunk
from kvtransfer.grpc_transport import GrpcSender, start_kv_server
from kvtransfer.local import LocalSender
from kvtransfer.shm import ShmRegion, ShmSender, shm_handler
from kvtransfer.transport import build_chunks
from prefill.worker import PrefillWorker

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Engine, Engine, Engine]:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32")
    return Engine(cfg), Engine(replace(cfg, max_prefill_chunk=64)), Engine(cfg)


async def _pd(prefill: PrefillWorker, decode: DecodeWorker, sender: Any, job: Job) -> list[int]:
    if decode.prefers_local(job):
        decode.start_local(job)
        tokens: list[int] = []
    else:
        dest = decode.reserve(job, prefill.epoch)
        assert dest is not None
        prefill.submit(job, dest)
        done = None
        while done is None:
            for finished in prefill.step():
                done = finished
        tokens = [done.first_token]
        if done.finish_reason is not None:
            return tokens
        result = await sender.send(dest, done.chunks, 10.0)
        assert result.accepted, result.error
        decode.start_prefilled(job, dest, done.first_token)
    while decode.engine.has_unfinished():
        for out in decode.step():
            tokens.extend(out.token_ids)
    return tokens


def _jobs() -> list[Job]:
    rng = np.random.default_rng(8)
    seeded = SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)
    return [
        Job(f"j{i}", tuple(rng.integers(4, 16_384, size=n).tolist()), params)
        for i, (n, params) in enumerate([(10, GREEDY), (40, GREEDY), (200, GREEDY), (200, seeded), (333, GREEDY)])
    ]


@pytest.mark.parametrize("transport", ["local", "grpc", "shm"])
async def test_pd_tokens_equal_one_engine(engines: tuple[Engine, Engine, Engine], transport: str) -> None:
    single, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine), DecodeWorker(d_engine, address="decode-0")
    server, region = None, None
    if transport == "local":
        sender: Any = LocalSender({"decode-0": decode.receiver})
    else:
        extra: list[Any] = []
        if transport == "shm":  # page bytes through /dev/shm, headers over the same KV server
            region = ShmRegion(num_slots=2, slot_bytes=4 << 20)  # a chunk is 32 pages of 64 KiB
            extra = [shm_handler(decode.receiver, region)]
        server, port = await start_kv_server(decode.receiver, "127.0.0.1:0", extra_handlers=extra)
        decode.address = f"127.0.0.1:{port}"
        sender = GrpcSender() if transport == "grpc" else ShmSender()
    try:
        for job in _jobs():
            expected = single.generate([list(job.prompt_ids)], job.sampling)[0]
            assert await _pd(prefill, decode, sender, replace(job, req_id=job.req_id + transport)) == expected
    finally:
        if server is not None:
            await sender.close()
            await server.stop(None)
        if region is not None:
            region.close()
    assert decode.book.num_open == 0 and not decode.book.completed
    assert d_engine.free_pages_at_idle() == d_engine.pool.num_pages
    assert p_engine.free_pages_at_idle() == p_engine.pool.num_pages


async def test_forged_reused_and_stale_pushes_are_refused(engines: tuple[Engine, Engine, Engine]) -> None:
    _, p_engine, d_engine = engines
    prefill, decode = PrefillWorker(p_engine, epoch=7), DecodeWorker(d_engine)
    sender = LocalSender({"decode-0": decode.receiver})
    job = Job("forge", tuple(range(100, 180)), GREEDY)
    dest = decode.reserve(job, sender_epoch=7)
    assert dest is not None
    prefill.submit(job, dest)
    (done,) = [d for _ in range(50) for d in prefill.step()][:1]
    used_before = d_engine.pool.pages.num_used

    forged = replace(dest, token=b"\x00" * len(dest.token))
    stale = PrefillWorker(p_engine, epoch=6)
    for bad_dest, worker in ((forged, prefill), (dest, stale)):
        chunks = build_chunks(bad_dest, _pages_of(done), worker.epoch)
        result = await sender.send(bad_dest, chunks, 10.0)
        assert not result.accepted
    assert decode.book.refused_bad_token == 1 and decode.book.refused_stale_epoch == 1
    assert decode.book.num_open == 1 and d_engine.pool.pages.num_used == used_before  # untouched

    assert (await sender.send(dest, done.chunks, 10.0)).accepted
    replay = await sender.send(dest, done.chunks, 10.0)  # the token is spent
    assert not replay.accepted and decode.book.refused_bad_token == 2
    decode.start_prefilled(job, dest, done.first_token)
    while d_engine.has_unfinished():
        decode.step()
    assert d_engine.free_pages_at_idle() == d_engine.pool.num_pages


def _pages_of(done: Any) -> list[torch.Tensor]:
    """The page tensors inside a PrefillDone's chunks (to re-send them under another header)."""
    return [page for chunk in done.chunks for page in decode_chunk(chunk, CodecLimits()).unbind(0)]


async def test_an_unused_reservation_expires_and_its_pages_return(engines: tuple[Engine, Engine, Engine]) -> None:
    _, _, d_engine = engines
    decode = DecodeWorker(d_engine, reservation_ttl_s=0.05)
    free_before = d_engine.pool.pages.num_free
    dest = decode.reserve(Job("lost", tuple(range(64)), GREEDY), sender_epoch=1)
    assert dest is not None and d_engine.pool.pages.num_free < free_before
    await asyncio.sleep(0.1)
    decode.step()  # expiry runs first
    assert decode.book.num_expired == 1 and d_engine.pool.pages.num_free == free_before
