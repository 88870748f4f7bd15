"""A simulated worker's KV cache and the channel its KV events take to the real GlobalIndex
(`baton sim`).

    TieredCache   device and host tiers of bounded pages, least recently used first:
                  store -> STORED (new) / TIER_CHANGED DEVICE (promoted from host)
                  room  -> TIER_CHANGED HOST (device -> host) / REMOVED (host -> gone, or
                           device -> gone with no host tier)
                  every event carries the worker's epoch and the next seq, as kvcache's do
    EventBus      delivers events to the index after `delay_s`, dropping a share `loss` of
                  them; the index finds the gap (the next event, or a heartbeat's seq) and
                  asks for a snapshot, which the bus answers after the same delay

A prompt's pages are touched tail first, so its head is the most recent: eviction takes the
tails of chains before their shared heads, as the radix tree's leaves-first LRU does.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cluster.placement.global_index import GlobalIndex, SnapshotRequest
from kvcache.events import EventKind, KVEvent, Tier

EPOCH = 1


class CacheHit(NamedTuple):
    num_device: int
    num_host: int

    @property
    def num_pages(self) -> int:
        return self.num_device + self.num_host


class TieredCache:
    def __init__(self, worker_id: str, device_pages: int, host_pages: int, emit: Callable[[KVEvent], None]) -> None:
        if device_pages < 0 or host_pages < 0:
            raise ValueError("tier sizes must be >= 0")
        self.worker_id = worker_id
        self.device_capacity = device_pages
        self.host_capacity = host_pages
        self.device: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.seq = 0
        self._emit = emit

    def match(self, hashes: Sequence[bytes], max_pages: int) -> CacheHit:
        """The prompt's leading pages held here, in either tier."""
        device, host = self.device, self.host
        n_dev = n_host = 0
        for h in hashes[:max_pages]:
            if h in device:
                n_dev += 1
            elif h in host:
                n_host += 1
            else:
                break
        return CacheHit(n_dev, n_host)

    def store(self, hashes: Sequence[bytes]) -> None:
        """The pages were computed or used here: on the device, most recent, head last."""
        device, host = self.device, self.host
        stored: list[bytes] = []
        promoted: list[bytes] = []
        for h in reversed(hashes):
            if h in device:
                device.move_to_end(h)
            elif h in host:
                del host[h]
                device[h] = None
                promoted.append(h)
            else:
                device[h] = None
                stored.append(h)
        self._send(EventKind.STORED, stored, Tier.DEVICE)
        self._send(EventKind.TIER_CHANGED, promoted, Tier.DEVICE)
        self.fit()

    def resize(self, device_pages: int) -> None:
        self.device_capacity = max(0, device_pages)
        self.fit()

    def fit(self) -> None:
        """Evict least recently used pages until both tiers are within their capacity."""
        demoted: list[bytes] = []
        dropped: list[bytes] = []
        while len(self.device) > self.device_capacity:  # bounded: the tier shrinks each turn
            h, _ = self.device.popitem(last=False)
            if self.host_capacity:
                self.host[h] = None
                demoted.append(h)
            else:
                dropped.append(h)
        self._send(EventKind.TIER_CHANGED, demoted, Tier.HOST)
        self._send(EventKind.REMOVED, dropped, Tier.DEVICE)
        gone: list[bytes] = []
        while len(self.host) > self.host_capacity:
            h, _ = self.host.popitem(last=False)
            gone.append(h)
        self._send(EventKind.REMOVED, gone, Tier.HOST)

    def snapshot(self) -> list[tuple[bytes, Tier]]:
        return [(h, Tier.DEVICE) for h in self.device] + [(h, Tier.HOST) for h in self.host]

    @property
    def num_pages(self) -> int:
        return len(self.device) + len(self.host)

    def _send(self, kind: EventKind, hashes: list[bytes], tier: Tier) -> None:
        if hashes:
            self.seq += 1
            self._emit(KVEvent(self.worker_id, EPOCH, self.seq, kind, tuple(hashes), tier))


class _Snapshot(NamedTuple):
    worker_id: str
    seq: int
    entries: list[tuple[bytes, Tier]]


class _Heartbeat(NamedTuple):
    worker_id: str
    seq: int


class EventBus:
    """Workers' KV events on their way to the index (delay and loss), and snapshots back."""

    def __init__(self, index: GlobalIndex, delay_s: float = 0.0, loss: float = 0.0,
                 rng: random.Random | None = None) -> None:
        if delay_s < 0 or not 0 <= loss < 1:
            raise ValueError("event delay must be >= 0 and loss in [0, 1)")
        self.index = index
        self.delay_s = delay_s
        self.loss = loss
        self.rng = rng or random.Random(0)
        self.caches: dict[str, TieredCache] = {}
        self.now = 0.0
        self._pending: deque[tuple[float, KVEvent | _Snapshot | _Heartbeat]] = deque()  # in time order
        self._asked: set[str] = set()  # workers with a snapshot on its way
        self.num_events = 0
        self.num_lost = 0
        self.num_snapshots = 0

    def add(self, cache: TieredCache) -> None:
        self.caches[cache.worker_id] = cache
        self.index.load_snapshot(cache.worker_id, EPOCH, cache.seq, cache.snapshot())

    def emit(self, event: KVEvent) -> None:
        self.num_events += 1
        if self.loss and self.rng.random() < self.loss:
            self.num_lost += 1
            return
        self._send(event)

    def heartbeat(self, worker_id: str) -> None:
        """A stats report carries the worker's last seq (how lost trailing events are found)."""
        self._send(_Heartbeat(worker_id, self.caches[worker_id].seq))

    def flush(self, now: float) -> None:
        """Deliver everything due by `now` (a constant delay keeps emission order)."""
        self.now = now
        pending = self._pending
        while pending and pending[0][0] <= now:  # bounded: each item is delivered once
            self._deliver(pending.popleft()[1])

    def _send(self, item: KVEvent | _Snapshot | _Heartbeat) -> None:
        if self.delay_s:
            self._pending.append((self.now + self.delay_s, item))
        else:
            self._deliver(item)

    def _deliver(self, item: KVEvent | _Snapshot | _Heartbeat) -> None:
        index = self.index
        if isinstance(item, KVEvent):
            request = index.apply(item)
        elif isinstance(item, _Heartbeat):
            request = index.observe_seq(item.worker_id, EPOCH, item.seq)
        else:
            self._asked.discard(item.worker_id)
            request = index.load_snapshot(item.worker_id, EPOCH, item.seq, item.entries)
        if request is not None:
            self._ask(request)

    def _ask(self, request: SnapshotRequest) -> None:
        """The worker answers with its cache as of its present seq (one in flight at a time)."""
        if request.worker_id in self._asked:
            return
        cache = self.caches[request.worker_id]
        self._asked.add(request.worker_id)
        self.num_snapshots += 1
        self._send(_Snapshot(request.worker_id, cache.seq, cache.snapshot()))
