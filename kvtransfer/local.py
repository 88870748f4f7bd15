"""The same-process transport (tests, `baton up --no-ray`): direct calls into a receiver.

Chunks still go through the full receive path (codec bounds and checksum, token and epoch
check), so what passes here passes over gRPC too.
"""

from __future__ import annotations

import asyncio

from kvtransfer.codec import CodecLimits
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
