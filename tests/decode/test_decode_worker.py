"""The decode worker's bookkeeping, on one engine with a fake clock: conditional disaggregation
counts the uncached part of the prompt; every way a reservation ends (admitted, cancelled,
aborted, superseded, expired open, expired complete at its admission lease) leaves the pool
whole, and `on_settle` hears of completions and failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.request import SloClass
from engine.sampling import SamplingParams
from kvtransfer.codec import CodecLimits
from kvtransfer.local import receive_all
from kvtransfer.transport import KVDestination, build_chunks
from tests.clock import Clock

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(100, 180))  # 80 tokens: 5 pages


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=32))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def settles() -> list[int]:
    return []


@pytest.fixture
def worker(engine: Engine, clock: Clock, settles: list[int]) -> DecodeWorker:
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()  # each test starts from an empty cache
    return DecodeWorker(engine, "decode-0", reservation_ttl_s=5.0, local_prefill_tokens=32, admit_lease_s=2.0,
                        clock=clock, on_settle=lambda: settles.append(1))


def _whole(worker: DecodeWorker) -> bool:
    engine = worker.engine
    engine.check_integrity()
    return engine.free_pages_at_idle() == engine.pool.num_pages and worker.num_reserved_pages == 0


def _fill(worker: DecodeWorker, dest: KVDestination) -> None:
    """Every page of `dest`, zeros, through the real receive path."""
    import torch

    lay = worker.engine.pool.layout
    kv = torch.zeros(len(dest.dest_page_ids), lay.num_layers, 2, lay.page_size, lay.num_kv_heads, lay.head_dim,
                     dtype=worker.engine.pool.kv.dtype)
    assert receive_all(worker.receiver, build_chunks(dest, kv, dest.epoch), CodecLimits()) == ""


def test_prefers_local_counts_only_the_uncached_part(worker: DecodeWorker) -> None:
    job = Job("long", PROMPT, GREEDY)
    assert worker.cached_tokens(job) == 0 and not worker.prefers_local(job)
    assert worker.prefers_local(Job("short", PROMPT[:20], GREEDY))
    worker.start_local(job)  # served here: its full pages enter the prefix cache
    while worker.engine.has_unfinished():
        worker.step()
    again = Job("again", PROMPT + (7, 8, 9), GREEDY)
    assert worker.cached_tokens(again) == 80 and worker.prefers_local(again)
    other_tenant = Job("t2", PROMPT + (7, 8, 9), GREEDY, cache_salt="t2")
    assert worker.cached_tokens(other_tenant) == 0 and not worker.prefers_local(other_tenant)
    assert _whole(worker)


def test_a_batch_job_is_not_prefilled_here_while_requests_run(worker: DecodeWorker) -> None:
    short = Job("short", PROMPT[:20], GREEDY, slo=SloClass.BATCH)
    assert worker.prefers_local(short)  # nothing runs here: nobody to stall
    worker.start_local(Job("running", PROMPT[:8], GREEDY))
    worker.step()
    assert worker.engine.scheduler.running
    assert not worker.prefers_local(short) and worker.prefers_local(Job("std", PROMPT[:20], GREEDY))
    while worker.engine.has_unfinished():
        worker.step()
    assert worker.prefers_local(short) and _whole(worker)


def test_every_end_of_a_reservation_returns_its_pages(worker: DecodeWorker, clock: Clock, settles: list[int]) -> None:
    job = Job("r", PROMPT, GREEDY)
    dest = worker.reserve(job, 1)
    assert dest is not None and worker.num_reserved_pages == 5
    worker.cancel(dest)
    assert _whole(worker) and worker.is_settled(dest) and not worker.is_complete(dest)

    first = worker.reserve(job, 1)
    second = worker.reserve(job, 1)  # a new placement of the same request supersedes the first
    assert first is not None and second is not None and worker.num_reserved_pages == 5
    assert worker.is_settled(first) and not worker.is_settled(second)
    worker.abort(job.req_id)
    assert _whole(worker)

    job = Job("r2", PROMPT, GREEDY)  # an aborted id is never placed again
    open_dest = worker.reserve(job, 1)
    assert open_dest is not None
    clock.now += 5.0
    assert worker.expire() == 1 and worker.book.num_expired == 1 and _whole(worker)

    done = worker.reserve(job, 1)
    assert done is not None
    n = len(settles)
    _fill(worker, done)
    assert worker.is_complete(done) and len(settles) == n + 1  # completion is heard
    clock.now += 1.9
    assert worker.expire() == 0 and worker.num_reserved_pages == 5  # within its lease
    clock.now += 0.1
    assert worker.expire() == 1 and worker.num_lease_expired == 1 and _whole(worker)


def test_an_admitted_transfer_is_the_requests(worker: DecodeWorker, clock: Clock) -> None:
    job = Job("a", PROMPT, GREEDY)
    dest = worker.reserve(job, 1)
    assert dest is not None
    _fill(worker, dest)
    worker.start_prefilled(job, dest, first_token=5)
    assert worker.num_reserved_pages == 0
    clock.now += 60.0
    assert worker.expire() == 0  # no lease on pages a request owns
    worker.abort("a")  # and aborting the request frees them
    assert _whole(worker)


def test_a_placement_arriving_after_its_abort_takes_nothing(worker: DecodeWorker, clock: Clock) -> None:
    """Ray does not order an async actor's calls: the gateway's abort of a request it gave up
    can run before that request's place. The late placement must reserve nothing and start
    nothing (else its pages stay held until the reservation TTL)."""
    job = Job("late", PROMPT, GREEDY)
    worker.abort("late")  # nothing of it here yet
    assert worker.was_aborted("late")
    with pytest.raises(RuntimeError, match="aborted"):
        worker.reserve(job, 1)
    with pytest.raises(RuntimeError, match="aborted"):
        worker.start_local(job)
    assert _whole(worker) and not worker.engine.has_unfinished()
    clock.now += 5.0  # past the reservation TTL: no placement of it can still be in flight
    worker.expire()
    assert not worker.was_aborted("late")
    dest = worker.reserve(job, 1)  # (an id is never reused; this shows the mark went)
    assert dest is not None
    worker.cancel(dest)


def test_a_transfer_cut_part_way_leaves_its_verified_pages_cached(worker: DecodeWorker) -> None:
    """The leading pages that arrived whole and verified before a transfer failed are offered to
    the prefix cache as the reservation's pages go back: a re-run here (decode-local, after the
    sender failed) computes only the pages from the first one missing."""
    import torch

    job = Job("cut", PROMPT, GREEDY)
    dest = worker.reserve(job, sender_epoch=1)
    assert dest is not None
    lay = worker.engine.pool.layout
    kv = torch.ones(len(dest.dest_page_ids), lay.num_layers, 2, lay.page_size, lay.num_kv_heads, lay.head_dim,
                    dtype=worker.engine.pool.kv.dtype)
    first = build_chunks(dest, kv, dest.epoch, pages_per_chunk=3)[0]  # pages 0-2 arrive; 3-4 never do
    assert receive_all(worker.receiver, [first], CodecLimits()) == "transfer incomplete"  # released
    assert worker.is_settled(dest) and worker.num_reserved_pages == 0
    assert worker.num_kept_pages == 3 and worker.cached_tokens(job) == 3 * 16
    assert _whole(worker)  # kept pages are cached (evictable), not held
    worker.start_local(job)
    first_out = worker.step()[0]
    assert first_out.cached.total == 3 * 16
    while worker.engine.has_unfinished():
        worker.step()
