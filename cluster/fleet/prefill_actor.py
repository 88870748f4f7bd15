"""The prefill role as a Ray actor: its own step loop, and one push task per transfer.

    prefill(job, dest)         queue the prompt; returns once its first token is sampled (TTFT
                               does not wait for the transfer)
    push_result(transfer_id)   how that push went (waits for it): a TransferReport
    abort(req_id)              the request went away: its prefill stops, its push is cancelled
    stall(seconds)             drills only: no step for that long (its queue grows; calls answer)

One push per transfer streams the pages as they are computed: after each step the chunks of
whole pages a chunked prefill has finished go to the push (PrefillWorker.take_ready), which
opens its stream with the first of them; the rest, the last page included, follow with the
first token. The transfer's deadline runs from the first token (as for a push that starts
then); before it, the stream is bounded by the decode side's reservation, which expires on
its own. The pages of a transfer stay pinned here (its chunks, held by the push) until the
decode side acks them, the push fails or is aborted, or the transfer's lease ends. Pushes run
on the actor's event loop between the engine's steps. Page bytes travel by the transport
chosen per decode worker (`route`: nccl between CUDA pools, shm on the same host, else gRPC),
never through Ray. An nccl route keeps a transfer's chunks on the device; a push that finds its
channel dead (aborted at a deadline) turns that route to gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import torch

from cluster.fleet.cpu import between_steps, core_for, pin_process
from cluster.fleet.registration import Registered
from cluster.fleet.worker_msgs import PrefillResult, PrefillStats, TransferReport
from cluster.membership.protocol import Role
from cluster.placement.kv_log import KVEventLog, KVPublisher
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.faults import TRANSFER as TRANSFER_FAULTS
from engine.faults import require_injection
from engine.omp import release_thread_pool
from kvcache.report import cache_report
from kvtransfer.codec import DeviceChunk, TransferError, WireChunk
from kvtransfer.grpc_transport import GrpcSender
from kvtransfer.jobs import AbortedIds, PrefillJob
from kvtransfer.nccl import nccl_usable
from kvtransfer.nccl_link import NcclSender
from kvtransfer.select import WorkerPlace
from kvtransfer.shm import ShmSender
from kvtransfer.tls import NO_TLS, KVTls, KVTlsPaths
from kvtransfer.transport import DEFAULT_DEADLINE_S, KVDestination, KVSender
from prefill.worker import Chunk, PrefillDone, PrefillWorker

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
LEASE_GRACE_S = 1.0  # past the push's own deadline, which normally ends it first
WARMUP_STEPS = 2  # steps left out of the measured prefill rate


class _Feed:
    """One transfer's chunks as the prefill computes them: the step loop puts batches, the
    push streams them; the batch holding the chunk flagged last closes the stream."""

    def __init__(self) -> None:
        self._batches: asyncio.Queue[tuple[Chunk, ...]] = asyncio.Queue()
        self._timer: asyncio.Timeout | None = None
        self._deadline: float | None = None  # loop time; set at the first token
        self.has_pages = False  # pages are pinned for the push from the first batch on
        self.num_bytes = 0

    def put(self, chunks: tuple[Chunk, ...]) -> None:
        self.has_pages = True
        self._batches.put_nowait(chunks)

    def set_deadline(self, when: float) -> None:
        self._deadline = when
        if self._timer is not None:
            self._timer.reschedule(when)

    def watch(self, timer: asyncio.Timeout | None) -> None:
        """The push's timer while it sends: it fires at the deadline, once there is one."""
        self._timer = timer
        if timer is not None and self._deadline is not None:
            timer.reschedule(self._deadline)

    async def next_batch(self) -> tuple[Chunk, ...]:
        return await self._batches.get()

    async def stream(self, first: tuple[Chunk, ...]) -> AsyncIterator[Chunk]:
        batch = first
        while True:
            for chunk in batch:
                self.num_bytes += chunk.header.payload_bytes
                yield chunk
            if batch and batch[-1].header.is_last:
                return
            batch = await self._batches.get()


@dataclass(slots=True)
class _Push:
    req_id: str
    num_pages: int
    lease_end: float  # time.monotonic(); the pinned chunks go when it passes (inf before the first token)
    task: asyncio.Task[TransferReport]
    feed: _Feed


class PrefillActor(KVPublisher, Registered):
    role = Role.PREFILL

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
    ) -> None:
        self.exit_on_failure = exit_on_failure
        self.tls = KVTls.load(tls)
        self.core = pin_process(core_for(pin_slot)) if pin_slot is not None else None
        torch.set_num_threads(num_threads)
        self.worker = PrefillWorker(Engine(cfg), epoch, pages_per_chunk)
        release_thread_pool()  # Ray may step on another thread than this one: one OpenMP pool (engine.omp)
        self.kv_log = KVEventLog(self.worker.engine.prefix_cache, epoch)
        self.fingerprint_bytes = self.worker.engine.fingerprint
        self._senders: dict[str, KVSender] = {"grpc": GrpcSender(tls=self.tls)}
        self._nccl: NcclSender | None = None  # its channels, once a route asks for nccl
        self._routes: dict[str, str] = {}  # decode address -> transport ("grpc" when unset)
        self.push_deadline_s = push_deadline_s
        # a stream opened before the first token: the reservation ends it at the latest, the
        # push deadline after the first token (the transport's own timeout is only a backstop)
        self.stream_limit_s = reservation_ttl_s + push_deadline_s
        self.chunk_pause_s = chunk_pause_s
        self._firsts: dict[str, asyncio.Future[PrefillDone]] = {}
        self._aborted = AbortedIds(self.stream_limit_s)  # a prefill arriving after its abort computes nothing
        self._pushes: dict[str, _Push] = {}  # transfer_id -> its push, until reported or expired
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self.num_transfers = self.num_failed = self.num_lease_expired = 0
        self._stalled_until = 0.0  # time.monotonic(); drills only (stall)
        self._flowing = asyncio.Event()  # cleared: pushes wait after their first chunk (drills: hold_pushes)
        self._flowing.set()
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
                           has_nccl=nccl_usable(device), host=ray.util.get_node_ip_address())  # fmt: skip

    async def route(self, address: str, transport: str, rendezvous: tuple[str, bytes] | None = None) -> str:
        """Push to the decode worker at `address` by `transport` ("grpc", "shm" or "nccl": then
        `rendezvous` is the channel the decode side listens on, from its nccl_listen); returns
        the transport in use, gRPC when the nccl channel did not open."""
        if transport == "nccl":
            if rendezvous is None:
                raise ValueError("an nccl route needs the decode side's rendezvous")
            if self._nccl is None:
                self._nccl = self._senders["nccl"] = NcclSender(self.worker.engine.device, tls=self.tls)
            try:
                await self._nccl.connect(address, *rendezvous)
            except TransferError as err:
                logger.warning("no nccl channel to %s (%s): pages go by gRPC", address, err.reason)
                transport = "grpc"
        elif transport not in self._senders:
            if transport != "shm":
                raise ValueError(f"unknown transport {transport!r}")
            self._senders["shm"] = ShmSender(tls=self.tls)
        self._routes[address] = transport
        return transport

    async def prefill(self, job: PrefillJob, dest: KVDestination) -> PrefillResult:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())
        if job.sampling.constraint is not None:  # the first token is sampled under its mask
            await asyncio.to_thread(self.worker.engine.prepare, job.sampling)
        if job.req_id in self._aborted:  # its abort came first: the caller is gone
            raise RuntimeError(f"{job.req_id} was aborted before its prefill")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillDone] = loop.create_future()
        self._firsts[job.req_id] = future
        feed = _Feed()
        transport = self._routes.get(dest.address, "grpc")
        task = asyncio.create_task(self._push(dest, feed, transport))
        push = self._pushes[dest.transfer_id] = _Push(job.req_id, len(dest.dest_page_ids), float("inf"), task, feed)
        try:
            self.worker.submit(job, dest, on_device=transport == "nccl")
            self._wake.set()
            done = await future
        except BaseException:
            self._drop(dest.transfer_id)
            raise
        finally:
            self._firsts.pop(job.req_id, None)
        if done.finish_reason is not None:  # the first token ends the request: nothing more moves
            self._drop(dest.transfer_id)
            return PrefillResult(done.output, "")
        feed.put(done.chunks)
        feed.set_deadline(loop.time() + self.push_deadline_s)
        push.lease_end = time.monotonic() + self.push_deadline_s
        return PrefillResult(done.output, dest.transfer_id)

    def _drop(self, transfer_id: str) -> None:
        """A transfer that will not complete: its push (and the reservation it holds) goes."""
        push = self._pushes.pop(transfer_id, None)
        if push is not None:
            push.task.cancel()

    async def push_result(self, transfer_id: str) -> TransferReport:
        push = self._pushes.get(transfer_id)
        if push is None:
            return TransferReport(transfer_id, "", False, 0, 0, 0.0, "unknown transfer")
        report = await asyncio.shield(push.task)
        self._pushes.pop(transfer_id, None)
        return report

    async def abort(self, req_id: str) -> None:
        self._aborted.add(req_id)
        self.worker.abort(req_id)
        future = self._firsts.pop(req_id, None)
        if future is not None and not future.done():
            future.cancel()
        for push in self._pushes.values():
            if push.req_id == req_id:
                push.task.cancel()

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
        if hold:
            self._flowing.clear()
        else:
            self._flowing.set()

    async def stats(self) -> PrefillStats:
        self._follow_epoch()
        inflight = [p for p in self._pushes.values() if p.feed.has_pages and not p.task.done()]
        cache = self.worker.engine.prefix_cache
        return PrefillStats(
            self.worker.epoch, self.worker.engine.scheduler.num_requests, len(inflight),
            sum(p.num_pages for p in inflight), self.num_transfers, self.num_failed, self.num_lease_expired,
            self.kv_log.last_seq, cache.stats.query_tokens if cache else 0, cache.stats.hit_tokens if cache else 0,
            self.worker.engine.scheduler.num_pending_tokens, self.s_per_token,
            cache_report(self.worker.engine.pool.pages, cache, self.worker.engine.cfg.page_size),
            self.worker.engine.num_preempted_total, os.getpid(),
        )  # fmt: skip

    def _engine(self) -> Engine:
        return self.worker.engine

    def _set_epoch(self, epoch: int) -> None:
        super()._set_epoch(epoch)
        self.worker.epoch = epoch  # its pushes carry it: decode refuses pages of a stale one

    def _is_idle(self) -> bool:
        busy = self.worker.engine.scheduler.num_requests or self._firsts
        return not busy and all(p.task.done() for p in self._pushes.values())

    def _num_unfinished(self) -> int:
        return self.worker.engine.scheduler.num_requests + sum(not p.task.done() for p in self._pushes.values())

    async def _shutdown(self) -> None:
        await self.close()

    async def close(self) -> None:
        await self.leave()
        if self._loop is not None:
            self._loop.cancel()
        for push in self._pushes.values():
            push.task.cancel()
        for sender in self._senders.values():
            close = getattr(sender, "close", None)
            if close is not None:
                await close()

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._expire_leases()
            if (pause := self._stalled_until - time.monotonic()) > 0:
                await asyncio.sleep(min(pause, IDLE_WAIT_S))
                continue
            if not self.worker.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_WAIT_S)
                except TimeoutError:
                    pass
                continue
            scheduler = self.worker.engine.scheduler
            pending, start = scheduler.num_pending_tokens, time.perf_counter()
            try:
                finished = self.worker.step()
            except Exception as exc:  # its prompts fail; the engine's state is in doubt
                logger.exception("prefill step failed")
                self._fail_all(exc)
                self._engine_failed(exc)  # with a restart budget: the process ends here
                continue
            self._measure(pending - scheduler.num_pending_tokens, time.perf_counter() - start)
            for done in finished:
                future = self._firsts.get(done.req_id)
                if future is not None and not future.done():
                    future.set_result(done)
            for ready in self.worker.take_ready():  # pages of prompts still computing
                push = self._pushes.get(ready.dest.transfer_id)
                if push is not None:
                    push.feed.put(ready.chunks)
            await between_steps()  # pushes and new calls run between steps

    def _measure(self, num_tokens: int, seconds: float) -> None:
        """The prefill rate the gateway's placement costs this worker at (s per token)."""
        if num_tokens > 0 and self._warmup_steps > 0:
            self._warmup_steps -= 1
        elif num_tokens > 0:
            rate = seconds / num_tokens
            self.s_per_token = rate if not self.s_per_token else 0.8 * self.s_per_token + 0.2 * rate

    def _fail_all(self, exc: Exception) -> None:
        for req_id, future in list(self._firsts.items()):
            self.worker.abort(req_id)
            if not future.done():
                future.set_exception(RuntimeError(f"prefill failed: {exc!r}"))

    def _expire_leases(self) -> None:
        """A push still running when its lease ends is cancelled (its pinned chunks go); a
        finished push's report is kept one more deadline for push_result to collect."""
        now = time.monotonic()
        for transfer_id, push in list(self._pushes.items()):
            if not push.task.done():
                if now >= push.lease_end + LEASE_GRACE_S:
                    self.num_lease_expired += 1
                    push.task.cancel()
            elif now >= push.lease_end + self.push_deadline_s:
                del self._pushes[transfer_id]

    async def _push(self, dest: KVDestination, feed: _Feed, transport: str) -> TransferReport:
        first = await feed.next_batch()  # no stream is open until there is a page to send
        start = time.perf_counter()
        waited = _Stopwatch()
        try:
            source = feed.stream(first)
            fault = next((p for p in TRANSFER_FAULTS if self.worker.engine.faults.take(p)), None)
            if fault is not None:  # drills only (engine.faults)
                source = self._faulty(source, fault)
            async with asyncio.timeout(None) as timer:  # the deadline, once the first token is out
                feed.watch(timer)
                # wire chunks for grpc and shm, device chunks for nccl: the worker made them per route
                # what the chunks wait for (pages being computed, a drill's pause) is not the link's
                paced = self._paced(source) if self.chunk_pause_s else source
                paced = paced if self._flowing.is_set() else self._held(paced)
                chunks = cast(AsyncIterator[WireChunk], waited.around(paced))
                sent = self._senders[transport].send(dest, chunks, self.stream_limit_s)
                try:
                    result = await sent
                finally:
                    feed.watch(None)  # a push that ended before the first token has no deadline left
            accepted, error = result.accepted, result.error
        except TimeoutError:
            accepted, error = False, "deadline exceeded"
        except asyncio.CancelledError:  # aborted, or its lease ended: the chunks go now
            accepted, error = False, "aborted"
        except Exception as exc:
            logger.exception("push of %s failed", dest.transfer_id)
            accepted, error = False, f"transport error: {type(exc).__name__}"
        if transport == "nccl" and self._nccl is not None and not self._nccl.is_open(dest.address):
            if self._routes.get(dest.address) == "nccl":
                logger.warning("nccl channel to %s is dead (%s): pages go by gRPC", dest.address, error)
                self._routes[dest.address] = "grpc"
        self.num_transfers += 1
        self.num_failed += not accepted
        seconds = time.perf_counter() - start  # first chunk to ack: with the prefill it overlapped
        return TransferReport(dest.transfer_id, transport, accepted, len(dest.dest_page_ids),
                              feed.num_bytes if accepted else 0, seconds, error,
                              wire_seconds=max(0.0, seconds - waited.seconds))

    async def _faulty(self, chunks: AsyncIterator[Chunk], fault: str) -> AsyncIterator[Chunk]:
        """The push as a damaged link or a wedged sender would make it (engine.faults)."""
        held: Chunk | None = None
        async for chunk in chunks:
            if fault == "transfer_corrupt" and held is None:  # a byte flipped after the checksum
                if isinstance(chunk, DeviceChunk):
                    block = chunk.block.clone()
                    raw = block.view(-1).view(torch.uint8)
                    raw[raw.numel() // 2] ^= 0x40
                    chunk = DeviceChunk(chunk.header, block)
                else:
                    payload = bytearray(chunk.payload)
                    payload[len(payload) // 2] ^= 0x40
                    chunk = WireChunk(chunk.header, bytes(payload))
            elif fault == "transfer_stall" and held is not None:
                await asyncio.sleep(self.push_deadline_s + 1)  # the deadline passes first
            if held is not None:
                yield held
            held = chunk
        if held is not None and fault != "transfer_truncate":  # truncated: the last chunk never goes
            yield held

    async def _paced(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        async for chunk in chunks:
            await asyncio.sleep(self.chunk_pause_s)
            yield chunk

    async def _held(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        first = True
        async for chunk in chunks:
            if not first:
                await self._flowing.wait()  # hold_pushes(False)
            first = False
            yield chunk


class _Stopwatch:
    """Time a push spends waiting for its next chunk: its pages being computed (and the chunk
    encoded), as opposed to sending (what the link costs: cluster.placement.links)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    async def around(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        it = aiter(chunks)
        while True:
            start = time.perf_counter()
            try:
                chunk = await anext(it)
            except StopAsyncIteration:
                return
            finally:
                self.seconds += time.perf_counter() - start
            yield chunk
