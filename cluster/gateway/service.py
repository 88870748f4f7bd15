"""The gateway's parts wired together for the server: the router, the upstream client, the
metrics, the request log, the endpoints' health loop and the KV-event subscribers.

    gateway = Gateway(spec, registry, request_timeout_s)
    await gateway.start()        health probes every period_s; one subscriber per publisher
    gateway.status()             /status's "gateway": pools, endpoints, overlap per route key
    gateway.tokenizer_for(model, own)   whose tokenizer gives the model's route tokens
    await gateway.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from cluster.gateway.config import GatewaySpec
from cluster.gateway.endpoints import Endpoint, Pool
from cluster.gateway.metrics import GatewayMetrics
from cluster.gateway.proxy import Upstreams
from cluster.gateway.route_log import RouteLog
from cluster.gateway.router import Router, endpoint_id, pool_fingerprint
from engine.errors import CheckpointError, ConfigError
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Gateway:
    def __init__(self, spec: GatewaySpec, registry: CollectorRegistry, request_timeout_s: float) -> None:
        self.spec = spec
        self.router = Router(spec)
        self.metrics = GatewayMetrics(registry)
        self.metrics.register_state(registry, self.router)
        self.upstreams = Upstreams(self.router, self.metrics, request_timeout_s)
        r = spec.routing
        self.log = RouteLog(r.log_path, r.log_max_bytes) if r.log_path else None
        self.tokenizers = _load_tokenizers(spec)
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribers: list[Any] = []

    @property
    def num_inflight(self) -> int:
        """Calls in flight to external pools (the own pool's are the edge's admission's)."""
        return sum(p.inflight for p in self.router.pools.values() if not p.spec.is_own)

    def tokenizer_for(self, model: str, default: Tokenizer) -> Tokenizer:
        """The tokenizer of `model`'s route tokens: its pools' `tokenizer`, else `default` (the
        gateway's own model's)."""
        return self.tokenizers.get(model, default)

    async def start(self) -> None:
        if any(not p.spec.is_own for p in self.router.pools.values()):
            self._tasks.append(asyncio.create_task(self._health_loop(), name="baton-gateway-health"))
        for pool in self.router.pools.values():
            for e in pool.endpoints:
                if e.kv_events:
                    self._subscribe(pool, e)

    def _subscribe(self, pool: Pool, e: Endpoint) -> None:
        from cluster.gateway.kv_events import (
            KVEventSubscriber,  # pyzmq: only where a pool has publishers
        )

        assert e.kv_events is not None
        sub = KVEventSubscriber(endpoint_id(pool.name, e.url), e.kv_events, pool.spec.kv_events_topic,
                                self.router.index, pool.spec.block_size, pool_fingerprint(pool.spec))  # fmt: skip
        self._subscribers.append((pool.name, e.url, sub, {}))
        self._tasks.append(asyncio.create_task(sub.run(), name=f"baton-kv-events-{pool.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for _, _, sub, _ in self._subscribers:
            with contextlib.suppress(Exception):
                sub.close()
        await self.upstreams.close()
        if self.log is not None:
            self.log.close()

    # -- health ------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        period = min(p.spec.health.period_s for p in self.router.pools.values() if not p.spec.is_own)
        while True:
            await self.probe_all()
            self._count_kv_events()
            await asyncio.sleep(period)

    async def probe_all(self) -> None:
        """One health probe of every external endpoint (GET its kind's health path, 200 = up)."""
        probes = [self._probe(pool, e) for pool in self.router.pools.values() if not pool.spec.is_own
                  for e in pool.endpoints]  # fmt: skip
        await asyncio.gather(*probes)

    async def _probe(self, pool: Pool, e: Endpoint) -> None:
        spec = pool.spec
        timeout = aiohttp.ClientTimeout(total=spec.health.timeout_s)
        headers = {}
        key = self.upstreams.key_of(pool.name)
        if key:
            headers["authorization"] = f"Bearer {key}"
        try:
            async with self.upstreams.session.get(e.url + spec.health_path, timeout=timeout, headers=headers) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        now = time.monotonic()
        if ok:
            if not e.is_available(now) or e.failures:
                logger.info("pool %s endpoint %s is healthy again", pool.name, e.url)
            e.succeeded()
        elif e.failed(now):
            self.metrics.ejections.labels(pool.name, e.url).inc()
            logger.warning("pool %s endpoint %s ejected for %.0f s: its health probe failed %d times", pool.name,
                           e.url, e.eject_s, e.failures)  # fmt: skip

    def _count_kv_events(self) -> None:
        for pool, url, sub, seen in self._subscribers:
            for outcome, total in sub.stats().items():
                delta = total - seen.get(outcome, 0)
                if delta > 0:
                    self.metrics.kv_events.labels(pool, url, outcome).inc(delta)
                    seen[outcome] = total

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = self.router.clock()
        pools = {}
        for pool in self.router.pools.values():
            pools[pool.name] = {
                "kind": pool.spec.kind, "models": list(pool.spec.models), "inflight": pool.inflight,
                "max_concurrency": pool.spec.max_concurrency,
                "ttft_p50_s": _median(pool.ttfts), "itl_p50_s": _median(pool.itls),
                "endpoints": [{
                    "url": e.url, "up": e.is_available(now), "inflight": e.inflight, "ok": e.num_ok,
                    "failed": e.num_failed, "failures": e.failures, "ejections": e.num_ejections,
                    "ejected_for_s": round(max(0.0, e.ejected_until - now), 1),
                    "index": "kv-events" if e.kv_events else "approximate" if not pool.spec.is_own else "engine",
                    "prompt_tokens": e.prompt_tokens, "estimated_hit_tokens": e.hit_tokens,
                    "reported_cached_tokens": e.cached_tokens,
                    "prompt_rate": _prompt_rate(e, now),
                } for e in pool.endpoints],
            }  # fmt: skip
        return {"pools": pools, "route_key": self.spec.routing.route_key,
                "overlap": self.router.meter.snapshot(), "indexed_pages": self.router.index.num_pages,
                "expected_pages": self.router.index.num_expected}  # fmt: skip


def _prompt_rate(endpoint: Endpoint, now: float) -> dict[str, Any]:
    """What the cost rule divides by for `endpoint` (cluster.gateway.router): tokens/s, the
    samples behind it (0: the configured rate) and the age of the last."""
    return {"tokens_per_s": round(endpoint.prompt_rate, 1), "samples": endpoint.rate_samples,
            "age_s": round(now - endpoint.sampled_at, 1) if endpoint.rate_samples else None}


def _load_tokenizers(spec: GatewaySpec) -> dict[str, Tokenizer]:
    """Each pool-named tokenizer, loaded once (tokenizer.json: data, never code); a missing or
    unreadable one stops the start, naming the pool's key."""
    loaded: dict[str, Tokenizer] = {}
    out: dict[str, Tokenizer] = {}
    for model, path in spec.tokenizer_paths().items():
        if path not in loaded:
            try:
                loaded[path] = Tokenizer.from_dir(path)
            except CheckpointError as exc:
                pool = next(p.name for p in spec.pools if p.tokenizer == path)
                raise ConfigError(f"pools.{pool}.tokenizer", str(exc)) from None
        out[model] = loaded[path]
    return out


def _median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 4) if ordered else None
