"""The prefix cache: a radix tree of KV pages keyed by chained page hashes, over three tiers.

Because a page hash covers its whole prefix (kvcache.hashing), the tree is a map from hash to
node with parent links; each node is one full page, on the device or in the host slab:

    root ── h0 ── h1 ── h2          request A: pages h0 h1 h2
                   └─── h2'         request B shares h0 h1, diverges at page 2

A parent is always in the same or a faster tier than its children (eviction takes leaves of
a tier, promotion walks from the root), so every cached prefix is a path from the root. The
disk tier sits below the tree as a flat index of durable records (a hash names its prefix, so
no links are needed), which is what lets a restarted worker serve hits from disk.

Device pages are reference counted on the PagePool: the tree holds one reference on every
device page it caches; a request reusing a page takes its own (that is the lock — a page with
a reference besides the tree's is in use and cannot be evicted). Eviction writes back down a
tier (device -> host -> disk -> gone); a hit in a lower tier is promoted into a fresh device
page. A lower-tier page that cannot be read back (corrupt, missing) is a counted miss.
Every change is published as a KV event with the worker's epoch and a sequence number.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvcache.disk import DiskTier
from kvcache.events import EventKind, KVEvent, Tier
from kvcache.hashing import tenant_of
from kvcache.host import HostTier
from kvcache.pool import DevicePool, PagePool

__all__ = ["CacheStats", "EventKind", "KVEvent", "Node", "PrefixCache", "Tier"]

MAX_STAGED_PAGES = 4096  # disk pages read ahead for queued requests, at most


@dataclass(slots=True, eq=False)
class Node:
    hash: bytes
    parent: Node | None
    page_id: int  # device page, or host slot when tier is HOST
    tier: Tier = Tier.DEVICE
    salt: bytes = b""  # the tenant whose request computed it (for purges)
    # A session's request computed or reused it: evicted after its tenant's other pages
    session: bool = False
    children: set[Node] = field(default_factory=set)
    last_access: int = 0
    created: float = 0.0  # time.monotonic() when computed (for the time-to-live)

    def __hash__(self) -> int:
        return id(self)


@dataclass(slots=True)
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from the cache (any tier)
    hit_pages_by_tier: list[int] = field(default_factory=lambda: [0, 0, 0])
    inserted_pages: int = 0
    evicted_pages: int = 0  # left the cache entirely
    demoted_pages: int = 0  # written back down a tier
    promoted_pages: int = 0  # copied up to the device
    failed_reads: int = 0  # lower-tier pages that could not be read back (a miss)
    written_back_pages: int = 0  # copied to disk while they stay on the device (write_back_pages)


class PrefixCache:
    def __init__(
        self,
        pages: PagePool,
        page_size: int,
        worker_id: str = "local",
        epoch: int = 0,
        on_event: Callable[[KVEvent], None] | None = None,
        device: DevicePool | None = None,
        host: HostTier | None = None,
        disk: DiskTier | None = None,
        ttl_s: float | None = None,
        write_back_pages: int = 0,
    ) -> None:
        if (host is not None or disk is not None) and device is None:
            raise ValueError("lower tiers need the device pool to copy pages")
        self.pages = pages
        self.page_size = page_size
        self.worker_id = worker_id
        self.epoch = epoch
        self.on_event = on_event
        self.device = device
        self.host = host
        self.disk = disk
        self.ttl_s = ttl_s  # pages older than this are not reused (and are dropped when idle)
        self.write_back_pages = write_back_pages if disk is not None else 0  # kvcache.tiers.TierConfig
        self._nodes: dict[bytes, Node] = {}
        # Tenants of pages this process wrote to disk (records carry no salt), for purges.
        self._disk_salts: dict[bytes, bytes] = {}
        self._pinned: set[int] = set()  # nodes a match in progress is about to promote
        # Disk reads started when a request is queued, so the I/O overlaps its wait.
        self._staged: OrderedDict[bytes, Future[torch.Tensor | None]] = OrderedDict()
        self._reader: ThreadPoolExecutor | None = None
        self._clock = 0
        self._seq = 0
        # Per tier a heap of (last_access, tiebreak, node), pushed whenever a node may have
        # become an eviction candidate (added, touched, arrived in the tier, lost its last
        # child there); entries that no longer say the truth are skipped when popped. An
        # eviction reads O(victims + entries skipped) of it, not the whole tree: a full cache
        # of 16k pages had scanned every node for each page a step allocated.
        self._heaps: dict[Tier, list[tuple[int, int, Node]]] = {Tier.DEVICE: [], Tier.HOST: []}
        # The same, per (tier, tenant), of the pages no session uses: what is evicted in the
        # place of a session's page that the LRU picked (`_lru`).
        self._plain: dict[tuple[Tier, bytes], list[tuple[int, int, Node]]] = {}
        self._tiebreak = itertools.count()
        self.stats = CacheStats()

    @property
    def num_cached_pages(self) -> int:
        return sum(1 for n in self._nodes.values() if n.tier == Tier.DEVICE)

    def cached_page_ids(self) -> list[int]:
        return [n.page_id for n in self._nodes.values() if n.tier == Tier.DEVICE]

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._nodes or (self.disk is not None and self.disk.contains(page_hash))

    def tier_of(self, page_hash: bytes) -> Tier | None:
        node = self._nodes.get(page_hash)
        if node is not None:
            return node.tier
        return Tier.DISK if self.disk is not None and self.disk.contains(page_hash) else None

    # -- lookups ----------------------------------------------------------------------------

    def match(
        self, hashes: Sequence[bytes], max_pages: int, by_tier: list[int] | None = None, session: bool = False
    ) -> list[int]:
        """Reuse the longest cached prefix (at most `max_pages` pages), promoting lower-tier
        pages to the device. The caller gets its own reference on each returned page.
        `by_tier` (indexed by Tier) counts the returned pages by the tier each was found in;
        `session`: the caller is a session's request (its pages are kept longer: `_lru`)."""
        self._clock += 1
        path: list[tuple[bytes, Node | None]] = []  # the cached prefix, in order
        expired_before = time.monotonic() - self.ttl_s if self.ttl_s is not None else None
        for page_hash in hashes[:max_pages]:
            node = self._nodes.get(page_hash)
            if node is None and not (self.disk is not None and self.disk.contains(page_hash)):
                break
            if node is not None and expired_before is not None and node.created < expired_before:
                self._expire(node)
                break
            path.append((page_hash, node))
        lower = [i for i, (_, node) in enumerate(path) if node is None or node.tier != Tier.DEVICE]
        fresh: list[int] = []
        if lower:
            # Pin the host nodes on the path and take every device page the promotions need in
            # one allocation, so one eviction pass makes room for all of them.
            self._pinned = {id(node) for _, node in path if node is not None}
            try:
                fresh = self.allocate(len(lower)) or []
            finally:
                self._pinned = set()
            if not fresh:
                path = path[: lower[0]]  # no room to promote: reuse the device part only
        found: list[int] = []
        parent: Node | None = None
        loads: list[tuple[int, int]] = []  # host promotions: (slot, device page), copied together
        for page_hash, node in path:
            tier = node.tier if node is not None else Tier.DISK
            if node is None or node.tier != Tier.DEVICE:
                node = self._promote(page_hash, node, parent, fresh[0], loads)
                if node is None:
                    break
                fresh.pop(0)
            node.last_access = self._clock
            node.session |= session
            self._candidate(node)
            self.pages.share([node.page_id])
            self.stats.hit_pages_by_tier[tier] += 1
            if by_tier is not None:
                by_tier[tier] += 1
            found.append(node.page_id)
            parent = node
        if loads:
            assert self.host is not None and self.device is not None
            slots = [slot for slot, _ in loads]
            self.host.load_many(slots, self.device.kv, [page_id for _, page_id in loads])
            for slot in slots:  # a later store into them queues behind these copies
                self.host.free(slot)
        if fresh:
            self.pages.free(fresh)  # promotions stopped early (an unreadable page)
        return found

    def prefetch(self, hashes: Sequence[bytes]) -> int:
        """Start reading the disk-tier pages of a queued request's prefix in the background;
        the promotion at admission then finds them in memory. Returns reads started."""
        if self.disk is None:
            return 0
        started = 0
        for page_hash in hashes:
            if page_hash in self._nodes or page_hash in self._staged:
                continue
            if not self.disk.contains(page_hash):
                break
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-disk-read")
            self._staged[page_hash] = self._reader.submit(self.disk.get, page_hash)
            started += 1
        while len(self._staged) > MAX_STAGED_PAGES:  # requests that never ran: forget the oldest
            self._staged.popitem(last=False)
        return started

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.query_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    # -- updates ----------------------------------------------------------------------------

    def insert(
        self, hashes: Sequence[bytes], page_ids: Sequence[int], start: int, salt: bytes = b"", session: bool = False
    ) -> int:
        """Cache device pages `start ..` of a sequence (hashes[i] is the hash of page_ids[i]);
        `session`: a session's request computed them (they are kept longer: `_lru`). How many
        pages were new to the cache."""
        self._clock += 1
        stored: list[bytes] = []
        parent = self._nodes.get(hashes[start - 1]) if start > 0 else None
        if start > 0 and (parent is None or parent.tier != Tier.DEVICE):
            return 0  # the prefix left the device meanwhile; its pages will be offered again
        for page_hash, page_id in zip(hashes[start:], page_ids[start:], strict=False):
            node = self._nodes.get(page_hash)
            if node is None:
                node = self._add(page_hash, parent, page_id, Tier.DEVICE, salt, session)
                self.pages.share([page_id])
                stored.append(page_hash)
            elif node.tier != Tier.DEVICE:
                break  # cached below; a later match promotes it
            node.session |= session
            if node.last_access != self._clock:
                node.last_access = self._clock
                self._candidate(node)
            parent = node
        if stored:
            self.stats.inserted_pages += len(stored)
            self._emit(EventKind.STORED, stored, Tier.DEVICE)
        if (n := self.write_back_pages) and len(hashes) // n > start // n:  # whole blocks, once each
            self.write_back(hashes[start // n * n : len(hashes) // n * n])
        return len(stored)

    def write_back(self, hashes: Sequence[bytes]) -> int:
        """Write the device pages of `hashes` to the disk tier too; they stay on the device (a
        copy, not a demotion: the index still has them on the device). Durable within the disk
        tier's sync interval, so a worker that dies leaves them on its disk, where its restarted
        self re-indexes them. How many records were written."""
        if self.disk is None or self.device is None:
            return 0
        written, dropped = 0, []
        for page_hash in hashes:
            node = self._nodes.get(page_hash)
            if node is None or node.tier != Tier.DEVICE or self.disk.contains(page_hash):
                continue
            lost = self.disk.put(page_hash, self.device.read_page(node.page_id))
            dropped += [h for h in lost if h != page_hash]
            if page_hash not in lost:  # (the write failed: it is only on the device, as before)
                self._disk_salts[page_hash] = node.salt  # a purge of its tenant removes it from disk too
                written += 1
        gone = [h for h in dropped if h not in self._nodes]  # disk-only pages the tier let go
        for page_hash in dropped:
            self._disk_salts.pop(page_hash, None)
        if gone:
            self.stats.evicted_pages += len(gone)
            self._emit(EventKind.REMOVED, gone, Tier.DISK)
        self.stats.written_back_pages += written
        return written

    def allocate(self, n: int) -> list[int] | None:
        """Fresh device pages, evicting (writing back) cached pages when that is what it takes."""
        shortfall = n - self.pages.num_free
        if shortfall > 0 and self.evict(shortfall) < shortfall:
            return None
        return self.pages.allocate(n)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` device pages: least recently used device leaves that only
        the tree holds, written back to the host tier (or disk) when there is one."""
        victims = self._lru(Tier.DEVICE, num_pages)
        if self.host is not None and len(victims) > self.host.num_free:
            self._make_host_room(len(victims) - self.host.num_free)  # one pass for the batch
        rest = victims
        if self.host is not None and self.device is not None and victims:
            # The batch's copies to the host go together (HostTier.store_many); what does not
            # fit takes the page-by-page way below (disk, or dropped).
            slots = self.host.store_many(self.device.kv, [node.page_id for node in victims])
            for node, slot in zip(victims, slots, strict=False):
                page_id = node.page_id
                self._to_host(node, slot)
                self.pages.free([page_id])
            rest = victims[len(slots) :]
        for node in rest:
            page_id = node.page_id
            self._demote_from_device(node)
            self.pages.free([page_id])
        return len(victims)

    def clear(self) -> None:
        """Drop every device page nobody is using (lower tiers keep their copies)."""
        while self.evict(len(self._nodes)):
            pass

    def purge(self, salt: bytes) -> int:
        """Forget every page of one tenant in the tree (a request using one keeps its own
        reference until it ends). A tenant's pages form whole subtrees, since the salt is in
        every page hash of its requests; pages its requests salted further (their own
        cache_salt) are the tenant's too. Returns how many pages were forgotten."""
        doomed = [n for n in self._nodes.values() if tenant_of(n.salt) == salt]
        for node in doomed:
            self._forget(node)
        on_disk = [h for h, s in self._disk_salts.items() if tenant_of(s) == salt]
        for page_hash in on_disk:
            del self._disk_salts[page_hash]
            if self.disk is not None:
                self.disk.remove(page_hash)
        if doomed or on_disk:
            self._emit(EventKind.REMOVED, [n.hash for n in doomed] + on_disk, Tier.DEVICE)
        return len(doomed) + len(on_disk)

    # -- tier moves -------------------------------------------------------------------------

    def _lru(self, tier: Tier, limit: int) -> list[Node]:
        """Up to `limit` evictable nodes of a tier, least recently used first (parents become
        candidates once their children in that tier are gone) -- but within a tenant, a
        session's pages last: when the LRU picks a page a session uses, its tenant's least
        recently used page that none uses goes in its place, if the tenant has one."""
        heap = self._heaps[tier]
        out: list[Node] = []
        taken: set[int] = set()
        held: list[tuple[list[tuple[int, int, Node]], tuple[int, int, Node]]] = []  # candidates again after
        while len(out) < limit:
            entry = self._next_victim(heap, tier, taken, held)
            if entry is None:
                break
            node = entry[2]
            if node.session:
                plain = self._plain.get((tier, tenant_of(node.salt)))
                instead = self._next_victim(plain, tier, taken, held, plain=True) if plain else None
                if instead is not None:
                    held.append((heap, entry))  # the session's page stays a candidate
                    node = instead[2]
            out.append(node)
            taken.add(id(node))
            if node.parent is not None and node.parent.tier == tier:
                self._candidate(node.parent)
        for source, entry in held:
            heapq.heappush(source, entry)
        return out

    def _next_victim(
        self, heap: list[tuple[int, int, Node]], tier: Tier, taken: set[int],
        held: list[tuple[list[tuple[int, int, Node]], tuple[int, int, Node]]], plain: bool = False,
    ) -> tuple[int, int, Node] | None:
        """Pop `heap` down to its least recently used evictable node's entry (None when it
        runs out); entries of nodes in use or pinned go to `held`. `plain`: a tenant's heap of
        pages no session uses (one a session has used since is skipped)."""
        while heap:
            entry = heapq.heappop(heap)
            last_access, _, node = entry
            if (id(node) in taken or node.tier != tier or node.last_access != last_access
                    or self._nodes.get(node.hash) is not node or (plain and node.session)):  # fmt: skip
                continue  # stale: touched since (a newer entry says so), moved, or gone
            if any(c.tier <= tier and id(c) not in taken for c in node.children):
                continue  # inner: a candidate again when its last child in the tier leaves
            if id(node) in self._pinned or (tier == Tier.DEVICE and self.pages.refcount(node.page_id) != 1):
                held.append((heap, entry))
                continue
            return entry
        return None

    def _candidate(self, node: Node) -> None:
        """`node` may be evictable from its tier now, or later (checked when popped)."""
        heap = self._heaps.get(node.tier)
        if heap is None:
            return
        self._push(heap, node, lambda n: n.tier == node.tier)
        if not node.session:
            tenant = tenant_of(node.salt)
            plain = self._plain.setdefault((node.tier, tenant), [])
            self._push(plain, node, lambda n: n.tier == node.tier and not n.session and tenant_of(n.salt) == tenant)

    def _push(self, heap: list[tuple[int, int, Node]], node: Node, belongs: Callable[[Node], bool]) -> None:
        if len(heap) > 2 * len(self._nodes) + 1024:  # mostly stale entries (every touch adds one): rebuild
            heap[:] = [(n.last_access, next(self._tiebreak), n) for n in self._nodes.values() if belongs(n)]
            heapq.heapify(heap)  # amortised: a rebuild per len(tree) pushes at most
            if node.hash in self._nodes:
                return  # it is in the rebuilt heap, as it is now
        heapq.heappush(heap, (node.last_access, next(self._tiebreak), node))

    def _demote_from_device(self, node: Node) -> None:
        assert self.device is not None or (self.host is None and self.disk is None)
        if self.host is not None and self.device is not None:
            slot = self.host.store(self.device.read_page(node.page_id))
            if slot is None and self._make_host_room(1):
                slot = self.host.store(self.device.read_page(node.page_id))
            if slot is not None:
                self._to_host(node, slot)
                return
        if self.disk is not None and self.device is not None:
            self._to_disk(node, self.device.read_page(node.page_id))
            return
        self._remove(node)
        self.stats.evicted_pages += 1
        self._emit(EventKind.REMOVED, [node.hash], Tier.DEVICE)

    def _to_host(self, node: Node, slot: int) -> None:
        node.tier, node.page_id = Tier.HOST, slot
        self._candidate(node)
        if node.parent is not None:
            self._candidate(node.parent)
        self.stats.demoted_pages += 1
        self._emit(EventKind.TIER_CHANGED, [node.hash], Tier.HOST)

    def _make_host_room(self, num_pages: int) -> bool:
        assert self.host is not None
        victims = self._lru(Tier.HOST, num_pages)
        for node in victims:
            slot = node.page_id
            if self.disk is not None:
                self._to_disk(node, self.host.load(slot))
            else:
                self._remove(node)
                self.stats.evicted_pages += 1
                self._emit(EventKind.REMOVED, [node.hash], Tier.HOST)
            self.host.free(slot)
        return bool(victims)

    def _to_disk(self, node: Node, page: torch.Tensor) -> None:
        assert self.disk is not None
        dropped = self.disk.put(node.hash, page)
        self._remove(node)
        self._disk_salts[node.hash] = node.salt
        for page_hash in dropped:
            self._disk_salts.pop(page_hash, None)
        self.stats.demoted_pages += 1
        self._emit(EventKind.TIER_CHANGED, [node.hash], Tier.DISK)
        gone = [h for h in dropped if h != node.hash] + ([node.hash] if node.hash in dropped else [])
        if gone:
            self.stats.evicted_pages += len(gone)
            self._emit(EventKind.REMOVED, gone, Tier.DISK)

    def _promote(
        self, page_hash: bytes, node: Node | None, parent: Node | None, page_id: int, loads: list[tuple[int, int]]
    ) -> Node | None:
        """Copy a disk page into device page `page_id`, or queue a host page's copy on `loads`
        as (slot, page_id): the caller copies them together, then frees the slots. None (a
        miss, `page_id` is then the caller's to free) if the page cannot be read."""
        assert self.device is not None
        if node is None:  # on disk
            assert self.disk is not None
            staged = self._staged.pop(page_hash, None)
            page = staged.result() if staged is not None else self.disk.get(page_hash)
            if page is None:  # indexed but unreadable: corrupt, truncated, deleted — a miss
                self.stats.failed_reads += 1
                return None
            self.device.write_page(page_id, page)
        else:
            assert self.host is not None and node.tier == Tier.HOST
            loads.append((node.page_id, page_id))
        if node is None:
            salt = parent.salt if parent is not None else b""
            node = self._add(page_hash, parent, page_id, Tier.DEVICE, self._disk_salts.pop(page_hash, salt))
            assert self.disk is not None
            self.disk.remove(page_hash)
        else:
            node.tier, node.page_id = Tier.DEVICE, page_id
            self._candidate(node)
        self.stats.promoted_pages += 1
        self._emit(EventKind.TIER_CHANGED, [page_hash], Tier.DEVICE)
        return node

    # -- structure --------------------------------------------------------------------------

    def _expire(self, node: Node) -> None:
        """Drop a page past its time-to-live, with its subtree, unless a request still uses it."""
        stack, doomed = [node], []
        while stack:
            current = stack.pop()
            if current.tier == Tier.DEVICE and self.pages.refcount(current.page_id) > 1:
                return  # in use: it expires when the last user is done and it is matched again
            doomed.append(current)
            stack.extend(current.children)
        for current in reversed(doomed):
            self._forget(current)
        self.stats.evicted_pages += len(doomed)
        self._emit(EventKind.REMOVED, [n.hash for n in doomed], Tier.DEVICE)

    def _add(
        self, page_hash: bytes, parent: Node | None, page_id: int, tier: Tier, salt: bytes, session: bool = False
    ) -> Node:
        node = Node(page_hash, parent, page_id, tier, salt, session, last_access=self._clock, created=time.monotonic())
        self._nodes[page_hash] = node
        if parent is not None:
            parent.children.add(node)
        self._candidate(node)
        return node

    def _remove(self, node: Node) -> None:
        del self._nodes[node.hash]
        if node.parent is not None:
            node.parent.children.discard(node)
            if node.parent.hash in self._nodes:
                self._candidate(node.parent)

    def _forget(self, node: Node) -> None:
        """Remove a node wherever it lives, releasing its storage."""
        if node.hash not in self._nodes:
            return
        self._remove(node)
        if node.tier == Tier.DEVICE:
            self.pages.free([node.page_id])
        elif self.host is not None:
            self.host.free(node.page_id)
        if self.disk is not None:
            self.disk.remove(node.hash)
            self._disk_salts.pop(node.hash, None)  # a copy written back went with it

    # -- events -----------------------------------------------------------------------------

    def _emit(self, kind: EventKind, hashes: list[bytes], tier: Tier) -> None:
        self._seq += 1
        if self.on_event is not None:
            self.on_event(KVEvent(self.worker_id, self.epoch, self._seq, kind, tuple(hashes), tier))

    def snapshot(self) -> tuple[int, list[tuple[bytes, Tier]]]:
        """(last event seq, every cached page and its tier) for a scheduler rebuilding its index."""
        pages = [(h, n.tier) for h, n in self._nodes.items()]
        if self.disk is not None:  # a page written back is on the device, as far as anyone reads it
            pages += [(h, Tier.DISK) for h in self.disk.hashes() if h not in self._nodes]
        return self._seq, pages

    # -- invariants -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        device_pages: set[int] = set()
        host_slots: set[int] = set()
        for node in self._nodes.values():
            used = device_pages if node.tier == Tier.DEVICE else host_slots
            if node.page_id in used:
                raise AssertionError(f"{node.tier.name} page {node.page_id} cached twice")
            used.add(node.page_id)
            if node.tier == Tier.DEVICE and self.pages.refcount(node.page_id) < 1:
                raise AssertionError(f"cached page {node.page_id} has no reference")
            if node.parent is not None:
                if self._nodes.get(node.parent.hash) is not node.parent:
                    raise AssertionError("a cached page's parent is not in the tree")
                if node not in node.parent.children or node.parent.tier > node.tier:
                    raise AssertionError("parent/child links or tier order broken")
        for tier, heap in self._heaps.items():  # every leaf of a tier is an eviction candidate
            live = {id(n) for la, _, n in heap if n.tier == tier and n.last_access == la and self._nodes.get(n.hash) is n}
            plain_live = {id(n) for (t, _), entries in self._plain.items() if t == tier
                          for la, _, n in entries if n.last_access == la and not n.session}  # fmt: skip
            for node in self._nodes.values():
                if node.tier != tier or any(c.tier <= tier for c in node.children):
                    continue
                if id(node) not in live or not (node.session or id(node) in plain_live):
                    raise AssertionError(f"{tier.name} page {node.page_id} is a leaf but no eviction candidate")
        if self.host is not None:
            self.host.check_integrity(len(host_slots))
