"""The same-host transport: page bytes through a shared-memory region, headers over gRPC.

The decode worker owns one staging region: a file under /dev/shm (mode 0600, unlinked on
close) cut into fixed slots. Its name, baton-kv-<pid namespace>-<pid>-<random>, says which
process owns it, so a region whose owner died without closing it (SIGKILL, OOM) is unlinked by
the next region made in the same pid namespace (`sweep_orphans`): a restarted decode worker
removes its predecessor's. A transfer is one `/baton.kv.v1.KVTransferService/PushShm`
call (bidirectional streaming) on the worker's existing KV server:

    decode:  region = ShmRegion(num_slots, slot_bytes)
             start_kv_server(receiver, extra_handlers=[shm_handler(receiver, region)])
    prefill: ShmSender.send(dest, chunks, deadline_s)
      sender -> PushShmRequest(header)                             the open: the transfer's id,
                                                                   token, request and epoch, no
                                                                   pages (within OPEN_TIMEOUT_S)
      server:   receiver.accept(header)                            a wrong token, epoch or request,
                                                                   or no open: PushShmResponse(ack=
                                                                   refused) and no slot is granted
      server -> PushShmResponse(region, slot_bytes, free_offsets)  up to slots_per_stream slots,
                                                                   waiting while the region is full
      sender:   payload -> a granted slot                          one memcpy from the page tensor
      sender -> PushShmRequest(header, offset, length)             the header still holds token,
                                                                   epoch and checksum
      server:   receive_push over the slot's bytes                 bounds, checksum over what is
                                                                   in shm, token, epoch, store
      server -> PushShmResponse(free_offsets=[offset])             the slot may be rewritten
      ...
      server -> PushShmResponse(ack)                               then waits for the half-close

    region:  | slot 0 | slot 1 | ... | slot n-1 |                  each slot_bytes long; a stream
             0        slot_bytes                                   names only slots granted to it

Every check of the gRPC path applies (transport.receive_push). Slots go only to a stream that
proved its transfer's token first, so connections without one hold nothing. A slot referenced by a stream
that was not granted it, or a length that does not fit it, is refused before shm is read.
Slots return to the region when the call ends however it ends (ack, refusal, deadline, the
sender's death); the reservation follows receive_push's rules.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import secrets
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.codec import MAX_HEADER_BYTES, CodecLimits, TransferError, WireChunk
from kvtransfer.grpc_transport import SERVICE, Channels, failed_call
from kvtransfer.tls import KVTls
from kvtransfer.transport import (
    Chunks,
    KVDestination,
    KVReceiver,
    PushResult,
    as_async,
    receive_push,
)

logger = logging.getLogger(__name__)

PUSH_SHM = f"/{SERVICE}/PushShm"
REGION_DIR = "/dev/shm"
_NAME = re.compile(r"baton-kv-(\d{1,20})-(\d{1,10})-[0-9a-f]{32}")  # pid namespace, owner pid, random
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in once
OPEN_TIMEOUT_S = 5.0  # a stream's first message (its open) comes within this, or the call ends


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no procfs: a namespace of its own, so no other process's region is swept
        return 0


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def orphans(directory: str = REGION_DIR) -> list[str]:
    """The regions whose owner process is gone: made in this pid namespace (a pid from another
    is meaningless here), owned by this user, and their pid no longer running."""
    namespace = _pid_namespace()
    found: list[str] = []
    if not namespace:
        return found
    try:
        entries = os.scandir(directory)
    except OSError:
        return found
    with entries:
        for entry in entries:
            name = _NAME.fullmatch(entry.name)
            if name is None or int(name.group(1)) != namespace or _is_alive(int(name.group(2))):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    found.append(entry.name)
            except OSError:  # gone meanwhile
                continue
    return found


def sweep_orphans(directory: str = REGION_DIR) -> list[str]:
    """Unlink the regions whose owner is gone (`orphans`); a sender that still maps one keeps
    its mapping (unlink removes only the name). Returns their names."""
    removed: list[str] = []
    for name in orphans(directory):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:  # raced with another sweeper
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d shm region(s) left by dead processes: %s", len(removed), ", ".join(removed))
    return removed


class ShmRegion:
    """The decode side's staging region: `num_slots` slots of `slot_bytes` in one shm file."""

    def __init__(
        self, num_slots: int = 4, slot_bytes: int = 32 << 20, directory: str = REGION_DIR
    ) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError("an shm region needs at least one non-empty slot")
        sweep_orphans(directory)
        self.name = f"baton-kv-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(directory, self.name)
        self.slot_bytes = slot_bytes
        self.size = num_slots * slot_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # reserve the memory now: a /dev/shm too small for the region fails here (ENOSPC),
            # not as a SIGBUS on some later write into it
            os.posix_fallocate(fd, 0, self.size)
            self._map = mmap.mmap(fd, self.size, flags=_MAP_FLAGS)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._buf = memoryview(self._map)
        self._free = list(range(0, self.size, slot_bytes))
        self._has_free = asyncio.Event()
        self._has_free.set()
        self.is_closed = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    async def acquire(self, max_slots: int) -> list[int]:
        """At least one and at most `max_slots` free slots (their offsets); waits while the
        region is full. Cancellation-safe: nothing is taken until it returns."""
        while not self._free:
            self._has_free.clear()
            await self._has_free.wait()
        taken = self._free[:max_slots]
        del self._free[:max_slots]
        return taken

    def release(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            if offset % self.slot_bytes or not 0 <= offset < self.size or offset in self._free:
                raise RuntimeError(f"release of slot {offset}, which is not held")
            self._free.append(offset)
        if self._free:
            self._has_free.set()

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes of one slot (a view, no copy); TransferError unless they lie in one slot."""
        if (
            offset % self.slot_bytes
            or not 0 <= offset < self.size
            or not 0 < length <= self.slot_bytes
        ):
            raise TransferError("payload outside the shm region's slots")
        return self._buf[offset : offset + length]

    def check_integrity(self) -> None:
        slots = set(range(0, self.size, self.slot_bytes))
        if len(set(self._free)) != len(self._free) or not set(self._free) <= slots:
            raise RuntimeError("shm region free list is corrupt")

    def close(self) -> None:
        """Unlink the file (no /dev/shm leak, whoever still maps it) and unmap it here."""
        if self.is_closed:
            return
        self.is_closed = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._buf.release()
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping dies with it
            logger.warning("shm region %s closed while a view of it was alive", self.name)

    def __enter__(self) -> ShmRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shm_handler(
    receiver: KVReceiver,
    region: ShmRegion,
    limits: CodecLimits | None = None,
    slots_per_stream: int = 2,
    stream_timeout_s: float = 60.0,
) -> grpc.GenericRpcHandler:
    """KVTransferService.PushShm for `receiver` through `region`, for start_kv_server's
    extra_handlers. `stream_timeout_s` bounds a call whose client set no deadline."""
    if slots_per_stream <= 0:
        raise ValueError("a stream needs at least one slot")
    limits = limits or CodecLimits()

    async def push_shm(requests: AsyncIterator[pb.PushShmRequest | None], context: Any) -> None:
        async with asyncio.timeout(stream_timeout_s):
            requests = aiter(requests)
            refusal = await _open(requests, receiver)
            if refusal is not None:  # no token, no slots
                await context.write(pb.PushShmResponse(ack=pb.PushResponse(error=refusal)))
                return
            granted = await region.acquire(slots_per_stream)
            try:
                await context.write(pb.PushShmResponse(
                    region=region.name, region_bytes=region.size, slot_bytes=region.slot_bytes,
                    free_offsets=granted,
                ))  # fmt: skip
                chunks = _from_region(requests, region, frozenset(granted), context)
                try:
                    ack = await receive_push(receiver, chunks, limits)
                finally:
                    await chunks.aclose()
                await context.write(pb.PushShmResponse(ack=ack))
                # Hold the call open until the sender half-closes: once a call has ended, the
                # client's read() no longer returns a reply it had not read yet (the ack).
                async for _ in requests:
                    pass
            finally:
                region.release(granted)

    method = grpc.stream_stream_rpc_method_handler(
        push_shm,
        request_deserializer=_parse_or_none,
        response_serializer=pb.PushShmResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"PushShm": method})


async def _open(
    requests: AsyncIterator[pb.PushShmRequest | None], receiver: KVReceiver
) -> str | None:
    """Read the stream's open (its first message: a header without pages) and check its token,
    epoch and request -> None, or why the stream gets no slots."""
    try:
        async with asyncio.timeout(OPEN_TIMEOUT_S):
            msg = await anext(requests)
    except (TimeoutError, StopAsyncIteration):
        return "no open"
    if msg is None:
        return "malformed header"
    header = msg.header
    if header.dest_page_ids or header.payload_bytes or msg.length:
        return "refused"
    if not receiver.accept(header):
        return receiver.refusal(header)
    return None


def _parse_or_none(data: bytes) -> pb.PushShmRequest | None:
    # like grpc_transport's poison chunk: a malformed message fails in receive_push, with a reason
    if len(data) > MAX_HEADER_BYTES + 64:  # a header, an offset and a length
        return None
    try:
        return pb.PushShmRequest.FromString(data)
    except DecodeError:
        return None


async def _from_region(
    requests: AsyncIterator[pb.PushShmRequest | None],
    region: ShmRegion,
    granted: frozenset[int],
    context: Any,
) -> AsyncGenerator[WireChunk, None]:
    """The stream's chunks, each payload a view of its slot; a slot is handed back to the
    sender when the next chunk is asked for, i.e. once receive_push stored this one."""
    async for msg in requests:
        if msg is None:
            raise TransferError("malformed header")
        if msg.offset not in granted or msg.length != msg.header.payload_bytes:
            raise TransferError("payload outside this stream's shm slots")
        yield WireChunk(msg.header, region.view(msg.offset, msg.length))
        await context.write(pb.PushShmResponse(free_offsets=[msg.offset]))


class ShmSender:
    """A KVSender into the shm region of a decode worker on this host, run by the same user
    (the region is mode 0600); one channel and one mapping per address, reused across
    transfers."""

    def __init__(self, directory: str = REGION_DIR, tls: KVTls | None = None) -> None:
        self.directory = directory
        self._channels = Channels(tls=tls)  # small messages only: no raised limits
        self._maps: dict[str, tuple[str, mmap.mmap]] = {}  # address -> (region name, mapping)

    async def send(self, dest: KVDestination, chunks: Chunks, deadline_s: float) -> PushResult:
        channel = self._channels.get(dest.address)
        call = channel.stream_stream(
            PUSH_SHM, request_serializer=pb.PushShmRequest.SerializeToString,
            response_deserializer=pb.PushShmResponse.FromString,
        )(timeout=deadline_s)  # fmt: skip
        try:
            async with asyncio.timeout(deadline_s):  # making the chunks counts too, not just grpc
                ack = await self._push(dest, call, chunks)
                await call.done_writing()
                await call.code()  # the server has handed the slots back when the call ends
        except TimeoutError:
            return PushResult(False, 0, "deadline exceeded")
        except grpc.aio.AioRpcError as err:
            return failed_call(err.code())
        except asyncio.InvalidStateError:  # a write after the call ended: its status says why
            return failed_call(await call.code())
        except TransferError as err:  # on this side: the call's cancellation tells the server
            return PushResult(False, 0, err.reason)
        finally:
            call.cancel()  # a no-op once done; ends the server's wait on any other exit
        return PushResult(ack.accepted, ack.pages_received, ack.error)

    async def _push(self, dest: KVDestination, call: Any, chunks: Chunks) -> pb.PushResponse:
        opening = pb.PageChunkHeader(req_id=dest.req_id, transfer_id=dest.transfer_id, transfer_token=dest.token,
                                     sender_epoch=dest.epoch)  # fmt: skip
        await call.write(pb.PushShmRequest(header=opening))  # the token first: slots come after it
        grant = await call.read()
        if grant is grpc.aio.EOF:
            raise TransferError("no shm grant")
        if grant.HasField("ack"):  # refused at the open
            return cast(pb.PushResponse, grant.ack)
        address = dest.address
        target = self._attach(address, grant)
        free, sent_last = deque(grant.free_offsets), False
        async for chunk in as_async(chunks):
            payload = memoryview(chunk.payload).cast("B")
            if payload.nbytes > grant.slot_bytes:
                raise TransferError("chunk larger than an shm slot")
            while not free:  # back-pressure: wait until the receiver stored a chunk
                reply = await _reply(call)
                if reply.HasField("ack"):  # refused early: the rest is not wanted
                    return reply.ack
                free.extend(reply.free_offsets)
            offset = free.popleft()
            if offset % grant.slot_bytes or offset + payload.nbytes > grant.region_bytes:
                raise TransferError("shm grant outside the region")
            target[offset : offset + payload.nbytes] = payload
            msg = pb.PushShmRequest(header=chunk.header, offset=offset, length=payload.nbytes)
            await call.write(msg)
            sent_last = chunk.header.is_last
        if not sent_last:  # the receiver waits for a last chunk until the stream ends
            await call.done_writing()
        while not (reply := await _reply(call)).HasField("ack"):
            pass  # credits for the last slots
        return reply.ack

    def _attach(self, address: str, grant: pb.PushShmResponse) -> mmap.mmap:
        known = self._maps.get(address)
        if known is not None and known[0] == grant.region:
            return known[1]
        if not _NAME.fullmatch(grant.region) or not 0 < grant.slot_bytes <= grant.region_bytes:
            raise TransferError("malformed shm grant")
        try:
            fd = os.open(os.path.join(self.directory, grant.region), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            raise TransferError("shm region not reachable from this host") from None
        try:
            if os.fstat(fd).st_size < grant.region_bytes:
                raise TransferError("shm region smaller than its grant")
            mapping = mmap.mmap(fd, grant.region_bytes, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        # a worker restarted with a new region: the old mapping goes once no send holds it
        self._maps[address] = (grant.region, mapping)
        return mapping

    async def close(self) -> None:
        await self._channels.close()
        for _, mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


async def _reply(call: Any) -> pb.PushShmResponse:
    reply = await call.read()
    if reply is grpc.aio.EOF:
        raise TransferError("shm stream ended without an ack")
    return cast(pb.PushShmResponse, reply)
