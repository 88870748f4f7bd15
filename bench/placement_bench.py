"""Placement at scale (BENCHMARKS.md P10): the real GlobalIndex and Placer over simulated
workers. Placement latency p50/p99 at 256 workers with 1 M indexed pages, and the index's
bytes per page.

    python -m bench.placement_bench [--workers 256] [--pages 1000000] [--requests 20000]

Build (from the KV events workers would send): each tenant's system prompt is held by a
quarter of the fleet; conversations (a system prompt + a history of their own) are held by one
to three workers, the head of the history on the device, the tail on the host or disk.
Requests: 70 % follow-up turns of a conversation, 20 % new conversations on a known system
prompt, 10 % unrelated prompts. Each one's page hashes are computed as the gateway would
(timed apart), then it is placed (timed); the chosen worker then reports the pages it
computed (events, timed apart), so the index stays at its cap and evicts; in-flight windows
keep the fairness and queue books busy; worker stats change between reports as they would.
Prints one JSON line, then a table. Latencies are wall clock; placement is also timed in the
thread's CPU time, which a busy machine's preemptions do not inflate.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from cluster.placement.global_index import GlobalIndex
from cluster.placement.policy import PlacementConfig, Placer, Role, WorkerStats
from kvcache.events import EventKind, KVEvent, Tier
from kvcache.hashing import page_hashes

PAGE_SIZE = 16
FINGERPRINT = b"placement-bench!"
SYSTEM_PAGES = 32
VOCAB = 32_000


class Conversation(NamedTuple):
    tenant: int
    seed: int
    num_pages: int  # of its own history, after the system prompt


class Sim:
    """The fleet: workers' event sequence numbers and the stats they report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        self.num_workers = args.workers
        self.ids = [f"p{i}" if i < args.workers // 2 else f"d{i}" for i in range(args.workers)]
        self.seqs = dict.fromkeys(self.ids, 0)
        self.index = GlobalIndex(max_pages=args.pages)
        self.placer = Placer(self.index, PlacementConfig(page_size=PAGE_SIZE, page_bytes=128 << 10,
                                                         transfer_bytes_per_s=5e9, peer_bytes_per_s=2e9),
                             random.Random(args.seed + 1))
        self.system = [_tokens(10**9 + t, SYSTEM_PAGES * PAGE_SIZE) for t in range(args.tenants)]
        self.system_hashes = [page_hashes(s, PAGE_SIZE, _salt(t), FINGERPRINT) for t, s in enumerate(self.system)]
        self.num_events = 0
        for w in self.ids:
            self.index.load_snapshot(w, 1, 0, [])
            self.report(w)

    def report(self, worker_id: str) -> None:
        """A stats report: measured numbers that wander between reports."""
        r = self.rng
        role = Role.PREFILL if worker_id[0] == "p" else Role.DECODE
        self.placer.update_worker(WorkerStats(
            worker_id, role, prefill_s_per_token=r.uniform(0.7e-4, 1.3e-4), queue_delay_s=r.uniform(0.0, 0.05),
            host_bytes_per_s=r.uniform(10e9, 20e9), disk_bytes_per_s=r.uniform(1e9, 3e9),
            itl_s=r.uniform(0.01, 0.03), num_running=r.randrange(0, 64), num_waiting=r.randrange(0, 4),
            max_running=64, num_free_pages=r.randrange(2_000, 20_000),
        ))

    def emit(self, worker_id: str, kind: EventKind, hashes: list[bytes], tier: Tier) -> None:
        if hashes:
            self.seqs[worker_id] += 1
            self.index.apply(KVEvent(worker_id, 1, self.seqs[worker_id], kind, tuple(hashes), tier))
            self.num_events += 1

    def hashes(self, conv: Conversation, extra_pages: int = 0) -> tuple[list[bytes], int]:
        """A prompt's page hashes, computed as the gateway does, and its length in tokens."""
        own = _tokens(conv.seed, (conv.num_pages + extra_pages) * PAGE_SIZE + 7)  # + a partial page
        prompt = self.system[conv.tenant] + own
        return page_hashes(prompt, PAGE_SIZE, _salt(conv.tenant), FINGERPRINT), len(prompt)

    def cache(self, worker_id: str, hashes: list[bytes]) -> None:
        """`worker_id` caches a prompt's pages: the head on the device, the tail lower down."""
        self.emit(worker_id, EventKind.STORED, hashes, Tier.DEVICE)
        n = len(hashes)
        host_from = self.rng.randint(min(SYSTEM_PAGES, n), n)
        disk_from = self.rng.randint(host_from, n)
        self.emit(worker_id, EventKind.TIER_CHANGED, hashes[host_from:disk_from], Tier.HOST)
        self.emit(worker_id, EventKind.TIER_CHANGED, hashes[disk_from:], Tier.DISK)


def _tokens(seed: int, n: int) -> list[int]:
    return list(np.random.default_rng(seed).integers(0, VOCAB, n).tolist())


def _salt(tenant: int) -> bytes:
    return b"tenant-%d" % tenant


def build(sim: Sim, num_pages: int) -> list[Conversation]:
    r = sim.rng
    for hashes in sim.system_hashes:  # each system prompt: a quarter of the fleet
        for w in r.sample(sim.ids, max(1, sim.num_workers // 4)):
            sim.emit(w, EventKind.STORED, hashes, Tier.DEVICE)
    conversations: list[Conversation] = []
    while sim.index.num_pages < num_pages:
        conv = Conversation(r.randrange(len(sim.system)), r.getrandbits(48), r.randint(16, 96))
        hashes, _ = sim.hashes(conv)
        for w in r.sample(sim.ids, r.choice((1, 1, 1, 2, 2, 3))):
            sim.cache(w, hashes)
        conversations.append(conv)
    return conversations


def serve(sim: Sim, conversations: list[Conversation], num_requests: int) -> dict[str, list[float]]:
    r, placer = sim.rng, sim.placer
    times: dict[str, list[float]] = {"place": [], "place_cpu": [], "hash": [], "events": [], "report": []}
    prefilling: deque[str] = deque()
    decoding: deque[str] = deque()
    for i in range(num_requests):
        kind = r.random()
        if kind < 0.7:  # a follow-up turn: the history + one to four new pages
            conv = conversations[r.randrange(len(conversations))]
            conv = conv._replace(num_pages=conv.num_pages + r.randint(1, 4))
        elif kind < 0.9:  # a new conversation on a known system prompt
            conv = Conversation(r.randrange(len(sim.system)), r.getrandbits(48), r.randint(4, 32))
            conversations.append(conv)
        else:  # unrelated: a tenant nobody has served
            conv = Conversation(len(sim.system) + r.randrange(1000), r.getrandbits(48), r.randint(8, 64))
        start = time.perf_counter_ns()
        if conv.tenant >= len(sim.system):
            num_tokens = conv.num_pages * PAGE_SIZE + 7
            hashes = page_hashes(_tokens(conv.seed, num_tokens), PAGE_SIZE, _salt(conv.tenant), FINGERPRINT)
        else:
            hashes, num_tokens = sim.hashes(conv)
        mid, mid_cpu = time.perf_counter_ns(), time.thread_time_ns()
        got = placer.place(f"r{i}", hashes, num_tokens, tenant=str(conv.tenant))
        end, end_cpu = time.perf_counter_ns(), time.thread_time_ns()
        times["hash"].append((mid - start) / 1e3)
        times["place"].append((end - mid) / 1e3)
        times["place_cpu"].append((end_cpu - mid_cpu) / 1e3)
        site = got.prefill_id or got.decode_id
        if site is not None:
            start = time.perf_counter_ns()
            sim.cache(site, hashes)  # the pages it computed are now cached there
            times["events"].append((time.perf_counter_ns() - start) / 1e3)
            prefilling.append(f"r{i}")
        if len(prefilling) > 128:  # first token back
            req_id = prefilling.popleft()
            placer.release_prefill(req_id)
            decoding.append(req_id)
        if len(decoding) > 1024:
            placer.finish(decoding.popleft())
        if i % 50 == 0:
            start = time.perf_counter_ns()
            for w in r.sample(sim.ids, 16):
                sim.report(w)
            times["report"].append((time.perf_counter_ns() - start) / 1e3 / 16)
    return times


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.placement_bench",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--pages", type=int, default=1_000_000, help="indexed pages (also the index's cap)")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracemalloc", action="store_true", help="also measure the build with tracemalloc (slower)")
    args = parser.parse_args(argv)
    if args.tracemalloc:
        tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0
    start = time.perf_counter()
    sim = Sim(args)
    conversations = build(sim, args.pages)
    build_s = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[0] - traced_before if args.tracemalloc else 0
    tracemalloc.stop()
    num_indexed = sim.index.num_pages
    bytes_per_page = sim.index.bytes_per_page()
    times = serve(sim, conversations, args.requests)
    busiest = max(sim.ids, key=lambda w: sim.seqs[w])
    pages = list(sim.index.worker_pages(busiest).items())
    start = time.perf_counter()
    sim.index.load_snapshot(busiest, 2, 0, pages)  # a restart: its part dropped, then reloaded
    rebuild_ms = (time.perf_counter() - start) * 1e3
    stats = sim.placer.stats
    row: dict[str, Any] = {
        "workers": args.workers, "indexed_pages": num_indexed, "pages_after": sim.index.num_pages,
        "requests": args.requests, "build_s": round(build_s, 1), "build_events": sim.num_events,
        "place_us_p50": _pct(times["place"], 50), "place_us_p99": _pct(times["place"], 99),
        "place_us_p999": _pct(times["place"], 99.9), "place_us_max": round(max(times["place"]), 1),
        "place_cpu_us_p50": _pct(times["place_cpu"], 50), "place_cpu_us_p99": _pct(times["place_cpu"], 99),
        "place_cpu_us_p999": _pct(times["place_cpu"], 99.9),
        "hash_us_p50": _pct(times["hash"], 50), "hash_us_p99": _pct(times["hash"], 99),
        "events_us_p50": _pct(times["events"], 50), "events_us_p99": _pct(times["events"], 99),
        "report_us_p99": _pct(times["report"], 99),
        "index_bytes_per_page": round(bytes_per_page, 1),
        "index_mb": round(bytes_per_page * num_indexed / 1e6, 1),
        "traced_bytes_per_page": round(traced / max(1, num_indexed), 1) if args.tracemalloc else None,
        "snapshot_rebuild_ms": round(rebuild_ms, 1), "snapshot_pages": len(pages),
        "hit_share": round(stats.hit_pages / max(1, stats.best_hit_pages), 3),
        "local_share": round(stats.num_local / max(1, stats.num_placed), 3),
        "saturated": stats.num_saturated, "forgotten_pages": sim.index.num_forgotten_pages,
    }
    print(json.dumps(row))
    print(f"P10: {args.workers} workers, {num_indexed:,} indexed pages, {args.requests:,} placements", file=sys.stderr)
    print(f"  placement      p50 {row['place_us_p50']:8.1f} us   p99 {row['place_us_p99']:8.1f} us   "
          f"p99.9 {row['place_us_p999']:8.1f} us", file=sys.stderr)
    print(f"  (thread CPU)   p50 {row['place_cpu_us_p50']:8.1f} us   p99 {row['place_cpu_us_p99']:8.1f} us   "
          f"p99.9 {row['place_cpu_us_p999']:8.1f} us",
          file=sys.stderr)
    print(f"  prompt hashing p50 {row['hash_us_p50']:8.1f} us   p99 {row['hash_us_p99']:8.1f} us", file=sys.stderr)
    print(f"  index          {row['index_bytes_per_page']} B/page ({row['index_mb']} MB); "
          f"snapshot rebuild of {len(pages):,} pages: {row['snapshot_rebuild_ms']} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
