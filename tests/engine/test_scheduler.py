"""Scenario tests for the step scheduler, asserting exact page ids and states."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcache.pool import PagePool

PARAMS = SamplingParams(max_tokens=100, temperature=0.0)


def make(num_pages: int = 8, **cfg: int) -> Scheduler:
    defaults = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_prefill_chunk": 64,
        "page_size": 4,
    }
    defaults.update(cfg)
    return Scheduler(SchedulerConfig(**defaults), PagePool(num_pages))


_arrival = iter(range(10**6))


def req(req_id: str, prompt_len: int, priority: int = 0) -> Request:
    return Request(req_id, list(range(10, 10 + prompt_len)), PARAMS, priority, next(_arrival))


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


def test_chunked_prefill_splits_a_long_prompt() -> None:
    s = make(max_prefill_chunk=4)
    a = req("a", 10)
    s.add(a)
    assert [apply(s.schedule())["a"] for _ in range(3)] == [4, 4, 2]
    assert a.output_ids == [7] and a.page_ids == [0, 1, 2]


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
