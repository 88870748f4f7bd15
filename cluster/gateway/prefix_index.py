"""Which endpoint holds which prefix: the cluster-wide index (cluster.placement.global_index)
over the gateway's endpoints, fed two ways into one structure the cost rule reads, and a third,
short-lived guess kept beside it.

    precise      an engine that publishes KV events (vLLM's, cluster.gateway.kv_events) says
                 what it stored and removed: `stored` / `removed` / `cleared` (a PageSink)
    approximate  for the rest, what the gateway itself sent there (`sent`), as SGLang's router
                 and llm-d's approximate mode do: an endpoint is assumed to hold a prompt's
                 pages for `ttl_s` after it was sent them, at most `max_pages` such pages in
                 all (the oldest forgotten first)
    expected     and for a publisher, what it was just sent (`expect`), until its events say
                 the pages are stored (or `expect_s` passes): a burst sharing a prefix is routed
                 before the first prompt's events come back, and would otherwise be spread over
                 the pool, each endpoint computing the prefix (llm-d's speculative indexing)

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


EXPECT_S = 10.0  # a publisher's prompt pages count as held this long after they were sent, unless
# its events come first: a prefill of a few thousand tokens and the event's way back, with room


class PrefixIndex:
    def __init__(self, max_pages: int = 1 << 20, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, expect_s: float = EXPECT_S) -> None:  # fmt: skip
        self._index = GlobalIndex(max_pages)
        self.ttl_s = ttl_s
        self.expect_s = expect_s
        self.max_pages = max_pages
        self._clock = clock
        self._seq: dict[str, int] = {}
        # approximate entries: (endpoint, page) -> when sent, oldest first
        self._sent: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        # a publisher's pages sent and not yet in its events: (endpoint, page) -> when, oldest first
        self._expected: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self.num_expired = 0

    def add_endpoint(self, endpoint: str) -> None:
        if endpoint not in self._seq:
            self._index.load_snapshot(endpoint, _EPOCH, 0, ())  # live at once, empty
            self._seq[endpoint] = 0

    # -- the precise feed (cluster.gateway.kv_events.PageSink) ------------------------------

    def stored(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self._unexpect(endpoint, page_hashes)  # the engine said so: no longer a guess
        self._event(endpoint, EventKind.STORED, page_hashes, tier)

    def removed(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self._unexpect(endpoint, page_hashes)
        self._event(endpoint, EventKind.REMOVED, page_hashes, tier)

    def cleared(self, endpoint: str) -> None:
        for key in [k for k in self._expected if k[0] == endpoint]:
            del self._expected[key]
        self._index.load_snapshot(endpoint, _EPOCH, self._seq.get(endpoint, 0), ())

    def expect(self, endpoint: str, page_hashes: Sequence[bytes]) -> None:
        """The gateway sent `endpoint`, which publishes its own events, a prompt with these
        pages: count them as held until its events say stored or removed, or `expect_s` passes.
        Kept apart from the index, so that a guess that expires never removes a page the
        events put there."""
        now = self._clock()
        held = self._index.match(page_hashes).hit(endpoint).num_pages if endpoint in self._seq else 0
        for h in page_hashes[held:]:  # past what its events already said it holds
            key = (endpoint, h)
            self._expected[key] = now
            self._expected.move_to_end(key)
        while len(self._expected) > self.max_pages:
            self._expected.popitem(last=False)

    def _unexpect(self, endpoint: str, page_hashes: Sequence[bytes]) -> None:
        if self._expected:
            for h in page_hashes:
                self._expected.pop((endpoint, h), None)

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
        now = self._clock()
        while self._expected:
            _, at = next(iter(self._expected.items()))
            if at > now - self.expect_s:
                break
            self._expected.popitem(last=False)
        cutoff = now - self.ttl_s
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
        """Per endpoint, the prompt's leading pages it holds (or is assumed to: pages sent to a
        publisher and not yet in its events continue its run, as device pages)."""
        self.expire()
        found = self._index.match(page_hashes)
        out = {e: found.hit(e) if e in self._seq else NO_HIT for e in endpoints}
        if self._expected:
            for e, hit in out.items():
                n = hit.num_pages
                while n < len(page_hashes) and (e, page_hashes[n]) in self._expected:
                    n += 1
                if n > hit.num_pages:
                    out[e] = hit._replace(num_device=hit.num_device + n - hit.num_pages)
        return out

    @property
    def num_expected(self) -> int:
        """Pages sent to publishers that their events have not yet confirmed (nor expired)."""
        self.expire()
        return len(self._expected)

    @property
    def num_pages(self) -> int:
        return self._index.num_pages

    def _event(self, endpoint: str, kind: EventKind, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self.add_endpoint(endpoint)
        self._seq[endpoint] += 1
        self._index.apply(KVEvent(endpoint, _EPOCH, self._seq[endpoint], kind, tuple(page_hashes), tier))
