"""The gateway's families on the one /metrics (docs/metrics.md, "The gateway over pools"):
per pool and endpoint, requests by outcome, in flight, TTFT and ITL as the proxy saw them,
prompt tokens and the index's estimate of how many of them the endpoint held, and what the
engine itself reported cached; routing decisions by reason; ejections; KV events consumed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cluster.gateway.router import Router

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "baton_pool_requests_total", "Requests the gateway sent each endpoint, by outcome",
            ["pool", "endpoint", "outcome"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "baton_route_decisions_total", "Routing decisions by the pool chosen and why: model, rule, cost",
            ["pool", "reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram("baton_pool_ttft_seconds", "Time to first token through the gateway, per endpoint",
                              ["pool", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("baton_pool_itl_seconds", "Time between streamed outputs through the gateway, per endpoint",
                             ["pool", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter(
            "baton_pool_prompt_tokens_total", "Prompt tokens (the gateway's count) sent each endpoint",
            ["pool", "endpoint"], registry=r,
        )  # fmt: skip
        self.hit_tokens = Counter(
            "baton_pool_estimated_hit_tokens_total",
            "Of those, the tokens the prefix index estimated the endpoint held when it was chosen",
            ["pool", "endpoint"], registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "baton_pool_reported_cached_tokens_total",
            "Cached prompt tokens the engines reported in their usage (prompt_tokens_details)",
            ["pool", "endpoint"], registry=r,
        )  # fmt: skip
        self.ejections = Counter("baton_pool_ejections_total", "Times an endpoint was ejected for failing",
                                 ["pool", "endpoint"], registry=r)  # fmt: skip
        self.kv_events = Counter(
            "baton_pool_kv_event_messages_total", "KV-event messages from external engines: applied, or dropped by why",
            ["pool", "endpoint", "outcome"], registry=r,
        )  # fmt: skip

    def register_state(self, registry: CollectorRegistry, router: Router) -> None:
        registry.register(_RouterState(lambda: router))


class _RouterState(Collector):
    """In flight and up per endpoint, and the overlap per route key, read at scrape time."""

    def __init__(self, router: Callable[[], Router]) -> None:
        self._router = router

    def collect(self) -> Iterator[GaugeMetricFamily]:
        router = self._router()
        now = router.clock()
        inflight = GaugeMetricFamily("baton_pool_inflight_requests", "Requests in flight per endpoint",
                                     labels=["pool", "endpoint"])  # fmt: skip
        up = GaugeMetricFamily("baton_pool_endpoint_up", "1 while an endpoint takes requests, 0 while ejected",
                               labels=["pool", "endpoint"])  # fmt: skip
        rate = GaugeMetricFamily("baton_pool_prompt_rate_tokens_per_second",
                                 "The prompt rate the cost rule uses per endpoint: measured from streamed first "
                                 "outputs, starting from the pool's prefill_tokens_per_s",
                                 labels=["pool", "endpoint"])  # fmt: skip
        for pool in router.pools.values():
            for e in pool.endpoints:
                inflight.add_metric([pool.name, e.url], e.inflight)
                up.add_metric([pool.name, e.url], 1.0 if e.is_available(now) else 0.0)
                rate.add_metric([pool.name, e.url], e.prompt_rate)
        overlap = GaugeMetricFamily(
            "baton_route_overlap_ratio",
            "Per route key, the token-weighted share of prompt tokens its earlier requests had sent (window)",
            labels=["route_key"],
        )
        for key, row in router.meter.snapshot(limit=64).items():
            if row["overlap"] is not None:
                overlap.add_metric([key], float(row["overlap"]))
        yield inflight
        yield up
        yield rate
        yield overlap
