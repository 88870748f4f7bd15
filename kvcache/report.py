"""One engine's KV cache at a glance, by tier: what a worker reports to the gateway for
`baton status`, the /status page and the per-node Prometheus families (cluster/ops/node_status.py).

    report = cache_report(engine.pool.pages, engine.prefix_cache, page_size)

Counters are cumulative since the engine started (a dashboard takes rates). Hits are
token-weighted per tier: the prefix cache reuses whole pages, so a tier's hit tokens are its
reused pages x page_size; `hit_tokens` (all tiers) is the exact count the scheduler recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache.events import Tier

if TYPE_CHECKING:  # the gateway reports nodes without torch
    from kvcache.pool import PagePool
    from kvcache.radix import PrefixCache


@dataclass(frozen=True, slots=True)
class TierReport:
    tier: str  # device, host, disk
    pages_total: int
    pages_used: int  # held by running requests (device only; lower tiers hold cache only)
    pages_cached: int  # in the prefix cache (on the device some may be shared with running requests)
    hit_tokens: int  # prompt tokens served from this tier (whole pages)

    @property
    def pages_free(self) -> int:
        return max(self.pages_total - self.pages_used - self.pages_cached, 0)


@dataclass(frozen=True, slots=True)
class CacheReport:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from the cache (any tier)
    tiers: tuple[TierReport, ...] = ()
    evicted_pages: int = 0
    demoted_pages: int = 0
    promoted_pages: int = 0
    failed_reads: int = 0
    corrupt_records: int = 0

    def tier(self, name: str) -> TierReport | None:
        return next((t for t in self.tiers if t.tier == name), None)


def cache_report(pool: PagePool, cache: PrefixCache | None, page_size: int) -> CacheReport:
    """Read on the thread that steps the engine (the structures are not locked)."""
    cached = cache.num_cached_pages if cache is not None else 0
    if cache is None:
        device = TierReport("device", pool.num_pages, pool.num_used, 0, 0)
        return CacheReport(tiers=(device,))
    st = cache.stats
    hits = st.hit_pages_by_tier
    tiers = [TierReport("device", pool.num_pages, pool.num_used - cached, cached, hits[Tier.DEVICE] * page_size)]
    if cache.host is not None:
        host = cache.host
        tiers.append(TierReport("host", host.num_pages, 0, host.num_pages - host.num_free, hits[Tier.HOST] * page_size))
    corrupt = 0
    if cache.disk is not None:
        disk = cache.disk.stats()
        corrupt = disk.corrupt
        tiers.append(TierReport("disk", cache.disk.capacity_pages, 0, disk.records, hits[Tier.DISK] * page_size))
    return CacheReport(
        query_tokens=st.query_tokens, hit_tokens=st.hit_tokens, tiers=tuple(tiers), evicted_pages=st.evicted_pages,
        demoted_pages=st.demoted_pages, promoted_pages=st.promoted_pages, failed_reads=st.failed_reads,
        corrupt_records=corrupt,
    )  # fmt: skip
