"""The two roles as Ray actors: thin wrappers that own a worker, its Engine and its transport.

    decode = spawn_decode(cfg); addr = decode.start()   its KV server (gRPC Push) on loopback
    dest = decode.reserve(job, epoch)                    pages reserved; dest.address = addr
    prefill = spawn_prefill(cfg, epoch)
    result = prefill.prefill(job, dest)                  chunked prefill, first token; the actor
                                                         itself pushes the pages to dest.address
    decode.start_prefilled(job, dest, result.first_token)   (or decode.start_local(job))
    decode.run_until_idle()                              {req_id: tokens} (this slice; a
                                                         long-lived per-step stream comes later)

Page bytes go prefill -> decode over gRPC (protobuf header + raw bytes + checksum), never through
Ray's object store or pickle. Actor methods take and return frozen dataclasses only.

Both are async actors: grpc.aio (the KV server, the sender) runs on the actor's event loop, and
so do the engine steps (synchronous, between awaits), so a push lands between two steps, never
inside one. Each actor asks Ray for 0 CPUs and runs torch on `num_threads` threads: the
machine's cores are shared by choice, not by Ray's CPU accounting (ENV-NOTES.md).

`ray` is imported inside the spawn functions only: cluster.ray_runtime must set Ray's
environment before the first `import ray` in the process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import torch

from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.request import FinishReason
from kvtransfer.grpc_transport import GrpcSender, start_kv_server
from kvtransfer.transport import DEFAULT_DEADLINE_S, KVDestination, PushResult
from prefill.worker import PrefillDone, PrefillJob, PrefillWorker

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A PrefillDone after the push: the first token for the edge and how the push went."""

    req_id: str
    first_token: int
    text: str
    finish_reason: FinishReason | None  # set when the first token ends the request (no push)
    accepted: bool  # every page arrived and verified (True when nothing had to be pushed)
    pages_received: int
    error: str


@dataclass(frozen=True, slots=True)
class DecodeStats:
    address: str
    num_pages: int
    num_used_pages: int
    num_free_pages_at_idle: int  # free or only cached: equals num_pages when nothing is held
    num_open_reservations: int
    num_expired: int
    refused_bad_token: int
    refused_stale_epoch: int
    refused_bad_page: int


class PrefillActor:
    def __init__(
        self,
        cfg: EngineConfig,
        epoch: int = 1,
        pages_per_chunk: int = 32,
        num_threads: int = 1,
        push_deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        torch.set_num_threads(num_threads)
        self.worker = PrefillWorker(Engine(cfg), epoch, pages_per_chunk)
        self.sender = GrpcSender()
        self.push_deadline_s = push_deadline_s
        self._done: dict[str, PrefillDone] = {}  # finished by a step another call ran

    async def ping(self) -> int:
        return os.getpid()

    async def prefill(self, job: PrefillJob, dest: KVDestination) -> PrefillResult:
        self.worker.submit(job, dest)
        while job.req_id not in self._done:
            if not self.worker.has_work():
                raise RuntimeError(f"prefill of {job.req_id} ended without a result")
            for done in self.worker.step():
                self._done[done.req_id] = done
            await asyncio.sleep(0)  # let pushes and other calls progress between steps
        done = self._done.pop(job.req_id)
        push = PushResult(True, 0, "")
        if done.finish_reason is None:
            push = await self.sender.send(done.dest, done.chunks, self.push_deadline_s)
        return PrefillResult(
            job.req_id, done.first_token, done.text, done.finish_reason,
            push.accepted, push.pages_received, push.error,
        )  # fmt: skip

    async def close(self) -> None:
        await self.sender.close()


class DecodeActor:
    def __init__(
        self,
        cfg: EngineConfig,
        reservation_ttl_s: float = 10.0,
        local_prefill_tokens: int = 32,
        num_threads: int = 1,
        host: str = "127.0.0.1",
    ) -> None:
        torch.set_num_threads(num_threads)
        engine = Engine(cfg)
        self.worker = DecodeWorker(engine, "", reservation_ttl_s, local_prefill_tokens)
        self.host = host
        self._server: grpc.aio.Server | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._tokens: dict[str, list[int]] = {}

    async def start(self) -> str:
        """Serve KV pushes; returns the address reservations name. Idempotent."""
        if self._server is None:
            self._server, port = await start_kv_server(self.worker.receiver, f"{self.host}:0")
            self.worker.address = f"{self.host}:{port}"
            # Reservations expire even when nothing steps the engine (a prefill died idle).
            self._expiry = asyncio.create_task(self._expire_forever())
        return self.worker.address

    async def reserve(self, job: PrefillJob, sender_epoch: int) -> KVDestination | None:
        if self._server is None:
            raise RuntimeError("start() the decode actor before reserving")
        return self.worker.reserve(job, sender_epoch)

    async def cancel(self, dest: KVDestination) -> None:
        self.worker.cancel(dest)

    async def start_prefilled(self, job: PrefillJob, dest: KVDestination, first_token: int) -> None:
        self.worker.start_prefilled(job, dest, first_token)
        self._tokens[job.req_id] = [first_token]

    async def start_local(self, job: PrefillJob) -> None:
        self.worker.start_local(job)
        self._tokens[job.req_id] = []

    async def run_until_idle(self) -> dict[str, list[int]]:
        """Step until no request runs; every request's output tokens since the last call
        (a prefilled one's first token included), all of them finished."""
        while self.worker.engine.has_unfinished():
            for out in self.worker.step():
                self._tokens.setdefault(out.req_id, []).extend(out.token_ids)
            await asyncio.sleep(0)  # pushes for other requests land between steps
        finished, self._tokens = self._tokens, {}
        return finished

    async def stats(self) -> DecodeStats:
        engine, book = self.worker.engine, self.worker.book
        return DecodeStats(
            self.worker.address, engine.pool.num_pages, engine.pool.pages.num_used,
            engine.free_pages_at_idle(), book.num_open, book.num_expired,
            book.refused_bad_token, book.refused_stale_epoch, book.refused_bad_page,
        )  # fmt: skip

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server is not None:
            await self._server.stop(None)
        self._server = self._expiry = None

    async def _expire_forever(self) -> None:
        period = min(1.0, self.worker.reservation_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            for transfer_id in self.worker.book.expire():
                logger.info("reservation %s expired; its pages are free again", transfer_id)


def spawn_prefill(cfg: EngineConfig, *, name: str | None = None, **kwargs: Any) -> ActorHandle[Any]:
    """A PrefillActor on the current Ray cluster (ray_runtime started or connected it)."""
    handle: ActorHandle[Any] = _remote(PrefillActor).options(name=name).remote(cfg, **kwargs)
    return handle


def spawn_decode(cfg: EngineConfig, *, name: str | None = None, **kwargs: Any) -> ActorHandle[Any]:
    """A DecodeActor on the current Ray cluster; call `start()` on it before reserving."""
    handle: ActorHandle[Any] = _remote(DecodeActor).options(name=name).remote(cfg, **kwargs)
    return handle


@functools.cache
def _remote(cls: type) -> Any:
    import ray

    # 0 CPUs: Ray would otherwise hold one core per actor and leave the third of a
    # 2 prefill + 2 decode cluster pending forever on a 2-core machine.
    return ray.remote(num_cpus=0)(cls)
