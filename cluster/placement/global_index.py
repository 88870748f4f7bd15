"""The cluster-wide KV index: which worker holds which page, in which tier, learned only from
the workers' KV events (docs/architecture.md, One request, step 2).

    add_worker(id, epoch)      a worker joined: ask it for a snapshot
    apply(event)               STORED / REMOVED / TIER_CHANGED, in the worker's seq order; a
                               gap, or a new epoch, makes the worker stale -> SnapshotRequest
    observe_seq(id, epoch, s)  the worker's heartbeat says its last seq is s: lost trailing
                               events show up as a gap here
    load_snapshot(...)         the worker's whole cache as of seq S replaces its part; events
                               buffered while it was stale and newer than S are replayed
    match(hashes)              per worker: the leading pages of the prompt it holds, by tier
    remove_worker(id)          it left the membership

Layout. Each worker id gets a small slot number; a page hash maps to one int with two bits
per slot (its tier there, or absent):

    bit    ... 7 6 | 5 4 | 3 2 | 1 0
    slot   ...  3  |  2  |  1  |  0          code: 00 absent, 01 device, 10 host, 11 disk

Equal values are interned, and consecutive pages of a chain mostly have the same holders, so a
page costs its dict entry and its 16-byte hash (`memory_bytes()` measures it), and `match`
spends a few big-int operations only where some worker's run changes tier or ends.

Memory bound and eviction (an approximate LRU; the workers evict their own least recently used
pages too): at most `max_pages` pages are indexed. Pages live in up to NUM_GENS generations
(dicts); a generation closes after max_pages // NUM_GENS new pages, and a page moves to the
newest one whenever it is touched: stored, changed tier, or matched by a lookup. Two rules
forget pages:
  - age: opening a generation past NUM_GENS forgets the oldest one, whose pages were not
    touched while (NUM_GENS - 1) generations of new pages arrived;
  - pressure: a new page beyond `max_pages` pushes out one page of the oldest generation
    (within a generation, the one that went in last).
A forgotten page is only a hint lost: a worker still holding it serves it once a request gets
there, and its next event about it indexes it again. Forgotten generations are freed a few
pages per insertion, so no call pays for a whole one; an older generation left sparse by pages
moving up is copied when a generation opens (a dict keeps its peak size through deletions).

Staleness. A worker whose events were lost (a gap) keeps its old entries as hints until its
snapshot arrives; a worker with a new epoch restarted, so its entries are dropped at once.
Events of an older epoch are refused (the epoch is a fencing token). While stale, a worker's
events are buffered (the newest MAX_BUFFERED_EVENTS).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.placement.prefix_match import NO_HIT, PrefixHit, PrefixMatch
from kvcache.events import EventKind, KVEvent, Tier

__all__ = ["NO_HIT", "GlobalIndex", "PrefixHit", "PrefixMatch", "SnapshotRequest", "SyncState"]

NUM_GENS = 8
MAX_BUFFERED_EVENTS = 4096  # per stale worker
MAX_INTERNED = 1 << 16  # distinct holder sets kept for sharing; the table restarts past this
SPARSE_BYTES_PER_PAGE = 256  # an older generation's dict this large per page left is copied
DRAIN_PER_INSERT = 2  # forgotten pages freed per insertion (a generation drains in half a fill)


class SnapshotRequest(NamedTuple):
    worker_id: str
    epoch: int


class SyncState(NamedTuple):
    """How far the index follows a worker: its part is exactly the worker's cache as of event
    `last_seq` of `epoch`, unless `is_stale` (then it waits for a snapshot)."""

    epoch: int
    last_seq: int
    is_stale: bool


@dataclass(slots=True)
class _Worker:
    slot: int
    epoch: int
    last_seq: int = 0
    is_stale: bool = True  # a new worker is stale until its first snapshot
    has_pages: bool = False  # False: clearing its part needs no scan
    pending: deque[KVEvent] = field(default_factory=lambda: deque(maxlen=MAX_BUFFERED_EVENTS))


class GlobalIndex:
    def __init__(self, max_pages: int = 1 << 20) -> None:
        if max_pages < 1:
            raise ValueError("max_pages must be >= 1")
        self.max_pages = max_pages
        num_gens = min(NUM_GENS, max_pages)
        self._num_gens = num_gens
        self._gen_size = max_pages // num_gens
        self._gens: deque[dict[bytes, int]] = deque([{}])  # oldest ... newest
        self._forgotten: list[dict[bytes, int]] = []  # being freed, never looked at
        self._interned: dict[int, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._slots: list[str | None] = []  # slot -> worker id
        self._even = 0  # bit 2s set for every slot s
        self.slots_version = 0  # changes whenever a worker id gets or loses its slot
        self._num_pages = 0
        self._num_new = 0  # new pages indexed since the newest generation opened
        self.num_forgotten_pages = 0  # pages the bound made the index forget

    # -- membership ---------------------------------------------------------------------------

    def add_worker(self, worker_id: str, epoch: int) -> SnapshotRequest | None:
        """A worker (re)joined with `epoch`: ask for its snapshot (None if already known)."""
        worker = self._workers.get(worker_id)
        if worker is not None and epoch <= worker.epoch:
            return None
        return self._restart(worker_id, epoch)

    def remove_worker(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._clear(worker)
        self._slots[worker.slot] = None
        self.slots_version += 1

    def stale_workers(self) -> list[SnapshotRequest]:
        """Workers waiting for a snapshot (to ask again when a request went unanswered)."""
        return [SnapshotRequest(w, s.epoch) for w, s in self._workers.items() if s.is_stale]

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def sync_state(self, worker_id: str) -> SyncState | None:
        worker = self._workers.get(worker_id)
        return None if worker is None else SyncState(worker.epoch, worker.last_seq, worker.is_stale)

    # -- events -------------------------------------------------------------------------------

    def apply(self, event: KVEvent) -> SnapshotRequest | None:
        """Learn one event; a SnapshotRequest when the worker just became stale."""
        worker = self._workers.get(event.worker_id)
        if worker is None or event.epoch > worker.epoch:
            request = self._restart(event.worker_id, event.epoch)
            self._workers[event.worker_id].pending.append(event)
            return request
        if event.epoch < worker.epoch:
            return None  # a previous life's event: fenced off
        if worker.is_stale:
            worker.pending.append(event)
            return None
        if event.seq <= worker.last_seq:
            return None  # a duplicate
        if event.seq > worker.last_seq + 1:  # lost events: ask instead of guessing
            worker.is_stale = True
            worker.pending.append(event)
            return SnapshotRequest(event.worker_id, worker.epoch)
        self._learn(worker, event)
        worker.last_seq = event.seq
        return None

    def observe_seq(self, worker_id: str, epoch: int, seq: int) -> SnapshotRequest | None:
        """A heartbeat carrying the worker's last event seq: events lost at the end of its
        stream (no later event to show the gap) are found here."""
        worker = self._workers.get(worker_id)
        if worker is None or epoch > worker.epoch:
            return self._restart(worker_id, epoch)
        if epoch < worker.epoch or worker.is_stale or seq <= worker.last_seq:
            return None
        worker.is_stale = True
        return SnapshotRequest(worker_id, epoch)

    def load_snapshot(
        self, worker_id: str, epoch: int, seq: int, entries: Iterable[tuple[bytes, Tier]]
    ) -> SnapshotRequest | None:
        """Replace the worker's part by its cache as of event `seq` (one call: no lookup sees
        half of it), then replay the buffered events after `seq`. Returns a SnapshotRequest
        if the worker is still stale afterwards (a gap right after `seq`, or an old snapshot)."""
        worker = self._workers.get(worker_id)
        if worker is not None and epoch < worker.epoch:
            return SnapshotRequest(worker_id, worker.epoch)  # an answer to an older request
        if worker is None or epoch > worker.epoch:
            self._restart(worker_id, epoch)
            worker = self._workers[worker_id]
        else:
            self._clear(worker)
        shift = 2 * worker.slot
        for page_hash, tier in entries:
            self._set(page_hash, shift, tier + 1)
            worker.has_pages = True
        worker.last_seq, worker.is_stale = seq, False
        buffered = sorted(worker.pending, key=lambda e: (e.epoch, e.seq))
        worker.pending.clear()
        request = None
        for event in buffered:
            request = self.apply(event) or request
        if worker.is_stale:
            return request or SnapshotRequest(worker_id, worker.epoch)
        return None

    def _restart(self, worker_id: str, epoch: int) -> SnapshotRequest:
        old = self._workers.get(worker_id)
        if old is not None:  # a new life: its device and host pages are gone
            self._clear(old)
            slot = old.slot
        else:
            slot = self._free_slot(worker_id)
        self._workers[worker_id] = _Worker(slot, epoch)
        return SnapshotRequest(worker_id, epoch)

    def _free_slot(self, worker_id: str) -> int:
        self.slots_version += 1
        for slot, owner in enumerate(self._slots):  # workers join rarely; slots stay dense
            if owner is None:
                self._slots[slot] = worker_id
                return slot
        self._slots.append(worker_id)
        self._even = (4 ** len(self._slots) - 1) // 3  # 0b0101...01
        return len(self._slots) - 1

    def _learn(self, worker: _Worker, event: KVEvent) -> None:
        shift = 2 * worker.slot
        if event.kind == EventKind.REMOVED:
            for page_hash in event.page_hashes:
                self._unset(page_hash, shift)
        else:  # STORED, TIER_CHANGED: the pages are now in event.tier
            for page_hash in event.page_hashes:
                self._set(page_hash, shift, event.tier + 1)
            worker.has_pages = True

    # -- lookups ------------------------------------------------------------------------------

    def match(self, hashes: Sequence[bytes], max_pages: int | None = None) -> PrefixMatch:
        """Every worker's run of the prompt's leading pages, by tier. One walk over the pages,
        stopping where no worker's run goes on, recording only where runs enter or leave a
        tier (as masks of workers); it refreshes the pages it matched (they are in use)."""
        n = len(hashes) if max_pages is None else min(len(hashes), max_pages)
        changes: list[tuple[int, int, int, int]] = []  # (page, tier, entered, left)
        ends: list[tuple[int, int]] = []  # (page, mask): runs that stop before `page`
        alive, prev, cur = 0, -1, [0, 0, 0]  # cur: per tier, bit 2s set while slot s is in it
        newest, even, end = self._gens[-1], self._even, n
        for i in range(n):
            page_hash = hashes[i]
            value = newest.get(page_hash)
            if value is None:
                value = self._refresh(page_hash)
            if value is prev:  # same holders as the page before: no run changes (interned)
                continue
            prev = value
            lo, hi = value & even, (value >> 1) & even
            still = (lo | hi) & (alive if i else even)
            if alive & ~still and i:
                ends.append((i, alive & ~still))
            alive = still
            for tier, new in enumerate((lo & ~hi & alive, hi & ~lo & alive, lo & hi & alive)):
                if new != cur[tier]:
                    changes.append((i, tier, new & ~cur[tier], cur[tier] & ~new))
                    cur[tier] = new
            if not alive:
                end = i
                break
        if alive:
            ends.append((end, alive))
        changes.extend((end, tier, 0, cur[tier]) for tier in range(3) if cur[tier])
        return PrefixMatch(self, changes, ends)

    def bit_of(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else 1 << (2 * worker.slot)

    def mask_of(self, worker_ids: Iterable[str]) -> int:
        """A set of workers as PrefixMatch.ranked takes it; valid while `slots_version` is."""
        mask = 0
        for worker_id in worker_ids:
            mask |= self.bit_of(worker_id)
        return mask

    def worker_of(self, bit: int) -> str:
        owner = self._slots[(bit.bit_length() - 1) // 2]
        assert owner is not None, "a freed slot still has pages"
        return owner

    def worker_pages(self, worker_id: str) -> dict[bytes, Tier]:
        """Every page the index thinks `worker_id` holds (a full scan: tests and status)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return {}
        shift = 2 * worker.slot
        return {h: Tier(((v >> shift) & 3) - 1) for gen in self._gens for h, v in gen.items() if (v >> shift) & 3}

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def memory_bytes(self) -> int:
        """What the index holds, by sys.getsizeof accounting: the generation dicts, the page
        hashes, the distinct holder values, the pages still being forgotten (a scan: for
        benchmarks and status, not the request path)."""
        total = sum(sys.getsizeof(gen) for gen in (*self._gens, *self._forgotten))
        values: dict[int, int] = {}
        for gen in (*self._gens, *self._forgotten):
            for page_hash, value in gen.items():
                total += sys.getsizeof(page_hash)
                values[id(value)] = sys.getsizeof(value)
        total += sum(values.values()) + sys.getsizeof(self._interned)
        return total + sys.getsizeof(self._workers) + sum(sys.getsizeof(w.pending) for w in self._workers.values())

    def bytes_per_page(self) -> float:
        return self.memory_bytes() / max(1, self.num_pages)

    # -- storage ------------------------------------------------------------------------------

    def _find(self, page_hash: bytes) -> tuple[int, dict[bytes, int]] | None:
        for gen in reversed(self._gens):
            value = gen.get(page_hash)
            if value is not None:
                return value, gen
        return None

    def _refresh(self, page_hash: bytes) -> int:
        """A matched page found below the newest generation moves up; 0 when not indexed."""
        found = self._find(page_hash)
        if found is None:
            return 0
        self._put(page_hash, found[0], found[1])
        return found[0]

    def _set(self, page_hash: bytes, shift: int, code: int) -> None:
        found = self._find(page_hash)
        value, gen = found if found is not None else (0, None)
        self._put(page_hash, self._intern((value & ~(3 << shift)) | (code << shift)), gen)

    def _unset(self, page_hash: bytes, shift: int) -> None:
        found = self._find(page_hash)
        if found is None:
            return
        value, gen = found
        value &= ~(3 << shift)
        if value:
            gen[page_hash] = self._intern(value)
        else:
            del gen[page_hash]
            self._num_pages -= 1

    def _put(self, page_hash: bytes, value: int, gen: dict[bytes, int] | None) -> None:
        """Index `value` for the page in the newest generation (`gen`: where it is now)."""
        newest = self._gens[-1]
        if gen is newest:
            newest[page_hash] = value
            return
        if gen is not None:  # touched: it moves up
            del gen[page_hash]
        else:
            if self._num_new >= self._gen_size:
                self._open_generation()
            if self._num_pages >= self.max_pages:
                self._evict_one()
            self._num_new += 1
            self._num_pages += 1
        self._gens[-1][page_hash] = value
        self._drain(DRAIN_PER_INSERT)

    def _open_generation(self) -> None:
        """A new newest generation; past NUM_GENS the oldest is forgotten (its pages were not
        touched while (NUM_GENS - 1) generations of new pages arrived)."""
        self._num_new = 0
        self._gens.append({})
        if len(self._gens) > self._num_gens:
            self._forget(self._gens.popleft())
        for i in range(len(self._gens) - 1):  # dicts never shrink on delete: copy sparse ones
            if sys.getsizeof(self._gens[i]) > SPARSE_BYTES_PER_PAGE * len(self._gens[i]) + 4096:
                self._gens[i] = dict(self._gens[i])

    def _evict_one(self) -> None:
        """Under pressure: one page of the oldest generation goes (within a generation, the
        most recently moved there first)."""
        while len(self._gens) > 1 and not self._gens[0]:
            self._gens.popleft()
        if len(self._gens) == 1:
            self._open_generation()
        self._gens[0].popitem()
        self._num_pages -= 1
        self.num_forgotten_pages += 1

    def _forget(self, gen: dict[bytes, int]) -> None:
        self._num_pages -= len(gen)
        self.num_forgotten_pages += len(gen)
        self._forgotten.append(gen)  # freed a few pages per insertion, never looked at

    def _drain(self, num_pages: int) -> None:
        while num_pages and self._forgotten:
            doomed = self._forgotten[-1]
            while num_pages and doomed:
                doomed.popitem()
                num_pages -= 1
            if not doomed:
                self._forgotten.pop()

    def _intern(self, value: int) -> int:
        if len(self._interned) >= MAX_INTERNED:
            self._interned = {}
        return self._interned.setdefault(value, value)

    def _clear(self, worker: _Worker) -> None:
        """Drop one worker's part: a scan of the index (restarts and gaps are rare; a worker
        that never had a page, like one that just joined, costs nothing)."""
        if not worker.has_pages:
            return
        worker.has_pages = False
        mask = 3 << (2 * worker.slot)
        remap: dict[int, int] = {}
        for gen in self._gens:
            held = [h for h, v in gen.items() if v & mask]
            for page_hash in held:
                value = gen[page_hash]
                rest = remap.get(value)
                if rest is None:
                    rest = remap[value] = self._intern(value & ~mask)
                if rest:
                    gen[page_hash] = rest
                else:
                    del gen[page_hash]
                    self._num_pages -= 1

