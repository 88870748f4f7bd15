"""The prefix cache: a radix tree of KV pages keyed by chained page hashes.

Because a page hash covers its whole prefix (kvcache.hashing), the tree is a map from hash to
node with parent links; each node is one full page:

    root ── h0 ── h1 ── h2          request A: pages h0 h1 h2
                   └─── h2'         request B shares h0 h1, diverges at page 2

Ownership of device pages is reference counting on the PagePool:
- the tree holds one reference on every page it caches;
- a request that reuses cached pages takes its own reference on each (that is the "lock":
  a page with a reference besides the tree's is in use and cannot be evicted);
- eviction frees the tree's reference of least-recently-used leaves nobody else holds.

So per pool: free + cached (only the tree holds it) + in use (a request holds it) == total.
Every change is published as a KV event with the worker's epoch and a sequence number.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.pool import PagePool


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


class EventKind(enum.IntEnum):
    STORED = 0
    REMOVED = 1
    TIER_CHANGED = 2


@dataclass(frozen=True, slots=True)
class KVEvent:
    worker_id: str
    epoch: int
    seq: int  # increases by one per event of this worker; a gap means events were lost
    kind: EventKind
    page_hashes: tuple[bytes, ...]
    tier: Tier


@dataclass(slots=True, eq=False)
class Node:
    hash: bytes
    parent: Node | None
    page_id: int
    salt: bytes = b""  # the tenant whose request computed it (for purges)
    num_children: int = 0
    last_access: int = 0


@dataclass(slots=True)
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from the cache
    inserted_pages: int = 0
    evicted_pages: int = 0


class PrefixCache:
    def __init__(
        self,
        pages: PagePool,
        page_size: int,
        worker_id: str = "local",
        epoch: int = 0,
        on_event: Callable[[KVEvent], None] | None = None,
    ) -> None:
        self.pages = pages
        self.page_size = page_size
        self.worker_id = worker_id
        self.epoch = epoch
        self._on_event = on_event
        self._nodes: dict[bytes, Node] = {}
        self._clock = 0
        self._seq = 0
        self.stats = CacheStats()

    @property
    def num_cached_pages(self) -> int:
        return len(self._nodes)

    def cached_page_ids(self) -> list[int]:
        return [node.page_id for node in self._nodes.values()]

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._nodes

    # -- lookups ----------------------------------------------------------------------------

    def match(self, hashes: Sequence[bytes], max_pages: int) -> list[int]:
        """Reuse the longest cached prefix (at most `max_pages` pages): the caller gets its
        own reference on each returned page and must free them like any other page."""
        self._clock += 1
        found: list[int] = []
        for page_hash in hashes[:max_pages]:
            node = self._nodes.get(page_hash)
            if node is None:
                break
            node.last_access = self._clock
            found.append(node.page_id)
        if found:
            self.pages.share(found)
        return found

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.query_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    # -- updates ----------------------------------------------------------------------------

    def insert(self, hashes: Sequence[bytes], page_ids: Sequence[int], start: int, salt: bytes = b"") -> None:
        """Cache pages `start ..` of a sequence (hashes[i] is the hash of page_ids[i])."""
        self._clock += 1
        stored: list[bytes] = []
        parent = self._nodes.get(hashes[start - 1]) if start > 0 else None
        for page_hash, page_id in zip(hashes[start:], page_ids[start:], strict=False):
            node = self._nodes.get(page_hash)
            if node is None:
                if start > 0 and parent is None:
                    break  # the prefix was evicted meanwhile: a child without its parent is useless
                node = Node(page_hash, parent, page_id, salt, last_access=self._clock)
                self.pages.share([page_id])
                self._nodes[page_hash] = node
                if parent is not None:
                    parent.num_children += 1
                stored.append(page_hash)
            else:
                node.last_access = self._clock
            parent = node
            start += 1
        if stored:
            self.stats.inserted_pages += len(stored)
            self._emit(EventKind.STORED, stored)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` device pages: least recently used leaves that only the tree
        holds. Returns how many were freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes.values() if self._is_evictable(n)]
        heapq.heapify(heap)
        removed: list[bytes] = []
        while heap and len(removed) < num_pages:
            _, _, node = heapq.heappop(heap)
            self._drop(node)
            removed.append(node.hash)
            parent = node.parent
            if parent is not None and self._is_evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if removed:
            self.stats.evicted_pages += len(removed)
            self._emit(EventKind.REMOVED, removed)
        return len(removed)

    def allocate(self, n: int) -> list[int] | None:
        """Fresh pages from the pool, evicting cached pages when that is what it takes."""
        shortfall = n - self.pages.num_free
        if shortfall > 0 and self.evict(shortfall) < shortfall:
            return None
        return self.pages.allocate(n)

    def clear(self) -> None:
        """Drop every page nobody is using."""
        self.evict(len(self._nodes))

    def purge(self, salt: bytes) -> int:
        """Forget every page of one tenant, in use or not (a request using one keeps its own
        reference until it ends). A tenant's pages form whole subtrees, since the salt is in
        every page hash of its requests. Returns how many pages were forgotten."""
        doomed = [n for n in self._nodes.values() if n.salt == salt]
        for node in doomed:
            del self._nodes[node.hash]
            self.pages.free([node.page_id])
        for node in doomed:
            if node.parent is not None and node.parent.hash in self._nodes:
                node.parent.num_children -= 1
        if doomed:
            self._emit(EventKind.REMOVED, [n.hash for n in doomed])
        return len(doomed)

    def _is_evictable(self, node: Node) -> bool:
        return node.num_children == 0 and self.pages.refcount(node.page_id) == 1

    def _drop(self, node: Node) -> None:
        del self._nodes[node.hash]
        if node.parent is not None:
            node.parent.num_children -= 1
        self.pages.free([node.page_id])

    # -- events -----------------------------------------------------------------------------

    def _emit(self, kind: EventKind, hashes: list[bytes]) -> None:
        self._seq += 1
        if self._on_event is not None:
            self._on_event(KVEvent(self.worker_id, self.epoch, self._seq, kind, tuple(hashes), Tier.DEVICE))

    def snapshot(self) -> tuple[int, list[tuple[bytes, Tier]]]:
        """(last event seq, every cached page) for a scheduler rebuilding its index."""
        return self._seq, [(h, Tier.DEVICE) for h in self._nodes]

    # -- invariants -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        children: dict[bytes, int] = {}
        seen_pages: set[int] = set()
        for node in self._nodes.values():
            if node.page_id in seen_pages:
                raise AssertionError(f"page {node.page_id} cached twice")
            seen_pages.add(node.page_id)
            if self.pages.refcount(node.page_id) < 1:
                raise AssertionError(f"cached page {node.page_id} has no reference")
            if node.parent is not None:
                if self._nodes.get(node.parent.hash) is not node.parent:
                    raise AssertionError("a cached page's parent is not cached")
                children[node.parent.hash] = children.get(node.parent.hash, 0) + 1
        for node in self._nodes.values():
            if node.num_children != children.get(node.hash, 0):
                raise AssertionError(f"child count of {node.hash.hex()} is {node.num_children}")
