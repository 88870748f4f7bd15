"""The step scheduler: which requests compute how many tokens this step.

Continuous batching with a per-step token budget (vLLM v1's shape, in miniature):

1. Running requests, highest priority first, each take what they still have to compute
   (one token when decoding, a chunk of a long prompt otherwise), capped by the budget and
   by `max_prefill_chunk`. When the pool cannot hold their new pages, the lowest-priority,
   most recent running request is preempted: its pages are freed and it goes back to the
   waiting queue to be recomputed later (preemption by recompute).
2. Then, if nothing was preempted this step, waiting requests are admitted in (priority,
   arrival) order while the budget, `max_num_seqs` and free pages allow.

`abort` removes a request in any state and frees every page it holds.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from dataclasses import dataclass
from typing import NamedTuple

from engine.request import Request, RequestStatus
from kvcache.pool import PagePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget per step
    max_prefill_chunk: int = 512  # longest piece of one prompt per step (chunked prefill)
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler.{name} must be positive")


class ScheduledRequest(NamedTuple):
    request: Request
    num_new: int  # tokens computed this step, starting at request.num_computed_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pages: PagePool) -> None:
        self.cfg = cfg
        self.pages = pages
        self.running: list[Request] = []  # sorted by (priority, arrival)
        self._waiting: list[tuple[tuple[int, int], Request]] = []  # heap on (priority, arrival)
        self._by_id: dict[str, Request] = {}

    # -- queue management -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_requests(self) -> int:
        return len(self._by_id)

    def get(self, req_id: str) -> Request | None:
        return self._by_id.get(req_id)

    def add(self, request: Request) -> None:
        if request.req_id in self._by_id:
            raise ValueError(f"duplicate req_id {request.req_id!r}")
        self._by_id[request.req_id] = request
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (request.sort_key, request))

    def abort(self, req_id: str) -> Request | None:
        """Remove a request in any state, freeing its pages; None if unknown or finished."""
        request = self._by_id.get(req_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._waiting = [item for item in self._waiting if item[1] is not request]
            heapq.heapify(self._waiting)
        self.finish(request)
        return request

    def finish(self, request: Request) -> None:
        """Retire a request (finished or aborted) and free its pages."""
        if request.status == RequestStatus.RUNNING and request in self.running:
            self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        del self._by_id[request.req_id]

    # -- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_pending, budget, self.cfg.max_prefill_chunk)
            if not self._grow(request, num_new, preempted):
                break  # the request preempted itself: nothing lower-priority was left
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            idx += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _grow(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        """Make room for `num_new` more tokens, preempting from the back of `running`."""
        while True:
            needed = self._pages_needed(request, num_new)
            if self.pages.can_allocate(needed):
                self._take_pages(request, needed)
                return True
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self._waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            request = self._waiting[0][1]
            num_new = min(request.num_pending, budget, self.cfg.max_prefill_chunk)
            needed = self._pages_needed(request, num_new)
            if not self.pages.can_allocate(needed):
                break  # FCFS within priority: do not let a later, smaller request jump ahead
            heapq.heappop(self._waiting)
            self._take_pages(request, needed)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _pages_needed(self, request: Request, num_new: int) -> int:
        total = request.num_computed_tokens + num_new
        return -(-total // self.cfg.page_size) - len(request.page_ids)

    def _take_pages(self, request: Request, n: int) -> None:
        if n <= 0:
            return
        pages = self.pages.allocate(n)
        if pages is None:  # can_allocate said yes a moment ago
            raise RuntimeError("page pool changed under the scheduler")
        request.page_ids.extend(pages)

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s (%d tokens)", request.req_id, request.num_tokens)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        heapq.heappush(self._waiting, (request.sort_key, request))

    def _release(self, request: Request) -> None:
        if request.page_ids:
            self.pages.free(request.page_ids)
        request.page_ids = []
        request.num_computed_tokens = 0
