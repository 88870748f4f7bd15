"""Simulated prefill and decode workers for `baton sim`: state machines over a virtual clock.
The simulation (bench/sim/cli.py) calls them when an event of theirs is due and schedules the
times they return; they never sleep and hold no threads.

    PrefillWorker  FIFO queue; a job matches its own cache at start (device, then host), costs
                   recomputed tokens x s/token + host pages x page_bytes / host bandwidth, then
                   stores the prompt's pages (KV events); its push streams pages while they
                   are computed, over one outgoing link (pushes go one after another)
    DecodeWorker   pages: prompt + output pages reserved per request (a FIFO waits when none
                   are free); its cache keeps finished requests' pages in whatever the
                   reservations leave free. Steps: each admits waiting requests up to
                   max_running, carries chunks of local prefills (up to the engine's token
                   budgets; their compute stalls the whole step: why disaggregation exists),
                   lasts step_s(batch) + that stall, and gives every running request a token

    request on decode:  first token (prefill) -> pages arrive -> joins at step s0 ->
                        tokens 2..n at the ends of steps s0 .. s0 + n - 2 -> finished

A request's cached pages also count in its reservation (the radix tree would share them): a
slight under-estimate of a decode worker's room, kept for simplicity.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from bench.sim.cache import CacheHit, TieredCache
from bench.sim.calibration import Calibration


@dataclass(slots=True, eq=False)
class SimRequest:
    req_id: str
    session: object  # the simulation's session record (opaque here)
    tenant: str
    hashes: list[bytes]  # the prompt's full pages
    num_tokens: int
    output_len: int
    arrival_s: float
    num_pages_needed: int  # on the decode worker: prompt + output
    prefill_id: str | None = None
    decode_id: str | None = None
    is_local: bool = False
    is_reserved: bool = False
    num_attempts: int = 0
    est_s: float = 0.0  # estimated compute, for queue-delay reports
    num_left: int = -1  # a local prefill's tokens still to compute (-1: not started)
    compute_start_s: float = -1.0
    reserved_s: float = -1.0  # when its decode pages were reserved
    hit: CacheHit = CacheHit(0, 0)  # what the computing worker actually reused
    best_hit_pages: int = 0  # in the index's view, at placement
    chosen_hit_pages: int = 0
    first_token_s: float = -1.0
    join_step: int = -1
    finish_s: float = -1.0
    itl_s: list[float] = field(default_factory=list)


class PrefillWorker:
    def __init__(self, worker_id: str, cal: Calibration, cache: TieredCache) -> None:
        self.worker_id = worker_id
        self.cal = cal
        self.cache = cache
        self.queue: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        self.busy_until = 0.0
        self.queued_s = 0.0  # estimated compute of the queued jobs
        self.busy_s = 0.0
        self.link_free_s = 0.0
        self.num_served = 0

    def submit(self, req: SimRequest, now: float) -> float | None:
        """Queue `req`; the time its compute ends if it started at once."""
        req.est_s = _compute_s(self.cal, req, self.cache.match(req.hashes, _max_hit(self.cal, req)))
        self.queue.append(req)
        self.queued_s += req.est_s
        return self.start(now) if self.current is None else None

    def start(self, now: float) -> float | None:
        if not self.queue:
            return None
        req = self.queue.popleft()
        self.queued_s = max(0.0, self.queued_s - req.est_s)
        req.hit = self.cache.match(req.hashes, _max_hit(self.cal, req))
        req.compute_start_s = now
        compute_s = _compute_s(self.cal, req, req.hit)
        self.current = req
        self.busy_until = now + compute_s
        self.busy_s += compute_s
        return self.busy_until

    def complete(self) -> SimRequest:
        req = self.current
        assert req is not None, "no prefill running"
        self.current = None
        self.num_served += 1
        self.cache.store(req.hashes)
        return req

    def send(self, req: SimRequest, now: float, transport: str) -> float:
        """The time the prompt's pages are all at the decode worker, the push having streamed
        them while they were computed (from when both the compute and the reservation had
        started and the link was free); the last page follows the first token."""
        cal = self.cal
        start = max(req.compute_start_s, req.reserved_s, self.link_free_s)
        num_pages = -(-req.num_tokens // cal.page_size)
        self.link_free_s = max(now + cal.transfer_s(1, transport), start + cal.transfer_s(num_pages, transport))
        return self.link_free_s

    def queue_delay_s(self, now: float) -> float:
        return max(0.0, self.busy_until - now) + self.queued_s


class DecodeWorker:
    def __init__(self, worker_id: str, cal: Calibration, cache: TieredCache, num_pages: int, max_running: int,
                 step_tokens: int = 2048, chunk_tokens: int = 512) -> None:
        if step_tokens < 1 or chunk_tokens < 1:
            raise ValueError("step_tokens and chunk_tokens must be >= 1")
        self.worker_id = worker_id
        self.step_tokens = step_tokens  # the engine's max_num_batched_tokens
        self.chunk_tokens = chunk_tokens  # ... and max_prefill_chunk
        self.cal = cal
        self.cache = cache
        self.num_pages = num_pages
        self.max_running = max_running
        self.in_use = 0
        self.page_wait: deque[SimRequest] = deque()
        self.waiting: deque[SimRequest] = deque()  # pages here (or computed here): next step
        self.local: deque[SimRequest] = deque()  # local prefills, reserved
        self.running = 0
        self._finishing: list[tuple[int, int, SimRequest]] = []  # (last step, tie, request)
        self._tie = itertools.count()
        self.step = 0
        self.step_ends = [0.0]  # step_ends[s]: when step s ended
        self.is_stepping = False
        self.num_tokens = 0  # generated here: the decode load
        self._step_s = [cal.step_s(b) for b in range(max_running + 1)]  # by batch size
        cache.resize(num_pages)

    # -- pages --------------------------------------------------------------------------------

    def reserve(self, req: SimRequest) -> bool:
        """Reserve `req`'s pages now (True) or queue it behind the others waiting (False)."""
        if self.page_wait or not self._fits(req):
            self.page_wait.append(req)
            return False
        self._take(req)
        return True

    def release(self, req: SimRequest, hashes: list[bytes]) -> list[SimRequest]:
        """`req` finished: its pages return and `hashes` (prompt + output) stay cached; the
        requests whose reservations now fit, in order."""
        self.in_use -= req.num_pages_needed
        self.cache.resize(self.num_pages - self.in_use)
        self.cache.store(hashes)
        granted: list[SimRequest] = []
        while self.page_wait and self._fits(self.page_wait[0]):
            granted.append(self.page_wait.popleft())
            self._take(granted[-1])
        return granted

    def _fits(self, req: SimRequest) -> bool:
        return self.num_pages - self.in_use >= req.num_pages_needed

    def _take(self, req: SimRequest) -> None:
        self.in_use += req.num_pages_needed
        req.is_reserved = True
        self.cache.resize(self.num_pages - self.in_use)

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - self.in_use - sum(r.num_pages_needed for r in self.page_wait)

    # -- steps --------------------------------------------------------------------------------

    def add_local(self, req: SimRequest) -> None:
        """A local prefill (its pages reserved): it runs in a coming step."""
        req.est_s = _compute_s(self.cal, req, self.cache.match(req.hashes, _max_hit(self.cal, req)))
        self.local.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.local)

    def begin_step(self, now: float) -> tuple[float, list[SimRequest]]:
        """Start step `step + 1`: (when it ends, the local prefills it completes). Local
        prefills ride along as chunks (chunked prefill): at most `chunk_tokens` of one
        request and `step_tokens` in all per step, in arrival order; their compute stalls
        the step for the whole batch."""
        s = self.step + 1
        cal = self.cal
        while self.waiting and self.running < self.max_running:
            req = self.waiting.popleft()
            req.join_step = s
            self.running += 1
            heapq.heappush(self._finishing, (s + req.output_len - 2, next(self._tie), req))
        stall_s, budget = 0.0, self.step_tokens
        done: list[SimRequest] = []
        for req in self.local:  # bounded: each turn spends budget, or ends the loop
            if budget <= 0 or self.running + len(done) >= self.max_running:
                break
            if req.num_left < 0:  # its first chunk: the cache hit is taken now
                req.hit = self.cache.match(req.hashes, _max_hit(cal, req))
                req.num_left = req.num_tokens - req.hit.num_pages * cal.page_size
                stall_s += req.hit.num_host * cal.page_bytes / cal.host_bytes_per_s
            take = min(req.num_left, self.chunk_tokens, budget)
            req.num_left -= take
            budget -= take
            stall_s += take * cal.prefill_s_per_token
            if req.num_left == 0:
                done.append(req)
        if done:
            self.local = deque(r for r in self.local if r.num_left)
        return now + self._step_s[self.running] + stall_s, done

    def end_step(self, now: float) -> list[SimRequest]:
        """The step ended: every running request got a token; those that are done."""
        self.step += 1
        self.step_ends.append(now)
        self.num_tokens += self.running
        done: list[SimRequest] = []
        while self._finishing and self._finishing[0][0] <= self.step:
            req = heapq.heappop(self._finishing)[2]
            self.running -= 1
            ends = self.step_ends
            req.itl_s = [ends[req.join_step] - req.first_token_s]
            req.itl_s.extend(ends[j] - ends[j - 1] for j in range(req.join_step + 1, self.step + 1))
            done.append(req)
        return done

    def queue_delay_s(self) -> float:
        cal = self.cal
        return sum(r.est_s if r.num_left < 0 else r.num_left * cal.prefill_s_per_token for r in self.local)


def _max_hit(cal: Calibration, req: SimRequest) -> int:
    """At least one token is computed, so the last page of a whole-page prompt is not a hit."""
    return max(0, (req.num_tokens - 1) // cal.page_size)


def _compute_s(cal: Calibration, req: SimRequest, hit: CacheHit) -> float:
    recompute = req.num_tokens - hit.num_pages * cal.page_size
    return recompute * cal.prefill_s_per_token + hit.num_host * cal.page_bytes / cal.host_bytes_per_s
