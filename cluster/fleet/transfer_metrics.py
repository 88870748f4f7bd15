"""Prometheus metrics of disaggregated serving, on the gateway's /metrics.

Transfers (bytes, seconds, outcome, per transport) are observed from the TransferReport each
push returns; pinned, reserved and in-flight figures come from the stats the actors report
(decode: with every output batch; prefill: the gateway's health poll), read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.fleet.workers import DecodeHandle, PrefillHandle
from kvcache.retained import RELEASE_REASONS
from kvtransfer.jobs import TransferReport

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BYTES = tuple(float(1 << k) for k in range(12, 32, 2))  # 4 KiB .. 1 GiB


class Workers(Protocol):
    @property
    def prefills(self) -> Sequence[PrefillHandle]: ...

    @property
    def decodes(self) -> Sequence[DecodeHandle]: ...

    @property
    def num_member_events(self) -> dict[str, int]: ...


class TransferMetrics:
    def __init__(self) -> None:
        self.transfers = Counter(
            "baton_kv_transfers_total", "KV transfers by transport and outcome", ["transport", "outcome"], registry=None
        )
        self.bytes = Counter("baton_kv_transfer_bytes_total", "KV payload bytes moved", ["transport"], registry=None)
        self.seconds = Histogram(
            "baton_kv_transfer_seconds", "Time of one KV push, first chunk to ack", ["transport"],
            buckets=_SECONDS, registry=None,
        )  # fmt: skip
        self.size = Histogram(
            "baton_kv_transfer_size_bytes", "Payload bytes of one KV push", ["transport"], buckets=_BYTES, registry=None
        )
        self.failures = Counter(
            "baton_kv_transfer_failures_total", "Failed transfers and prefills, by reason", ["reason"], registry=None
        )
        self.redispatches = Counter(
            "baton_redispatches_total", "Requests sent down another path after a failure", ["to"], registry=None
        )
        self.migrations = Counter(
            "baton_request_migrations", "Requests moved to another decode worker after theirs was lost", registry=None
        )
        # KV-preserving failover: a migrated request's context (prompt + tokens already sent)
        # fetched from a copy -- another worker's ("peer": the prefill worker's retained copy, or
        # any worker the index named), the drained worker's it left ("drained": its hand-off) or
        # the new decode worker's own tiers ("own") -- or recomputed
        self.migrated_tokens = Counter(
            "baton_migration_context_tokens", "Context tokens of migrated requests, fetched or recomputed",
            ["outcome", "source"], registry=None,
        )
        self.resume_seconds = Histogram(
            "baton_migration_resume_seconds", "A migrated request's wait from its worker's loss to its next token",
            buckets=_SECONDS + (30, 60), registry=None,
        )  # fmt: skip
        self.stalls = Counter(
            "baton_worker_stalls", "Workers that answered nothing within the watchdog (their requests moved)",
            ["role"], registry=None,
        )
        self.restarts = Counter(
            "baton_worker_restarts", "Workers that died, were restarted by Ray and rejoined", ["role"], registry=None
        )
        self.pins_reapplied = Counter(
            "baton_pins_reapplied", "Standing pins re-applied to a worker that joined, by what it answered",
            ["role", "outcome"], registry=None,
        )
        self.placements = Counter(
            "baton_placements_total", "Requests by where their prompt was prefilled", ["route"], registry=None
        )
        self.inflight = Gauge("baton_kv_transfers_inflight", "Transfers the gateway is waiting on", registry=None)
        self.given_up = Counter(
            "baton_placement_locality_given_up_pages", "Cached pages of the best holder a placement did not reuse",
            registry=None,
        )
        self.saturated = Counter("baton_placements_saturated", "Requests refused: no decode worker had room",
                                 registry=None)  # fmt: skip

    def observe(self, report: TransferReport) -> None:
        outcome = "ok" if report.accepted else "failed"
        self.transfers.labels(report.transport, outcome).inc()
        if report.accepted:
            self.bytes.labels(report.transport).inc(report.num_bytes)
            self.seconds.labels(report.transport).observe(report.seconds)
            self.size.labels(report.transport).observe(report.num_bytes)

    def register(self, registry: CollectorRegistry, workers: Workers) -> None:
        for metric in (self.transfers, self.bytes, self.seconds, self.size, self.failures, self.redispatches,
                       self.migrations, self.migrated_tokens, self.resume_seconds, self.stalls, self.restarts,
                       self.pins_reapplied, self.placements, self.inflight, self.given_up, self.saturated):
            registry.register(metric)
        registry.register(_WorkerCollector(workers))


class _WorkerCollector(Collector):
    """Per-node transfer figures from the actors' last reported stats (no calls at scrape
    time); up, load and cache by tier are cluster.ops.node_status's baton_node_* families."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pinned = GaugeMetricFamily("baton_kv_pinned_pages", "Prefill pages held for transfers", labels=["node"])
        pushing = GaugeMetricFamily("baton_kv_node_transfers_inflight", "Pushes a prefill worker is sending",
                                    labels=["node"])  # fmt: skip
        lease = CounterMetricFamily("baton_kv_lease_expired", "Held pages released because a lease ended",
                                    labels=["node", "role"])  # fmt: skip
        reserved = GaugeMetricFamily("baton_kv_reserved_pages", "Decode pages reserved for transfers",
                                     labels=["node"])  # fmt: skip
        expired = CounterMetricFamily("baton_kv_reservations_expired", "Reservations whose transfer deadline passed",
                                      labels=["node"])  # fmt: skip
        refused = CounterMetricFamily("baton_kv_pushes_refused", "Push chunks refused, by reason",
                                      labels=["node", "reason"])  # fmt: skip
        changes = CounterMetricFamily("baton_membership_changes", "Membership events the gateway followed",
                                      labels=["kind"])  # fmt: skip
        retained = GaugeMetricFamily("baton_kv_retained_pages", "Prefill pages held as retained copies of "
                                     "pushed prompts (KV-preserving failover)", labels=["node"])  # fmt: skip
        let_go = CounterMetricFamily("baton_kv_retained_released", "Retained copies released, by why",
                                     labels=["node", "reason"])  # fmt: skip
        kept = CounterMetricFamily("baton_kv_kept_pages", "Verified pages of failed transfers a decode worker "
                                   "kept in its prefix cache", labels=["node"])  # fmt: skip
        handed = CounterMetricFamily("baton_kv_handed_off", "Requests a draining decode worker pushed to another "
                                     "with their pages", labels=["node"])  # fmt: skip
        # A dead worker's last report is not what it holds: its pages went with it (gauges 0).
        for p in self.workers.prefills:
            if p.stats is not None:
                alive = p.is_alive
                pinned.add_metric([p.name], p.stats.num_pinned_pages if alive else 0)
                pushing.add_metric([p.name], p.stats.num_inflight_transfers if alive else 0)
                lease.add_metric([p.name, "prefill"], p.stats.num_lease_expired)
                retained.add_metric([p.name], p.stats.num_retained_pages if alive else 0)
                for reason in RELEASE_REASONS:
                    let_go.add_metric([p.name, reason], p.stats.retained_released.get(reason, 0))
        for d in self.workers.decodes:
            if (s := d.stats) is not None:
                reserved.add_metric([d.name], s.num_reserved_pages if d.is_alive else 0)
                expired.add_metric([d.name], s.num_expired)
                lease.add_metric([d.name, "decode"], s.num_lease_expired)
                kept.add_metric([d.name], s.num_kept_pages)
                handed.add_metric([d.name], s.num_handed_off)
                for reason, n in (("token", s.refused_bad_token), ("epoch", s.refused_stale_epoch),
                                  ("page", s.refused_bad_page), ("aborted", s.refused_aborted)):  # fmt: skip
                    refused.add_metric([d.name, reason], n)
        for kind, n in self.workers.num_member_events.items():
            changes.add_metric([kind], n)
        yield from (pinned, pushing, lease, reserved, expired, refused, changes, retained, let_go, kept, handed)
