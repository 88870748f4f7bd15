"""Prometheus metrics of the serving edge (one registry per server); the per-node families are
cluster.ops.node_status's, the transfer ones cluster.fleet.transfer_metrics's. Every name is in the table
of docs/metrics.md (tests/cluster/test_metrics_catalog.py keeps the two in step)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no *_created series: they double the families and no dashboard reads them

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LOOP_LAG_PERIOD_S = 0.1


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
        self.admission_rejected = Counter(
            "baton_admission_rejected_total", "Requests refused by admission's queue bounds, by SLO class",
            ["slo_class"], registry=r,
        )
        self.ttft = Histogram("baton_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_itl_seconds", "Inter-token latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "baton_request_duration_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.waiting = Gauge("baton_queue_waiting_requests", "Admitted requests without a first token", registry=r)
        self.inflight = Gauge("baton_inflight_requests", "Admitted, unfinished requests (and calls to external pools)",
                              registry=r)  # fmt: skip
        self.running = Gauge("baton_running_batch", "Requests in the engine's running batch", registry=r)
        self.pages_used = Gauge("baton_kv_pages_used", "KV pages held by requests", ["tier"], registry=r)
        self.pages_cached = Gauge("baton_kv_pages_cached", "KV pages held only by the prefix cache", ["tier"], registry=r)
        self.pages_total = Gauge("baton_kv_pages", "KV pages in the pool", ["tier"], registry=r)
        self.loop_lag = Histogram(
            "baton_event_loop_lag_seconds", "How late the gateway's event loop woke a timer (sampled every 0.1 s)",
            buckets=_LAG_BUCKETS, registry=r,
        )

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


async def watch_loop_lag(metrics: EdgeMetrics, period_s: float = LOOP_LAG_PERIOD_S) -> None:
    """Observe, every `period_s`, how much later than asked the event loop woke this task: the
    time every request's callbacks waited behind other work (a blocking call, a long parse)."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(period_s)
        metrics.loop_lag.observe(max(0.0, time.monotonic() - asked - period_s))
