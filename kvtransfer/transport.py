"""Transports move a request's KV pages from a prefill worker to the decode worker holding them.

Lifecycle of one transfer (docs/architecture.md: One request, KV transfer):

    decode:  pages = pool.allocate(n); dest = book.reserve(req_id, pages, sender_epoch, ttl)
    prefill: sender.send(dest, build_chunks(dest, pages, epoch), deadline_s) -> PushResult
    decode:  receive_push: decode_chunk (bounds, checksum) -> receiver.accept (token, epoch,
             reserved page) -> receiver.store; the reservation completes when every layer of
             every page arrived verified
    failure: a stream that proved the token and then broke (deadline, corrupt chunk, early
             end) releases the reservation at once; an unclaimed one is released by
             book.expire() at its deadline. Either way `on_release` returns the pages.

A chunk that fails before proving the token touches nothing: forged or stale pushes cannot
cancel someone else's reservation.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar, cast

import torch

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvcache.pool import DevicePool
from kvcache.upload import upload
from kvtransfer.codec import (
    INT_VIEWS,
    ChunkMeta,
    CodecLimits,
    TransferError,
    WireChunk,
    decode_chunk,
    encode_chunk,
)

logger = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 10.0
TOKEN_BYTES = 16
# a push's ack error when the decode side released its reservation because the request was
# aborted there (a client that left): the sender ends the push as aborted, not refused
ABORTED = "aborted"

Chunks = AsyncIterable[WireChunk] | Iterable[WireChunk]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KVDestination:
    """Where to push one request's pages, minted by the decode side with its reservation."""

    address: str  # the decode worker's KV endpoint ("host:port"; a name for `local`)
    req_id: str
    transfer_id: str
    token: bytes  # one-time: accepted for this transfer only
    epoch: int  # the sender epoch the reservation was made for
    dest_page_ids: tuple[int, ...]


class PushResult(NamedTuple):
    accepted: bool  # every reserved page arrived and verified
    pages_received: int
    error: str


class KVSender(Protocol):
    async def send(self, dest: KVDestination, chunks: Chunks, deadline_s: float) -> PushResult: ...


class KVReceiver(Protocol):
    def accept(self, header: pb.PageChunkHeader) -> bool: ...

    def refusal(self, header: pb.PageChunkHeader) -> str:
        """Why accept() refused `header`, for the sender's ack: ABORTED when its reservation
        was released by its request's abort (the chunk's token proves the sender held it),
        else "refused" -- no detail, the token may be a guess."""
        ...

    def store(self, header: pb.PageChunkHeader, pages: torch.Tensor) -> int:
        """Write a verified chunk; return how many pages of the transfer are now complete."""
        ...

    def is_complete(self, transfer_id: str) -> bool: ...

    def abort(self, transfer_id: str) -> None: ...


@dataclass(slots=True)
class Reservation:
    req_id: str
    transfer_id: str
    token: bytes
    sender_epoch: int
    page_ids: tuple[int, ...]
    deadline: float
    # page_id -> bitmask of the layers received so far
    layers: dict[int, int] = field(default_factory=dict)


class ReservationBook:
    """The decode side's open reservations: one-time tokens, epoch fencing, completion, expiry."""

    def __init__(
        self,
        num_layers: int,
        on_release: Callable[[Reservation], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_layers = num_layers
        self._full = (1 << num_layers) - 1
        self._on_release = on_release
        self._clock = clock
        self._open: dict[str, Reservation] = {}
        # transfer_id -> (token, deadline) of a reservation its request's abort released: a
        # chunk still on its way is refused as ABORTED (not a fault), until the deadline it had
        self._aborted: dict[str, tuple[bytes, float]] = {}
        self.completed: dict[str, Reservation] = {}  # the decode loop pops these to admit
        self.refused_bad_token = 0
        self.refused_stale_epoch = 0
        self.refused_bad_page = 0
        self.refused_aborted = 0  # chunks still on their way when their request's abort released them
        self.num_expired = 0

    def reserve(
        self, address: str, req_id: str, page_ids: Sequence[int], sender_epoch: int, ttl_s: float
    ) -> KVDestination:
        transfer_id = secrets.token_hex(8)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._open[transfer_id] = Reservation(
            req_id, transfer_id, token, sender_epoch, tuple(page_ids), self._clock() + ttl_s,
            {p: 0 for p in page_ids},
        )  # fmt: skip
        return KVDestination(address, req_id, transfer_id, token, sender_epoch, tuple(page_ids))

    def get(self, transfer_id: str) -> Reservation | None:
        return self._open.get(transfer_id)

    def check(self, header: pb.PageChunkHeader) -> bool:
        """Whether a chunk may be stored; refusals are counted and change nothing."""
        res = self._open.get(header.transfer_id)
        # an unknown transfer id is a wrong or spent token: completion and release drop it
        if res is None or not hmac.compare_digest(res.token, header.transfer_token):
            if self.refusal(header) == ABORTED:  # its request's abort came first: no fault
                self.refused_aborted += 1
            else:
                self.refused_bad_token += 1
            return False
        if header.sender_epoch != res.sender_epoch or header.req_id != res.req_id:
            self.refused_stale_epoch += 1
            return False
        if header.layer_end > self.num_layers:  # bounded before it sizes a bitmask
            self.refused_bad_page += 1
            return False
        mask = _layer_mask(header.layer_start, header.layer_end)
        ids = header.dest_page_ids
        if len(set(ids)) != len(ids) or any(p not in res.layers or res.layers[p] & mask for p in ids):
            self.refused_bad_page += 1
            return False
        return True

    def mark(self, header: pb.PageChunkHeader) -> int:
        """Record a stored chunk (after `check`); return the number of complete pages."""
        res = self._open[header.transfer_id]
        mask = _layer_mask(header.layer_start, header.layer_end)
        for page_id in header.dest_page_ids:
            res.layers[page_id] |= mask
        done = sum(1 for m in res.layers.values() if m == self._full)
        if done == len(res.page_ids):
            self.completed[res.transfer_id] = self._open.pop(res.transfer_id)
        return done

    def release(self, transfer_id: str, aborted: bool = False) -> bool:
        """Drop an open reservation and hand its pages back; False if it was not open.
        `aborted`: its request was aborted, which refusal() tells a chunk still on its way."""
        res = self._open.pop(transfer_id, None)
        if res is not None:
            if aborted:
                self._aborted[transfer_id] = (res.token, res.deadline)
            self._on_release(res)
        return res is not None

    def refusal(self, header: pb.PageChunkHeader) -> str:
        """KVReceiver.refusal for a chunk check() refused."""
        ended = self._aborted.get(header.transfer_id)
        if ended is not None and hmac.compare_digest(ended[0], header.transfer_token):
            return ABORTED
        return "refused"

    def expire(self) -> list[str]:
        """Release every open reservation past its deadline; return their transfer ids."""
        now = self._clock()
        for tid in [tid for tid, (_, deadline) in self._aborted.items() if deadline <= now]:
            del self._aborted[tid]
        stale = [tid for tid, res in self._open.items() if res.deadline <= now]
        for tid in stale:
            self.num_expired += 1
            self.release(tid)
        return stale

    @property
    def num_open(self) -> int:
        return len(self._open)


class PoolReceiver:
    """A KVReceiver that writes verified pages into a DevicePool's reserved page ids."""

    def __init__(self, pool: DevicePool, book: ReservationBook) -> None:
        self.pool = pool
        self.book = book
        lay = pool.layout
        self._page_tail = (2, lay.page_size, lay.num_kv_heads, lay.head_dim)

    def accept(self, header: pb.PageChunkHeader) -> bool:
        return self.book.check(header)

    def refusal(self, header: pb.PageChunkHeader) -> str:
        return self.book.refusal(header)

    def store(self, header: pb.PageChunkHeader, pages: torch.Tensor) -> int:
        # pages: [n, layer_end - layer_start, 2, page_size, kv_heads, head_dim]
        if tuple(pages.shape[2:]) != self._page_tail or pages.dtype != self.pool.kv.dtype:
            raise TransferError("page shape or dtype does not match this pool")
        kv = self.pool.kv
        layers = slice(header.layer_start, header.layer_end)
        if kv.device.type == "cpu":
            # numpy copies on this thread; torch's index_copy_ here ran on its OpenMP pool, whose
            # worker then spun for a core that the gRPC threads and the sender needed (profiled)
            ints = INT_VIEWS[kv.element_size()]
            dst = kv.view(ints).numpy()
            dst[layers, :, list(header.dest_page_ids)] = pages.view(ints).numpy().transpose(1, 2, 0, 3, 4, 5)
            return self.book.mark(header)
        # One indexed copy per chunk; a copy per page was a kernel launch per page on a GPU
        # (64 a chunk: most of the NCCL transport's time in the 2026-11-29 H200 run).
        index = upload(header.dest_page_ids, torch.int64, kv.device)  # not waiting for a decode step
        src = pages.to(kv.device, non_blocking=True).movedim(0, 2)  # [layers, 2, n, page_size, ...]
        kv[layers].index_copy_(2, index, src)
        return self.book.mark(header)

    def is_complete(self, transfer_id: str) -> bool:
        return transfer_id in self.book.completed

    def abort(self, transfer_id: str) -> None:
        self.book.release(transfer_id)


def build_chunks(
    dest: KVDestination,
    pages: Sequence[torch.Tensor] | torch.Tensor,
    sender_epoch: int,
    pages_per_chunk: int = 32,
    page_hashes: Sequence[bytes] = (),
) -> list[WireChunk]:
    """All of `pages` (one per dest page, all layers; a list or a page-major block) as chunks
    for `dest`, the last flagged."""
    return list(iter_chunks(dest, pages, sender_epoch, pages_per_chunk, page_hashes))


def iter_chunks(
    dest: KVDestination,
    pages: Sequence[torch.Tensor] | torch.Tensor,
    sender_epoch: int,
    pages_per_chunk: int = 32,
    page_hashes: Sequence[bytes] = (),
) -> Iterator[WireChunk]:
    """build_chunks, each chunk encoded when it is asked for: a sender encodes the next one
    while the one before is on the wire."""
    if len(pages) != len(dest.dest_page_ids):
        raise ValueError(f"{len(pages)} pages for {len(dest.dest_page_ids)} reserved")
    for start in range(0, len(pages), pages_per_chunk):
        end = min(start + pages_per_chunk, len(pages))
        meta = ChunkMeta(
            dest.req_id, dest.transfer_id, dest.token, sender_epoch,
            dest.dest_page_ids[start:end], tuple(page_hashes[start:end]),
            is_last=end == len(pages),
        )  # fmt: skip
        yield encode_chunk(meta, pages[start:end])


@dataclass(slots=True)
class PushState:
    """What one push stream has proven so far on the receiving side."""

    transfer_id: str = ""  # set once a chunk proved the token: from then on, failures release it
    done: int = 0  # pages complete

    def same_transfer(self, header: pb.PageChunkHeader) -> None:
        if self.transfer_id and header.transfer_id != self.transfer_id:
            raise TransferError("one stream carries one transfer")


async def settle_push(
    receiver: KVReceiver, state: PushState, body: Awaitable[None], name: str = "push"
) -> pb.PushResponse:
    """Run a push stream's `body` (which advances `state`) and make its ack: accepted when the
    reservation is complete; a TransferError, an early end, the sender gone or the deadline
    passed release the reservation once its token was proven."""
    try:
        await body
        if not state.transfer_id:
            raise TransferError("empty stream")
        if not receiver.is_complete(state.transfer_id):
            raise TransferError("stream ended before every page arrived")
        return pb.PushResponse(
            transfer_id=state.transfer_id, accepted=True, pages_received=state.done
        )
    except TransferError as err:
        if state.transfer_id:
            receiver.abort(state.transfer_id)
        logger.info("%s %s failed: %s", name, state.transfer_id or "?", err.reason)
        return pb.PushResponse(
            transfer_id=state.transfer_id, pages_received=state.done, error=err.reason
        )
    except (asyncio.CancelledError, Exception):
        if state.transfer_id:  # the sender went away or its deadline passed mid-stream
            receiver.abort(state.transfer_id)
        raise


async def receive_push(
    receiver: KVReceiver, chunks: AsyncIterator[WireChunk], limits: CodecLimits
) -> pb.PushResponse:
    """Apply one Push stream to `receiver`; the ack a transport returns to the sender."""
    state = PushState()

    async def body() -> None:
        async for chunk in chunks:
            state.same_transfer(chunk.header)
            pages = decode_chunk(chunk, limits)  # bounds, checksum; a view over a gRPC message's bytes
            if not receiver.accept(chunk.header):
                raise TransferError(receiver.refusal(chunk.header))
            state.transfer_id = chunk.header.transfer_id
            state.done = receiver.store(chunk.header, pages)
            if chunk.header.is_last or receiver.is_complete(state.transfer_id):
                break  # complete: the transfer stands, whatever the stream still carries

    return await settle_push(receiver, state, body())


async def read_ahead(items: AsyncIterator[T], depth: int = 1) -> AsyncGenerator[T, None]:
    """`items`, up to `depth` of them read before the caller asks for them: the next read starts
    as soon as the caller takes one (or there is room), while the caller works on it.

    A push's receiver reads ahead (depth 2): over gRPC a pending read keeps the stream's
    flow-control window open, so the next chunks cross the wire while this one is verified
    and stored -- one chunk's check and copy into the pool take about as long as its transfer
    on a fast link, and with one read pending the sender still waited for the store (README, P8:
    kv/raw 0.75 on average at depth 1, 0.79 at depth 2, in interleaved runs). Its
    sender frames one chunk ahead (depth 1), while the one before is on the wire. Bounded:
    memory is `depth` chunks a push. Not for payloads that live in a shared buffer: a shm slot
    is handed back when its next chunk is read. The source's end or error reaches the caller
    after the items read before it; closing this generator stops the reading."""
    if depth < 1:
        raise ValueError("depth must be at least 1")
    room = asyncio.Semaphore(depth)
    ready: asyncio.Queue[tuple[bool, T | BaseException | None]] = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                await room.acquire()
                ready.put_nowait((True, await anext(items)))
        except StopAsyncIteration:
            ready.put_nowait((False, None))
        except Exception as exc:  # the caller's to raise, in order
            ready.put_nowait((False, exc))

    reader = asyncio.ensure_future(read())
    try:
        while True:
            ok, value = await ready.get()
            if not ok:
                if value is not None:
                    raise cast(BaseException, value)
                return
            room.release()  # the next read starts while the caller works on this one
            yield cast(T, value)
    finally:
        reader.cancel()


async def as_async(chunks: Chunks) -> AsyncIterator[WireChunk]:
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield chunk
    else:
        for chunk in chunks:
            yield chunk


def _layer_mask(start: int, end: int) -> int:
    return ((1 << end) - 1) ^ ((1 << start) - 1)
