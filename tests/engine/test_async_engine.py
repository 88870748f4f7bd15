"""The asyncio front: streaming deltas, cancellation frees pages, refusals reach the caller."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.job import Job
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def sync_engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512))


async def _collect(
    front: AsyncEngine, req_id: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    tokens: list[int] = []
    async for out in front.generate(Job(req_id, tuple(prompt), params)):
        tokens.extend(out.token_ids)
    return tokens


async def test_concurrent_streams_match_offline_generation(sync_engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(50 + i, 90 + 2 * i)) for i in range(4)]
    expected = [sync_engine.generate([p], params)[0] for p in prompts]
    front = AsyncEngine(sync_engine)
    front.start()
    try:
        got = await asyncio.gather(
            *(_collect(front, f"c{i}", p, params) for i, p in enumerate(prompts))
        )
        assert got == expected
        assert front.last_stats is not None and front.is_alive
    finally:
        await front.stop()
    assert sync_engine.free_pages_at_idle() == sync_engine.pool.num_pages


async def test_cancelled_consumer_aborts_and_frees_pages(sync_engine: Engine) -> None:
    front = AsyncEngine(sync_engine)
    front.start()
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        seen = 0
        stream = front.generate(Job("long", tuple(range(10, 60)), params))
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        for _ in range(100):  # the abort lands on the step thread's next turn
            if not sync_engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert seen == 3
        assert not sync_engine.has_unfinished()
        assert sync_engine.free_pages_at_idle() == sync_engine.pool.num_pages
    finally:
        await front.stop()


async def test_refused_request_raises_for_its_caller_only(sync_engine: Engine) -> None:
    front = AsyncEngine(sync_engine)
    front.start()
    try:
        too_long = SamplingParams(max_tokens=500, temperature=0.0)
        with pytest.raises(RequestError, match="max_tokens"):
            await _collect(front, "big", list(range(10, 110)), too_long)
        ok = await _collect(
            front,
            "ok",
            [11, 12, 13],
            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        assert len(ok) == 3
    finally:
        await front.stop()


async def test_a_reader_that_falls_behind_is_cancelled_without_stalling(sync_engine: Engine) -> None:
    from engine.errors import SlowReaderError

    front = AsyncEngine(sync_engine, max_buffered=4)
    front.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        slow = front.generate(Job("slow", tuple(range(20, 40)), params))
        try:
            await anext(slow)  # then stop reading
            cancelled = False
        except SlowReaderError:  # the step thread ran max_buffered steps before this loop read the first
            cancelled = True
        # fewer outputs than max_buffered: "fast" cannot be behind, however late this loop runs
        # (with 30, a busy machine's loop ran four of its dispatches before its reader did: cancelled)
        fast = await _collect(front, "fast", [11, 12, 13], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(fast) == 3  # the batch kept stepping while "slow" did not read
        for _ in range(200):
            if not sync_engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert sync_engine.free_pages_at_idle() == sync_engine.pool.num_pages
        if not cancelled:
            with pytest.raises(SlowReaderError):
                async for _ in slow:
                    pass
    finally:
        await front.stop()
