"""The gRPC API's serving options over a real grpc.aio server on loopback, driving a real engine
(baton-tiny): `n` samples, `cache_salt`, `session_id`'s bounds, usage split by tier, and prefix
pins (operator keys) that survive eviction pressure until their TTL. `session_id` keeping a
conversation on one of two decode workers is tests/cluster/test_ray_placement.py's (it needs
the Ray fleet)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2

from batonpb.baton.v1 import generation_pb2 as pb
from bench.server_proc import free_port
from cluster.client import AsyncBatonClient, BatonClientError, CachedTokens, Options, Sampling
from cluster.edge.frontend import Frontend
from cluster.edge.grpc_server import GrpcConfig, create_grpc_server
from cluster.edge.tenants import ApiKeys, Tenant
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.request import SloClass
from tests.cluster.conftest import all_pages_free

pytestmark = pytest.mark.timeout(120)

MODEL = "baton-tiny"
KEY, OPS = "k" * 20, "o" * 20
KEYS = ApiKeys({KEY: Tenant("t"), OPS: Tenant("ops", role="operator")})
SAMPLED = Sampling(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
GREEDY = Sampling(max_tokens=2, temperature=0.0, ignore_eos=True)
POOL = 48  # pages: small enough that a flood of prompts evicts


@dataclass(frozen=True, slots=True)
class Served:
    engine: Engine
    front: AsyncEngine
    target: str

    def client(self, key: str = KEY) -> AsyncBatonClient:
        return AsyncBatonClient(self.target, model=MODEL, api_key=key, timeout_s=60)


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path) -> AsyncIterator[Served]:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512, num_pages=POOL))
    front = AsyncEngine(engine)
    front.start()
    port = free_port()
    server = create_grpc_server(Frontend(front, MODEL), KEYS, GrpcConfig(port=port))
    await server.start()
    try:
        yield Served(engine, front, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)
        await front.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104_729) % 15_000 for i in range(n)]


async def test_n_samples_stream_interleaved_and_complete_in_choices(served: Served) -> None:
    prompt = _prompt(1, 20)
    async with served.client() as client:
        done = await client.complete(prompt, sampling=SAMPLED, options=Options(n=3))
        again = await client.complete(prompt, sampling=SAMPLED, options=Options(n=3))
        deltas = [d async for d in client.generate(prompt, sampling=SAMPLED, options=Options(n=3))]
    assert [c.index for c in done.choices] == [0, 1, 2]
    samples = [list(c.token_ids) for c in done.choices]
    assert samples == [list(c.token_ids) for c in again.choices]  # seed + index: reproducible
    assert len({tuple(s) for s in samples}) > 1  # and the samples are not one sample thrice
    assert list(done.token_ids) == samples[0] and done.text == done.choices[0].text
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (20, 18)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for d in deltas:
        streamed[d.index].extend(d.token_ids)
    assert [streamed[i] for i in range(3)] == samples
    finals = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.index for d in finals) == [0, 1, 2]  # one final message per sample
    assert all(d.usage is not None and d.usage.completion_tokens == 6 for d in finals)
    assert sum(1 for d in deltas if d.request_id) == 1  # the call's id, on its first message


async def test_n_is_bounded(served: Served) -> None:
    async with served.client() as client:
        with pytest.raises(BatonClientError) as err:
            await client.complete([5, 6, 7], sampling=GREEDY, options=Options(n=17))
    assert err.value.code.name == "INVALID_ARGUMENT" and err.value.message.startswith("n:")


async def test_cache_salt_keeps_requests_apart_and_usage_says_where_hits_were(served: Served) -> None:
    prompt = _prompt(2, 40)  # 2 whole pages + 8 tokens: 32 reusable tokens

    async def cached(salt: str) -> CachedTokens:
        async with served.client() as client:
            done = await client.complete(prompt, sampling=GREEDY, options=Options(cache_salt=salt))
        assert done.usage is not None and done.usage.cached_tokens == done.usage.cached.device
        return done.usage.cached

    assert await cached("x") == CachedTokens()
    assert await cached("x") == CachedTokens(device=32)  # one engine: nothing from another worker
    assert await cached("y") == CachedTokens()
    assert await cached("") == CachedTokens()  # no salt: the tenant's own pages, apart from both
    for field in ("cache_salt", "session_id"):
        async with served.client() as client:
            with pytest.raises(BatonClientError) as err:
                await client.complete(prompt, sampling=GREEDY, options=Options(**{field: "s" * 257}))
        assert err.value.code.name == "INVALID_ARGUMENT" and err.value.message.startswith(field)


async def _flood(served: Served, rounds: int, seed: int) -> None:
    """Distinct prompts until the cache has had to evict (the prefix too, were it not pinned)."""
    evicted = served.engine.prefix_cache.stats.evicted_pages  # type: ignore[union-attr]
    async with served.client() as client:
        for i in range(rounds):
            await client.complete(_prompt(seed + i, 70), sampling=GREEDY)
    assert served.engine.prefix_cache.stats.evicted_pages > evicted  # type: ignore[union-attr]


async def test_a_pinned_prefix_survives_eviction_until_its_ttl(served: Served) -> None:
    system = _prompt(3, 100)  # 6 whole pages
    question = system + [7, 8, 9]
    async with served.client() as client:
        with pytest.raises(BatonClientError) as err:  # a tenant's key may not pin
            await client.pin_prefix(system, pin_id="sys", ttl_s=60)
        assert err.value.code.name == "PERMISSION_DENIED"
    async with served.client(OPS) as ops:
        pin = await ops.pin_prefix(system, pin_id="sys", ttl_s=60, tenant="t")
    assert (pin.tenant, pin.num_tokens, pin.num_pages, pin.workers) == ("t", 100, 6, {"engine-0": "held"})
    await _flood(served, 14, seed=100)
    async with served.client() as client:
        hit = (await client.complete(question, sampling=GREEDY)).usage
    assert hit is not None and hit.cached_tokens == 96  # every pinned page, after the flood
    # The TTL passes (the engine's clock moved on; its idle loop's call releases the pin).
    clock = served.engine.pins.clock
    served.engine.pins.clock = lambda: clock() + 61
    try:
        await served.front.call(lambda e: e.flush_cache())
    finally:
        served.engine.pins.clock = clock
    assert served.engine.pins.num_held_pages == 0
    await _flood(served, 14, seed=200)
    async with served.client() as client:
        after = (await client.complete(question, sampling=GREEDY)).usage
    assert after is not None and after.cached_tokens == 0  # aged out like any other page
    async with served.client(OPS) as ops:
        assert not await ops.unpin_prefix("sys", tenant="t")  # already gone


async def test_unpin_releases_on_every_worker(served: Served) -> None:
    async with served.client(OPS) as ops:
        await ops.pin_prefix(_prompt(4, 48), pin_id="doc", ttl_s=600, tenant="t")
        assert served.engine.pins.num_held_pages == 3
        assert await ops.unpin_prefix("doc", tenant="t")
    assert served.engine.pins.num_held_pages == 0
    served.engine.check_integrity()


async def test_the_readmes_grpcurl_calls_are_valid_requests(served: Served) -> None:
    """README's grpcurl lines (grpcurl itself is a Go binary, not installed here): each `-d`
    body parses, by protobuf's JSON mapping as grpcurl does it, into its method's request, and
    the Generate call streams its 16 tokens when sent as written."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("grpcurl -plaintext 127.0.0.1:50051 list"):]
    block = block[: block.index("```")].replace("\\\n", " ")
    calls = re.findall(r"-d '([^']*)'.*? (\S+/\w+)\n", block)
    assert [method for _, method in calls] == ["grpc.health.v1.Health/Check", "baton.v1.GenerationService/Generate"]
    json_format.Parse(calls[0][0], health_pb2.HealthCheckRequest())
    request = json_format.Parse(calls[1][0], pb.GenerateRequest())
    async with grpc.aio.insecure_channel(served.target) as channel:
        generate = channel.unary_stream("/" + calls[1][1], request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
        replies = [m async for m in generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)]
    assert sum(len(m.token_ids) for m in replies) == 16 and replies[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_slo_class_reaches_the_engine_and_latency_needs_the_operators_leave(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    classes: list[SloClass] = []
    generate = served.front.generate

    def recording(job: Job) -> Any:
        classes.append(job.slo)
        return generate(job)

    monkeypatch.setattr(served.front, "generate", recording)
    async with served.client() as client:
        await client.complete([5, 6, 7], sampling=GREEDY, options=Options(slo_class="batch", n=2))
        with pytest.raises(BatonClientError) as err:
            await client.complete([5, 6, 7], sampling=GREEDY, options=Options(slo_class="latency"))
    assert err.value.code.name == "PERMISSION_DENIED" and err.value.message.startswith("slo_class")
    port = free_port()
    allowing = create_grpc_server(Frontend(served.front, MODEL), KEYS, GrpcConfig(port=port, allow_priority_field=True))
    await allowing.start()
    try:
        async with AsyncBatonClient(f"127.0.0.1:{port}", model=MODEL, api_key=KEY, timeout_s=60) as client:
            await client.complete([5, 6, 7], sampling=GREEDY, options=Options(slo_class="latency"))
            await client.complete([5, 6, 7], sampling=GREEDY)
    finally:
        await allowing.stop(None)
    assert classes == [SloClass.BATCH, SloClass.BATCH, SloClass.LATENCY, SloClass.STANDARD]


async def test_leaving_a_stream_of_samples_early_aborts_every_sample(served: Served) -> None:
    """Cancelling a Generate call with n samples (after its first message) aborts all of them:
    every page comes back."""
    async with served.client() as client:
        long = Sampling(max_tokens=300, temperature=0.0, ignore_eos=True)
        deltas = client.generate(_prompt(9, 40), sampling=long, options=Options(n=3))
        first = await anext(deltas)
        assert first.token_ids
        await deltas.aclose()  # the call is cancelled: the server aborts its three requests
    assert await all_pages_free(served.engine)
