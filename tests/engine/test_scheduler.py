"""Scenario tests for the step scheduler, asserting exact page ids and states."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.request import Request, RequestStatus, SloClass
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcache.pool import PagePool
from kvcache.radix import PrefixCache

PARAMS = SamplingParams(max_tokens=100, temperature=0.0)


def make(num_pages: int = 8, policy: str = "fcfs", **cfg: int) -> Scheduler:
    """A scheduler over `num_pages` pages; arrival order unless `policy` says otherwise (these
    scenarios assert exact page ids, which follow the order of admission)."""
    defaults = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_prefill_chunk": 64,
        "page_size": 4,
    }
    defaults.update(cfg)
    return Scheduler(SchedulerConfig(**defaults, policy=policy), PagePool(num_pages))


_arrival = iter(range(10**6))


def req(req_id: str, prompt_len: int, priority: int = 0, slo: SloClass = SloClass.STANDARD) -> Request:
    return Request(req_id, list(range(10, 10 + prompt_len)), PARAMS, priority, next(_arrival), slo)


def apply(out: SchedulerOutput) -> dict[str, int]:
    """What the engine does after a step: count computed tokens, append a token on catch-up."""
    for request, num_new in out.scheduled:
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens:
            request.output_ids.append(7)
    return {r.req_id: n for r, n in out.scheduled}


def test_prefill_then_decode_allocates_pages_on_page_boundaries() -> None:
    s = make()
    a, b = req("a", 6), req("b", 3)
    s.add(a)
    s.add(b)
    assert apply(s.schedule()) == {"a": 6, "b": 3}
    assert a.page_ids == [0, 1] and b.page_ids == [2]
    assert apply(s.schedule()) == {"a": 1, "b": 1}  # a at 7 tokens, b at 4: no new page
    assert a.page_ids == [0, 1] and b.page_ids == [2]
    assert apply(s.schedule()) == {"a": 1, "b": 1}  # b's 5th token starts a page
    assert b.page_ids == [2, 3]
    s.pages.check_integrity()


def test_chunked_prefill_splits_a_long_prompt_beside_decode_rows() -> None:
    s = make(max_prefill_chunk=4)
    b = req("b", 2)
    s.add(b)
    assert apply(s.schedule()) == {"b": 2}  # b decodes from now on
    a = req("a", 10)
    s.add(a)
    steps = [apply(s.schedule()) for _ in range(3)]
    assert [step["a"] for step in steps] == [4, 4, 2] and all(step["b"] == 1 for step in steps)
    assert a.output_ids == [7] and len(a.page_ids) == 3


def test_a_step_without_decode_rows_takes_a_prompt_up_to_its_budget() -> None:
    """max_prefill_chunk protects decode rows' inter-token latency; with none in the step, a
    prompt's piece is capped by the step's budget alone."""
    s = make(max_prefill_chunk=4, max_num_batched_tokens=8)
    a = req("a", 10)
    s.add(a)
    assert [apply(s.schedule())["a"] for _ in range(2)] == [8, 2]
    assert a.output_ids == [7] and a.page_ids == [0, 1, 2]
    streaming = make(max_prefill_chunk=4, max_num_batched_tokens=8)  # a prefill worker's: pages leave piece by piece
    streaming.cfg = replace(streaming.cfg, stream_chunks=True)
    b = req("b", 10)
    streaming.add(b)
    assert [apply(streaming.schedule())["b"] for _ in range(3)] == [4, 4, 2]


def test_token_budget_is_shared_and_fcfs_within_a_class() -> None:
    s = make(max_num_batched_tokens=5)
    for name in "abc":
        s.add(req(name, 3))
    assert apply(s.schedule()) == {"a": 3, "b": 2}
    assert apply(s.schedule()) == {"a": 1, "b": 1, "c": 3}


def test_priority_classes_run_first() -> None:
    s = make(max_num_seqs=1)
    s.add(req("low", 2, priority=1))
    s.add(req("high", 2, priority=0))
    assert apply(s.schedule()) == {"high": 2}


def test_page_pressure_preempts_the_latest_request_and_recomputes_it() -> None:
    s = make(num_pages=4)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    apply(s.schedule())  # a 8 tokens in [0,1], b in [2,3]; each sampled one token
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3]
    out = s.schedule()  # a's 9th token needs a page: b is preempted
    assert [r.req_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.page_ids == [] and b.num_computed_tokens == 0
    assert a.page_ids == [0, 1, 2]
    assert apply(out) == {"a": 1}
    s.abort("a")
    out = s.schedule()  # b is recomputed: prompt + its one output token
    assert apply(out) == {"b": 9}
    assert b.page_ids == [3, 0, 1] and b.num_preemptions == 1
    s.pages.check_integrity()


def test_abort_frees_pages_in_every_state() -> None:
    s = make(num_pages=4, max_num_seqs=1)
    running, waiting = req("running", 5), req("waiting", 5)
    s.add(running)
    s.add(waiting)
    apply(s.schedule())
    assert s.pages.num_used == 2
    assert s.abort("waiting") is waiting
    assert s.abort("running") is running
    assert s.abort("unknown") is None
    assert s.pages.num_free == 4 and s.num_requests == 0
    s.pages.check_integrity()


# -- least uncached work first (the default policy) ------------------------------------------


def test_the_least_uncached_work_is_admitted_first_within_a_priority_class() -> None:
    s = make(policy="least-uncached", max_num_seqs=1)
    s.add(req("cold", 20))
    s.add(req("warm", 3))
    assert apply(s.schedule()) == {"warm": 3}  # arrived later, but three tokens from its first token
    s = make(policy="least-uncached", max_num_seqs=1)
    s.add(req("cold", 20, priority=0))
    s.add(req("warm", 3, priority=1))
    assert apply(s.schedule()) == {"cold": 20}  # a priority class still comes first
    s = make(max_num_seqs=1)  # fcfs: arrival order
    s.add(req("cold", 20))
    s.add(req("warm", 3))
    assert apply(s.schedule()) == {"cold": 20}
    with pytest.raises(ValueError, match="scheduler.policy"):
        SchedulerConfig(policy="sjf")


def test_a_long_prompt_ages_by_the_work_done_after_it_and_is_never_starved() -> None:
    """Rank = uncached tokens + prompt tokens the engine had computed when the request arrived:
    a 12-token prompt lets newcomers of 2 tokens pass until 10 tokens of their work are done."""
    s = make(policy="least-uncached", max_num_seqs=1)
    s.add(req("long", 12))
    order = []
    for i in range(8):
        s.add(req(f"short{i}", 2))
        first = apply(s.schedule())
        (name,) = first
        order.append(name)
        s.abort(name)  # finished: the next newcomer arrives
    assert order == ["short0", "short1", "short2", "short3", "short4", "long", "short5", "short6"]
    assert s.work_done == 5 * 2 + 12 + 2 * 2


def test_a_steps_prompt_tokens_go_to_the_prompts_closest_to_their_first_token() -> None:
    s = make(policy="least-uncached", max_num_batched_tokens=8, max_prefill_chunk=8, num_pages=16)
    s.add(req("a", 20))
    assert apply(s.schedule()) == {"a": 8}  # 12 left; ranks 12 + 0
    s.add(req("b", 3))  # ranks 3 + 8 (it arrived after 8 tokens of work): ahead of a
    assert apply(s.schedule()) == {"b": 3, "a": 5}
    s = make(max_num_batched_tokens=8, max_prefill_chunk=8, num_pages=16)  # fcfs: a's chunk first
    s.add(req("a", 20))
    apply(s.schedule())
    s.add(req("b", 3))
    assert apply(s.schedule()) == {"a": 8}


def test_prompt_tokens_a_waiting_request_cannot_take_go_to_the_held_prompts() -> None:
    """A waiting request ranked ahead of a running prompt whose prefix that prompt is still
    computing waits for it (no duplicate work); the tokens it was ranked for go to the running
    prompt, so the two never wait on each other."""
    pool = PagePool(32)
    cache = PrefixCache(pool, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_prefill_chunk=8, page_size=4), pool, cache)
    shared = list(range(100, 116))  # 4 pages
    leader = Request("leader", [*shared, 90, 91, 92, 93], PARAMS, 1, next(_arrival))
    s.add(leader)
    assert apply(s.schedule()) == {"leader": 8}
    s.commit(leader)
    follower = Request("follower", [*shared, *range(50, 59)], PARAMS, 0, next(_arrival))
    s.add(follower)  # priority 0 ranks it first, but its pages 2-3 are the leader's next chunk
    assert apply(s.schedule()) == {"leader": 8}
    s.commit(leader)
    assert follower.status == RequestStatus.WAITING
    out = s.schedule()  # the shared pages are cached now: the follower reuses all four
    assert apply(out) == {"follower": 8} and follower.num_cached_tokens == 16
    s.pages.check_integrity()


def test_a_queued_requests_estimate_resumes_where_it_stopped_and_rescans_after_an_eviction() -> None:
    pool = PagePool(32)
    cache = PrefixCache(pool, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_prefill_chunk=64, page_size=4), pool, cache)
    shared = list(range(100, 116))  # 4 pages
    first = Request("first", [*shared, 1], PARAMS, 0, next(_arrival))
    s.add(first)
    apply(s.schedule())
    s.commit(first)
    s.abort("first")  # finished: its pages stay cached
    busy = Request("busy", [7, 8], PARAMS, 0, next(_arrival))
    s.add(busy)
    apply(s.schedule())  # holds the one running slot: the next request waits
    queued = Request("queued", [*shared, *range(50, 58)], PARAMS, 0, next(_arrival))
    s.add(queued)
    (_, need, _), = s._waiting_ranks(s._window(), set()).values()
    assert (need, queued.rank_pages) == (8, 4)
    assert cache.evict(4) == 4  # the shared pages leave: the estimate must not keep them
    (_, need, _), = s._waiting_ranks(s._window(), set()).values()
    assert (need, queued.rank_pages) == (24, 0)


# -- service classes -------------------------------------------------------------------------

LATENCY, STANDARD, BATCH = SloClass.LATENCY, SloClass.STANDARD, SloClass.BATCH


@pytest.mark.parametrize("policy", ["fcfs", "least-uncached"])
def test_a_waiting_latency_request_goes_before_earlier_standard_ones_whatever_their_priority(policy: str) -> None:
    s = make(policy=policy, max_num_seqs=1)
    s.add(req("batch", 2, priority=-100, slo=BATCH))
    s.add(req("standard", 2, priority=-100))
    s.add(req("latency", 8, priority=100, slo=LATENCY))
    assert apply(s.schedule()) == {"latency": 8}
    s.abort("latency")
    assert apply(s.schedule()) == {"standard": 2}
    s.abort("standard")
    assert apply(s.schedule()) == {"batch": 2}


def test_a_latency_request_without_a_seat_preempts_the_latest_batch_request_and_runs_at_once() -> None:
    s = make(max_num_seqs=3, num_pages=16)
    b1, b2, std = req("b1", 4, slo=BATCH), req("b2", 4, slo=BATCH), req("std", 4)
    for r in (b1, b2, std):
        s.add(r)
    assert apply(s.schedule()) == {"std": 4, "b1": 4, "b2": 4}  # running order: class, then arrival
    s.add(req("late", 3, slo=LATENCY))
    out = s.schedule()
    assert [r.req_id for r in out.preempted] == ["b2"]  # one seat was enough
    assert b2.status == RequestStatus.PREEMPTED
    assert b2.page_ids == [] and b2.num_computed_tokens == 0 and b2.num_preemptions == 1
    assert apply(out) == {"std": 1, "b1": 1, "late": 3}  # admitted in the same step; b2 waits
    s.abort("late")
    assert apply(s.schedule()) == {"std": 1, "b1": 1, "b2": 5}  # back: prompt + its one token
    s.pages.check_integrity()


def test_a_latency_request_without_pages_preempts_batch_requests_until_it_fits() -> None:
    s = make(num_pages=6)
    b1, b2, b3 = req("b1", 8, slo=BATCH), req("b2", 4, slo=BATCH), req("b3", 4, slo=BATCH)
    for r in (b1, b2, b3):
        s.add(r)
    apply(s.schedule())
    assert (b1.page_ids, b2.page_ids, b3.page_ids, s.pages.num_free) == ([0, 1], [2], [3], 2)
    # Each decode row starts a page this step (3) and late's 12 tokens take 3 more: b3 going
    # leaves 3 free for 2 + 3, b2 going 4 free for 1 + 3. b1 stays.
    s.add(req("late", 12, slo=LATENCY))
    out = s.schedule()
    assert [r.req_id for r in out.preempted] == ["b3", "b2"]
    assert apply(out) == {"b1": 1, "late": 12}
    assert (b1.page_ids, s.get("late").page_ids, s.pages.num_free) == ([0, 1, 4], [5, 3, 2], 0)  # type: ignore[union-attr]
    # No free page: later's 2 and late's next one take b1's 3.
    s.add(req("later", 8, slo=LATENCY))
    out = s.schedule()
    assert [r.req_id for r in out.preempted] == ["b1"]
    assert apply(out) == {"late": 1, "later": 8}
    assert [r.req_id for _, r in sorted(s._waiting)] == ["b1", "b2", "b3"]  # back in order
    s.pages.check_integrity()


def test_a_standard_request_never_preempts_and_a_finishing_row_is_never_preempted() -> None:
    s = make(max_num_seqs=2)
    s.add(req("b1", 4, slo=BATCH))
    s.add(req("b2", 4, slo=BATCH))
    apply(s.schedule())
    s.add(req("std", 3))
    out = s.schedule()
    assert out.preempted == () and apply(out) == {"b1": 1, "b2": 1}  # std waits for a seat
    s.abort("std")
    b1, b2 = s.get("b1"), s.get("b2")
    assert b1 is not None and b2 is not None
    b2.finishing = True  # async scheduling: its last token is in flight, it leaves anyway
    s.add(req("late", 3, slo=LATENCY))
    out = s.schedule()
    assert [r.req_id for r in out.preempted] == ["b1"] and apply(out) == {"late": 3}
    s.add(req("late2", 3, slo=LATENCY))  # no seat, and only a finishing batch request: it waits
    out = s.schedule()
    assert out.preempted == () and apply(out) == {"late": 1}
