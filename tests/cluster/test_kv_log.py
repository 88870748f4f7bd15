"""cluster.placement.kv_log: a worker's KV events in bounded batches, a snapshot, and how a gateway that
fell behind the log's bound finds the gap and recovers through the snapshot."""

from __future__ import annotations

from dataclasses import replace

from cluster.placement.global_index import GlobalIndex
from cluster.placement.kv_log import KVEventLog
from kvcache.hashing import model_fingerprint, page_hashes
from kvcache.pool import PagePool
from kvcache.radix import PrefixCache

FP = model_fingerprint("kv-log-test")


def _fill(cache: PrefixCache, pool: PagePool, start: int) -> list[bytes]:
    hashes = page_hashes(list(range(start, start + 8)), 4, b"", FP)
    pages = pool.allocate(2)
    assert pages is not None
    cache.insert(hashes, pages, 0)
    pool.free(pages)
    return hashes


def test_batches_snapshot_and_gap_recovery() -> None:
    pool = PagePool(64)
    cache = PrefixCache(pool, 4)
    log = KVEventLog(cache, epoch=7, max_events=3)
    assert log.events(0) == () and log.last_seq == 0
    chains = [_fill(cache, pool, 100 * i) for i in range(5)]  # one STORED event each
    assert log.last_seq == 5
    assert [e.seq for e in log.events(0)] == [3, 4, 5]  # the bound kept the newest three
    assert [e.seq for e in log.events(3, limit=1)] == [4] and log.events(5) == ()
    assert all(e.epoch == 7 for e in log.events(0))

    index = GlobalIndex()
    assert index.add_worker("w", 7) is not None  # joined: wants a snapshot
    epoch, seq, entries = log.snapshot()
    assert (epoch, seq) == (7, 5) and len(entries) == 10
    assert index.load_snapshot("w", epoch, seq, entries) is None
    assert index.match(chains[0]).hit("w").num_pages == 2

    _fill(cache, pool, 900)
    _fill(cache, pool, 1000)
    _fill(cache, pool, 1100)
    _fill(cache, pool, 1200)  # seq 9; the log holds 7..9: event 6 is lost to a slow poller
    events = log.events(5)
    assert [e.seq for e in events] == [7, 8, 9]
    requests = [r for e in events if (r := index.apply(replace(e, worker_id="w"))) is not None]  # the gateway names it
    assert requests == [("w", 7)]  # the gap is seen at event 7
    assert index.sync_state("w") == (7, 5, True)
    assert index.load_snapshot("w", *log.snapshot()) is None
    assert index.match(page_hashes(list(range(900, 908)), 4, b"", FP)).hit("w").num_pages == 2
