"""The decode role as a Ray actor: its own step loop, a KV server, one output feed.

    start()                          serve KV pushes (gRPC, and shm when it has a region) and
                                     start the step loop; the address
    place(job, epoch | None)         reserve pages for a push -> KVDestination; or, when the
                                     uncached part is short, no prefill worker is healthy
                                     (epoch None) or no pages are free, prefill here -> None
    admit(job, dest, first, wait_s)  once every page arrived: join the batch -> True; a
                                     transfer that fails or misses wait_s -> False, pages freed
    next_batch(after, wait_s)        the output stream: every step after `after` (long-poll)
    abort(req_id) / cancel(dest)     the request or its reservation lets go of its pages
    stall(seconds, after_steps)      drills only: no step for that long, after that many more
    hand_off(job, dest, moved)       draining: a moved request's context, pushed to another
                                     decode worker's reservation (decode.handoff) -> its first
                                     token; push_result(transfer_id) says how the push went;
                                     route(address, transport) says how to reach that worker

The engine steps run on the actor's event loop between awaits, so pushes land between two
steps, never inside one. Reservations that are never completed expire at their deadline;
complete ones that are never admitted expire at their admission lease (decode.worker).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc
import torch

from cluster.fleet.cpu import between_steps, core_for, idle, pin_process
from cluster.fleet.first_tokens import FirstTokens
from cluster.fleet.output_feed import OutputFeed
from cluster.fleet.registration import Registration, WorkerActor
from cluster.fleet.worker_msgs import DecodeStats, OutputBatch, PrefillResult
from cluster.membership.protocol import Role
from cluster.placement.kv_log import KVEventLog
from decode.handoff import HandOffs
from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.env import pod_name
from engine.faults import require_injection
from engine.job import Job
from engine.omp import release_thread_pool
from engine.outputs import StepOutput
from engine.pins import PinView, pin_in_loop
from kvcache.report import CacheReport, cache_report
from kvtransfer.codec import chunk_pages
from kvtransfer.grpc_transport import start_kv_server
from kvtransfer.jobs import TransferReport
from kvtransfer.listen import LOOPBACK, listen_address
from kvtransfer.nccl_comm import nccl_usable
from kvtransfer.nccl_link import NcclEndpoint, nccl_handler
from kvtransfer.select import WorkerPlace
from kvtransfer.shm import ShmRegion, shm_handler
from kvtransfer.tls import NO_TLS, KVTls, KVTlsPaths
from kvtransfer.transport import DEFAULT_DEADLINE_S, KVDestination
from prefill.pushes import Pushes

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.25  # expiry runs at least this often
CACHE_REPORT_S = 0.5  # the cache report (it walks the prefix cache) rides on output batches this often


class _Signal:
    """Wakes everyone waiting for 'something changed' (a broadcast, unlike one Event)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            pass


class DecodeActor(WorkerActor):
    def __init__(
        self,
        cfg: EngineConfig,
        reservation_ttl_s: float = DEFAULT_DEADLINE_S,
        local_prefill_tokens: int = 32,
        num_threads: int = 1,
        bind_host: str = "auto",  # the KV listener (kvtransfer.listen): auto, node or an IP
        advertise_host: str = "",  # what senders dial, when not the bound address
        admit_lease_s: float = DEFAULT_DEADLINE_S,
        max_feed_steps: int = 4096,
        shm_slots: int = 0,  # > 0: also serve PushShm from a /dev/shm region of this many slots
        shm_slot_pages: int | None = None,  # pages one slot holds: the senders' pages per chunk
        pin_slot: int | None = None,  # set: pin this process to core_for(pin_slot) (--pin-cores)
        epoch: int = 1,  # of its KV events (a restarted worker gets a new one)
        exit_on_failure: bool = False,  # a failed engine ends the process (Ray restarts it)
        tls: KVTlsPaths = NO_TLS,  # mutual TLS on the KV server (kvtransfer.tls)
        hand_off_on_drain: bool = False,  # a drain asks the gateway to move its requests (recovery.drain_hand_off)
        hand_off_pages: bool = True,  # and they take their pages from here (recovery.preserve_kv)
    ) -> None:
        self.tls = KVTls.load(tls)
        self.hand_off_on_drain = hand_off_on_drain
        self.hand_off_pages = hand_off_pages
        self.handing_off = False  # draining, and its requests should move: the gateway reads it in the stats
        self.core = pin_process(core_for(pin_slot)) if pin_slot is not None else None
        torch.set_num_threads(num_threads)
        self._settled = _Signal()
        self.worker = DecodeWorker(Engine(cfg), "", reservation_ttl_s, local_prefill_tokens, admit_lease_s,
                                   on_settle=self._settled.fire)
        release_thread_pool()  # Ray may step on another thread than this one: one OpenMP pool (engine.omp)
        kv_log = KVEventLog(self.worker.engine.prefix_cache, epoch)
        registration = Registration(Role.DECODE, kv_log, self._is_idle, self._num_unfinished,
                                    exit_on_failure=exit_on_failure, on_drain=self._on_drain)  # fmt: skip
        super().__init__(registration, kv_log, self.worker.engine)
        self.bind_host, self.advertise_host = bind_host, advertise_host
        self.feed = OutputFeed(max_feed_steps)
        self._wake = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.Task[None] | None = None
        self.shm_slots, self.shm_slot_pages = shm_slots, shm_slot_pages
        self._region: ShmRegion | None = None
        self.nccl = NcclEndpoint(self.worker.engine.device)  # channels of nccl-routed prefill workers
        self.error: str = ""
        self._report, self._report_at = CacheReport(), -CACHE_REPORT_S
        self._acked = 0  # the last output step the gateway confirmed (a drain waits for all)
        self._stall: tuple[int, float] | None = None  # drills only: (steps first, then seconds without one)
        self._stalled_until = 0.0  # time.monotonic()
        # a drain's hand-offs: this worker pushes its moved requests' pages (decode.handoff)
        engine = self.worker.engine
        page_bytes = engine.pool.kv[:, :, 0].numel() * engine.pool.kv.element_size()
        self.hand_offs = HandOffs(engine, chunk_pages(page_bytes, shm_slot_pages))
        self.pushes = Pushes(engine.device, engine.faults, self.tls, admit_lease_s, reservation_ttl_s + admit_lease_s)
        self.firsts = FirstTokens(self.pushes)  # the hand-offs' first tokens

    async def start(self) -> str:
        """Serve KV pushes and start stepping; returns the address reservations name. Idempotent."""
        if self._server is None:
            receiver = self.worker.receiver
            extra = [nccl_handler(receiver, self.nccl)]
            if self.shm_slots:
                pool = self.worker.engine.pool
                page_bytes = pool.kv[:, :, 0].numel() * pool.kv.element_size()
                # a slot holds one chunk, as large as the senders make them (codec.chunk_pages)
                self._region = ShmRegion(self.shm_slots, chunk_pages(page_bytes, self.shm_slot_pages) * page_bytes)
                extra.append(shm_handler(receiver, self._region))
            listen = listen_address(self.bind_host, self.advertise_host, *_node())
            self._server, port = await start_kv_server(receiver, listen.bind_at(0), extra_handlers=extra, tls=self.tls)
            self.worker.address = listen.advertise_at(port)
            logger.info("KV server on %s, advertised as %s", listen.bind_at(port), self.worker.address)
            self._loop = asyncio.create_task(self._run())
        return self.worker.address

    # -- requests -----------------------------------------------------------------------------

    async def place(self, job: Job, sender_epoch: int | None) -> KVDestination | None:
        self._check_started()
        # A constraint compiles here, off the step loop and before any page is reserved
        # (ConstraintError reaches the gateway as this call's error: a 400 there).
        if job.sampling.constraint is not None:
            await asyncio.to_thread(self.worker.engine.prepare, job.sampling)
        if self.worker.was_aborted(job.req_id):  # its abort came first: the caller is gone
            return None
        if sender_epoch is not None and not self.worker.prefers_local(job):
            dest = self.worker.reserve(job, sender_epoch)
            if dest is not None:
                return dest
        self.worker.start_local(job)  # no room to reserve: the engine queues it like any request
        self._wake.set()
        return None

    async def admit(self, job: Job, dest: KVDestination, first: StepOutput, wait_s: float) -> bool:
        """Join the batch once the transfer completes; False (pages freed) if it fails first."""
        end = time.monotonic() + wait_s
        while not self.worker.is_settled(dest) and time.monotonic() < end:
            await self._settled.wait(end - time.monotonic())
        if not self.worker.is_complete(dest):
            self.worker.cancel(dest)
            return False
        self.worker.start_prefilled(job, dest, first.token_ids[0], first.cached)
        self._wake.set()
        return True

    async def pin_prefix(
        self, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float, wait_s: float
    ) -> PinView | str:
        """Keep a prefix's pages resident here (engine.pins): the pin once its pages are held
        (or still computing past `wait_s`), or why it was refused."""
        self._check_started()
        return await pin_in_loop(self.worker.engine, self._wake.set, pin_id, prompt_ids, cache_salt, ttl_s, wait_s)

    async def unpin_prefix(self, pin_id: str) -> bool:
        return self.worker.engine.unpin_prefix(pin_id)

    async def nccl_listen(self) -> tuple[str, bytes]:
        """Open a channel for one prefill worker (its route's rendezvous): its name and unique
        id; this side joins it now, the prefill worker within the rendezvous deadline."""
        self._check_started()
        return await self.nccl.listen()

    async def cancel(self, dest: KVDestination) -> None:
        self.worker.cancel(dest)
        self._settled.fire()

    async def abort(self, req_id: str) -> None:
        self.worker.abort(req_id)
        self.hand_offs.abort(req_id)
        self.firsts.cancel(req_id)
        self.pushes.abort(req_id)
        self._settled.fire()

    async def route(self, address: str, transport: str, rendezvous: tuple[str, bytes] | None = None) -> str:
        """Push hand-offs to the decode worker at `address` by `transport` (prefill.pushes)."""
        return await self.pushes.route(address, transport, rendezvous)

    async def hand_off(self, job: Job, dest: KVDestination, moved: str) -> PrefillResult:
        """Draining: `job` (the request that ran here as `moved`, with the tokens it emitted now
        part of its prompt) prefilled from this worker's cached pages, its pages pushed to
        `dest`; its first token once sampled (push_result says how the push went)."""
        self._check_started()
        if not self.registration.draining:
            raise RuntimeError("only a draining decode worker hands requests off")
        if job.sampling.constraint is not None:  # its first token here is sampled under its mask
            await asyncio.to_thread(self.worker.engine.prepare, job.sampling)
        if self.worker.was_aborted(job.req_id):  # its abort came first: the caller is gone
            raise RuntimeError(f"{job.req_id} was aborted before its hand-off")
        self._stall, self._stalled_until = None, 0.0  # a drill's stall does not hold the drain's last work

        def submit(on_device: bool) -> None:
            self.hand_offs.submit(job, dest, moved, on_device)
            self._wake.set()

        return await self.firsts.prefill(job, dest, submit)

    async def push_result(self, transfer_id: str) -> TransferReport:
        return await self.pushes.result(transfer_id)

    async def stall(self, seconds: float, after_steps: int = 0) -> None:
        """Drills and tests only: after `after_steps` more steps, take none for `seconds` (calls,
        pushes and aborts are still served): a request caught mid-decode for as long as a drill
        needs, instead of one that may finish while a test looks. `stall(0)` ends a stall.
        Refused unless the worker's environment allows fault injection."""
        require_injection()
        self._stall, self._stalled_until = None, 0.0
        if seconds > 0 and after_steps <= 0:
            self._stalled_until = time.monotonic() + seconds
        elif seconds > 0:
            self._stall = (after_steps, seconds)

    async def next_batch(self, after: int, wait_s: float) -> OutputBatch:
        self._acked = max(self._acked, after)  # the gateway has every step up to here
        if self.error:
            raise RuntimeError(f"decode step loop died: {self.error}")
        taken = await self.feed.take(after, wait_s)
        return OutputBatch(taken.first_seq, taken.last_seq, taken.outputs, self._stats())

    async def stats(self) -> DecodeStats:
        return self._stats()

    async def cores(self) -> list[int]:
        """The cores this actor may run on (one, when pinned)."""
        return sorted(os.sched_getaffinity(0))

    async def place_of(self) -> WorkerPlace:
        """Where this worker runs, for the choice of transport (kvtransfer.select)."""
        import ray

        return WorkerPlace(ray.get_runtime_context().get_node_id(), os.getpid(),
                           self.worker.engine.device.type == "cuda", has_nccl=nccl_usable(self.worker.engine.device),
                           has_shm=self._region is not None, host=_node()[0], pod=pod_name())  # fmt: skip

    def kv_address(self) -> str:
        return self.worker.address

    def _on_drain(self) -> None:
        """A drain started (the gateway's, the planner's or SIGTERM's): with hand-off, the
        stats say so from the next batch on, and the gateway moves this worker's requests to
        the others (which resume them from copies of their pages: from this worker's, which it
        pushes them, unless preservation is off), aborting them here."""
        self.handing_off = self.hand_off_on_drain
        if self.handing_off and self.hand_off_pages:  # the drain waits for their hand-offs (or their end here)
            self.hand_offs.expect(self.worker.engine.scheduler.req_ids())

    def _is_idle(self) -> bool:
        engine = self.worker.engine
        return (not engine.has_unfinished() and not self.worker.book.num_open and self._acked >= self.feed.seq
                and not self.pushes.num_running and not self.hand_offs.is_waiting())  # fmt: skip

    def _num_unfinished(self) -> int:
        return (len(self.worker.engine.scheduler.running) + self.worker.engine.scheduler.num_waiting
                + self.pushes.num_running)  # fmt: skip

    async def close(self) -> None:
        await self.registration.leave()
        if self._loop is not None:
            self._loop.cancel()
        if self._server is not None:
            await self._server.stop(None)
        await self.pushes.close()
        if self._region is not None:
            self._region.close()
        self.nccl.close()
        self._server = self._loop = self._region = None

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        engine = self.worker.engine
        try:
            while True:
                self.worker.expire()
                self.pushes.expire_leases()  # a hand-off's push past its lease lets go
                if (pause := self._stalled_until - time.monotonic()) > 0:  # drills only (stall)
                    await asyncio.sleep(min(pause, IDLE_WAIT_S))
                    continue
                if not engine.has_unfinished():
                    engine.flush_cache()
                    await idle(self._wake, IDLE_WAIT_S)
                    continue
                outputs = engine.step()
                if self.hand_offs or self.registration.draining:
                    outputs = self._handed_off(outputs)
                if outputs:
                    self.feed.publish(outputs)
                self._count_stall_step()
                await between_steps()  # pushes and calls run between steps
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # report the death through next_batch, never vanish
            logger.exception("decode step loop died")
            self.error = repr(exc)
            self.registration.engine_failed(exc)

    def _handed_off(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The step's outputs less the hand-offs' (whose first tokens go to their callers)."""
        kept, done = self.hand_offs.take(outputs)
        for req_id, result in done:
            self.firsts.done(req_id, result)
        return kept

    def _count_stall_step(self) -> None:
        if self._stall is None:
            return
        steps, seconds = self._stall
        if steps <= 1:  # that was the last step before the stall
            self._stalled_until, self._stall = time.monotonic() + seconds, None
        else:
            self._stall = (steps - 1, seconds)

    def _check_started(self) -> None:
        if self._server is None:
            raise RuntimeError("start() the decode actor before placing requests")

    def _stats(self) -> DecodeStats:
        self.registration.follow_epoch()
        w, engine, book = self.worker, self.worker.engine, self.worker.book
        cache = engine.prefix_cache
        cached = cache.num_cached_pages if cache is not None else 0
        return DecodeStats(
            w.address, engine.pool.num_pages, engine.pool.pages.num_used, engine.free_pages_at_idle(), cached,
            w.num_reserved_pages, book.num_open, book.num_expired, w.num_lease_expired,
            len(engine.scheduler.running), engine.scheduler.num_waiting,
            book.refused_bad_token, book.refused_stale_epoch, book.refused_bad_page,
            self.kv_log.last_seq, cache.stats.query_tokens if cache else 0, cache.stats.hit_tokens if cache else 0,
            self._cache_report(), engine.num_preempted_total, os.getpid(), self.handing_off, w.num_kept_pages,
            self.hand_offs.num_handed_off, self.kernels, book.refused_aborted,
        )  # fmt: skip

    def _cache_report(self) -> CacheReport:
        now = time.monotonic()
        if now - self._report_at >= CACHE_REPORT_S:
            engine = self.worker.engine
            self._report, self._report_at = cache_report(engine.pool.pages, engine.prefix_cache, engine.cfg.page_size), now
        return self._report


def _node() -> tuple[str, int]:
    """This node's address and the number of live nodes in the Ray cluster (outside Ray, as
    in tests that build the actor directly: loopback, one)."""
    import ray

    if not ray.is_initialized():
        return LOOPBACK, 1
    return ray.util.get_node_ip_address(), sum(1 for node in ray.nodes() if node.get("Alive"))
