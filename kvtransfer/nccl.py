"""The NCCL transport: KV pages GPU to GPU through one communicator per (prefill, decode) pair.

Headers travel on the control channel, page bytes over NCCL, straight between device buffers:

    rendezvous  decode makes a unique id and hands it over with its destination; both sides
                open the communicator (rank 0 sends, rank 1 receives) within the deadline
    sender      nccl_chunks(dest, kv): one header per chunk of a page-major device block; its
                checksum covers the header and a 16-byte digest of the chunk computed on the
                device; the headers go over the control channel, then send(block) per chunk
    receiver    prepare(header): codec bounds, token, epoch, reserved pages -> a device staging
                buffer the recv lands in; finish(header, staging): digest, checksum, store into
                the reserved pages. A refused header posts no recv and touches nothing.
    deadline    every group of sends/recvs is polled against the transfer's deadline; past it the
                communicator is aborted (ncclCommAbort) and the channel is dead: the reservation
                is released and a new rendezvous is needed. NCCL never blocks the caller forever.

On one GPU, `transfer_to_self` runs a sender and a receiver over a one-rank communicator: each
chunk's send and recv go in one group (NCCL's send-to-self), through the same prepare/finish
checks. `Comm` is the seam: kvtransfer.nccl_comm's `CupyComm` is CuPy's NCCL binding (GPU only),
its `GlooComm` torch's gloo (CPU pools); tests drive the state
machine on CPU through `LoopbackFabric`, which pairs sends with recvs in memory.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.codec import (
    DTYPES,
    CodecLimits,
    DeviceChunk,
    TransferError,
    _checksum,
    check_header,
)
from kvtransfer.transport import KVDestination, KVReceiver

_WIRE_DTYPES = {v: k for k, v in DTYPES.items()}


class Completion(Protocol):
    def query(self) -> bool: ...


class Comm(Protocol):
    """The NCCL calls the channel makes; ranks are 0 and 1 (or 0 alone, sending to itself)."""

    def group(self) -> Any: ...  # a context manager: ncclGroupStart / ncclGroupEnd

    def send(self, buf: torch.Tensor, peer: int) -> None: ...

    def recv(self, buf: torch.Tensor, peer: int) -> None: ...

    def completion(self) -> Completion: ...  # done when every op enqueued so far has finished

    def abort(self) -> None: ...


class ChannelState(enum.Enum):
    NEW = "new"
    READY = "ready"
    BUSY = "busy"
    ABORTED = "aborted"
    CLOSED = "closed"


class NcclChannel:
    """One pair's communicator and its state machine: every operation has a deadline."""

    def __init__(
        self,
        connect: Callable[[], Comm],
        peer: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self.peer = peer
        self._clock = clock
        self.state = ChannelState.NEW
        self.comm: Comm | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    def open(self, deadline_s: float) -> None:
        """Join the communicator (a collective: the peer must join too) within the deadline."""
        if self.state is not ChannelState.NEW:
            raise TransferError(f"channel is {self.state.value}, not new")
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["comm"] = self._connect()
            except Exception as err:  # noqa: BLE001 - reported to the opener below
                box["error"] = err

        thread = threading.Thread(target=join, name="nccl-rendezvous", daemon=True)
        thread.start()
        thread.join(deadline_s)
        if "comm" not in box:
            self.state = ChannelState.ABORTED
            why = f"rendezvous failed: {box['error']}" if "error" in box else "rendezvous deadline exceeded"
            raise TransferError(why)
        self.comm = box["comm"]
        self.state = ChannelState.READY

    def run(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], deadline_s: float) -> None:
        """Enqueue sends and recvs as one group and wait for them; abort past the deadline."""
        deadline = self._clock() + deadline_s
        done = self.post(sends, recvs)
        try:
            pause = 20e-6
            while not done.query():
                if self._clock() >= deadline:
                    raise TransferError("deadline exceeded")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        except BaseException:
            self.abort()
            raise
        self._settle(sends, recvs)

    async def exchange(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], deadline_s: float) -> None:
        """`run` for an event loop."""
        await self.wait(self.post(sends, recvs), sends, recvs, deadline_s)

    def post(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> Completion:
        """Enqueue one group; the channel is busy until `wait` sees it done."""
        if self.state is not ChannelState.READY or self.comm is None:
            raise TransferError(f"channel is {self.state.value}")
        self.state = ChannelState.BUSY
        comm = self.comm
        try:
            with comm.group():
                for buf in sends:
                    comm.send(buf, self.peer)
                for buf in recvs:
                    comm.recv(buf, self.peer)
            return comm.completion()
        except BaseException:
            self.abort()
            raise

    async def wait(
        self, done: Completion, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], deadline_s: float
    ) -> None:
        """Poll a posted group between other tasks. Past the deadline, or cancelled (an outer
        timeout, the caller gone) with the group in flight, the communicator is aborted."""
        deadline = self._clock() + deadline_s
        try:
            pause = 20e-6
            while not done.query():
                if self._clock() >= deadline:
                    raise TransferError("deadline exceeded")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1e-3)
        except BaseException:
            self.abort()
            raise
        self._settle(sends, recvs)

    def _settle(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        self.bytes_sent += sum(nbytes(b) for b in sends)
        self.bytes_received += sum(nbytes(b) for b in recvs)
        self.state = ChannelState.READY

    def abort(self) -> None:
        """Abort the communicator (ncclCommAbort): what is in flight ends; the channel is dead."""
        self.state = ChannelState.ABORTED
        if self.comm is not None:
            self.comm.abort()

    def close(self) -> None:
        if self.state in (ChannelState.READY, ChannelState.NEW):
            self.state = ChannelState.CLOSED


def device_digest(block: torch.Tensor, width: int = 1024) -> bytes:
    """16 bytes summarising a chunk, computed where it lives. Its 32-bit words are laid out
    as rows of `width`; the digest is the index-weighted sums of the row sums and of the
    column sums (accumulated in int64). A flipped or dropped word changes both; two unequal
    words swapped change the row sums unless they share a row, the column sums unless they
    share a column. Two reductions over the chunk and one device-to-host read. Integrity,
    not secrecy: who may send is decided by the transfer token."""
    raw = block.contiguous().view(-1).view(torch.uint8)
    if raw.numel() % 4:
        raise ValueError("a chunk's size must be a multiple of 4 bytes")
    words = raw.view(torch.int32)
    if words.numel() % width:
        words = torch.cat([words, words.new_zeros(width - words.numel() % width)])
    grid = words.view(-1, width)
    rows = grid.sum(dim=1, dtype=torch.int64)
    cols = grid.sum(dim=0, dtype=torch.int64)
    weight_r = torch.arange(1, rows.numel() + 1, device=rows.device, dtype=torch.int64)
    weight_c = torch.arange(1, width + 1, device=rows.device, dtype=torch.int64)
    sums: list[int] = torch.stack([(rows * weight_r).sum(), (cols * weight_c).sum()]).tolist()
    mask = (1 << 64) - 1
    return b"".join((int(v) & mask).to_bytes(8, "little") for v in sums)


def device_chunks(
    dest: KVDestination,
    kv: torch.Tensor,
    epoch: int,
    first_page: int = 0,
    pages_per_chunk: int = 64,
) -> list[DeviceChunk]:
    """`kv` (page-major [pages, layers, 2, ...]: kv[i] is the reservation's page first_page + i)
    in chunks of pages_per_chunk, each a contiguous block where `kv` lives; the chunk holding
    the reservation's last page is flagged last."""
    if first_page + kv.shape[0] > len(dest.dest_page_ids):
        raise ValueError(
            f"pages {first_page}..{first_page + kv.shape[0]} of {len(dest.dest_page_ids)} reserved"
        )
    chunks = []
    for start in range(0, kv.shape[0], pages_per_chunk):
        block = kv[start : start + pages_per_chunk].contiguous()
        at = first_page + start
        header = pb.PageChunkHeader(
            req_id=dest.req_id,
            transfer_id=dest.transfer_id,
            transfer_token=dest.token,
            sender_epoch=epoch,
            dest_page_ids=list(dest.dest_page_ids[at : at + block.shape[0]]),
            layer_start=0,
            layer_end=block.shape[1],
            dtype=DTYPES[block.dtype],
            shape=list(block.shape[1:]),
            payload_bytes=nbytes(block),
            is_last=at + block.shape[0] == len(dest.dest_page_ids),
        )
        header.checksum = _checksum(header, device_digest(block))
        chunks.append(DeviceChunk(header, block))
    return chunks


def nccl_chunks(
    dest: KVDestination,
    kv: torch.Tensor,
    epoch: int,
    pages_per_chunk: int = 64,
) -> Iterator[tuple[pb.PageChunkHeader, torch.Tensor]]:
    """(header, device block) per chunk of a page-major block holding every reserved page."""
    if kv.shape[0] != len(dest.dest_page_ids):
        raise ValueError(f"{kv.shape[0]} pages for {len(dest.dest_page_ids)} reserved")
    for chunk in device_chunks(dest, kv, epoch, 0, pages_per_chunk):
        yield chunk.header, chunk.block


class NcclReceiver:
    """The decode side of one pair: checks each header before posting its recv."""

    def __init__(self, receiver: KVReceiver, device: torch.device, limits: CodecLimits | None = None) -> None:
        self.receiver = receiver
        self.device = device
        self.limits = limits or CodecLimits()
        self.refused = 0

    def prepare(self, header: pb.PageChunkHeader) -> torch.Tensor:
        dtype = _WIRE_DTYPES.get(header.dtype)
        if dtype is None:
            raise TransferError("unknown dtype")
        expected = check_header(header, torch.empty((), dtype=dtype).element_size(), self.limits)
        if header.payload_bytes != expected:
            raise TransferError("payload length does not match the header")
        if not self.receiver.accept(header):
            self.refused += 1
            raise TransferError(self.receiver.refusal(header))
        return torch.empty((len(header.dest_page_ids), *header.shape), dtype=dtype, device=self.device)

    def finish(self, header: pb.PageChunkHeader, staging: torch.Tensor) -> int:
        if _checksum(header, device_digest(staging)) != header.checksum:
            raise TransferError("checksum mismatch")
        return self.receiver.store(header, staging)


def transfer_to_self(
    channel: NcclChannel,
    receiver: NcclReceiver,
    chunks: Iterator[tuple[pb.PageChunkHeader, torch.Tensor]],
    deadline_s: float,
) -> str:
    """Both ends on one rank: each chunk's send and recv in one group. "" when every page
    arrived and verified, else why not (and the reservation is released)."""
    deadline = time.monotonic() + deadline_s
    transfer_id = ""
    try:
        for header, block in chunks:
            transfer_id = header.transfer_id
            staging = receiver.prepare(header)
            channel.run([block], [staging], max(0.0, deadline - time.monotonic()))
            receiver.finish(header, staging)
        if not transfer_id or not receiver.receiver.is_complete(transfer_id):
            raise TransferError("transfer incomplete")
        return ""
    except TransferError as err:
        if transfer_id:
            receiver.receiver.abort(transfer_id)
        return err.reason


def nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


# -- an in-memory fabric for the state machine's tests (CPU) ----------------------------------


class LoopbackFabric:
    """Pairs sends with recvs between in-process ranks, in order, byte for byte. `stall` makes
    every op hang (a dead peer); `flip` corrupts the next delivered byte."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], deque[torch.Tensor]] = {}
        self.stall = False
        self.flip = False
        self.aborted: list[int] = []
        self._lock = threading.Lock()

    def comm(self, rank: int) -> _LoopbackComm:
        return _LoopbackComm(self, rank)


class _Done:
    def __init__(self, check: Callable[[], bool]) -> None:
        self._check = check

    def query(self) -> bool:
        return self._check()


class _LoopbackComm:
    def __init__(self, fabric: LoopbackFabric, rank: int) -> None:
        self.fabric = fabric
        self.rank = rank
        self._pending: list[tuple[torch.Tensor, int]] = []

    @contextmanager
    def group(self) -> Iterator[None]:
        yield

    def send(self, buf: torch.Tensor, peer: int) -> None:
        with self.fabric._lock:
            self.fabric.queues.setdefault((self.rank, peer), deque()).append(buf.clone())

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._pending.append((buf, peer))

    def _deliver(self) -> bool:
        if self.fabric.stall:
            return False
        with self.fabric._lock:
            while self._pending:
                buf, peer = self._pending[0]
                queue = self.fabric.queues.get((peer, self.rank))
                if not queue:
                    return False
                sent = queue.popleft().view(-1).view(torch.uint8)
                if sent.numel() != nbytes(buf):
                    raise TransferError("size mismatch on the fabric")
                if self.fabric.flip:
                    sent[0] ^= 1
                    self.fabric.flip = False
                buf.view(-1).view(torch.uint8).copy_(sent)
                self._pending.pop(0)
        return True

    def completion(self) -> Completion:
        return _Done(lambda: not self.fabric.stall and self._deliver())

    def abort(self) -> None:
        self.fabric.aborted.append(self.rank)
