"""Which (prefill, decode) pairs can move pages, as the gateway has seen it: a failed transfer
falls back quietly (the request is re-dispatched and completes), so without this a pair whose
every transfer fails would look healthy everywhere but in a failure counter.

    pairs.routed(routes)           cluster.fleet.launch.route's result: transport and hosts per pair; a
                                   pair that cannot work (a loopback address across nodes) is
                                   unroutable from the start
    pairs.can_route(p, d)          placement asks before it sends a prefill down a pair
    pairs.succeeded(p, d) / failed(p, d, reason)    each transfer's outcome

A pair is unroutable after `max_failures` consecutive failed transfers: placement skips it
(the next prefill worker, then decode-local prefill), and a warning, /status, `baton status`
and baton_kv_pair_unroutable name it. Every `retry_s` one request probes it again; its success
makes the pair routable. A pair unroutable by its route stays so until it is routed again
(the worker restarts or rejoins): retrying an unreachable address cannot succeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PairRoute:
    """How one prefill worker reaches one decode worker (cluster.fleet.launch.route)."""

    prefill: str  # worker names
    decode: str
    transport: str  # grpc, shm or nccl; "" when pages cannot move (error says why)
    prefill_host: str = ""  # each worker's node address
    decode_host: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class PairView:
    """One pair in /status."""

    prefill: str
    decode: str
    transport: str
    prefill_host: str
    decode_host: str
    routable: bool
    failures: int  # consecutive, now
    total_failures: int
    transfers: int  # that succeeded
    reason: str  # the last failure's


@dataclass(slots=True)
class _Pair:
    route: PairRoute
    failures: int = 0
    total_failures: int = 0
    transfers: int = 0
    reason: str = ""
    is_unroutable: bool = False
    retry_at: float | None = None  # None: no probes (its route cannot work)


class PairHealth:
    def __init__(self, max_failures: int = 3, retry_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.max_failures = max_failures
        self.retry_s = retry_s
        self.clock = clock
        self._pairs: dict[tuple[str, str], _Pair] = {}

    def routed(self, routes: Iterable[PairRoute]) -> None:
        """A fresh route starts its pair over (a worker restarted or joined)."""
        for route in routes:
            pair = _Pair(route)
            if route.error:
                pair.is_unroutable, pair.reason = True, route.error
                logger.error("KV pair %s -> %s is unroutable: %s", route.prefill, route.decode, route.error)
            self._pairs[route.prefill, route.decode] = pair

    def forget(self, worker: str) -> None:
        for key in [k for k in self._pairs if worker in k]:
            del self._pairs[key]

    def can_route(self, prefill: str, decode: str) -> bool:
        """True for a healthy (or unknown) pair; for an unroutable one, True once per retry_s:
        that request probes it."""
        pair = self._pairs.get((prefill, decode))
        if pair is None or not pair.is_unroutable:
            return True
        now = self.clock()
        if pair.retry_at is None or now < pair.retry_at:
            return False
        pair.retry_at = now + self.retry_s
        logger.info("probing unroutable KV pair %s -> %s", prefill, decode)
        return True

    def succeeded(self, prefill: str, decode: str) -> None:
        pair = self._pairs.get((prefill, decode))
        if pair is None:
            return
        pair.transfers += 1
        pair.failures = 0
        if pair.is_unroutable:
            pair.is_unroutable, pair.retry_at = False, None
            logger.warning("KV pair %s -> %s is routable again", prefill, decode)

    def failed(self, prefill: str, decode: str, reason: str) -> None:
        pair = self._pairs.get((prefill, decode))
        if pair is None:
            return
        pair.failures += 1
        pair.total_failures += 1
        pair.reason = reason
        if pair.is_unroutable:
            return  # a probe failed: the next one in retry_s
        if pair.failures >= self.max_failures:
            pair.is_unroutable, pair.retry_at = True, self.clock() + self.retry_s
            r = pair.route
            logger.error("KV pair %s (%s) -> %s (%s) is unroutable after %d failed %s transfers (last: %s); its "
                         "requests prefill elsewhere, a probe every %.0f s", prefill, r.prefill_host or "?", decode,
                         r.decode_host or "?", pair.failures, r.transport, reason, self.retry_s)  # fmt: skip

    def hosts(self) -> dict[str, str]:
        """Each routed worker's node address."""
        out: dict[str, str] = {}
        for pair in self._pairs.values():
            out[pair.route.prefill] = pair.route.prefill_host
            out[pair.route.decode] = pair.route.decode_host
        return out

    def views(self) -> list[PairView]:
        return [PairView(p.route.prefill, p.route.decode, p.route.transport, p.route.prefill_host,
                         p.route.decode_host, not p.is_unroutable, p.failures, p.total_failures, p.transfers, p.reason)
                for _, p in sorted(self._pairs.items())]  # fmt: skip


@runtime_checkable
class ReportsPairs(Protocol):
    """An engine side whose workers move pages between them (RayFront)."""

    @property
    def pairs(self) -> PairHealth: ...


class PairCollector(Collector):
    """baton_kv_pair_* at scrape time, from the gateway's PairHealth (no calls to workers)."""

    def __init__(self, pairs: PairHealth) -> None:
        self.pairs = pairs

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = GaugeMetricFamily("baton_kv_pair_info", "A (prefill, decode) pair's transport and the nodes' hosts",
                                 labels=["prefill", "decode", "transport", "prefill_host", "decode_host"])  # fmt: skip
        unroutable = GaugeMetricFamily("baton_kv_pair_unroutable",
                                       "1 while a pair's transfers fail and placement avoids it",
                                       labels=["prefill", "decode"])  # fmt: skip
        failures = CounterMetricFamily("baton_kv_pair_failures", "Failed transfers of a (prefill, decode) pair",
                                       labels=["prefill", "decode"])  # fmt: skip
        for v in self.pairs.views():
            info.add_metric([v.prefill, v.decode, v.transport, v.prefill_host, v.decode_host], 1)
            unroutable.add_metric([v.prefill, v.decode], 0 if v.routable else 1)
            failures.add_metric([v.prefill, v.decode], v.total_failures)
        yield from (info, unroutable, failures)
