"""The gRPC transport: `baton.kv.v1.KVTransferService.Push` (client streaming) on grpc.aio.

The decode worker serves Push in front of its KVReceiver; the prefill worker streams a
transfer's chunks, each one PushRequest message (kvtransfer.codec.frame), with the transfer's
deadline as the call's timeout. When the deadline passes mid-stream, grpc cancels both sides:
the client gets DEADLINE_EXCEEDED (a failed PushResult) and the server's handler is cancelled,
which releases the reservation (transport.receive_push).
Message limits are raised to fit one multi-MiB chunk and nothing larger.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.codec import CodecLimits, WireChunk, frame, unframe
from kvtransfer.tls import KVTls
from kvtransfer.transport import (
    Chunks,
    KVDestination,
    KVReceiver,
    PushResult,
    as_async,
    read_ahead,
    receive_push,
)

# baton.kv.v1.KVTransferService: Push here, PushShm (kvtransfer.shm), PushNccl (.nccl_link)
SERVICE = pb.DESCRIPTOR.services_by_name["KVTransferService"].full_name
PUSH = f"/{SERVICE}/Push"
_HEADER_ROOM = 1 << 20  # headroom over the payload bound for the header and framing
RECEIVE_AHEAD = 2  # chunks a push's receiver reads before it stores them (transport.read_ahead)


def _message_options(limits: CodecLimits) -> list[tuple[str, int]]:
    size = limits.max_chunk_bytes + _HEADER_ROOM
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]


# A link that was cut comes back within seconds; gRPC's own reconnect backoff grows to 120 s,
# which would keep a pair failing (and unroutable) for minutes after the network healed.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000))  # fmt: skip


class Channels:
    """A sender's grpc.aio channels, one per KV address, reused across transfers."""

    def __init__(self, options: Sequence[tuple[str, int]] = (), tls: KVTls | None = None) -> None:
        self._options: list[tuple[str, int | str]] = [*options, *RECONNECT_OPTIONS]
        self._tls = tls  # mutual TLS to the KV servers (kvtransfer.tls); None: plaintext
        self._by_address: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._by_address.get(address)
        if channel is None:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            else:
                channel = grpc.aio.secure_channel(address, self._tls.channel_credentials(),
                                                  options=[*self._options, *self._tls.channel_options()])
            self._by_address[address] = channel
        return channel

    async def close(self) -> None:
        for channel in self._by_address.values():
            await channel.close()
        self._by_address.clear()


def failed_call(code: grpc.StatusCode) -> PushResult:
    """A push whose call ended with `code`, as its sender reports it."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PushResult(False, 0, "deadline exceeded")
    return PushResult(False, 0, f"transport error: {code.name}")


def _unframe_or_poison(data: bytes) -> WireChunk:
    # A malformed frame must reach receive_push as a chunk that fails validation (so the
    # transfer is refused with a reason), not as an exception inside grpc's deserializer.
    try:
        return unframe(data)
    except Exception:
        return WireChunk(pb.PageChunkHeader(), b"")


async def start_kv_server(
    receiver: KVReceiver,
    address: str = "127.0.0.1:0",
    limits: CodecLimits | None = None,
    extra_handlers: Sequence[grpc.GenericRpcHandler] = (),
    tls: KVTls | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started server hosting KVTransferService.Push for `receiver`, and the port it bound;
    `extra_handlers` add methods next to it (KVTransferService.PushShm: kvtransfer.shm.shm_handler);
    with `tls`, only clients holding the deployment's certificate connect (kvtransfer.tls)."""
    limits = limits or CodecLimits()

    async def push(request_iterator: AsyncIterator[WireChunk], context: object) -> pb.PushResponse:
        chunks = read_ahead(request_iterator, RECEIVE_AHEAD)  # the next chunks arrive while this one is stored
        try:
            return await receive_push(receiver, chunks, limits)
        finally:
            await chunks.aclose()

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {"Push": grpc.stream_unary_rpc_method_handler(
            push, request_deserializer=_unframe_or_poison, response_serializer=pb.PushResponse.SerializeToString
        )},
    )  # fmt: skip
    server = grpc.aio.server(options=_message_options(limits))
    server.add_generic_rpc_handlers((handler, *extra_handlers))
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials())
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    return server, port


async def _framed(chunks: Chunks) -> AsyncIterator[bytes]:
    async for chunk in as_async(chunks):
        yield frame(chunk)


class GrpcSender:
    """A KVSender over gRPC; one channel per destination address, reused across transfers."""

    def __init__(self, limits: CodecLimits | None = None, tls: KVTls | None = None) -> None:
        self.limits = limits or CodecLimits()
        self._channels = Channels(_message_options(self.limits), tls)

    async def send(self, dest: KVDestination, chunks: Chunks, deadline_s: float) -> PushResult:
        push = self._channels.get(dest.address).stream_unary(
            PUSH, request_serializer=None, response_deserializer=pb.PushResponse.FromString
        )
        # framed one chunk ahead: grpc asks for a message only once the one before is written
        call = push(read_ahead(_framed(chunks)), timeout=deadline_s)
        try:
            ack: pb.PushResponse = await call
        except grpc.aio.AioRpcError as err:
            return failed_call(err.code())
        finally:
            call.cancel()  # a no-op once done; stops the request stream on any other exit
        return PushResult(ack.accepted, ack.pages_received, ack.error)

    async def close(self) -> None:
        await self._channels.close()
