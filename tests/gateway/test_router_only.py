"""A gateway with no workers of its own (`pools: {baton: {kind: baton, enabled: false}}`): a
router over external pools, with real servers on loopback (baton servers as plain OpenAI
endpoints), its HTTP and gRPC edges, /status, /metrics and the dashboard page, and no engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from bench.server_proc import free_port
from cluster.errors import EdgeError
from cluster.gateway.config import OWN, GatewaySpec, PoolSpec, RoutingSpec, check
from cluster.gateway.router_front import RouterFront
from cluster.ops.status_view import render_status
from cluster.server import ServerConfig, start
from engine.engine_config import EngineConfig
from engine.errors import ConfigError
from tests.cluster.conftest import ServerHandle, start_server
from tests.gateway.conftest import EXT, pool
from tests.gateway.test_gateway import complete, count, text

pytestmark = pytest.mark.timeout(120)

OFF = PoolSpec(name=OWN, kind="baton", enabled=False)


@pytest.fixture
def make_router(tiny_engine_config: EngineConfig) -> Iterator[Callable[..., ServerHandle]]:
    handles: list[ServerHandle] = []

    def make(pools: list[PoolSpec], grpc_port: int | None = None) -> ServerHandle:
        spec = check(GatewaySpec((OFF, *pools), RoutingSpec(route_key="user")))
        handle = start_server(ServerConfig(engine=tiny_engine_config, grpc_port=grpc_port, gateway=spec), None)
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        handle.stop()


def test_a_gateway_without_workers_routes_every_model_to_its_pools(
    upstreams: list[ServerHandle], make_router: Callable[..., ServerHandle]
) -> None:
    import grpc

    from batonpb.baton.v1 import generation_pb2 as pb
    from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc

    port = free_port()
    gw = make_router([pool("ext", [u.url for u in upstreams], models=(EXT, "chat"), upstream_models=(("chat", EXT),))],
                     grpc_port=port)  # fmt: skip
    assert gw.running.engine is None and isinstance(gw.running.front, RouterFront)
    # a conversation's turns stay on the endpoint that holds its prefix (the approximate index,
    # its route tokens from the built-in tokenizer): the first turn's endpoint takes the rest
    shared = text(31, 80)
    first = complete(gw.url, shared, user="u1")
    assert first.status_code == 200 and first.headers["x-baton-pool"] == "ext", first.text
    for turn in range(3):
        assert complete(gw.url, f"{shared} turn {turn}", model="chat", user="u1").status_code == 200
    endpoints = httpx.get(gw.url + "/status").json()["pools"]["pools"]["ext"]["endpoints"]
    assert sorted(e["ok"] for e in endpoints) == [0, 4] and max(e["estimated_hit_tokens"] for e in endpoints) > 0
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60,
                      json={"model": EXT, "prompt": "one two", "max_tokens": 4, "stream": True}) as r:  # fmt: skip
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    # only the pools' models: the router has none of its own
    assert [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]] == [EXT, "chat"]
    own = complete(gw.url, "hello", model="baton-tiny")
    assert own.status_code == 404 and own.json()["error"]["param"] == "model"
    unnamed = httpx.post(gw.url + "/tokenize", json={"prompt": "hello"})
    assert unnamed.status_code == 404 and "no model of its own" in unnamed.json()["error"]["message"]
    named = httpx.post(gw.url + "/tokenize", json={"model": EXT, "prompt": "hello"})
    assert named.status_code == 200 and named.headers["x-baton-pool"] == "ext"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        done = stub.Complete(pb.CompleteRequest(model=EXT, text="one two", sampling=pb.Sampling(max_tokens=3)), timeout=60)
        ids = stub.Tokenize(pb.TokenizeRequest(model=EXT, text="hello"), timeout=30)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Complete(pb.CompleteRequest(model="baton-tiny", text="x", sampling=pb.Sampling(max_tokens=1)), timeout=30)
    assert done.text and done.usage.completion_tokens == 3 and list(ids.token_ids) == named.json()["tokens"]
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # what operators look at: ready, no nodes, its pools, their metrics, the page
    assert httpx.get(gw.url + "/ready").status_code == 200 and httpx.get(gw.url + "/live").status_code == 200
    status = httpx.get(gw.url + "/status").json()
    assert status["model"] is None and status["nodes"] == [] and list(status["pools"]["pools"]) == ["ext"]
    shown = render_status(status)  # `baton status`
    assert shown.startswith("a router (no model of its own)  ready") and "\nPOOLS\n  ext (openai-compatible: ext, chat)" in shown
    assert all(f"    {u.url}  up  inflight 0" in shown for u in upstreams)
    assert count(gw.url, "baton_pool_requests_total", pool="ext", outcome="ok") == 8
    assert count(gw.url, "baton_requests_total", api="grpc", outcome="ok") == 1
    assert httpx.get(gw.url + "/dashboard").status_code == 200
    pin = gw.running.frontend.pin("acme", "p1", [5, 6, 7], 60.0)
    with pytest.raises(EdgeError) as nothing:  # the pools' engines hold their own pages
        asyncio.run_coroutine_threadsafe(pin, gw.loop).result(10)
    assert "no workers of its own" in nothing.value.message


def _spec(pools: tuple[PoolSpec, ...], rules: Any = ()) -> GatewaySpec:
    return check(GatewaySpec(pools, RoutingSpec(rules=rules)))


def test_what_a_router_cannot_be_is_refused_naming_the_key(tiny_engine_config: EngineConfig) -> None:
    from cluster.gateway.config import Rule

    ext = pool("ext", ["http://127.0.0.1:9"])
    cases = [
        (lambda: _spec((OFF,)), "pools.baton.enabled"),  # nothing to route to
        (lambda: _spec((PoolSpec(name=OWN, kind="baton"), replace(ext, enabled=False))),
         "pools.ext.enabled"),  # only the own pool turns off
        (lambda: _spec((OFF, ext), (Rule(pool=OWN),)), "routing.rules.0.pool"),  # a rule to no workers
    ]  # fmt: skip
    for build, key in cases:
        with pytest.raises(ConfigError) as err:
            build()
        assert err.value.field == key
    spec = _spec((OFF, ext))
    assert spec.is_router_only and [p.name for p in spec.with_own_models(()).pools] == ["ext"]
    assert not _spec((PoolSpec(name=OWN, kind="baton"), ext)).is_router_only


async def test_a_router_starts_no_workers(tiny_engine_config: EngineConfig) -> None:
    spec = _spec((OFF, pool("ext", ["http://127.0.0.1:9"])))
    with pytest.raises(ConfigError) as err:
        await start(ServerConfig(engine=tiny_engine_config, grpc_port=None, gateway=spec, prefill_workers=1))
    assert err.value.field == "pools.baton.enabled"

