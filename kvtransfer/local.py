"""The same-process transport (tests, `baton up --no-ray`): direct calls into a receiver.

Chunks still go through the full receive path (codec bounds and checksum, token and epoch
check), so what passes here passes over gRPC too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtransfer.codec import CodecLimits, TransferError, WireChunk, decode_chunk
from kvtransfer.transport import (
    Chunks,
    KVDestination,
    KVReceiver,
    PushResult,
    as_async,
    receive_push,
)


class LocalSender:
    """A KVSender whose destinations are receivers in this process, keyed by address."""

    def __init__(self, receivers: dict[str, KVReceiver], limits: CodecLimits | None = None) -> None:
        self.receivers = receivers
        self.limits = limits or CodecLimits()

    async def send(self, dest: KVDestination, chunks: Chunks, deadline_s: float) -> PushResult:
        receiver = self.receivers.get(dest.address)
        if receiver is None:
            return PushResult(False, 0, "unknown destination")
        try:
            async with asyncio.timeout(deadline_s):
                ack = await receive_push(receiver, as_async(chunks), self.limits)
        except TimeoutError:  # receive_push released the reservation on its cancellation
            return PushResult(False, 0, "deadline exceeded")
        return PushResult(ack.accepted, ack.pages_received, ack.error)


def receive_all(receiver: KVReceiver, chunks: Sequence[WireChunk], limits: CodecLimits) -> str:
    """Apply a whole transfer synchronously on the receiver's own thread (the in-process
    disaggregated mode): "" when every page arrived and verified, else why not. The same
    checks as a pushed stream: codec bounds and checksum, token, epoch, completeness."""
    transfer_id = ""
    try:
        for chunk in chunks:
            pages = decode_chunk(chunk, limits)
            if not receiver.accept(chunk.header):
                raise TransferError(receiver.refusal(chunk.header))
            transfer_id = chunk.header.transfer_id
            receiver.store(chunk.header, pages)
            if receiver.is_complete(transfer_id):
                break  # complete: the transfer stands (its token is spent), as in receive_push
        if not transfer_id or not receiver.is_complete(transfer_id):
            raise TransferError("transfer incomplete")
        return ""
    except TransferError as err:
        if transfer_id:
            receiver.abort(transfer_id)
        return err.reason
