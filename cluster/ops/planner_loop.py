"""The planner's loop (cluster.ops.planner decides): a sample from the gateway every period, and
each decision applied through a Scaler, one at a time, bounded.

    window = LatencyWindow(frontend.metrics)       TTFT / ITL p90 over the last period
    await run(planner, scaler, lambda: sample_from(frontend, window), period_s, stop)

Scalers: LocalRayScaler (the Fleet's actors, cluster.fleet.fleet) and
cluster.ops.planner_k8s.KubeRayScaler (the RayCluster's worker groups).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from prometheus_client import Histogram

from cluster.ops.metrics import EdgeMetrics
from cluster.ops.node_status import NodeStatus
from cluster.ops.planner import QUANTILE, Decision, Planner, Role, Sample

logger = logging.getLogger(__name__)


# -- samples from the gateway ---------------------------------------------------------------------

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last


def bucket_counts(hist: Histogram) -> Buckets:
    """A Histogram's cumulative bucket counts as it reads now."""
    out = [(float(s.labels["le"]), s.value) for m in hist.collect() for s in m.samples if s.name.endswith("_bucket")]
    return tuple(sorted(out))


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the q-th observation falls in;
    the first bucket starts at 0; one in +Inf reads as the highest finite bound. None: empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(buckets):
        if count >= rank and count > below:
            if math.isinf(upper):
                return buckets[i - 1][0] if i > 0 else None
            if i == 0 and upper <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return buckets[-2][0] if len(buckets) > 1 else None


def _difference(now: Buckets, before: Buckets) -> Buckets:
    if len(now) != len(before) or now[-1][1] < before[-1][1]:
        return now  # a histogram that restarted: all of it is new
    return tuple((le, n - b) for (le, n), (_, b) in zip(now, before, strict=True))


class WindowRead(NamedTuple):
    ttft_p90_s: float | None
    itl_p90_s: float | None
    requests: int


class LatencyWindow:
    """The gateway's TTFT and ITL histograms and finished requests since the previous read()."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self.metrics = metrics
        self._ttft = bucket_counts(metrics.ttft)
        self._itl = bucket_counts(metrics.itl)
        self._requests = sum(metrics.outcomes().values())

    def read(self) -> WindowRead:
        ttft, itl = bucket_counts(self.metrics.ttft), bucket_counts(self.metrics.itl)
        requests = sum(self.metrics.outcomes().values())
        out = WindowRead(histogram_quantile(QUANTILE, _difference(ttft, self._ttft)),
                         histogram_quantile(QUANTILE, _difference(itl, self._itl)),
                         requests - self._requests if requests >= self._requests else requests)  # fmt: skip
        self._ttft, self._itl, self._requests = ttft, itl, requests
        return out


class Gateway(Protocol):
    """What sample_from reads (cluster.edge.frontend.Frontend)."""

    async def nodes(self) -> list[NodeStatus]: ...


async def sample_from(frontend: Gateway, window: LatencyWindow, now: float | None = None) -> Sample:
    """One sample: the window since the last one and every node as the gateway sees it now."""
    read = window.read()
    nodes = tuple(await frontend.nodes())
    return Sample(time.monotonic() if now is None else now, read.ttft_p90_s, read.itl_p90_s, read.requests, nodes)


# -- applying decisions ---------------------------------------------------------------------------


class Scaler(Protocol):
    async def add(self, role: Role) -> str:
        """Start one worker of `role`; its name, or "" when the platform names it later."""
        ...

    async def remove(self, role: Role, victim: str) -> None:
        """Drain `victim` (no new work, what it runs finishes), then stop it."""
        ...


class WorkerPool(Protocol):
    """The gateway's side of its actors (cluster.fleet.fleet.Fleet)."""

    async def add_worker(self, role: str) -> str: ...

    async def drain_worker(self, name: str) -> object: ...


class LocalRayScaler:
    """Ray actors started and stopped by the gateway itself (`baton up --prefill P --decode D`)."""

    def __init__(self, front: WorkerPool) -> None:
        self.front = front

    async def add(self, role: Role) -> str:
        return await self.front.add_worker(role)

    async def remove(self, role: Role, victim: str) -> None:
        await self.front.drain_worker(victim)


async def run(
    planner: Planner, scaler: Scaler, sample_fn: Callable[[], Awaitable[Sample]], period_s: float,
    stop_event: asyncio.Event, action_timeout_s: float = 900.0, max_samples: int | None = None,
    sample_timeout_s: float | None = None,
) -> list[Decision]:
    """Sample every period_s until stop_event (or max_samples), act on each decision; returns the
    decisions the scaler carried out. A sample that fails or takes past sample_timeout_s (None:
    period_s) is skipped; an action that fails or takes past action_timeout_s is logged and backs
    off (Planner.failed). Cancelling the task stops it at once."""
    done: list[Decision] = []
    taken = 0
    while not stop_event.is_set() and (max_samples is None or taken < max_samples):
        taken += 1
        try:
            sample = await asyncio.wait_for(sample_fn(), period_s if sample_timeout_s is None else sample_timeout_s)
        except Exception as exc:
            logger.warning("planner: no sample this period: %r", exc)
        else:
            decision = planner.observe(sample)
            if decision is not None and await _apply(planner, scaler, decision, action_timeout_s):
                done.append(decision)
        if max_samples is not None and taken >= max_samples:
            break
        try:
            await asyncio.wait_for(stop_event.wait(), period_s)
        except TimeoutError:
            pass
    return done


async def _apply(planner: Planner, scaler: Scaler, decision: Decision, timeout_s: float) -> bool:
    logger.info("planner: %s %s%s: %s", decision.action, decision.role,
                f" {decision.victim}" if decision.victim else "", decision.reason)  # fmt: skip
    try:
        async with asyncio.timeout(timeout_s):
            if decision.action == "add":
                name = await scaler.add(decision.role)
            else:
                assert decision.victim is not None
                await scaler.remove(decision.role, decision.victim)
                name = decision.victim
    except Exception:
        logger.exception("planner: %s %s failed; backing off", decision.action, decision.role)
        planner.failed(decision)
        return False
    planner.applied(decision, name)
    return True
