"""The cluster-wide KV index: exact scenarios, event streams that drop, duplicate and reorder
events (the index recovers through snapshots to exactly the workers' state), longest-prefix
lookups against a brute-force oracle, and the memory bound."""

from __future__ import annotations

import random
import tempfile
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.placement.global_index import GlobalIndex, PrefixHit, SnapshotRequest
from kvcache.disk import DiskTier
from kvcache.events import EventKind, KVEvent, Tier
from kvcache.hashing import page_hashes
from kvcache.host import HostTier
from kvcache.pool import DevicePool, KVLayout
from kvcache.radix import PrefixCache

H = [bytes([i]) * 16 for i in range(12)]  # page hashes: opaque to the index


def _ev(worker: str, seq: int, kind: EventKind, pages: list[int], tier: Tier = Tier.DEVICE, epoch: int = 1) -> KVEvent:
    return KVEvent(worker, epoch, seq, kind, tuple(H[i] for i in pages), tier)


def _joined(*workers: str, max_pages: int = 1 << 16) -> GlobalIndex:
    index = GlobalIndex(max_pages)
    for w in workers:
        assert index.add_worker(w, 1) == SnapshotRequest(w, 1)
        assert index.load_snapshot(w, 1, 0, []) is None  # a fresh worker: empty, caught up
    return index


# -- scenarios ---------------------------------------------------------------------------------


def test_events_build_per_worker_runs_by_tier() -> None:
    index = _joined("a", "b")
    assert index.apply(_ev("a", 1, EventKind.STORED, [0, 1, 2, 3, 4])) is None
    assert index.apply(_ev("b", 1, EventKind.STORED, [0, 1, 5])) is None
    assert index.apply(_ev("a", 2, EventKind.TIER_CHANGED, [3], Tier.HOST)) is None
    assert index.apply(_ev("a", 3, EventKind.TIER_CHANGED, [4], Tier.DISK)) is None
    prompt = [H[i] for i in (0, 1, 2, 3, 4, 6)]
    assert index.match(prompt).to_dict() == {"a": PrefixHit(3, 1, 1), "b": PrefixHit(2, 0, 0)}
    assert index.match(prompt, max_pages=2).to_dict() == {"a": PrefixHit(2, 0, 0), "b": PrefixHit(2, 0, 0)}
    assert index.match([H[2], H[5]]).to_dict() == {"a": PrefixHit(1, 0, 0)}  # b holds page 5, not page 2 before it
    index.apply(_ev("a", 4, EventKind.REMOVED, [2]))  # a's run now ends at page 2
    assert index.match(prompt).to_dict() == {"a": PrefixHit(2, 0, 0), "b": PrefixHit(2, 0, 0)}
    index.apply(_ev("b", 2, EventKind.REMOVED, [0, 1, 5]))
    assert index.match(prompt).to_dict() == {"a": PrefixHit(2, 0, 0)}
    assert index.worker_pages("b") == {} and index.num_pages == 4  # pages 0 1 3 4, a's


def test_a_gap_asks_for_a_snapshot_and_buffered_events_replay_after_it() -> None:
    index = _joined("a")
    index.apply(_ev("a", 1, EventKind.STORED, [0, 1]))
    assert index.apply(_ev("a", 3, EventKind.STORED, [3])) == SnapshotRequest("a", 1)  # seq 2 lost
    assert index.apply(_ev("a", 4, EventKind.STORED, [4])) is None  # asked once, buffered
    assert index.stale_workers() == [SnapshotRequest("a", 1)]
    assert index.match([H[0], H[1]]).to_dict() == {"a": PrefixHit(2, 0, 0)}  # old entries stay as hints
    # The snapshot was taken after event 3: event 4 is replayed on top, event 3 is not applied twice.
    assert index.load_snapshot("a", 1, 3, [(H[0], Tier.HOST), (H[2], Tier.DEVICE), (H[3], Tier.DEVICE)]) is None
    assert index.worker_pages("a") == {H[0]: Tier.HOST, H[2]: Tier.DEVICE, H[3]: Tier.DEVICE, H[4]: Tier.DEVICE}
    assert index.stale_workers() == []
    assert index.apply(_ev("a", 4, EventKind.STORED, [4])) is None  # a duplicate: ignored
    assert index.apply(_ev("a", 6, EventKind.STORED, [5])) == SnapshotRequest("a", 1)


def test_a_snapshot_followed_by_a_gap_stays_stale() -> None:
    index = _joined("a")
    index.apply(_ev("a", 2, EventKind.STORED, [0]))  # 1 lost
    index.apply(_ev("a", 5, EventKind.STORED, [1]))
    assert index.load_snapshot("a", 1, 3, [(H[0], Tier.DEVICE)]) == SnapshotRequest("a", 1)  # 4 lost too
    assert index.stale_workers() == [SnapshotRequest("a", 1)]
    assert index.load_snapshot("a", 1, 5, [(H[0], Tier.DEVICE), (H[1], Tier.DEVICE)]) is None


def test_a_new_epoch_drops_the_old_life_and_fences_its_events() -> None:
    index = _joined("a")
    index.apply(_ev("a", 1, EventKind.STORED, [0, 1]))
    assert index.apply(_ev("a", 1, EventKind.STORED, [2], epoch=2)) == SnapshotRequest("a", 2)
    assert index.worker_pages("a") == {}  # restarted: its device and host pages are gone
    assert index.apply(_ev("a", 2, EventKind.STORED, [5], epoch=1)) is None  # the old life: fenced
    assert index.load_snapshot("a", 1, 9, [(H[7], Tier.DEVICE)]) == SnapshotRequest("a", 2)  # old answer
    assert index.load_snapshot("a", 2, 0, [(H[0], Tier.DISK)]) is None  # its disk tier survived
    assert index.worker_pages("a") == {H[0]: Tier.DISK, H[2]: Tier.DEVICE}


def test_a_heartbeat_finds_events_lost_at_the_end_of_the_stream() -> None:
    index = _joined("a")
    index.apply(_ev("a", 1, EventKind.STORED, [0]))
    assert index.observe_seq("a", 1, 1) is None
    assert index.observe_seq("a", 1, 2) == SnapshotRequest("a", 1)  # event 2 never came
    assert index.observe_seq("b", 4, 0) == SnapshotRequest("b", 4)  # an unknown worker: a join


def test_remove_worker_frees_its_slot_for_the_next() -> None:
    index = _joined("a", "b")
    index.apply(_ev("a", 1, EventKind.STORED, [0, 1]))
    index.apply(_ev("b", 1, EventKind.STORED, [0]))
    index.remove_worker("a")
    assert index.match([H[0], H[1]]).to_dict() == {"b": PrefixHit(1, 0, 0)} and index.num_pages == 1
    index.load_snapshot("c", 1, 0, [(H[1], Tier.HOST)])  # takes a's slot; a's bits are gone
    assert index.worker_pages("c") == {H[1]: Tier.HOST} and index.worker_ids == ["b", "c"]


# -- lossy event streams from model workers -----------------------------------------------------


@dataclass
class ModelWorker:
    """A worker as the index should see it: its true pages, epoch and event seq."""

    name: str
    epoch: int = 1
    seq: int = 0
    pages: dict[bytes, Tier] = field(default_factory=dict)
    history: dict[tuple[int, int], dict[bytes, Tier]] = field(default_factory=lambda: {(1, 0): {}})

    def emit(self, kind: EventKind, hashes: list[bytes], tier: Tier, wire: list[KVEvent]) -> None:
        if hashes:
            self.seq += 1
            self.history[(self.epoch, self.seq)] = dict(self.pages)  # its cache as of each event
            wire.append(KVEvent(self.name, self.epoch, self.seq, kind, tuple(hashes), tier))

    def restart(self) -> None:  # device and host pages are lost; the disk tier survives
        self.epoch, self.seq = self.epoch + 1, 0
        self.pages = {h: t for h, t in self.pages.items() if t == Tier.DISK}
        self.history[(self.epoch, 0)] = dict(self.pages)


def _oracle(workers: list[ModelWorker], prompt: list[bytes]) -> dict[str, PrefixHit]:
    out = {}
    for w in workers:
        counts = [0, 0, 0]
        for page_hash in prompt:
            if page_hash not in w.pages:
                break
            counts[w.pages[page_hash]] += 1
        if sum(counts):
            out[w.name] = PrefixHit(*counts)
    return out


def _check_in_sync(index: GlobalIndex, workers: list[ModelWorker]) -> None:
    """At every moment, a worker the index does not call stale is mirrored exactly as it was
    at the last event the index took from it: never a mix of lost, repeated or old events."""
    for w in workers:
        state = index.sync_state(w.name)
        if state is not None and not state.is_stale:
            assert index.worker_pages(w.name) == w.history[(state.epoch, state.last_seq)]


def _settle(index: GlobalIndex, answer: dict[str, ModelWorker]) -> None:
    """Heartbeats, then snapshots for every stale worker, until none is stale."""
    for w in answer.values():
        index.observe_seq(w.name, w.epoch, w.seq)
    for _ in range(3):
        for request in index.stale_workers():
            w = answer[request.worker_id]
            index.load_snapshot(w.name, w.epoch, w.seq, list(w.pages.items()))
    assert index.stale_workers() == []


page_ids = st.lists(st.integers(0, len(H) - 1), min_size=1, max_size=6)
tiers = st.sampled_from(list(Tier))
worker_kind = st.sampled_from(["store", "store", "remove", "move", "restart"])
worker_op = st.tuples(worker_kind, st.integers(0, 2), page_ids, tiers)
wire_kind = st.sampled_from(["deliver", "deliver", "deliver", "dup", "drop", "answer", "beat"])
wire_op = st.tuples(wire_kind, st.integers(0, 99))
prompt_ids = st.lists(st.lists(st.integers(0, len(H) - 1), max_size=8), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(worker_op, wire_op), max_size=60), prompt_ids)
def test_lossy_streams_recover_through_snapshots(ops: list[tuple[Any, ...]], prompts: list[list[int]]) -> None:
    workers = [ModelWorker(n) for n in "abc"]
    by_name = {w.name: w for w in workers}
    index = GlobalIndex(max_pages=1 << 10)
    index.load_snapshot("a", 1, 0, [])  # a and b are followed from their start;
    index.load_snapshot("b", 1, 0, [])
    index.add_worker("c", 1)  # c joins: stale until its snapshot is answered
    wire: list[KVEvent] = []  # sent, not yet delivered: delivered in any order, or never
    for op in ops:
        if len(op) == 4:
            kind, which, ids, tier = op
            w = workers[which]
            hashes = list(dict.fromkeys(H[i] for i in ids))
            if kind == "store":
                w.pages.update(dict.fromkeys(hashes, tier))
                w.emit(EventKind.STORED, hashes, tier, wire)
            elif kind == "remove":
                held = [h for h in hashes if h in w.pages]
                for h in held:
                    del w.pages[h]
                w.emit(EventKind.REMOVED, held, Tier.DEVICE, wire)
            elif kind == "move":
                held = [h for h in hashes if h in w.pages]
                w.pages.update(dict.fromkeys(held, tier))
                w.emit(EventKind.TIER_CHANGED, held, tier, wire)
            else:
                w.restart()
            continue
        kind, pos = op
        if kind == "answer":  # the workers answer the snapshot requests now
            for request in index.stale_workers():
                w = by_name[request.worker_id]
                index.load_snapshot(w.name, w.epoch, w.seq, list(w.pages.items()))
        elif kind == "beat":
            w = workers[pos % 3]
            index.observe_seq(w.name, w.epoch, w.seq)
        elif wire:
            event = wire[pos % len(wire)]
            if kind != "dup":
                wire.remove(event)
            if kind != "drop":
                index.apply(event)
        _check_in_sync(index, workers)
    random.Random(len(ops)).shuffle(wire)
    for event in wire:  # whatever is still on the wire arrives late, out of order
        index.apply(event)
        _check_in_sync(index, workers)
    _settle(index, by_name)
    for w in workers:
        assert index.worker_pages(w.name) == w.pages
    for prompt in [[H[i] for i in p] for p in prompts] + [H[:6]]:
        assert index.match(prompt).to_dict() == _oracle(workers, prompt)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.dictionaries(st.integers(0, len(H) - 1), tiers, max_size=len(H)), min_size=1, max_size=5),
    st.lists(st.integers(0, len(H) - 1), max_size=10),
    st.integers(0, 12),
)
def test_longest_prefix_matches_brute_force(states: list[dict[int, Tier]], prompt_ids: list[int], limit: int) -> None:
    workers = [ModelWorker(f"w{i}", pages={H[k]: t for k, t in s.items()}) for i, s in enumerate(states)]
    index = GlobalIndex()
    for w in workers:
        index.load_snapshot(w.name, 1, 0, list(w.pages.items()))
    prompt = [H[i] for i in prompt_ids]
    expected = _oracle(workers, prompt)
    got = index.match(prompt)
    assert got.to_dict() == expected and bool(got) == bool(expected)
    ranked = list(got.ranked())  # longest first, every holder once
    assert sorted(ranked) == sorted((w, hit.num_pages) for w, hit in expected.items())
    assert [n for _, n in ranked] == sorted((n for _, n in ranked), reverse=True)
    assert all(got.hit(w.name) == expected.get(w.name, PrefixHit()) for w in workers)
    assert got.hit("nobody") == PrefixHit()
    assert index.match(prompt, max_pages=limit).to_dict() == _oracle(workers, prompt[:limit])


# -- the real prefix cache's events ------------------------------------------------------------

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4)


def _run(cache: PrefixCache, device: DevicePool, hashes: list[bytes]) -> list[int] | None:
    got = cache.match(hashes, len(hashes))
    fresh = cache.allocate(len(hashes) - len(got))
    if fresh is None:
        device.pages.free(got)
        return None
    cache.insert(hashes, got + fresh, len(got))
    return got + fresh


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["run", "run", "release", "evict", "purge", "lose", "dup"]),
                          st.integers(0, 4), st.integers(1, 4)), max_size=40))
def test_real_prefix_caches_over_three_tiers_stay_mirrored(ops: list[tuple[int, str, int, int]]) -> None:
    index = GlobalIndex()
    wire: list[KVEvent] = []
    with tempfile.TemporaryDirectory() as tmp:
        caches, devices, held = [], [], []
        for i in range(2):
            device = DevicePool(LAYOUT, 6, torch.float32)
            host = HostTier(LAYOUT, 3, torch.float32)
            disk = DiskTier(Path(tmp) / str(i), b"t" * 16, (1, 2, 4, 1, 2), torch.float32,
                            capacity_pages=6, sync_every_pages=1)  # durable at once: events = snapshot
            caches.append(PrefixCache(device.pages, 4, f"w{i}", 1, wire.append, device, host, disk))
            devices.append(device)
            held.append([])
            index.add_worker(f"w{i}", 1)
        for which, op, k, n in ops:
            cache, device = caches[which], devices[which]
            salt = b"ab"[k % 2 : k % 2 + 1]
            if op == "run":
                pages = _run(cache, device, page_hashes(list(range(k * 5, k * 5 + 4 * n)), 4, salt, b"t" * 16))
                if pages is not None:
                    held[which].append(pages)
            elif op == "release" and held[which]:
                device.pages.free(held[which].pop(k % len(held[which])))
            elif op == "evict":
                cache.evict(n)
            elif op == "purge":
                cache.purge(salt)
            elif op == "lose" and wire:  # the event bus drops one
                wire.pop(k % len(wire))
            elif op == "dup" and wire:
                wire.append(wire[k % len(wire)])
            for event in wire[: len(wire) // 2]:  # deliver half of what is on the wire
                index.apply(event)
            del wire[: len(wire) // 2]
        for event in wire:
            index.apply(event)
        for i, cache in enumerate(caches):
            seq, _ = cache.snapshot()
            index.observe_seq(f"w{i}", 1, seq)
        for request in index.stale_workers():
            seq, pages = caches[int(request.worker_id[1])].snapshot()
            assert index.load_snapshot(request.worker_id, 1, seq, pages) is None
        for i, cache in enumerate(caches):
            assert index.worker_pages(f"w{i}") == dict(cache.snapshot()[1])
            assert cache.disk is not None
            cache.disk.close()


# -- memory bound -------------------------------------------------------------------------------


def _store_chain(index: GlobalIndex, worker: str, seq: int, hashes: list[bytes]) -> None:
    assert index.apply(KVEvent(worker, 1, seq, EventKind.STORED, tuple(hashes), Tier.DEVICE)) is None


def test_the_cap_holds_and_recently_touched_pages_survive() -> None:
    index = _joined("a", "b", max_pages=64)
    hot = [b"hot-%012d" % i for i in range(4)]
    _store_chain(index, "a", 1, hot)
    for seq in range(2, 80):
        _store_chain(index, "b", seq - 1, [b"cold-%05d-%05d" % (seq, j) for j in range(3)])
        assert index.num_pages <= 64
        assert index.match(hot).to_dict() == {"a": PrefixHit(4, 0, 0)}  # matched: moves up, never forgotten
    assert index.num_forgotten_pages == 4 + 78 * 3 - 64
    assert index.num_pages == 64 == sum(len(p) for p in (index.worker_pages("a"), index.worker_pages("b")))
    newest = [b"cold-%05d-%05d" % (79, j) for j in range(3)]
    assert index.match(newest[:1]).to_dict() == {"b": PrefixHit(1, 0, 0)}
    assert index.match([b"cold-%05d-%05d" % (2, 0)]).to_dict() == {}  # the oldest cold chain is gone


def test_bytes_per_page_is_measured_and_small() -> None:
    """1 M pages x 256 workers must fit comfortably: sharing an int per holder set, a page
    costs its hash and its dict entry. tracemalloc agrees with the getsizeof accounting."""
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = GlobalIndex(max_pages=1 << 20)
    for w in range(256):
        index.load_snapshot(f"w{w}", 1, 0, [])
    seqs = [0] * 256
    for _ in range(500):
        hashes = [rng.randbytes(16) for _page in range(64)]
        for w in rng.sample(range(256), rng.choice([1, 1, 2, 3])):
            seqs[w] += 1
            _store_chain(index, f"w{w}", seqs[w], hashes)
        del hashes
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.num_pages == 500 * 64
    per_page = index.bytes_per_page()
    assert 49 <= per_page < 120, per_page  # a 16-byte hash alone is a 49-byte object
    assert abs(traced / index.num_pages - per_page) < 0.25 * per_page, (traced / index.num_pages, per_page)
