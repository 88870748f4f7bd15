"""Every engine behind a gateway, one NodeStatus each: the source of `baton status`, the
`GET /status` JSON the /dashboard page polls, and the per-node Prometheus families
(`baton_node_*{node, role, tier}`), so the three can never disagree.

    nodes = await collect_nodes(front)     colocated: one "engine-0"; in-process PD: "prefill-0"
                                           and "decode-0"; Ray: every actor the gateway knows,
                                           from the stats it already polls (no calls here)

A node's `health`: "ok"; "down" (the gateway lost it: a failed call, a dead actor);
"left" (alive, but not in membership: its lease ran out or it drained; no new work goes there);
"starting" (no stats reported yet); "stalled" (an in-process engine's step thread did not
answer within READ_TIMEOUT_S). Cache counters are cumulative (kvcache.report).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine
from engine.kernel_info import EngineKernels
from kvcache.report import CacheReport, cache_report

if TYPE_CHECKING:
    from engine.engine import Engine

TIERS = ("device", "host", "disk")
KERNEL_LABELS = ("attention", "linear", "decode_step", "isa", "kv_dtype", "device")  # EngineKernels' fields
READ_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class NodeStatus:
    name: str  # the gateway's name for the worker (prefill-0, decode-1, engine-0)
    role: str  # prefill, decode, colocated
    health: str  # ok, down, left, starting
    epoch: int = 0  # its membership registration (0: none)
    running: int = 0  # requests in its batch (prefill: prompts being computed)
    waiting: int = 0  # requests queued on it
    pending_tokens: int = 0  # prefill: prompt tokens queued or being computed
    reserved_pages: int = 0  # decode: held for incoming transfers
    pinned_pages: int = 0  # prefill: held until a transfer is acknowledged
    transfers: int = 0  # prefill: pushes sent
    failed_transfers: int = 0
    cache: CacheReport = CacheReport()
    age_s: float = 0.0  # since its last report
    preemptions: int = 0  # requests its engine preempted (recomputed later) since start
    host: str = ""  # its node's address (Ray's node IP); "" in one process
    pid: int = 0  # its process, as it last said (0: not known)
    retained_pages: int = 0  # prefill: held as retained copies of pushed prompts (KV-preserving failover)
    kernels: EngineKernels = EngineKernels()  # what its engine runs on (engine.kernel_info)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache"]["tiers"] = {t["tier"]: t for t in d["cache"]["tiers"]}
        for t in d["cache"]["tiers"].values():
            del t["tier"]
        return d


@runtime_checkable
class ReportsNodes(Protocol):
    """An engine side that knows its workers itself (RayFront)."""

    def nodes(self) -> list[NodeStatus]: ...


@runtime_checkable
class ReadsNodes(Protocol):
    """An engine side whose engines run in this process, read on their step threads (PDFront)."""

    async def read_nodes(self) -> list[NodeStatus]: ...


async def collect_nodes(front: object) -> list[NodeStatus]:
    if isinstance(front, ReportsNodes):
        return front.nodes()
    if isinstance(front, ReadsNodes):
        return await front.read_nodes()
    if isinstance(front, AsyncEngine):
        return [await engine_node("engine-0", "colocated", front)]
    return []


async def engine_node(name: str, role: str, stepper: AsyncEngine) -> NodeStatus:
    """An in-process engine's status, read on its step thread (the structures are unlocked)."""
    if not stepper.is_alive:
        return NodeStatus(name, role, "down")
    start = time.monotonic()
    try:
        running, waiting, report, preempted, kernels = await asyncio.wait_for(stepper.call(_read_engine),
                                                                              READ_TIMEOUT_S)  # fmt: skip
    except TimeoutError:
        return NodeStatus(name, role, "stalled", age_s=time.monotonic() - start)
    return NodeStatus(name, role, "ok", running=running, waiting=waiting, cache=report,
                      age_s=time.monotonic() - start, preemptions=preempted, kernels=kernels)  # fmt: skip


def _read_engine(engine: Engine) -> tuple[int, int, CacheReport, int, EngineKernels]:
    return (len(engine.scheduler.running), engine.scheduler.num_waiting,
            cache_report(engine.pool.pages, engine.prefix_cache, engine.cfg.page_size),
            engine.num_preempted_total, engine.kernels)  # fmt: skip


class NodeCollector(Collector):
    """The per-node families, from a snapshot the gateway refreshes before each scrape."""

    def __init__(self) -> None:
        self.nodes: Sequence[NodeStatus] = ()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["node", "role"]
        up = GaugeMetricFamily("baton_node_up", "1 while the gateway routes work to the node", labels=labels)
        queried = CounterMetricFamily("baton_node_prefix_query_tokens", "Prompt tokens looked up in the node's "
                                      "prefix cache", labels=labels)  # fmt: skip
        hits = CounterMetricFamily("baton_node_prefix_hit_tokens", "Prompt tokens served from the node's prefix "
                                   "cache, by the tier the pages came from", labels=[*labels, "tier"])  # fmt: skip
        pages = GaugeMetricFamily("baton_node_kv_pages", "KV pages per tier: used by requests, cached, free",
                                  labels=[*labels, "tier", "state"])  # fmt: skip
        moves = CounterMetricFamily("baton_node_kv_page_moves", "Pages evicted, demoted and promoted",
                                    labels=[*labels, "kind"])  # fmt: skip
        corrupt = CounterMetricFamily("baton_node_kv_corrupt_records", "Disk-tier records dropped as corrupt",
                                      labels=labels)  # fmt: skip
        failed = CounterMetricFamily("baton_node_kv_failed_reads", "Lower-tier pages that could not be read back",
                                     labels=labels)  # fmt: skip
        preempted = CounterMetricFamily("baton_node_preemptions", "Requests the node's engine preempted "
                                        "(their pages freed, recomputed later)", labels=labels)  # fmt: skip
        requests = GaugeMetricFamily("baton_node_requests", "Requests on the node: running, waiting",
                                     labels=[*labels, "state"])  # fmt: skip
        kernels = GaugeMetricFamily("baton_node_kernels_info", "1, labelled with what the node's engine runs on: "
                                    "attention backend, projections, decode step, ISA, KV dtype, device (engine.kernel_info)",
                                    labels=[*labels, *KERNEL_LABELS])  # fmt: skip
        for n in self.nodes:
            key = [n.name, n.role]
            up.add_metric(key, float(n.health == "ok"))
            c = n.cache
            queried.add_metric(key, c.query_tokens)
            for t in c.tiers:
                hits.add_metric([*key, t.tier], t.hit_tokens)
                for state, value in (("used", t.pages_used), ("cached", t.pages_cached), ("free", t.pages_free)):
                    pages.add_metric([*key, t.tier, state], value)
            for kind, value in (("evicted", c.evicted_pages), ("demoted", c.demoted_pages),
                                ("promoted", c.promoted_pages)):  # fmt: skip
                moves.add_metric([*key, kind], value)
            corrupt.add_metric(key, c.corrupt_records)
            failed.add_metric(key, c.failed_reads)
            preempted.add_metric(key, n.preemptions)
            requests.add_metric([*key, "running"], n.running)
            requests.add_metric([*key, "waiting"], n.waiting)
            if n.kernels.attention:  # not known yet: no sample
                kernels.add_metric([*key, *(getattr(n.kernels, k) for k in KERNEL_LABELS)], 1.0)
        yield from (up, queried, hits, pages, moves, corrupt, failed, preempted, requests, kernels)
