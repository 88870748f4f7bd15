"""The prefill role as a Ray actor: its own step loop, and one push task per transfer.

    prefill(job, dest)         queue the prompt; returns once its first token is sampled (TTFT
                               does not wait for the transfer); the push to dest starts then
    push_result(transfer_id)   how that push went (waits for it): a TransferReport
    abort(req_id)              the request went away: its prefill stops, its push is cancelled

The pages of a transfer stay pinned here (its chunks, held by the push task) until the decode
side acks them, the push fails or is aborted, or the transfer's lease ends. Pushes run on the
actor's event loop and the engine's steps between awaits, so pages leave while the next
prompt computes. Page bytes travel by the transport chosen per decode worker (`route`: shm on
the same host, else gRPC), never through Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from cluster.cpu import between_steps, core_for, pin_process
from cluster.worker_msgs import PrefillResult, PrefillStats, TransferReport
from engine.engine import Engine
from engine.engine_config import EngineConfig
from kvtransfer.codec import WireChunk
from kvtransfer.grpc_transport import GrpcSender
from kvtransfer.select import WorkerPlace
from kvtransfer.shm import ShmSender
from kvtransfer.transport import DEFAULT_DEADLINE_S, KVDestination, KVSender
from prefill.worker import PrefillDone, PrefillJob, PrefillWorker

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
LEASE_GRACE_S = 1.0  # past the push's own deadline, which normally ends it first


@dataclass(slots=True)
class _Push:
    req_id: str
    num_pages: int
    lease_end: float  # time.monotonic(); the pinned chunks go when it passes
    task: asyncio.Task[TransferReport]


class PrefillActor:
    def __init__(
        self,
        cfg: EngineConfig,
        epoch: int = 1,
        pages_per_chunk: int = 32,
        num_threads: int = 1,
        push_deadline_s: float = DEFAULT_DEADLINE_S,
        chunk_pause_s: float = 0.0,  # fault drills only: a pause before each chunk
        pin_slot: int | None = None,  # set: pin this process to core_for(pin_slot) (--pin-cores)
    ) -> None:
        self.core = pin_process(core_for(pin_slot)) if pin_slot is not None else None
        torch.set_num_threads(num_threads)
        self.worker = PrefillWorker(Engine(cfg), epoch, pages_per_chunk)
        self._senders: dict[str, KVSender] = {"grpc": GrpcSender()}
        self._routes: dict[str, str] = {}  # decode address -> transport ("grpc" when unset)
        self.push_deadline_s = push_deadline_s
        self.chunk_pause_s = chunk_pause_s
        self._firsts: dict[str, asyncio.Future[PrefillDone]] = {}
        self._pushes: dict[str, _Push] = {}  # transfer_id -> its push, until reported or expired
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self.num_transfers = self.num_failed = self.num_lease_expired = 0

    async def ping(self) -> int:
        return os.getpid()

    async def cores(self) -> list[int]:
        """The cores this actor may run on (one, when pinned)."""
        return sorted(os.sched_getaffinity(0))

    async def place_of(self) -> WorkerPlace:
        """Where this worker runs, for the choice of transport (kvtransfer.select)."""
        import ray

        device = self.worker.engine.device.type
        return WorkerPlace(ray.get_runtime_context().get_node_id(), os.getpid(), device == "cuda")

    async def route(self, address: str, transport: str) -> None:
        """Push to the decode worker at `address` by `transport` ("grpc" or "shm")."""
        if transport not in self._senders:
            if transport != "shm":
                raise ValueError(f"unknown transport {transport!r}")
            self._senders["shm"] = ShmSender()
        self._routes[address] = transport

    async def prefill(self, job: PrefillJob, dest: KVDestination) -> PrefillResult:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())
        future: asyncio.Future[PrefillDone] = asyncio.get_running_loop().create_future()
        self._firsts[job.req_id] = future
        try:
            self.worker.submit(job, dest)
            self._wake.set()
            done = await future
        finally:
            self._firsts.pop(job.req_id, None)
        if done.finish_reason is not None:  # the first token ends the request: nothing moves
            return PrefillResult(done.output, "")
        lease_end = time.monotonic() + self.push_deadline_s
        task = asyncio.create_task(self._push(done))
        self._pushes[dest.transfer_id] = _Push(job.req_id, len(dest.dest_page_ids), lease_end, task)
        return PrefillResult(done.output, dest.transfer_id)

    async def push_result(self, transfer_id: str) -> TransferReport:
        push = self._pushes.get(transfer_id)
        if push is None:
            return TransferReport(transfer_id, "", False, 0, 0, 0.0, "unknown transfer")
        report = await asyncio.shield(push.task)
        self._pushes.pop(transfer_id, None)
        return report

    async def abort(self, req_id: str) -> None:
        self.worker.abort(req_id)
        future = self._firsts.pop(req_id, None)
        if future is not None and not future.done():
            future.cancel()
        for push in self._pushes.values():
            if push.req_id == req_id:
                push.task.cancel()

    async def stats(self) -> PrefillStats:
        inflight = [p for p in self._pushes.values() if not p.task.done()]
        return PrefillStats(
            self.worker.epoch, self.worker.engine.scheduler.num_requests, len(inflight),
            sum(p.num_pages for p in inflight), self.num_transfers, self.num_failed, self.num_lease_expired,
        )  # fmt: skip

    async def close(self) -> None:
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
            if not self.worker.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_WAIT_S)
                except TimeoutError:
                    pass
                continue
            try:
                finished = self.worker.step()
            except Exception as exc:  # one bad step fails its prompts, not the actor
                logger.exception("prefill step failed")
                self._fail_all(exc)
                continue
            for done in finished:
                future = self._firsts.get(done.req_id)
                if future is not None and not future.done():
                    future.set_result(done)
            await between_steps()  # pushes and new calls run between steps

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

    async def _push(self, done: PrefillDone) -> TransferReport:
        dest, chunks = done.dest, done.chunks
        transport = self._routes.get(dest.address, "grpc")
        num_bytes = sum(memoryview(c.payload).nbytes for c in chunks)
        start = time.perf_counter()
        try:
            source = self._paced(chunks) if self.chunk_pause_s else chunks
            result = await self._senders[transport].send(dest, source, self.push_deadline_s)
            accepted, error = result.accepted, result.error
        except asyncio.CancelledError:  # aborted, or its lease ended: the chunks go now
            accepted, error = False, "aborted"
        except Exception as exc:
            logger.exception("push of %s failed", dest.transfer_id)
            accepted, error = False, f"transport error: {type(exc).__name__}"
        self.num_transfers += 1
        self.num_failed += not accepted
        seconds = time.perf_counter() - start
        return TransferReport(dest.transfer_id, transport, accepted, len(dest.dest_page_ids),
                              num_bytes if accepted else 0, seconds, error)

    async def _paced(self, chunks: tuple[WireChunk, ...]) -> AsyncIterator[WireChunk]:
        for chunk in chunks:
            await asyncio.sleep(self.chunk_pause_s)
            yield chunk
