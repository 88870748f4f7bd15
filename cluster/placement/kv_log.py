"""A worker actor's KV events, kept for the gateway's GlobalIndex to poll (docs/architecture.md, One request).

    log = KVEventLog(engine.prefix_cache, epoch)   the cache publishes into it from now on
    log.events(after_seq, limit)                   the next events, oldest first (a bounded batch)
    log.snapshot()                                 (epoch, seq, every cached page and its tier)
    log.last_seq                                   for the worker's stats: a gap at the end of
                                                   the stream shows up in the index from it

The log keeps the newest `max_events`; a gateway that fell further behind sees a gap in the
sequence numbers and asks for a snapshot (GlobalIndex.apply / observe_seq), so nothing is
lost for good. Events carry the cache's worker id ("local"): the gateway names the worker.
"""

from __future__ import annotations

from collections import deque

from kvcache.events import KVEvent, Tier
from kvcache.radix import PrefixCache

MAX_EVENTS = 16384  # kept in the actor for the gateway to poll
MAX_BATCH = 1024  # events per kv_events call


class KVEventLog:
    def __init__(self, cache: PrefixCache | None, epoch: int, max_events: int = MAX_EVENTS) -> None:
        self.cache = cache
        self.epoch = epoch
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        if cache is not None:
            cache.epoch = epoch
            cache.on_event = self._events.append

    def set_epoch(self, epoch: int) -> None:
        """A new registration: events from now on carry it, and the index reloads on seeing it."""
        self.epoch = epoch
        if self.cache is not None:
            self.cache.epoch = epoch

    @property
    def last_seq(self) -> int:
        return self._events[-1].seq if self._events else 0

    def events(self, after_seq: int, limit: int = MAX_BATCH) -> tuple[KVEvent, ...]:
        """Up to `limit` events with seq > after_seq, oldest first (those still kept)."""
        if not self._events or self._events[-1].seq <= after_seq:
            return ()
        start = max(0, after_seq - self._events[0].seq + 1)  # seqs are consecutive in the log
        return tuple(self._events[i] for i in range(start, min(len(self._events), start + limit)))

    def snapshot(self) -> tuple[int, int, list[tuple[bytes, Tier]]]:
        if self.cache is None:
            return self.epoch, 0, []
        seq, entries = self.cache.snapshot()
        return self.epoch, seq, entries
