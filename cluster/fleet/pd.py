"""Disaggregated serving in one process (`baton up --prefill 1 --no-ray`): a prefill engine and
a decode engine, each on its own step thread, behind the surface the Frontend expects.

    generate(req)
      placement: the uncached part short -> decode prefills it itself; else prefill-0 first
      dispatch(job, decode, paths)                cluster.fleet.dispatch, the same flow as on Ray:
        decode.call(reserve)                      pages + a one-time transfer token (decode thread)
        prefill.stream(start)                     prefill, sample the first token  (prefill thread)
          └─ yield the first token at once (TTFT does not wait for the transfer)
        decode.call(receive_all)                  verify and store every page       (decode thread)
        decode.stream(start_prefilled)            the request joins the running batch; stream the rest
      a failed prefill or transfer: the pages go back and decode prefills the request itself

Spans (cluster.ops.tracing, under the edge's): baton.placement (local or disaggregated), baton.prefill
(prefill-0, or decode-0 when it prefills itself), baton.transfer (local), baton.decode.

Every engine-side step runs on that engine's own thread (AsyncEngine.call / stream), so the
reservation book and the page pools are only ever touched by one thread. The Ray deployment
(cluster.fleet.front) has actors for sides; the flow is the same function.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from cluster.fleet.dispatch import Handed, PrefillSide, Redispatch, Started, dispatch, replayable
from cluster.ops.node_status import NodeStatus, engine_node
from cluster.ops.tracing import RequestTrace, Span, trace_of
from decode.worker import DecodeWorker
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.job import Job
from engine.outputs import ExportedKV, StepOutput, StepStats
from engine.pins import PinAnswer, pin_on, unpin_on
from engine.request import CachedTokens
from engine.sampling import SamplingParams
from kvtransfer.codec import CodecLimits, WireChunk, chunk_pages, damaged
from kvtransfer.local import receive_all
from kvtransfer.transport import KVDestination, build_chunks
from prefill.worker import PrefillWorker

logger = logging.getLogger(__name__)

PREFILL_NODE, DECODE_NODE = "prefill-0", "decode-0"  # as cluster.ops.node_status names them


class PDFront:
    def __init__(self, prefill: AsyncEngine, decode: AsyncEngine, local_prefill_tokens: int = 32) -> None:
        self.prefill = prefill
        self.decode = decode
        self.worker = DecodeWorker(decode.engine, address="decode-0", local_prefill_tokens=local_prefill_tokens)
        self.epoch = 1
        self.limits = CodecLimits()
        self.counts = Counts()
        self._prefill = _LocalPrefill(self)
        self._decode = _LocalDecode(self)

    @property
    def num_local(self) -> int:
        return self.counts.num_local

    @property
    def num_disaggregated(self) -> int:
        return self.counts.num_disaggregated

    # -- the surface the Frontend uses --------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self.decode.engine  # tokenizer, context length, pool metrics: the decode side's

    @property
    def is_alive(self) -> bool:
        return self.prefill.is_alive and self.decode.is_alive

    def is_live(self, max_heartbeat_age_s: float) -> bool:
        return self.prefill.is_live(max_heartbeat_age_s) and self.decode.is_live(max_heartbeat_age_s)

    @property
    def last_stats(self) -> StepStats | None:
        return self.decode.last_stats

    async def read_nodes(self) -> list[NodeStatus]:
        """Both engines' status, for /status and the node metrics (cluster.ops.node_status)."""
        return [await engine_node("prefill-0", "prefill", self.prefill),
                await engine_node("decode-0", "decode", self.decode)]  # fmt: skip

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()

    async def stop(self) -> None:
        await self.prefill.stop()
        await self.decode.stop()

    async def pin_prefix(
        self, role: str, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float, wait_s: float
    ) -> list[PinAnswer]:
        """cluster.edge.pins: on the prefill engine (where prompts are computed) unless `role`
        names decode."""
        name, engine = (DECODE_NODE, self.decode) if role == "decode" else (PREFILL_NODE, self.prefill)
        return [await pin_on(engine, name, pin_id, prompt_ids, cache_salt, ttl_s, wait_s)]

    async def unpin_prefix(self, pin_id: str) -> int:
        return sum([await unpin_on(self.prefill, pin_id), await unpin_on(self.decode, pin_id)])

    def follow_pins(self, answered: Callable[[str, PinAnswer], None]) -> None:
        """Its two engines are there from the start: no worker joins later."""

    async def prepare(self, sampling: SamplingParams) -> None:
        """Compile the request's constraint on both sides (the prefill side samples the first
        token under it, the decode side goes on from there); ConstraintError if refused."""
        await self.decode.prepare(sampling)
        await self.prefill.prepare(sampling)

    # -- one request ----------------------------------------------------------------------------

    async def generate(self, job: Job) -> AsyncIterator[StepOutput]:
        job = replayable(job)  # a failed transfer re-runs it on the decode side
        trace = trace_of(job.req_id)
        with trace.span("baton.placement", req_id=job.req_id, decode_worker=DECODE_NODE) as placing:
            # On the decode thread: prefers_local reads the decode engine's prefix cache.
            local = await self.decode.call(lambda _: self.worker.prefers_local(job))
            placing.set(kind="local" if local else "disaggregated",
                        prefill_worker=DECODE_NODE if local else PREFILL_NODE)  # fmt: skip
        paths: list[PrefillSide | None] = [None] if local else [self._prefill, None]
        async for out in dispatch(job, self._decode, paths, trace, self.counts):
            yield out


class Counts:
    """How requests went (dispatch's Tally), for the tests: the in-process P/D exports no metric of it."""

    def __init__(self) -> None:
        self.num_local = 0
        self.num_disaggregated = 0
        self.num_redispatched = 0

    def placed(self, job: Job, route: str) -> None:
        if route == "local":
            self.num_local += 1
        else:
            self.num_disaggregated += 1

    def redispatched(self, job: Job, to: str) -> None:
        self.num_redispatched += 1

    def computed(self, job: Job, cached: CachedTokens, decode: str, prefill: str | None) -> None:
        """Where a context came from matters to a migration; in one process nothing migrates."""


class _LocalPrefill:
    """The prefill engine as dispatch() sees it (cluster.fleet.dispatch.PrefillSide)."""

    name = PREFILL_NODE

    def __init__(self, front: PDFront) -> None:
        self.front = front

    @property
    def epoch(self) -> int:
        return self.front.epoch

    async def prefill(self, job: Job, dest: KVDestination, span: Span) -> Started:
        engine = self.front.prefill
        try:
            first: StepOutput | None = None
            async for out in engine.stream(job.req_id, lambda e: PrefillWorker.start(e, job)):
                first = out
            assert first is not None and first.finish_reason is not None
            exported = await engine.call(lambda e: e.take_exported(job.req_id))
            assert exported is not None
        except Exception as exc:  # a prefill engine that refused or died: decode prefills it
            logger.warning("%s: prefill failed: %r", job.req_id, exc)
            span.fail(exc)
            raise Redispatch from None
        if PrefillWorker.ends_here(job, first.finish_reason):
            return Started(first, exported)
        return Started(replace(first, finish_reason=None), exported)  # decode goes on from it

    def abort(self, req_id: str) -> None:
        self.front.prefill.abort(req_id)


class _LocalDecode:
    """The decode engine as dispatch() sees it (cluster.fleet.dispatch.DecodeSide)."""

    name = DECODE_NODE

    def __init__(self, front: PDFront) -> None:
        self.front = front
        self.worker = front.worker
        self.engine = front.decode
        self._calls: set[asyncio.Task[None]] = set()  # cancels and aborts nobody waits for

    @property
    def epoch(self) -> int:
        return self.front.epoch

    async def reserve(self, job: Job, prefill: PrefillSide | None) -> KVDestination | None:
        if prefill is None:
            return None  # started by outputs()
        epoch = prefill.epoch
        return await self.engine.call(lambda _: self.worker.reserve(job, epoch))  # None: no room

    async def hand_over(self, job: Job, dest: KVDestination, started: Started, trace: RequestTrace) -> None:
        """The prompt's pages into the decode engine's reserved ones; Redispatch if refused."""
        exported = started.ticket
        assert isinstance(exported, ExportedKV)
        limits = self.front.limits
        with trace.span("baton.transfer", req_id=job.req_id, transport="local", prefill_worker=PREFILL_NODE,
                        decode_worker=DECODE_NODE, pages=len(dest.dest_page_ids)) as transfer:  # fmt: skip
            start = time.perf_counter()
            page_bytes = exported.kv[0].numel() * exported.kv.element_size()
            chunks = build_chunks(dest, exported.kv, self.front.epoch, chunk_pages(page_bytes, None, limits))
            if self.front.prefill.engine.faults.take("transfer_corrupt"):  # drills only (engine.faults)
                chunks[0] = damaged(chunks[0])
            error = await self.engine.call(lambda _: self._receive(dest, chunks))
            seconds = time.perf_counter() - start
            transfer.set(bytes=sum(len(c.payload) for c in chunks), seconds=seconds)
            if error:
                transfer.fail(error)
                logger.info("%s: local transfer refused (%s); decode prefills it", job.req_id, error)
                raise Redispatch
        logger.debug("%s: %d pages moved in %.1f ms", job.req_id, len(dest.dest_page_ids), 1000 * seconds)

    def _receive(self, dest: KVDestination, chunks: list[WireChunk]) -> str | None:
        """On the decode thread: store the chunks; a refusal gives the reservation's pages back
        (one refused before it proved the token would otherwise wait out its TTL)."""
        error = receive_all(self.worker.receiver, chunks, self.front.limits)
        if error:
            self.worker.cancel(dest)
        return error

    def outputs(self, job: Job, handed: Handed | None) -> AsyncIterator[StepOutput]:
        if handed is None:
            return self.engine.generate(job)
        dest, started = handed
        exported = started.ticket
        assert isinstance(exported, ExportedKV)
        return self.engine.stream(job.req_id, lambda _: self.worker.start_prefilled(
            job, dest, exported.first_token, started.first.cached))  # fmt: skip

    def cancel(self, dest: KVDestination) -> None:
        self._fire(lambda: self.worker.cancel(dest))

    def abort(self, req_id: str) -> None:
        self._fire(lambda: self.worker.abort(req_id))  # its pages, reserved or running, go back

    def _fire(self, fn: Callable[[], None]) -> None:
        if not self.engine.is_alive:
            return
        task = asyncio.ensure_future(self.engine.call(lambda _: fn()))
        self._calls.add(task)
        task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the engine stopped meanwhile
            logger.debug("decode call failed: %r", task.exception())
