"""Cancellation and overload through real HTTP: nothing leaks, excess load is refused early."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from cluster.edge.admission import AdmissionConfig
from tests.cluster.conftest import ServerHandle

MODEL = "baton-tiny"


async def _cancel_after(client: httpx.AsyncClient, chunks: int, seed: int) -> int:
    body = {"model": MODEL, "prompt": [100 + seed % 50, 7, 8, 9] * 4, "max_tokens": 200,
            "stream": True, "ignore_eos": True, "temperature": 0}
    seen = 0
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        if chunks == 0:
            return 0  # cancelled before reading a single event
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream
    return seen


def test_hundred_streams_cancelled_at_random_points_free_every_page(server: ServerHandle) -> None:
    rng = random.Random(1234)
    points = [rng.randint(0, 12) for _ in range(100)]

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=25)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            return await asyncio.gather(*(_cancel_after(client, p, i) for i, p in enumerate(points)))

    seen = asyncio.run(main())
    assert seen == points  # every stream was really cut at its point (200 tokens were on offer)
    assert server.wait_idle(2.0), "pages were still held 2 s after the last client left"
    adm = server.running.frontend.admission
    assert adm.num_inflight == 0 and adm.num_waiting == 0 and adm.waiting_tokens == 0


def test_overload_is_refused_quickly_and_admitted_requests_complete(make_server: Any) -> None:
    busy: ServerHandle = make_server(
        admission=AdmissionConfig(max_waiting_requests=3, max_inflight_requests=6, retry_after_s=2.0)
    )
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=busy.url, timeout=60,
                                     limits=httpx.Limits(max_connections=80)) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(80)))

    replies = asyncio.run(main())
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(ok) + len(refused) == 80, {r.status_code for r in replies}
    assert ok and refused, (len(ok), len(refused))
    for r in refused:
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 24
    assert busy.wait_idle()
    adm = busy.running.frontend.admission
    assert adm.num_inflight == 0 and adm.num_waiting == 0 and adm.num_rejected == len(refused)
