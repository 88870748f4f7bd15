"""The discrete-event loop of `baton sim`: one policy, one fleet of simulated workers, one
stream of sessions, the real GlobalIndex (fed only by the workers' KV events) and, for the
`baton` policy, the real Placer (fed by the workers' periodic stats reports).

    arrive(session)  turn k's prompt -> page hashes -> place
    place            policy decision; SATURATED retries after retry_after_s (a bounded
                     number of times, then the request fails); the decode worker reserves
                     prompt + output pages (or queues the reservation)
    disaggregated    prefill queue -> compute (own cache hits) -> first token; the push
                     streams pages as they are computed once the decode reservation holds,
                     the last page after the first token -> joins the batch
    local            the decode worker computes it in chunks riding on its steps (stalling
                     its batch), caches its pages, then decodes it
    finished         pages back, prompt + output cached on decode; next turn after `think`
    stats            every stats_interval_s: reports to the policy, heartbeats to the index

Virtual time only: the heap orders events by (time, insertion), nothing sleeps. The loop is
bounded by a horizon (arrivals' end + drain_s: requests still open then count as failed) and
by an event budget.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.sim.cache import EventBus, TieredCache
from bench.sim.calibration import Calibration
from bench.sim.policies import POLICIES, Baton
from bench.sim.report import Recorder, SimResult
from bench.sim.traffic import PromptHasher, SessionRun, Traffic
from bench.sim.workers import DecodeWorker, PrefillWorker, SimRequest
from cluster.placement.global_index import GlobalIndex
from cluster.placement.policy import PlacementConfig, PlacementKind, Role, WorkerStats
from kvcache.hashing import model_fingerprint

MAX_EVENTS = 200_000_000


@dataclass(frozen=True, slots=True)
class FleetConfig:
    num_prefill: int = 64
    num_decode: int = 64
    prefill_pages: int = 4096  # device pages per prefill worker
    host_pages: int = 4096  # host-tier pages per prefill worker
    decode_pages: int = 16_384  # device pages per decode worker (reservations + cache)
    decode_host_pages: int = 0
    max_running: int = 64  # decode batch limit
    transport: str = "grpc"  # prefill -> decode push: a key of calibration.transfer_bytes_per_s
    stats_interval_s: float = 0.25
    event_delay_s: float = 0.0  # KV events reach the index this late
    event_loss: float = 0.0  # ... or not at all, this often
    index_pages: int = 1 << 21  # the GlobalIndex's cap
    max_attempts: int = 8  # placements of one request before it fails (SATURATED)
    drain_s: float = 600.0  # after the last arrival, how long requests may still finish

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1 or self.max_running < 1 or self.max_attempts < 1:
            raise ValueError("prefill, decode, max_running and max_attempts must be >= 1")
        if min(self.prefill_pages, self.host_pages, self.decode_pages, self.decode_host_pages) < 0:
            raise ValueError("page counts must be >= 0")
        if self.stats_interval_s <= 0 or self.drain_s < 0:
            raise ValueError("stats_interval_s > 0, drain_s >= 0")


class Simulation:
    def __init__(self, cal: Calibration, fleet: FleetConfig, policy: str, traffic: Traffic,
                 slo: tuple[float, float], seed: int = 0, keep_records: bool = False) -> None:
        if fleet.transport not in cal.transfer_bytes_per_s:
            raise ValueError(f"transport {fleet.transport!r}: calibration {cal.name} has "
                             f"{', '.join(cal.transfer_bytes_per_s)}")  # fmt: skip
        self.cal, self.fleet = cal, fleet
        self.rng = random.Random(seed)
        self.index = GlobalIndex(max_pages=fleet.index_pages)
        self.bus = EventBus(self.index, fleet.event_delay_s, fleet.event_loss, random.Random(seed + 1))
        self.prefills = {f"p{i}": PrefillWorker(f"p{i}", cal, self._cache(f"p{i}", fleet.prefill_pages, fleet.host_pages))
                         for i in range(fleet.num_prefill)}  # fmt: skip
        self.decodes = {f"d{i}": DecodeWorker(f"d{i}", cal, self._cache(f"d{i}", 0, fleet.decode_host_pages),
                                              fleet.decode_pages, fleet.max_running)
                        for i in range(fleet.num_decode)}  # fmt: skip
        cfg = PlacementConfig(page_size=cal.page_size, page_bytes=cal.page_bytes,
                              transfer_bytes_per_s=cal.transfer_bytes_per_s[fleet.transport])
        self.policy = POLICIES[policy](self.index, list(self.prefills), list(self.decodes), random.Random(seed + 2), cfg,
                                       clock=lambda: self._now)  # fmt: skip
        self.hasher = PromptHasher(cal.page_size, model_fingerprint("baton-sim", cal.name))
        self.recorder = Recorder(policy, cal.page_size, slo, traffic.end_s, keep_records)
        self.think_s = traffic.think_s
        self._arrivals: Iterator[tuple[float, SessionRun]] = traffic.arrivals()
        self._horizon = traffic.end_s + fleet.drain_s
        self._heap: list[tuple[float, int, int, object]] = []
        self._tie = itertools.count()
        self._num_open = 0  # requests created and not yet finished or failed
        self._now = 0.0
        self._ids = itertools.count()
        self._handlers: tuple[Callable[[float, object], None], ...] = (
            self._on_new_session, self._on_turn, self._on_place, self._on_prefill_done, self._on_pushed,
            self._on_step, self._on_stats,
        )

    def _cache(self, worker_id: str, device: int, host: int) -> TieredCache:
        cache = TieredCache(worker_id, device, host, self.bus.emit)
        self.bus.add(cache)
        return cache

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        self._report()
        self._next_session()
        self._at(0.0, _STATS, None)
        n = 0
        while self._heap and n < MAX_EVENTS:
            now, _, kind, obj = heapq.heappop(self._heap)
            if now > self._horizon:
                break
            n += 1
            self._now = now
            self.bus.flush(now)
            self._handlers[kind](now, obj)
        self.recorder.num_failed += self._num_open  # still open at the horizon
        return self.recorder.result(self.prefills.values(), self.decodes.values(), self.bus, self.policy, n)

    def _at(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._tie), kind, obj))

    def _next_session(self) -> None:
        item = next(self._arrivals, None)
        if item is not None:
            self._at(max(item[0], self._now), _NEW_SESSION, item[1])  # an unsorted trace: no time travel

    # -- handlers -----------------------------------------------------------------------------

    def _on_new_session(self, now: float, run: object) -> None:
        self._next_session()
        self._on_turn(now, run)

    def _on_turn(self, now: float, run: object) -> None:
        assert isinstance(run, SessionRun)
        turn = run.session.turns[run.next_turn]
        hashes, num_tokens = self.hasher.hash(run.salt, run.parts(run.next_turn))
        need = -(-(num_tokens + turn.output_len) // self.cal.page_size)
        req = SimRequest(f"r{next(self._ids)}", run, run.tenant, hashes, num_tokens, turn.output_len, now, need)
        self._num_open += 1
        self.recorder.num_requests += 1
        self._on_place(now, req)

    def _on_place(self, now: float, obj: object) -> None:
        assert isinstance(obj, SimRequest)
        req = obj
        req.num_attempts += 1
        d = self.policy.place(req)
        if d.kind == PlacementKind.SATURATED or d.decode_id is None:
            self.recorder.num_saturated += 1
            if req.num_attempts >= self.fleet.max_attempts:
                self._fail()
            else:
                self._at(now + d.retry_after_s, _PLACE, req)
            return
        req.prefill_id, req.decode_id = d.prefill_id, d.decode_id
        req.is_local = d.kind == PlacementKind.LOCAL
        req.chosen_hit_pages, req.best_hit_pages = d.chosen_hit_pages, d.best_hit_pages
        decode = self.decodes[d.decode_id]
        if req.num_pages_needed > decode.num_pages:
            self.policy.finished(req)
            self._fail()  # can never fit there
            return
        is_reserved = decode.reserve(req)
        if is_reserved:
            req.reserved_s = now
        if req.is_local:
            if is_reserved:
                self._run_local(now, decode, req)
        else:
            prefill = self.prefills[d.prefill_id or ""]
            done = prefill.submit(req, now)
            if done is not None:
                self._at(done, _PREFILL_DONE, prefill)

    def _on_prefill_done(self, now: float, obj: object) -> None:
        assert isinstance(obj, PrefillWorker)
        worker = obj
        req = worker.complete()
        req.first_token_s = now
        self.policy.prefill_done(req)
        if req.is_reserved:
            self._at(worker.send(req, now, self.fleet.transport), _PUSHED, req)
        done = worker.start(now)
        if done is not None:
            self._at(done, _PREFILL_DONE, worker)

    def _on_pushed(self, now: float, obj: object) -> None:
        assert isinstance(obj, SimRequest)
        self._join(now, obj)

    def _join(self, now: float, req: SimRequest) -> None:
        decode = self.decodes[req.decode_id or ""]
        if req.output_len <= 1:
            self._finish(now, req)
            return
        decode.waiting.append(req)
        self._kick(now, decode)

    def _run_local(self, now: float, decode: DecodeWorker, req: SimRequest) -> None:
        decode.add_local(req)
        self._kick(now, decode)

    def _kick(self, now: float, decode: DecodeWorker) -> None:
        if decode.is_stepping or not decode.has_work():
            return
        end, computed = decode.begin_step(now)
        decode.is_stepping = True
        self._at(end, _STEP, (decode, computed))

    def _on_step(self, now: float, obj: object) -> None:
        assert isinstance(obj, tuple)
        decode: DecodeWorker = obj[0]
        computed: list[SimRequest] = obj[1]
        decode.is_stepping = False
        for req in decode.end_step(now):
            self._finish(now, req)
        for req in computed:  # local prefills whose last chunk this step carried
            decode.cache.store(req.hashes)  # offered to the cache as computed
            req.first_token_s = now
            self.policy.prefill_done(req)
            self._join(now, req)
        self._kick(now, decode)

    def _finish(self, now: float, req: SimRequest) -> None:
        req.finish_s = now
        self._num_open -= 1
        self.policy.finished(req)
        self.recorder.finished(req)
        run = req.session
        assert isinstance(run, SessionRun)
        decode = self.decodes[req.decode_id or ""]
        hashes, _ = self.hasher.hash(run.salt, run.parts(run.next_turn, with_output=True))
        for granted in decode.release(req, hashes):
            self._granted(now, decode, granted)
        run.next_turn += 1
        if run.next_turn < len(run.session.turns):
            think = self.rng.expovariate(1 / self.think_s) if self.think_s > 0 else 0.0
            self._at(now + think, _TURN, run)

    def _granted(self, now: float, decode: DecodeWorker, req: SimRequest) -> None:
        """A queued reservation now holds: start what waited on it."""
        req.reserved_s = now
        if req.is_local:
            self._run_local(now, decode, req)
        elif req.first_token_s >= 0:  # computed already: push now
            self._at(self.prefills[req.prefill_id or ""].send(req, now, self.fleet.transport), _PUSHED, req)

    def _fail(self) -> None:
        self._num_open -= 1
        self.recorder.num_failed += 1

    def _on_stats(self, now: float, _: object) -> None:
        self._report(now)
        if self.fleet.event_loss:
            for worker_id in self.bus.caches:
                self.bus.heartbeat(worker_id)
        if self._heap:  # anything left to happen (a turn after a pause counts)
            self._at(now + self.fleet.stats_interval_s, _STATS, None)

    def _report(self, now: float = 0.0) -> None:
        if not isinstance(self.policy, Baton):
            return
        cal, fleet = self.cal, self.fleet
        stats = [WorkerStats(w.worker_id, Role.PREFILL, cal.prefill_s_per_token, w.queue_delay_s(now),
                             cal.host_bytes_per_s) for w in self.prefills.values()]  # fmt: skip
        stats.extend(
            WorkerStats(d.worker_id, Role.DECODE, cal.prefill_s_per_token, d.queue_delay_s(), cal.host_bytes_per_s,
                        itl_s=cal.step_s(max(1, d.running)), num_running=d.running,
                        num_waiting=len(d.waiting) + len(d.local) + len(d.page_wait),
                        max_running=fleet.max_running, num_free_pages=d.num_free_pages)
            for d in self.decodes.values()
        )
        self.policy.update(stats)


_NEW_SESSION, _TURN, _PLACE, _PREFILL_DONE, _PUSHED, _STEP, _STATS = range(7)
