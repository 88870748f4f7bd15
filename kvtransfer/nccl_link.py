"""The nccl transport between two workers: a communicator per (prefill, decode) pair, opened
when the pair is routed, and KVTransferService/PushNccl for the headers (docs/architecture.md,
KV transfer).

    rendezvous  the launcher asks the decode worker to listen (NcclEndpoint.listen): it names a
                channel, makes a unique id (NCCL's; a gloo rendezvous between CPU pools) and
                joins as rank 1 in the background; the prefill worker joins as rank 0
                (NcclSender.connect). Both joins are bounded by the rendezvous deadline.
    a chunk     sender: header -> (receiver: codec bounds, token, epoch, reserved pages; posts
                the recv into a staging buffer; answers go) -> send -> both wait for the group;
                receiver: digest, checksum, store. A refused header gets the ack instead of go,
                and nothing is sent. One chunk is in flight per channel: each side holds the
                channel's lock from the header to the group's completion, so sends and recvs
                pair in order even when several transfers share the pair.
    deadline    the sender's deadline bounds the call and each group; the receiver's group is
                bounded by what is left of the call's deadline. Past it the communicator is
                aborted, the reservation released, and the channel is dead on both sides: the
                sender reports it (`is_open`), so its worker routes that decode worker by gRPC.

Page bytes never touch the host on CUDA: the blocks are the prefill's device pages, the staging
buffer is on the decode worker's device, and the headers are small protobufs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import torch
from google.protobuf.message import DecodeError

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.codec import MAX_HEADER_BYTES, CodecLimits, DeviceChunk, TransferError
from kvtransfer.grpc_transport import SERVICE, Channels, failed_call
from kvtransfer.nccl import (
    ChannelState,
    Comm,
    NcclChannel,
    NcclReceiver,
)
from kvtransfer.nccl_comm import forget_uid, make_uid, open_comm
from kvtransfer.tls import KVTls
from kvtransfer.transport import (
    Chunks,
    KVDestination,
    KVReceiver,
    PushResult,
    PushState,
    as_async,
    settle_push,
)

logger = logging.getLogger(__name__)

PUSH_NCCL = f"/{SERVICE}/PushNccl"
RENDEZVOUS_S = 30.0  # both ranks join within this
STREAM_TIMEOUT_S = 60.0  # a call whose client set no deadline

Connect = Callable[[bytes, int, torch.device], Comm]


@dataclass(slots=True)
class _Link:
    channel: NcclChannel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    name: str = ""  # the channel's name on the decode side
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # decode side: its join ended, either way


class NcclEndpoint:
    """The decode side's channels, one per routed prefill worker, by name."""

    def __init__(self, device: torch.device, connect: Connect = open_comm) -> None:
        self.device = device
        self._connect = connect
        self._links: dict[str, _Link] = {}
        self._joins: set[asyncio.Task[None]] = set()
        self._uids: set[bytes] = set()  # rendezvous still on disk (gloo)
        self._closed = False

    async def listen(self, deadline_s: float = RENDEZVOUS_S) -> tuple[str, bytes]:
        """A new channel's name and unique id; this side joins it in the background (rank 1)."""
        self._closed = False
        name, uid = secrets.token_hex(8), make_uid(self.device)
        channel = NcclChannel(lambda: self._connect(uid, 1, self.device), peer=0)
        link = self._links[name] = _Link(channel, name=name)

        async def join() -> None:
            opened = False
            try:
                await asyncio.to_thread(channel.open, deadline_s)
                opened = True
            except TransferError as err:
                logger.warning("nccl channel %s did not open: %s", name, err.reason)
                self._links.pop(name, None)
            finally:
                link.joined.set()
                if opened and not self._closed:  # the peer may still be reading the rendezvous
                    self._uids.add(uid)
                    asyncio.get_running_loop().call_later(deadline_s, self._forget, uid)
                else:
                    forget_uid(uid)

        task = asyncio.create_task(join())
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)
        return name, uid

    def get(self, name: str) -> _Link | None:
        link = self._links.get(name)
        if link is not None and link.channel.state in (ChannelState.ABORTED, ChannelState.CLOSED):
            del self._links[name]  # dead: the sender routes by gRPC until it is routed again
            return None
        return link

    def _forget(self, uid: bytes) -> None:
        self._uids.discard(uid)
        forget_uid(uid)

    def close(self) -> None:
        self._closed = True
        for task in self._joins:
            task.cancel()
        for uid in list(self._uids):
            self._forget(uid)
        for link in self._links.values():
            link.channel.close()
        self._links.clear()

    @property
    def num_open(self) -> int:
        return sum(1 for link in self._links.values() if link.channel.state is not ChannelState.NEW)


def nccl_handler(
    receiver: KVReceiver,
    endpoint: NcclEndpoint,
    limits: CodecLimits | None = None,
    stream_timeout_s: float = STREAM_TIMEOUT_S,
) -> grpc.GenericRpcHandler:
    """KVTransferService.PushNccl for `receiver` over `endpoint`'s channels, for start_kv_server's
    extra_handlers."""
    staging = NcclReceiver(receiver, endpoint.device, limits)

    async def push_nccl(requests: AsyncIterator[pb.PushNcclRequest | None], context: Any) -> None:
        left = context.time_remaining()
        async with asyncio.timeout(min(left, stream_timeout_s) if left is not None else stream_timeout_s):
            ack = await _receive(staging, endpoint, requests, context)
            await context.write(pb.PushNcclResponse(ack=ack))
            # Hold the call open until the sender half-closes: once a call has ended, the
            # client's read() no longer returns a reply it had not read yet (the ack).
            async for _ in requests:
                pass

    method = grpc.stream_stream_rpc_method_handler(
        push_nccl, request_deserializer=_parse_or_none,
        response_serializer=pb.PushNcclResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"PushNccl": method})


async def _receive(
    staging: NcclReceiver,
    endpoint: NcclEndpoint,
    requests: AsyncIterator[pb.PushNcclRequest | None],
    context: Any,
) -> pb.PushResponse:
    receiver, state = staging.receiver, PushState()

    async def body() -> None:
        async for msg in requests:
            if msg is None:
                raise TransferError("malformed header")
            header = msg.header
            state.same_transfer(header)
            link = endpoint.get(msg.channel)
            if link is not None and link.channel.state is ChannelState.NEW:
                # The sender's side of the rendezvous ended first: this side's join is still
                # coming back from its thread (a busy host), and its push is already here.
                try:
                    await asyncio.wait_for(link.joined.wait(), _left(context))
                except TimeoutError:
                    raise TransferError("the channel did not open in time") from None
                link = endpoint.get(msg.channel)
            if link is None or link.channel.state is ChannelState.NEW:
                raise TransferError("no such channel")
            async with link.lock:
                buf = staging.prepare(header)  # refused: no recv is posted, nothing changes
                state.transfer_id = header.transfer_id
                posted = link.channel.post([], [buf])  # before the sender hears go
                try:
                    await context.write(pb.PushNcclResponse(go=True))
                except BaseException:  # the recv waits for a send that will not come
                    link.channel.abort()
                    raise
                await link.channel.wait(posted, [], [buf], _left(context))
            state.done = staging.finish(header, buf)
            if header.is_last or receiver.is_complete(state.transfer_id):
                break

    return await settle_push(receiver, state, body(), "nccl push")


def _left(context: Any) -> float:
    left = context.time_remaining()
    return STREAM_TIMEOUT_S if left is None else max(0.0, left)


def _parse_or_none(data: bytes) -> pb.PushNcclRequest | None:
    if len(data) > MAX_HEADER_BYTES + 64:  # a header and a channel name
        return None
    try:
        return pb.PushNcclRequest.FromString(data)
    except DecodeError:
        return None


class NcclSender:
    """A KVSender over the channels this prefill worker opened, one per decode address; the
    chunks are DeviceChunks (PrefillWorker makes them for an nccl route)."""

    def __init__(self, device: torch.device, connect: Connect = open_comm, tls: KVTls | None = None) -> None:
        self.device = device
        self._connect = connect
        self._links: dict[str, _Link] = {}
        self._headers = Channels(tls=tls)  # headers only: no raised limits

    async def connect(self, address: str, name: str, uid: bytes, deadline_s: float = RENDEZVOUS_S) -> None:
        """Join the channel the decode worker at `address` listens on (rank 0)."""
        channel = NcclChannel(lambda: self._connect(uid, 0, self.device), peer=1)
        await asyncio.to_thread(channel.open, deadline_s)
        self._links[address] = _Link(channel, name=name)

    def is_open(self, address: str) -> bool:
        link = self._links.get(address)
        return link is not None and link.channel.state in (ChannelState.READY, ChannelState.BUSY)

    async def send(self, dest: KVDestination, chunks: Chunks, deadline_s: float) -> PushResult:
        if not self.is_open(dest.address):
            return PushResult(False, 0, "no nccl channel to that worker")
        link = self._links[dest.address]
        call = self._headers.get(dest.address).stream_stream(
            PUSH_NCCL, request_serializer=pb.PushNcclRequest.SerializeToString,
            response_deserializer=pb.PushNcclResponse.FromString,
        )(timeout=deadline_s)
        try:
            async with asyncio.timeout(deadline_s):
                ack = await self._push(link, call, chunks, deadline_s)
                await call.done_writing()
                await call.code()
        except TimeoutError:
            return PushResult(False, 0, "deadline exceeded")
        except grpc.aio.AioRpcError as err:
            return failed_call(err.code())
        except asyncio.InvalidStateError:  # a write after the call ended: its status says why
            return failed_call(await call.code())
        except TransferError as err:
            return PushResult(False, 0, err.reason)
        finally:
            call.cancel()  # a no-op once done; ends the receiver's wait on any other exit
        return PushResult(ack.accepted, ack.pages_received, ack.error)

    async def _push(
        self, link: _Link, call: Any, chunks: Chunks, deadline_s: float
    ) -> pb.PushResponse:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        sent_last = False
        async for chunk in as_async(chunks):
            if not isinstance(chunk, DeviceChunk):
                raise TransferError("an nccl push takes device chunks")
            async with link.lock:
                await call.write(pb.PushNcclRequest(header=chunk.header, channel=link.name))
                reply = await _reply(call)
                if reply.HasField("ack"):  # refused: nothing was posted for it
                    return cast(pb.PushResponse, reply.ack)
                if not reply.go:
                    raise TransferError("no go from the receiver")
                await link.channel.exchange([chunk.block], [], max(0.0, end - loop.time()))
            sent_last = chunk.header.is_last
            if sent_last:
                break
        if not sent_last:  # the receiver waits for a last chunk until the stream ends
            await call.done_writing()
        while not (reply := await _reply(call)).HasField("ack"):
            pass
        return reply.ack

    async def close(self) -> None:
        await self._headers.close()
        for link in self._links.values():
            link.channel.close()
        self._links.clear()


async def _reply(call: Any) -> pb.PushNcclResponse:
    reply = await call.read()
    if reply is grpc.aio.EOF:
        raise TransferError("nccl stream ended without an ack")
    return cast(pb.PushNcclResponse, reply)
