"""Real servers on loopback for the gateway's tests: baton servers started as plain OpenAI
endpoints (the external pools, serving the model "ext"), and gateways in front of them whose
own pool is a baton-tiny engine of their own (tests/cluster/conftest.py's servers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cluster.gateway.config import OWN, GatewaySpec, HealthSpec, PoolSpec, RoutingSpec, check
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, _server_factory

EXT = "ext"  # the model name the upstream servers serve


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_model_dir: Any) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512, num_pages=256)


@pytest.fixture(scope="module")
def upstreams(tiny_engine_config: EngineConfig) -> Iterator[list[ServerHandle]]:
    """Two baton servers as plain OpenAI endpoints (no KV events): the external pools' engines."""
    servers = _server_factory(tiny_engine_config)
    make = next(servers)
    yield [make(served_model_name=EXT) for _ in range(2)]
    next(servers, None)  # stops them


def pool(name: str, urls: list[str], **kw: Any) -> PoolSpec:
    kw.setdefault("health", HealthSpec(period_s=3600.0, failures=1, eject_s=60.0))
    kw.setdefault("kind", "openai-compatible")
    kw.setdefault("models", (EXT,))
    return PoolSpec(name=name, endpoints=tuple(urls), **kw)


@pytest.fixture
def make_gateway(tiny_engine_config: EngineConfig) -> Iterator[Callable[..., ServerHandle]]:
    """A gateway over the given external pools, beside its own baton-tiny pool."""
    servers = _server_factory(tiny_engine_config)
    make_server = next(servers)

    def make(pools: list[PoolSpec], routing: RoutingSpec | None = None, grpc_port: int | None = None,
             served: tuple[str, ...] = ("baton-tiny",)) -> ServerHandle:  # fmt: skip
        spec = check(GatewaySpec((PoolSpec(name=OWN, kind="baton"), *pools), routing or RoutingSpec()))
        return make_server(gateway=spec, grpc_port=grpc_port, served_model_name=served)

    yield make
    next(servers, None)
