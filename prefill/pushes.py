"""A prefill worker's pushes: one per transfer, streaming a prompt's pages to its decode worker
as they are computed, by the transport routed for that decode worker.

    pushes.route(address, transport)     how pages reach the decode worker at `address`
    push = pushes.open(req_id, dest)     a push waiting for its first chunks
    push.feed.put(chunks)                the step loop's whole pages (PrefillWorker.take_ready),
                                         then the rest with the first token:
    pushes.first_token(push, chunks)     ... and from now on the transfer's deadline runs
    await pushes.result(transfer_id)     how it went: a TransferReport
    pushes.expire_leases()               each step: a push past its lease is cancelled
    pushes.ended                         how pushes ended, by END_REASONS (the stats say it);
                                         `on_end` is told each one's request (its retained copy's
                                         lease starts: prefill.worker.Retention)

The push opens its stream with the first chunks; the rest, the last page included, follow
with the first token. The transfer's deadline runs from the first token (as for a push that
starts then); before it, the stream is bounded by the decode side's reservation, which expires
on its own. The pages of a transfer stay pinned here (its chunks, held by the push) until the
decode side acks them, the push fails or is aborted, or its lease ends. Page bytes travel by
the transport chosen per decode worker (nccl between CUDA pools, shm on the same host, else
gRPC), never through Ray. An nccl route keeps a transfer's chunks on the device; a push that
finds its channel dead (aborted at a deadline) turns that route to gRPC. Drills (engine.faults)
damage, stall or truncate a push, pause before each chunk, or hold pushes after their first
chunk until released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import torch

from engine.faults import TRANSFER as TRANSFER_FAULTS
from engine.faults import FaultPoints
from kvtransfer.codec import DeviceChunk, TransferError, WireChunk, damaged
from kvtransfer.grpc_transport import GrpcSender
from kvtransfer.jobs import TransferReport
from kvtransfer.nccl_link import NcclSender
from kvtransfer.shm import ShmSender
from kvtransfer.tls import KVTls
from kvtransfer.transport import ABORTED, KVDestination, KVSender
from prefill.worker import Chunk

logger = logging.getLogger(__name__)

LEASE_GRACE_S = 1.0  # past the push's own deadline, which normally ends it first
# How a push ended: acked; cancelled by the request's abort, by drop() or close(), or at its
# lease; its deadline passed; the decode side answered with a refusal; the transport failed.
END_REASONS = ("ok", "aborted", "dropped", "lease", "deadline", "refused", "transport")


class ChunkFeed:
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
class Push:
    req_id: str
    num_pages: int
    lease_end: float  # time.monotonic(); the pinned chunks go when it passes (inf before the first token)
    task: asyncio.Task[TransferReport]
    feed: ChunkFeed


class Pushes:
    def __init__(
        self, device: torch.device, faults: FaultPoints, tls: KVTls | None, push_deadline_s: float,
        stream_limit_s: float, chunk_pause_s: float = 0.0, on_end: Callable[[str], None] | None = None,
    ) -> None:
        self.device = device
        self.on_end = on_end  # told each push's request id once it ended, however it did
        self.faults = faults  # the engine's: a drill armed there damages the next push
        self.tls = tls
        self.push_deadline_s = push_deadline_s
        self.stream_limit_s = stream_limit_s  # a stream opened before the first token, at most
        self.chunk_pause_s = chunk_pause_s  # drills only: a pause before each chunk
        self._senders: dict[str, KVSender] = {"grpc": GrpcSender(tls=tls)}
        self._nccl: NcclSender | None = None  # its channels, once a route asks for nccl
        self._routes: dict[str, str] = {}  # decode address -> transport ("grpc" when unset)
        self._pushes: dict[str, Push] = {}  # transfer_id -> its push, until reported or expired
        self._cancelled: dict[str, str] = {}  # transfer_id -> why this side cancelled its push
        self.ended: Counter[str] = Counter()  # pushes by END_REASONS
        self._flowing = asyncio.Event()  # cleared: pushes wait after their first chunk (hold)
        self._flowing.set()
        self.num_transfers = self.num_failed = self.num_lease_expired = 0

    async def route(self, address: str, transport: str, rendezvous: tuple[str, bytes] | None = None) -> str:
        """Push to the decode worker at `address` by `transport` ("grpc", "shm" or "nccl": then
        `rendezvous` is the channel the decode side listens on, from its nccl_listen); returns
        the transport in use, gRPC when the nccl channel did not open."""
        if transport == "nccl":
            if rendezvous is None:
                raise ValueError("an nccl route needs the decode side's rendezvous")
            if self._nccl is None:
                self._nccl = self._senders["nccl"] = NcclSender(self.device, tls=self.tls)
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

    def transport_to(self, address: str) -> str:
        return self._routes.get(address, "grpc")

    def open(self, req_id: str, dest: KVDestination) -> Push:
        """A push for `dest`, started: it waits for its first chunks (no lease until the first token)."""
        feed = ChunkFeed()
        task = asyncio.create_task(self._push(dest, feed, self.transport_to(dest.address)))
        push = self._pushes[dest.transfer_id] = Push(req_id, len(dest.dest_page_ids), float("inf"), task, feed)
        return push

    def first_token(self, push: Push, chunks: tuple[Chunk, ...]) -> None:
        """The rest of the prompt's chunks; the transfer's deadline and the pages' lease start now."""
        push.feed.put(chunks)
        push.feed.set_deadline(asyncio.get_running_loop().time() + self.push_deadline_s)
        push.lease_end = time.monotonic() + self.push_deadline_s

    def feed(self, transfer_id: str, chunks: tuple[Chunk, ...]) -> None:
        """Whole pages of a prompt still computing, for its push (if it is still going)."""
        push = self._pushes.get(transfer_id)
        if push is not None:
            push.feed.put(chunks)

    def drop(self, transfer_id: str) -> None:
        """A transfer that will not complete: its push (and the reservation it holds) goes."""
        push = self._pushes.pop(transfer_id, None)
        if push is not None:
            self._cancel(transfer_id, push, "dropped")

    def abort(self, req_id: str) -> None:
        for transfer_id, push in self._pushes.items():
            if push.req_id == req_id:
                self._cancel(transfer_id, push, "aborted")

    def _cancel(self, transfer_id: str, push: Push, reason: str) -> None:
        if not push.task.done():
            self._cancelled.setdefault(transfer_id, reason)
            push.task.cancel()

    def _why_cancelled(self, transfer_id: str) -> str:
        """END_REASONS' name for a cancelled push: what _cancel() recorded, else "aborted" (a
        cancel from outside: the worker going away)."""
        return self._cancelled.pop(transfer_id, "aborted")

    async def result(self, transfer_id: str) -> TransferReport:
        push = self._pushes.get(transfer_id)
        if push is None:
            return TransferReport(transfer_id, "", False, 0, 0, 0.0, "unknown transfer")
        report = await asyncio.shield(push.task)
        self._pushes.pop(transfer_id, None)
        return report

    def hold(self, hold: bool) -> None:
        """Drills only: with `hold`, a push that starts from now on sends its first chunk and
        then waits until hold(False) (its deadline still runs; an abort ends it)."""
        if hold:
            self._flowing.clear()
        else:
            self._flowing.set()

    def in_flight(self) -> list[Push]:
        """Pushes holding pinned pages that have not ended."""
        return [p for p in self._pushes.values() if p.feed.has_pages and not p.task.done()]

    @property
    def num_running(self) -> int:
        return sum(not p.task.done() for p in self._pushes.values())

    def expire_leases(self) -> None:
        """A push still running when its lease ends is cancelled (its pinned chunks go); a
        finished push's report is kept one more deadline for result() to collect."""
        now = time.monotonic()
        for transfer_id, push in list(self._pushes.items()):
            if not push.task.done():
                if now >= push.lease_end + LEASE_GRACE_S:
                    self.num_lease_expired += 1
                    self._cancel(transfer_id, push, "lease")
            elif now >= push.lease_end + self.push_deadline_s:
                del self._pushes[transfer_id]

    async def close(self) -> None:
        for transfer_id, push in self._pushes.items():
            self._cancel(transfer_id, push, "dropped")
        for sender in self._senders.values():
            close = getattr(sender, "close", None)
            if close is not None:
                await close()

    async def _push(self, dest: KVDestination, feed: ChunkFeed, transport: str) -> TransferReport:
        try:
            first = await feed.next_batch()  # no stream is open until there is a page to send
        except asyncio.CancelledError:  # it ends before it began: counted by how, never as a transfer
            self._ended(dest, self._why_cancelled(dest.transfer_id))
            raise
        start = time.perf_counter()
        waited = _Stopwatch()
        try:
            source = feed.stream(first)
            fault = next((p for p in TRANSFER_FAULTS if self.faults.take(p)), None)
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
            end = "ok" if accepted else _end_of(error)
        except TimeoutError:
            accepted, error, end = False, "deadline exceeded", "deadline"
        except asyncio.CancelledError:  # aborted, dropped or its lease ended: the chunks go now
            accepted, error, end = False, "aborted", self._why_cancelled(dest.transfer_id)
        except Exception as exc:
            logger.exception("push of %s failed", dest.transfer_id)
            accepted, error, end = False, f"transport error: {type(exc).__name__}", "transport"
        self._ended(dest, end)
        if transport == "nccl" and self._nccl is not None and not self._nccl.is_open(dest.address):
            if self._routes.get(dest.address) == "nccl":
                logger.warning("nccl channel to %s is dead (%s): pages go by gRPC", dest.address, error)
                self._routes[dest.address] = "grpc"
        self.num_transfers += 1
        self.num_failed += not accepted
        seconds = time.perf_counter() - start  # first chunk to ack: with the prefill it overlapped
        return TransferReport(dest.transfer_id, transport, accepted, len(dest.dest_page_ids),
                              feed.num_bytes if accepted else 0, seconds, error,
                              wire_seconds=max(0.0, seconds - waited.seconds))  # fmt: skip

    def _ended(self, dest: KVDestination, end: str) -> None:
        self.ended[end] += 1
        if self.on_end is not None:
            self.on_end(dest.req_id)

    async def _faulty(self, chunks: AsyncIterator[Chunk], fault: str) -> AsyncIterator[Chunk]:
        """The push as a damaged link or a wedged sender would make it (engine.faults)."""
        held: Chunk | None = None
        async for chunk in chunks:
            if fault == "transfer_corrupt" and held is None:  # a byte flipped after the checksum
                chunk = _damaged(chunk)
            elif fault == "transfer_stall" and held is not None:
                await asyncio.sleep(self.push_deadline_s + 1)  # the deadline passes first
            if held is not None:
                yield held
            held = chunk
        if held is not None and fault != "transfer_truncate":  # truncated: the last chunk never goes
            yield _damaged(held) if fault == "transfer_corrupt_last" else held

    async def _paced(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        async for chunk in chunks:
            await asyncio.sleep(self.chunk_pause_s)
            yield chunk

    async def _held(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        first = True
        async for chunk in chunks:
            if not first:
                await self._flowing.wait()  # hold(False)
            first = False
            yield chunk


def _damaged(chunk: Chunk) -> Chunk:
    """`chunk` with one byte flipped after its checksum (drills only)."""
    if not isinstance(chunk, DeviceChunk):
        return damaged(chunk)
    block = chunk.block.clone()
    raw = block.view(-1).view(torch.uint8)
    raw[raw.numel() // 2] ^= 0x40
    return DeviceChunk(chunk.header, block)


def _end_of(error: str) -> str:
    """END_REASONS' name for a sender's failed PushResult: its own deadline or transport
    (kvtransfer.grpc_transport.failed_call), the request aborted on the decode side (which
    can come before its abort here), else the decode side's refusal."""
    if error == "deadline exceeded":
        return "deadline"
    if error == ABORTED:
        return "aborted"
    return "transport" if error.startswith("transport error") else "refused"


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
