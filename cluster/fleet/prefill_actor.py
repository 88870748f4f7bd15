"""The prefill role as a Ray actor: its own step loop over a PrefillWorker, and its pushes
(prefill.pushes: one per transfer, streaming the pages as they are computed).

    prefill(job, dest)         queue the prompt; returns once its first token is sampled (TTFT
                               does not wait for the transfer)
    push_result(transfer_id)   how that push went (waits for it): a TransferReport
    abort(req_id)              the request went away: its prefill stops, its push is cancelled
    stall(seconds)             drills only: no step for that long (its queue grows; calls answer)
    evict_cached(keep_pages)   drills only: its retained copies go, its cache keeps keep_pages

Each pushed prompt's pages are retained here (prefill.worker.Retention) until a lease past its
push's end, so a request that loses its decode worker resumes from them (docs/architecture.md,
KV-preserving failover).

After each step the chunks of whole pages a chunked prefill has finished go to its push
(PrefillWorker.take_ready); the rest follow with the first token. Pushes run on the actor's
event loop between the engine's steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import torch

from cluster.fleet.cpu import between_steps, core_for, idle, pin_process
from cluster.fleet.first_tokens import FirstTokens
from cluster.fleet.registration import Registration, WorkerActor
from cluster.fleet.worker_msgs import PrefillResult, PrefillStats
from cluster.membership.protocol import Role
from cluster.placement.kv_log import KVEventLog
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.env import pod_name
from engine.faults import require_injection
from engine.job import Job
from engine.omp import release_thread_pool
from engine.pins import PinView, pin_in_loop
from kvcache.report import cache_report
from kvtransfer.jobs import AbortedIds, TransferReport
from kvtransfer.nccl_comm import nccl_usable
from kvtransfer.select import WorkerPlace
from kvtransfer.tls import NO_TLS, KVTls, KVTlsPaths
from kvtransfer.transport import DEFAULT_DEADLINE_S, KVDestination
from prefill.pushes import Pushes
from prefill.worker import PrefillWorker, Retention

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
WARMUP_STEPS = 2  # steps left out of the measured prefill rate


class PrefillActor(WorkerActor):
    def __init__(
        self,
        cfg: EngineConfig,
        epoch: int = 1,
        pages_per_chunk: int | None = None,  # None: chunks of about 4 MiB
        num_threads: int = 1,
        push_deadline_s: float = DEFAULT_DEADLINE_S,
        chunk_pause_s: float = 0.0,  # fault drills only: a pause before each chunk
        pin_slot: int | None = None,  # set: pin this process to core_for(pin_slot) (--pin-cores)
        reservation_ttl_s: float = 30.0,  # the decode side's reserve -> complete bound
        exit_on_failure: bool = False,  # a failed engine ends the process (Ray restarts it)
        tls: KVTlsPaths = NO_TLS,  # mutual TLS to the decode workers' KV servers (kvtransfer.tls)
        retain_share: float = 0.0,  # of the pool, held for pushed prompts (recovery.retain_share)
        retain_s: float = 30.0,  # a retained copy's lease past its push's end (recovery.retain_s)
    ) -> None:
        self.tls = KVTls.load(tls)
        self.core = pin_process(core_for(pin_slot)) if pin_slot is not None else None
        torch.set_num_threads(num_threads)
        engine = Engine(cfg)
        # a stream opened before the first token: the reservation ends it at the latest, the
        # push deadline after the first token (the transport's own timeout is only a backstop)
        stream_limit_s = reservation_ttl_s + push_deadline_s
        retention = Retention(int(engine.pool.pages.num_pages * retain_share), retain_s, stream_limit_s + retain_s)
        self.worker = PrefillWorker(engine, epoch, pages_per_chunk, retention=retention)
        release_thread_pool()  # Ray may step on another thread than this one: one OpenMP pool (engine.omp)
        kv_log = KVEventLog(self.worker.engine.prefix_cache, epoch)
        registration = Registration(Role.PREFILL, kv_log, self._is_idle, self._num_unfinished, self._set_epoch,
                                    exit_on_failure)  # fmt: skip
        super().__init__(registration, kv_log, self.worker.engine)
        self.pushes = Pushes(self.worker.engine.device, self.worker.engine.faults, self.tls, push_deadline_s,
                             stream_limit_s, chunk_pause_s, on_end=self.worker.pushed)  # fmt: skip
        self.firsts = FirstTokens(self.pushes)
        self._aborted = AbortedIds(stream_limit_s)  # a prefill arriving after its abort computes nothing
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._stalled_until = 0.0  # time.monotonic(); drills only (stall)
        self.s_per_token = 0.0  # measured: step time / tokens computed, moving average
        self._warmup_steps = WARMUP_STEPS  # not measured: the first steps pay one-off costs

    async def ping(self) -> int:
        return os.getpid()

    async def cores(self) -> list[int]:
        """The cores this actor may run on (one, when pinned)."""
        return sorted(os.sched_getaffinity(0))

    async def place_of(self) -> WorkerPlace:
        """Where this worker runs, for the choice of transport (kvtransfer.select)."""
        import ray

        device = self.worker.engine.device
        return WorkerPlace(ray.get_runtime_context().get_node_id(), os.getpid(), device.type == "cuda",
                           has_nccl=nccl_usable(device), host=ray.util.get_node_ip_address(), pod=pod_name())  # fmt: skip

    async def route(self, address: str, transport: str, rendezvous: tuple[str, bytes] | None = None) -> str:
        """Push to the decode worker at `address` by `transport` (prefill.pushes.Pushes.route)."""
        return await self.pushes.route(address, transport, rendezvous)

    async def prefill(self, job: Job, dest: KVDestination) -> PrefillResult:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())
        if job.sampling.constraint is not None:  # the first token is sampled under its mask
            await asyncio.to_thread(self.worker.engine.prepare, job.sampling)
        if job.req_id in self._aborted:  # its abort came first: the caller is gone
            raise RuntimeError(f"{job.req_id} was aborted before its prefill")

        def submit(on_device: bool) -> None:
            self.worker.submit(job, dest, on_device=on_device)
            self._wake.set()

        return await self.firsts.prefill(job, dest, submit)

    async def pin_prefix(
        self, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float, wait_s: float
    ) -> PinView | str:
        """Keep a prefix's pages resident here (engine.pins): the pin once its pages are held
        (or still computing past `wait_s`), or why it was refused."""
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())
        return await pin_in_loop(self.worker.engine, self._wake.set, pin_id, prompt_ids, cache_salt, ttl_s, wait_s)

    async def unpin_prefix(self, pin_id: str) -> bool:
        return self.worker.engine.unpin_prefix(pin_id)

    async def push_result(self, transfer_id: str) -> TransferReport:
        return await self.pushes.result(transfer_id)

    async def abort(self, req_id: str) -> None:
        self._aborted.add(req_id)
        self.worker.abort(req_id)
        self.firsts.cancel(req_id)
        self.pushes.abort(req_id)

    async def stall(self, seconds: float) -> None:
        """Drills and tests only: take no step for `seconds` (an overloaded or stuck worker)."""
        self._stalled_until = time.monotonic() + seconds

    async def hold_pushes(self, hold: bool) -> None:
        """Drills and tests only: with `hold`, a push that starts from now on sends its first
        chunk and then waits until `hold_pushes(False)` (its deadline still runs; an abort ends
        it): a transfer in flight that stays in flight for as long as a drill needs to look at
        it or break it, instead of one caught by polling while it lasts. A push already under
        way, or one of a single chunk, is not held. Refused unless the worker's environment
        allows fault injection."""
        require_injection()
        self.pushes.hold(hold)

    async def evict_cached(self, keep_pages: int) -> int:
        """Drills and tests only: let every retained copy go and evict cached pages until
        `keep_pages` are left (least recently used first, a prompt's tail before its head): the
        copy a migrating request counts on, lost in part. Pages evicted. Refused unless the
        worker's environment allows fault injection."""
        require_injection()
        self.worker.retained.clear()
        cache = self.worker.engine.prefix_cache
        return cache.evict(max(0, cache.num_cached_pages - keep_pages)) if cache is not None else 0

    async def stats(self) -> PrefillStats:
        self.registration.follow_epoch()
        inflight, pushes, retained = self.pushes.in_flight(), self.pushes, self.worker.retained
        cache = self.worker.engine.prefix_cache
        return PrefillStats(
            self.worker.epoch, self.worker.engine.scheduler.num_requests, len(inflight),
            sum(p.num_pages for p in inflight), pushes.num_transfers, pushes.num_failed, pushes.num_lease_expired,
            self.kv_log.last_seq, cache.stats.query_tokens if cache else 0, cache.stats.hit_tokens if cache else 0,
            self.worker.engine.scheduler.num_pending_tokens, self.s_per_token,
            cache_report(self.worker.engine.pool.pages, cache, self.worker.engine.cfg.page_size),
            self.worker.engine.num_preempted_total, os.getpid(), dict(pushes.ended),
            retained.num_held_pages, len(retained), dict(retained.released), self.kernels,
        )  # fmt: skip

    def _set_epoch(self, epoch: int) -> None:
        self.worker.epoch = epoch  # its pushes carry it: decode refuses pages of a stale one

    def _is_idle(self) -> bool:
        busy = self.worker.engine.scheduler.num_requests or len(self.firsts)
        return not busy and not self.pushes.num_running

    def _num_unfinished(self) -> int:
        return self.worker.engine.scheduler.num_requests + self.pushes.num_running

    async def close(self) -> None:
        await self.registration.leave()
        if self._loop is not None:
            self._loop.cancel()
        await self.pushes.close()
        self.worker.retained.clear()

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self.pushes.expire_leases()
            self.worker.retained.expire()
            if (pause := self._stalled_until - time.monotonic()) > 0:
                await asyncio.sleep(min(pause, IDLE_WAIT_S))
                continue
            if not self.worker.has_work():
                await idle(self._wake, IDLE_WAIT_S)
                continue
            scheduler = self.worker.engine.scheduler
            pending, start = scheduler.num_pending_tokens, time.perf_counter()
            try:
                finished = self.worker.step()
            except Exception as exc:  # its prompts fail; the engine's state is in doubt
                logger.exception("prefill step failed")
                self._fail_all(exc)
                self.registration.engine_failed(exc)  # with a restart budget: the process ends here
                continue
            self._measure(pending - scheduler.num_pending_tokens, time.perf_counter() - start)
            for done in finished:
                self.firsts.done(done.req_id, done)
            for ready in self.worker.take_ready():  # pages of prompts still computing
                self.pushes.feed(ready.dest.transfer_id, ready.chunks)
            await between_steps()  # pushes and new calls run between steps

    def _measure(self, num_tokens: int, seconds: float) -> None:
        """The prefill rate the gateway's placement costs this worker at (s per token)."""
        if num_tokens > 0 and self._warmup_steps > 0:
            self._warmup_steps -= 1
        elif num_tokens > 0:
            rate = seconds / num_tokens
            self.s_per_token = rate if not self.s_per_token else 0.8 * self.s_per_token + 0.2 * rate

    def _fail_all(self, exc: Exception) -> None:
        for req_id in self.firsts.waiting():
            self.worker.abort(req_id)
            self.firsts.done(req_id, RuntimeError(f"prefill failed: {exc!r}"))
