"""Prometheus metrics of the serving edge (one registry per server; the full per-node set
arrives with the operations work). Names follow Prometheus conventions."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.engine import Engine
from kvcache.events import Tier

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "baton_requests_total", "Requests by API and outcome", ["api", "outcome"], registry=r
        )
        self.tenant_tokens = Counter(
            "baton_tenant_tokens_total", "Tokens per tenant: prompt, cached, generated",
            ["tenant", "kind"], registry=r,
        )
        self.ttft = Histogram("baton_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_itl_seconds", "Inter-token latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "baton_request_duration_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.waiting = Gauge("baton_queue_waiting_requests", "Admitted requests without a first token", registry=r)
        self.inflight = Gauge("baton_inflight_requests", "Admitted, unfinished requests", registry=r)
        self.running = Gauge("baton_running_batch", "Requests in the engine's running batch", registry=r)
        self.pages_used = Gauge("baton_kv_pages_used", "KV pages held by requests", ["tier"], registry=r)
        self.pages_cached = Gauge("baton_kv_pages_cached", "KV pages held only by the prefix cache", ["tier"], registry=r)
        self.pages_total = Gauge("baton_kv_pages_total", "KV pages in the pool", ["tier"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def outcomes(self) -> dict[str, int]:
        """Finished requests by outcome, every API together (GET /status)."""
        totals: dict[str, int] = {}
        for family in self.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels["outcome"]
                    totals[outcome] = totals.get(outcome, 0) + int(sample.value)
        return totals

    def watch_engine(self, engine: Engine) -> None:
        self.registry.register(_CacheCollector(engine))


class _CacheCollector(Collector):
    """The prefix cache's own counters, read at scrape time (no copies kept in step)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        cache = self.engine.prefix_cache
        if cache is None:
            return
        st = cache.stats
        yield CounterMetricFamily("baton_prefix_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=st.query_tokens)
        yield CounterMetricFamily("baton_prefix_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=st.hit_tokens)
        hits = CounterMetricFamily("baton_prefix_hit_pages", "Pages reused, by the tier they came from",
                                   labels=["tier"])
        for tier in Tier:
            hits.add_metric([tier.name.lower()], st.hit_pages_by_tier[tier])
        yield hits
        moves = CounterMetricFamily("baton_kv_page_moves", "Pages evicted, demoted and promoted", labels=["kind"])
        for kind, value in (("evicted", st.evicted_pages), ("demoted", st.demoted_pages),
                            ("promoted", st.promoted_pages)):
            moves.add_metric([kind], value)
        yield moves
        yield CounterMetricFamily("baton_kv_failed_reads", "Lower-tier pages that could not be read back",
                                  value=st.failed_reads)
        if cache.host is not None:
            host = GaugeMetricFamily("baton_kv_host_pages", "Host-tier pages", labels=["state"])
            host.add_metric(["free"], cache.host.num_free)
            host.add_metric(["total"], cache.host.num_pages)
            yield host
        if cache.disk is not None:
            disk = cache.disk.stats()
            yield GaugeMetricFamily("baton_kv_disk_records", "Durable disk-tier records", value=disk.records)
            yield CounterMetricFamily("baton_kv_corrupt_records", "Disk records dropped as corrupt",
                                      value=disk.corrupt)
