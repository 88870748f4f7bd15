"""Disaggregated serving in one process (`baton up --prefill 1 --no-ray`): a prefill engine and
a decode engine, each on its own step thread, behind the surface the Frontend expects.

    generate(req)
      uncached part short ──────────────────────▶ decode engine prefills it itself
      otherwise:
        decode.call(reserve)         pages + a one-time transfer token   (decode thread)
        prefill.stream(start)        prefill, sample the first token      (prefill thread)
          └─ yield the first token at once (TTFT does not wait for the transfer)
        decode.call(receive_all)     verify and store every page          (decode thread)
        decode.stream(start_prefilled) the request joins the running batch; stream the rest

Spans (cluster.ops.tracing, under the edge's): baton.placement (local or disaggregated), baton.prefill
(prefill-0, or decode-0 when it prefills itself), baton.transfer (local), baton.decode.

Every engine-side step runs on that engine's own thread (AsyncEngine.call / stream), so the
reservation book and the page pools are only ever touched by one thread. The Ray deployment
replaces the two AsyncEngines with actors; the flow stays the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from cluster.ops.node_status import NodeStatus, engine_node
from cluster.ops.tracing import NO_SPAN, RequestTrace, first_token, trace_of
from decode.worker import DecodeWorker
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.job import Job
from engine.outputs import ExportedKV, StepOutput, StepStats
from engine.sampling import SamplingParams
from kvtransfer.codec import CodecLimits, TransferError, chunk_pages
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
        self.num_disaggregated = 0
        self.num_local = 0

    # -- the surface the Frontend uses --------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self.decode.engine  # tokenizer, context length, pool metrics: the decode side's

    @property
    def is_alive(self) -> bool:
        return self.prefill.is_alive and self.decode.is_alive

    @property
    def heartbeat(self) -> float:
        return min(self.prefill.heartbeat, self.decode.heartbeat)

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

    async def prepare(self, sampling: SamplingParams) -> None:
        """Compile the request's constraint on both sides (the prefill side samples the first
        token under it, the decode side goes on from there); ConstraintError if refused."""
        await self.decode.prepare(sampling)
        await self.prefill.prepare(sampling)

    # -- one request ----------------------------------------------------------------------------

    async def generate(self, job: Job) -> AsyncIterator[StepOutput]:
        trace = trace_of(job.req_id)
        with trace.span("baton.placement", req_id=job.req_id, decode_worker=DECODE_NODE) as placing:
            # On the decode thread: prefers_local reads the decode engine's prefix cache.
            dest = await self.decode.call(
                lambda _: None if self.worker.prefers_local(job) else self.worker.reserve(job, self.epoch)
            )
            placing.set(kind="local" if dest is None else "disaggregated",
                        prefill_worker=DECODE_NODE if dest is None else PREFILL_NODE)  # fmt: skip
        if dest is None:  # uncached part short, or no room to reserve: prefill on the decode side
            self.num_local += 1
            async for out in self._local(job, trace):
                yield out
            return
        self.num_disaggregated += 1
        async for out in self._disaggregated(job, dest, trace):
            yield out

    async def _local(self, job: Job, trace: RequestTrace) -> AsyncIterator[StepOutput]:
        stage = trace.span("baton.prefill", req_id=job.req_id, worker=DECODE_NODE, local=True)  # then decode
        num_tokens, finished = 0, False
        try:
            async for out in self.decode.generate(job):
                if out.num_output_tokens == len(out.token_ids):  # the first token
                    stage.end()
                    stage = first_token(trace, out.finished, req_id=job.req_id, worker=DECODE_NODE)
                num_tokens, finished = out.num_output_tokens, out.finished
                yield out
        except BaseException as exc:
            if not finished:
                stage.fail(exc)
            raise
        finally:
            if num_tokens:  # the stage is decode's
                stage.set(output_tokens=num_tokens)
            stage.end()

    async def _disaggregated(
        self, job: Job, dest: KVDestination, trace: RequestTrace
    ) -> AsyncIterator[StepOutput]:
        handed_over = False
        prefilling = trace.span("baton.prefill", req_id=job.req_id, worker=PREFILL_NODE, epoch=self.epoch,
                                local=False)  # fmt: skip
        decoding = NO_SPAN
        num_tokens, finished = 0, False
        try:
            first: StepOutput | None = None
            async for out in self.prefill.stream(job.req_id, lambda e: PrefillWorker.start(e, job)):
                first = out
            assert first is not None and first.finish_reason is not None
            exported = await self.prefill.call(lambda e: e.take_exported(job.req_id))
            assert exported is not None
            prefilling.end()
            if PrefillWorker.ends_here(job, first.finish_reason):
                yield first
                return
            decoding = first_token(trace, False, req_id=job.req_id, worker=DECODE_NODE)
            yield replace(first, finish_reason=None)  # the first token goes out now
            await self._transfer(job, dest, exported, trace)
            handed_over = True

            def start_decode(_: Engine) -> None:
                self.worker.start_prefilled(job, dest, exported.first_token, first.num_cached_tokens)

            async for out in self.decode.stream(job.req_id, start_decode):
                num_tokens, finished = out.num_output_tokens, out.finished
                yield out
        except BaseException as exc:
            if not finished:
                prefilling.fail(exc)
                decoding.fail(exc)
            raise
        finally:
            prefilling.end()
            decoding.set(output_tokens=num_tokens)
            decoding.end()
            if not handed_over:  # failed, cancelled or finished early: the reservation goes back
                await self.decode.call(lambda _: self.worker.cancel(dest))

    async def _transfer(self, job: Job, dest: KVDestination, exported: ExportedKV, trace: RequestTrace) -> None:
        """The prompt's pages into the decode engine's reserved ones; TransferError if refused."""
        with trace.span("baton.transfer", req_id=job.req_id, transport="local", prefill_worker=PREFILL_NODE,
                        decode_worker=DECODE_NODE, pages=len(dest.dest_page_ids)) as transfer:  # fmt: skip
            start = time.perf_counter()
            page_bytes = exported.kv[0].numel() * exported.kv.element_size()
            chunks = build_chunks(dest, exported.kv, self.epoch, chunk_pages(page_bytes, None, self.limits))
            error = await self.decode.call(lambda _: receive_all(self.worker.receiver, chunks, self.limits))
            seconds = time.perf_counter() - start
            transfer.set(bytes=sum(len(c.payload) for c in chunks), seconds=seconds)
            if error:
                transfer.fail(error)
                raise TransferError(error)
        logger.debug("%s: %d pages moved in %.1f ms", job.req_id, len(dest.dest_page_ids), 1000 * seconds)
