"""The step scheduler: which requests compute how many tokens this step.

Continuous batching with a per-step token budget (vLLM v1's shape, in miniature):

1. Running requests, highest priority first, each take what they still have to compute
   (one token when decoding, a chunk of a long prompt otherwise), capped by the budget and,
   in a step that carries decode rows, by `max_prefill_chunk` (a step without any has no
   inter-token latency to protect: its chunks are capped by the budget alone). When the pool
   cannot hold their new pages, the lowest-priority, most recent running request is
   preempted: its pages are freed and it goes back to the waiting queue to be recomputed
   later (preemption by recompute).
2. Then, if no running request had to preempt anything, waiting requests are admitted while
   the budget, `max_num_seqs` and free pages allow.

Service classes (engine.request.SloClass) order both queues before the priority does: LATENCY,
then STANDARD, then BATCH. Before anything is scheduled, a LATENCY request at the head of the
waiting queue that could not be admitted now -- no seat left under `max_num_seqs`, or not
enough pages for its first piece even after evicting cached ones -- preempts running BATCH
requests, the lowest-ranked (most recent) first, until it fits or none is left. It is then
admitted first in the same step (its class ranks it first); the requests it preempted are not
readmitted before the next step (async scheduling may still have their last token in flight),
and a request whose last token is in flight (`finishing`) is never preempted. Room counts the
pages this step's decode rows take. STANDARD requests never preempt by class: their only
preemptions are the page-pressure ones of step 1, which take BATCH requests first too.

Within a class and priority, prompt work goes to the prompts with the least uncached work first
(`policy="least-uncached"`, the default; SGLang's longest-prefix-match order does the same
for its waiting queue): a request whose prompt is mostly in the prefix cache gets its first
token at once instead of queueing behind a cold 4k-token prompt, and a step's prompt chunks
go to the prompts closest to their first token. A waiting request's uncached work is
estimated from the cache (and the pages running requests are computing now, which it will
reuse). Requests age by the engine's work, not the clock, so the order is deterministic: a
request's rank improves by one token for every prompt token the engine computes after it
arrived (AGING), so one that needs U uncached tokens is overtaken by newcomers for at most U
tokens of others' work: long prompts are never starved. `policy="fcfs"` keeps arrival order.

Least-uncached also spreads a burst of prompts over steps, shortest remaining first (SRPT): a
step's prompt work stops growing, in rank order, once it is worth STEP_WORTH times what a step
without prompt work costs (both measured: engine.step_cost.StepWorth). Eight mostly cached
prompts that arrive together then get their first tokens one step after another (the first
after one eighth of the work) instead of all at the end of one long step; each extra step costs
at most 1/STEP_WORTH of the prompt work it carries. Where a step costs much against a chunk
(a device whose per-token cost falls with the batch), the rule takes the burst in one step; on
a CPU, where a prompt token costs about the same in any batch, batching only delayed the first
prompts (measured: README, "Side by side with the peers"; not yet measured on a GPU). Until both
costs are measured a step takes all it may.

With an inter-token target (`itl_target_s`), prefill chunks get their own budget per step:
what the target leaves after this step's decode rows, at the per-token costs this engine has
measured (engine.step_cost); never less than `min_prefill_tokens`, so prompts always progress.
Decode rows are never held back for a prefill (stall-free batching, as in Sarathi-Serve).

With a prefix cache, admission first reuses the longest cached prefix of the request's full
pages (always leaving at least one token to compute, so a fully cached prompt recomputes its
last page), allocation evicts cached pages before it preempts anyone, and `commit` offers
every newly completed page to the cache after each step.

`abort` removes a request in any state and frees every page it holds.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from engine.request import NOT_CACHED, CachedTokens, Request, RequestStatus, SloClass
from engine.step_cost import StepCostModel, StepShape, StepWorth
from kvcache.hashing import ROOT_HASH, page_hashes

if TYPE_CHECKING:  # annotations: reading POLICIES (engine.engine_config) imports no torch
    from kvcache.pool import PagePool
    from kvcache.radix import PrefixCache

logger = logging.getLogger(__name__)


POLICIES = ("least-uncached", "fcfs")
# least-uncached: a waiting request's rank improves by this many tokens per prompt token the
# engine computes after its arrival (1.0: it waits behind at most its own work's worth of others')
AGING = 1.0
RANK_WINDOW = 64  # waiting requests ranked per step: the oldest (by class and priority, then arrival)
# least-uncached: a step takes prompt chunks, in rank order, until they are worth this many times
# a step without prompt work: the extra steps cost at most 1/STEP_WORTH of the prompt work
STEP_WORTH = 2.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget per step
    max_prefill_chunk: int = 512  # longest piece of one prompt in a step with decode rows (chunked prefill)
    page_size: int = 16
    itl_target_s: float | None = None  # a step's time to aim at while requests decode (None: off)
    min_prefill_tokens: int = 64  # prefill tokens a step may always take, whatever the target
    policy: str = "least-uncached"  # prompt work within a priority class: "least-uncached" | "fcfs"
    # Keep prompts in max_prefill_chunk pieces in steps without decode rows too: a prefill
    # worker streams each piece's pages while it computes the next (prefill.worker sets it).
    stream_chunks: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "page_size",
                     "min_prefill_tokens"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler.{name} must be positive")
        if self.itl_target_s is not None and not self.itl_target_s > 0:
            raise ValueError("scheduler.itl_target_s must be positive (or unset)")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class Rank(NamedTuple):
    """A waiting request's place in the least-uncached order, for one step."""

    rank: tuple[int, float, int]  # (class priority, uncached tokens + aging, arrival): lowest first
    need: int  # prompt tokens it would compute if admitted now
    context: int  # tokens before them (cached, or being computed by a running request)


class ScheduledRequest(NamedTuple):
    request: Request
    num_new: int  # tokens computed this step, starting at request.num_computed_tokens


def step_shape(scheduled: Sequence[ScheduledRequest]) -> StepShape:
    """What a step computes, for the cost model (taken before the step advances its requests)."""
    prefill = [(r, n) for r, n in scheduled if n > 1]
    decode = [r for r, n in scheduled if n == 1]
    return StepShape(
        sum(n for _, n in prefill), sum(n * (r.num_computed_tokens + n) for r, n in prefill),
        len(decode), sum(r.num_computed_tokens + 1 for r in decode),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...]
    shape: StepShape | None = None  # what the step computes, for the cost models (not under plain fcfs)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, pages: PagePool, cache: PrefixCache | None = None, fingerprint: bytes = b""
    ) -> None:
        self.cfg = cfg
        self.pages = pages
        self.cache = cache
        self.fingerprint = fingerprint
        self.running: list[Request] = []  # sorted by sort_key: (class priority, arrival)
        self._waiting: list[tuple[tuple[int, int], Request]] = []  # heap on sort_key
        self._by_id: dict[str, Request] = {}
        self.costs = StepCostModel()  # learns from every step when there is a target (observe)
        self.worth = StepWorth()  # least-uncached's burst rule (the engine sets the model's key weight)
        self.work_done = 0  # prompt tokens scheduled so far: the clock requests age by

    # -- queue management -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_requests(self) -> int:
        return len(self._by_id)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute across every request (a prefill worker's queue)."""
        return sum(r.num_pending for r in self._by_id.values())

    def req_ids(self) -> list[str]:
        """Every request here, running or waiting."""
        return list(self._by_id)

    def get(self, req_id: str) -> Request | None:
        return self._by_id.get(req_id)

    def add(self, request: Request) -> None:
        if request.req_id in self._by_id:
            raise ValueError(f"duplicate req_id {request.req_id!r}")
        self._by_id[request.req_id] = request
        request.status = RequestStatus.WAITING
        request.work_mark = self.work_done
        heapq.heappush(self._waiting, (request.sort_key, request))
        if self.cache is not None and self.cache.disk is not None:
            # Disk hits start loading now, overlapping the wait in the queue.
            self._ensure_hashes(request, (request.num_tokens - 1) // self.cfg.page_size)
            self.cache.prefetch(request.page_hashes)

    def add_running(self, request: Request) -> None:
        """Admit a request whose pages are already filled (decode role: the KV came from a
        prefill worker). It may briefly exceed max_num_seqs; preemption still applies."""
        if request.req_id in self._by_id:
            raise ValueError(f"duplicate req_id {request.req_id!r}")
        self._by_id[request.req_id] = request
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)

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
        preempted: list[Request] = []
        self._make_room_for_latency(preempted)
        made_room = set(map(id, preempted))  # wait a step: their last token may be in flight
        budget = self.cfg.max_num_batched_tokens
        prefill = self._prefill_budget()  # tokens of prompt chunks this step (the ITL target)
        in_flight = self._pages_in_flight()
        window = self._window()
        ranks = self._waiting_ranks(window, in_flight)
        decoding = self._num_decoding()
        # A prompt's piece of a step is capped where decode rows share the step (their
        # inter-token latency); a step without any takes pieces up to its whole budget, as
        # vLLM's does: cutting a lone cold prompt into more steps only delays its first token
        # (rag at c=8 on baton-tiny: the first wave's 2,050-token prompt in 512-token pieces
        # gave TTFT p99 302-308 ms, in 2,048-token ones 252-281 ms).
        chunk = self.cfg.max_prefill_chunk if decoding or self.cfg.stream_chunks else budget
        chunks, prefill = self._chunks(min(prefill, budget - decoding), prefill, ranks, chunk)
        scheduled: list[ScheduledRequest] = []
        held: list[Request] = []  # running prompts that waiting requests ranked ahead of
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            if request.finishing:  # its last token is in flight (engine async scheduling)
                idx += 1
                continue
            num_new = min(request.num_pending, budget, chunk)
            if num_new > 1:  # a prompt chunk: its share of the prefill budget; decode rows never wait
                num_new = min(num_new, prefill, chunks.get(request.req_id, prefill))
                if num_new == 0:
                    held.append(request)
                    idx += 1
                    continue
                prefill -= num_new
            if not self._grow(request, num_new, preempted):
                break  # the request preempted itself: nothing lower-priority was left
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            idx += 1
        if len(preempted) == len(made_room) and prefill > 0:  # no running request had to preempt
            left = self._admit(min(budget, prefill), scheduled, window, ranks, in_flight, chunk, made_room)
            prefill -= min(budget, prefill) - left
            budget = left
            # What the waiting requests were ranked for but did not take (no pages, a prefix
            # still being computed) goes to the held prompts: no step idles prompt work.
            for request in held:
                num_new = min(request.num_pending, budget, prefill, chunk)
                # still running: a step whose running requests preempted any never gets here
                if num_new > 1 and self._take_pages(request, self._pages_needed(request, num_new)):
                    scheduled.append(ScheduledRequest(request, num_new))
                    budget -= num_new
                    prefill -= num_new
        self.work_done += sum(n for _, n in scheduled if n > 1)
        shape = step_shape(scheduled) if self.cfg.itl_target_s is not None or self.cfg.policy != "fcfs" else None
        return SchedulerOutput(tuple(scheduled), tuple(preempted), shape)

    def _num_decoding(self) -> int:
        return sum(1 for r in self.running if r.num_pending == 1 and not r.finishing)

    def _window(self) -> list[tuple[tuple[int, int], Request]]:
        """The RANK_WINDOW oldest waiting requests (by priority, then arrival), oldest first:
        the ones a step ranks and offers places to first. Taken once a step: nothing joins or
        leaves the queue between the ranking and the admissions of a step that admits."""
        return heapq.nsmallest(RANK_WINDOW, self._waiting)

    def _waiting_ranks(
        self, window: list[tuple[tuple[int, int], Request]], in_flight: set[bytes]
    ) -> dict[str, Rank]:
        """least-uncached: the rank, estimated uncached tokens and cached context of each
        request in `window`; {} under fcfs."""
        if self.cfg.policy == "fcfs":
            return {}
        ranks = {}
        for _, request in window:
            need = self._uncached_estimate(request, in_flight)
            ranks[request.req_id] = Rank(self._rank(request, need), need, request.num_tokens - need)
        return ranks

    def _chunks(self, total: int, prefill: int, ranks: dict[str, Rank], chunk: int) -> tuple[dict[str, int], int]:
        """least-uncached: each running prompt's chunk this step (at most `chunk` tokens),
        `total` prompt tokens handed out in rank order, where waiting requests that rank ahead
        of a running prompt are served first (they are admitted after the loop over the running ones), and the step's
        prefill budget: `prefill`, or what the chunks handed out come to when they reached
        STEP_WORTH step overheads first. ({}, prefill) under fcfs (running order, each chunk
        from what is left)."""
        if self.cfg.policy == "fcfs":
            return {}, prefill
        prompts = [r for r in self.running if r.num_pending > 1 and not r.finishing]
        ranked = [(self._rank(r, r.num_pending), r.num_pending, r.num_computed_tokens, r.req_id) for r in prompts]
        room = self.cfg.max_num_seqs - len(self.running)
        ranked += sorted((rank, need, context, "") for rank, need, context in ranks.values())[: max(room, 0)]
        overhead = self.worth.step_s
        chunks: dict[str, int] = {}
        handed, worth, full = 0, 0.0, False
        for _, need, context, req_id in sorted(ranked):
            take = 0 if full else min(need, chunk, total - handed)
            if req_id:
                chunks[req_id] = take
            handed += take
            cost = self.worth.chunk_s(take, context) if take > 0 else None
            if overhead is not None and cost is not None:
                worth += cost
                full = worth >= STEP_WORTH * overhead
        return chunks, min(prefill, handed) if full else prefill

    def _rank(self, request: Request, uncached: int) -> tuple[int, float, int]:
        return (request.class_priority, uncached + AGING * request.work_mark, request.arrival)

    def observe(self, out: SchedulerOutput, forward_s: float) -> None:
        """The step `out` scheduled took `forward_s`: the ITL target's cost model and
        least-uncached's step worth learn it."""
        if out.shape is None:
            return
        if self.cfg.itl_target_s is not None:
            self.costs.observe(out.shape, forward_s)
        if self.cfg.policy != "fcfs":
            self.worth.observe(out.shape, forward_s)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: all of the step's budget without a target;
        with one, what the target leaves after the decode rows (at least min_prefill_tokens)."""
        cfg = self.cfg
        if cfg.itl_target_s is None:
            return cfg.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_pending == 1 and not r.finishing]
        if not decoding:
            return cfg.max_num_batched_tokens  # no inter-token latency to protect
        rows = StepShape(decode_rows=len(decoding), decode_keys=sum(r.num_tokens for r in decoding))
        prompts = [r for r in self.running if r.num_pending > 1]
        context = (max(r.num_computed_tokens for r in prompts) if prompts else 0) + cfg.max_prefill_chunk // 2
        budget = self.costs.prefill_budget(rows, cfg.itl_target_s, context)
        if budget is None:
            return cfg.max_num_batched_tokens  # not measured yet
        return min(cfg.max_num_batched_tokens, max(cfg.min_prefill_tokens, budget))

    def _grow(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        """Make room for `num_new` more tokens, preempting from the back of `running`."""
        while True:
            if self._take_pages(request, self._pages_needed(request, num_new)):
                return True
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False

    def _admit(
        self, budget: int, scheduled: list[ScheduledRequest], window: list[tuple[tuple[int, int], Request]],
        ranks: dict[str, Rank], in_flight: set[bytes], chunk: int, barred: set[int],
    ) -> int:  # fmt: skip
        """Admit waiting requests while `budget` (the step's tokens left, or its prefill budget
        when that is less) lasts, each with a first piece of at most `chunk` tokens: in rank
        order under least-uncached (`ranks`; the rest after them by priority and arrival), else
        by priority and arrival. `in_flight`: the pages
        running requests are computing (grows with each admission). `barred`: ids of requests
        preempted this step, passed over."""
        admitted: set[int] = set()
        for request in self._admission_order(window, ranks):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if id(request) in barred:
                continue
            hit = self._reuse_prefix(request)
            if self._would_duplicate(request, in_flight):
                # A running request is computing this request's next page right now: wait a
                # step or two and reuse it, instead of computing the same prefix twice.
                self._release(request)
                continue
            num_new = min(request.num_pending, budget, chunk)
            if not self._take_pages(request, self._pages_needed(request, num_new)):
                self._release(request)  # give back the reused prefix too
                break  # in order within priority: do not let a later-ranked request jump ahead
            admitted.add(id(request))
            if self.cache is not None and request.num_preemptions == 0:
                request.cached = hit
                self.cache.record_query(len(request.prompt_ids), hit.total)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            in_flight.update(self._uncommitted(request))
        if admitted:
            self._waiting = [item for item in self._waiting if id(item[1]) not in admitted]
            heapq.heapify(self._waiting)
        return budget

    def _make_room_for_latency(self, preempted: list[Request]) -> None:
        """The most urgent waiting request, when it is LATENCY and could not be admitted now
        (no seat, or no pages for its first piece), preempts running BATCH requests, from the
        back of `running` (the lowest-ranked, most recent first), until it could or none is
        left. A request whose last token is in flight (`finishing`) is left alone."""
        if not self._waiting or self._waiting[0][1].slo != SloClass.LATENCY:
            return
        head = self._waiting[0][1]
        while not self._can_admit(head):
            victim = next((r for r in reversed(self.running) if r.slo == SloClass.BATCH and not r.finishing), None)
            if victim is None:
                return
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim)

    def _can_admit(self, request: Request) -> bool:
        """A seat, and pages for the first piece of a waiting request beside the pages the
        decode rows take this step, now. Enough free pages for the piece without its cached
        prefix settle it; else its prefix is reused and the rest allocated (evicting cached
        pages, as admission would), then all of it given back at once."""
        cfg = self.cfg
        if len(self.running) >= cfg.max_num_seqs:
            return False
        decoding = [r for r in self.running if r.num_pending == 1 and not r.finishing]
        growth = sum(self._pages_needed(r, 1) for r in decoding)
        chunk = cfg.max_prefill_chunk if decoding or cfg.stream_chunks else cfg.max_num_batched_tokens
        piece = min(request.num_pending, cfg.max_num_batched_tokens, chunk)
        if (self.pages.num_free - growth) * cfg.page_size >= piece:  # a cached prefix only needs fewer
            return True
        self._reuse_prefix(request)
        num_new = min(request.num_pending, cfg.max_num_batched_tokens, chunk)
        fits = self._take_pages(request, growth + self._pages_needed(request, num_new))
        self._release(request)
        return fits

    def _admission_order(
        self, window: list[tuple[tuple[int, int], Request]], ranks: dict[str, Rank]
    ) -> Iterator[Request]:
        """The waiting requests in the order `_admit` offers them places: the `window` (the
        ones `ranks` covers) by rank, then the rest by priority and arrival. Lazy: a step that
        admits a few looks at the window, not the whole queue (sorting all of it was
        O(n log n) a step, with thousands queued in a burst)."""
        def key(item: tuple[tuple[int, int], Request]) -> tuple[bool, tuple[object, ...]]:
            found = ranks.get(item[1].req_id)
            return (False, (found.rank, found.need)) if found is not None else (True, item[0])

        head = sorted(window, key=key)
        for _, request in head:
            yield request
        if len(head) < len(self._waiting):  # every one of the window taken or passed over
            offered = {id(request) for _, request in head}
            for _, request in sorted(item for item in self._waiting if id(item[1]) not in offered):
                yield request

    def _uncached_estimate(self, request: Request, in_flight: set[bytes]) -> int:
        """Prompt tokens a waiting request would compute if admitted now: all of them less its
        leading pages that the cache holds (any tier) or a running request is computing."""
        if self.cache is None or not request.reuse_cache:
            return request.num_pending
        ps = self.cfg.page_size
        max_pages = (request.num_tokens - 1) // ps
        self._ensure_hashes(request, max_pages)
        hashes = request.page_hashes
        # Resume where the last ranking stopped while its last page is still there (the cache
        # evicts leaves first, so the pages before it are too): a queued request costs the
        # pages that changed since, not its whole prompt, each step.
        found = min(request.rank_pages, max_pages)
        if found and hashes[found - 1] not in in_flight and hashes[found - 1] not in self.cache:
            found = 0
        while found < max_pages and (hashes[found] in in_flight or hashes[found] in self.cache):
            found += 1
        request.rank_pages = found
        return request.num_tokens - found * ps

    def _pages_in_flight(self) -> set[bytes]:
        """Hashes of pages running requests have not finished computing yet."""
        if self.cache is None or not self._waiting:
            return set()
        return {h for r in self.running for h in self._uncommitted(r)}

    def _uncommitted(self, request: Request) -> list[bytes]:
        return request.page_hashes[request.num_committed_pages :]

    def _would_duplicate(self, request: Request, in_flight: set[bytes]) -> bool:
        nxt = request.num_committed_pages  # == pages reused from the cache
        return nxt < len(request.page_hashes) and request.page_hashes[nxt] in in_flight

    # -- the prefix cache -------------------------------------------------------------------

    def _reuse_prefix(self, request: Request) -> CachedTokens:
        """Take the cached pages of the request's longest cached prefix; tokens reused, by the
        tier each page was found in."""
        if self.cache is None or not request.reuse_cache:
            return NOT_CACHED
        ps = self.cfg.page_size
        max_pages = (request.num_tokens - 1) // ps  # at least one token must be computed
        self._ensure_hashes(request, max_pages)
        by_tier = [0, 0, 0]
        shared = self.cache.match(request.page_hashes, max_pages, by_tier, request.in_session)
        request.page_ids = shared
        request.num_computed_tokens = len(shared) * ps
        request.num_committed_pages = len(shared)
        return CachedTokens(*(n * ps for n in by_tier))

    def commit(self, request: Request) -> None:
        """Offer the request's newly completed pages to the cache (after each step)."""
        if self.cache is None:
            return
        full = request.num_computed_tokens // self.cfg.page_size
        if full > request.num_committed_pages:
            self._ensure_hashes(request, full)
            self.cache.insert(request.page_hashes[:full], request.page_ids[:full], request.num_committed_pages,
                              request.cache_salt, request.in_session)  # fmt: skip
            request.num_committed_pages = full

    def prefix_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """The hashes of the request's first `num_pages` full pages (as its cached pages get them)."""
        self._ensure_hashes(request, num_pages)
        return request.page_hashes[:num_pages]

    def _ensure_hashes(self, request: Request, num_pages: int) -> None:
        have = len(request.page_hashes)
        if have >= num_pages:
            return
        ps = self.cfg.page_size
        parent = request.page_hashes[-1] if have else ROOT_HASH
        # Pages inside an operator-shared prefix are hashed without the tenant's salt, so every
        # tenant reuses them; the pages after it chain from there with the salt.
        public = min(max(request.num_shared_pages - have, 0), num_pages - have)
        if public:
            tokens = request.token_slice(have * ps, (have + public) * ps)
            request.page_hashes.extend(page_hashes(tokens, ps, b"", self.fingerprint, parent))
            have += public
            parent = request.page_hashes[-1]
        tokens = request.token_slice(have * ps, num_pages * ps)
        request.page_hashes.extend(page_hashes(tokens, ps, request.cache_salt, self.fingerprint, parent))

    def _pages_needed(self, request: Request, num_new: int) -> int:
        total = request.num_computed_tokens + num_new
        return -(-total // self.cfg.page_size) - len(request.page_ids)

    def _take_pages(self, request: Request, n: int) -> bool:
        """Add `n` fresh pages to the request (evicting cached pages if needed); False if they
        cannot be had."""
        if n <= 0:
            return True
        pages = self.cache.allocate(n) if self.cache is not None else self.pages.allocate(n)
        if pages is None:
            return False
        request.page_ids.extend(pages)
        return True

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
        request.num_committed_pages = 0
