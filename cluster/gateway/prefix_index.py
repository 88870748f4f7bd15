"""Which endpoint holds which prefix: the cluster-wide index (cluster.placement.global_index)
over the gateway's endpoints, fed two ways into one structure the cost rule reads.

    precise      an engine that publishes KV events (vLLM's, cluster.gateway.kv_events) says
                 what it stored and removed: `stored` / `removed` / `cleared` (a PageSink)
    approximate  for the rest, what the gateway itself sent there (`sent`), as SGLang's router
                 and llm-d's approximate mode do: an endpoint is assumed to hold a prompt's
                 pages for `ttl_s` after it was sent them, at most `max_pages` such pages in
                 all (the oldest forgotten first)

Page hashes are kvcache.hashing's chained hashes of the route tokens in the endpoint's block
size, with no salt: an external engine's cache is shared by whoever reaches it through the
gateway. Each endpoint is one "worker" of the index, with an epoch that never changes and a
seq the feeds number themselves.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from cluster.placement.global_index import NO_HIT, GlobalIndex, PrefixHit
from kvcache.events import EventKind, KVEvent, Tier

_EPOCH = 1


class PrefixIndex:
    def __init__(self, max_pages: int = 1 << 20, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._index = GlobalIndex(max_pages)
        self.ttl_s = ttl_s
        self.max_pages = max_pages
        self._clock = clock
        self._seq: dict[str, int] = {}
        # approximate entries: (endpoint, page) -> when sent, oldest first
        self._sent: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self.num_expired = 0

    def add_endpoint(self, endpoint: str) -> None:
        if endpoint not in self._seq:
            self._index.load_snapshot(endpoint, _EPOCH, 0, ())  # live at once, empty
            self._seq[endpoint] = 0

    # -- the precise feed (cluster.gateway.kv_events.PageSink) ------------------------------

    def stored(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self._event(endpoint, EventKind.STORED, page_hashes, tier)

    def removed(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self._event(endpoint, EventKind.REMOVED, page_hashes, tier)

    def cleared(self, endpoint: str) -> None:
        self._index.load_snapshot(endpoint, _EPOCH, self._seq.get(endpoint, 0), ())

    # -- the approximate feed ----------------------------------------------------------------

    def sent(self, endpoint: str, page_hashes: Sequence[bytes]) -> None:
        """The gateway sent `endpoint` a prompt with these pages: assume it holds them a while."""
        self.expire()
        now = self._clock()
        new = []
        for h in page_hashes:
            key = (endpoint, h)
            if key not in self._sent:
                new.append(h)
            self._sent[key] = now
            self._sent.move_to_end(key)
        if new:
            self._event(endpoint, EventKind.STORED, new, Tier.DEVICE)
        while len(self._sent) > self.max_pages:
            (old_endpoint, old), _ = self._sent.popitem(last=False)
            self._event(old_endpoint, EventKind.REMOVED, (old,), Tier.DEVICE)

    def expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        gone: dict[str, list[bytes]] = {}
        while self._sent:
            (endpoint, h), at = next(iter(self._sent.items()))
            if at > cutoff:
                break
            self._sent.popitem(last=False)
            gone.setdefault(endpoint, []).append(h)
        for endpoint, hashes in gone.items():
            self.num_expired += len(hashes)
            self._event(endpoint, EventKind.REMOVED, hashes, Tier.DEVICE)

    # -- lookups ---------------------------------------------------------------------------

    def hits(self, page_hashes: Sequence[bytes], endpoints: Sequence[str]) -> dict[str, PrefixHit]:
        """Per endpoint, the prompt's leading pages it holds (or is assumed to)."""
        self.expire()
        found = self._index.match(page_hashes)
        return {e: found.hit(e) if e in self._seq else NO_HIT for e in endpoints}

    @property
    def num_pages(self) -> int:
        return self._index.num_pages

    def _event(self, endpoint: str, kind: EventKind, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self.add_endpoint(endpoint)
        self._seq[endpoint] += 1
        self._index.apply(KVEvent(endpoint, _EPOCH, self._seq[endpoint], kind, tuple(page_hashes), tier))
