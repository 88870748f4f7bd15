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

Every engine-side step runs on that engine's own thread (AsyncEngine.call / stream), so the
reservation book and the page pools are only ever touched by one thread. The Ray deployment
replaces the two AsyncEngines with actors; the flow stays the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from decode.worker import DecodeWorker
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.outputs import StepOutput, StepStats
from engine.sampling import SamplingParams
from kvtransfer.codec import CodecLimits, TransferError
from kvtransfer.local import receive_all
from kvtransfer.transport import KVDestination, build_chunks
from prefill.worker import PrefillJob, PrefillWorker

logger = logging.getLogger(__name__)


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

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()

    async def stop(self) -> None:
        await self.prefill.stop()
        await self.decode.stop()

    # -- one request ----------------------------------------------------------------------------

    async def generate(
        self,
        req_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
    ) -> AsyncIterator[StepOutput]:
        job = PrefillJob(req_id, tuple(prompt_ids), sampling, priority, cache_salt)
        # On the decode thread: prefers_local reads the decode engine's prefix cache.
        dest = await self.decode.call(
            lambda _: None if self.worker.prefers_local(job) else self.worker.reserve(job, self.epoch)
        )
        if dest is None:  # uncached part short, or no room to reserve: prefill on the decode side
            self.num_local += 1
            async for out in self.decode.generate(req_id, prompt_ids, sampling, priority, cache_salt):
                yield out
            return
        self.num_disaggregated += 1
        async for out in self._disaggregated(job, dest):
            yield out

    async def _disaggregated(self, job: PrefillJob, dest: KVDestination) -> AsyncIterator[StepOutput]:
        handed_over = False
        try:
            first: StepOutput | None = None
            async for out in self.prefill.stream(job.req_id, lambda e: PrefillWorker.start(e, job)):
                first = out
            assert first is not None and first.finish_reason is not None
            exported = await self.prefill.call(lambda e: e.take_exported(job.req_id))
            assert exported is not None
            if PrefillWorker.ends_here(job, first.finish_reason):
                yield first
                return
            yield replace(first, finish_reason=None)  # the first token goes out now
            start = time.perf_counter()
            chunks = build_chunks(dest, exported.kv, self.epoch)
            error = await self.decode.call(lambda _: receive_all(self.worker.receiver, chunks, self.limits))
            if error:
                raise TransferError(error)
            logger.debug("%s: %d pages moved in %.1f ms", job.req_id, len(dest.dest_page_ids),
                         1000 * (time.perf_counter() - start))
            handed_over = True

            def start_decode(_: Engine) -> None:
                self.worker.start_prefilled(job, dest, exported.first_token, first.num_cached_tokens)

            async for out in self.decode.stream(job.req_id, start_decode):
                yield out
        finally:
            if not handed_over:  # failed, cancelled or finished early: the reservation goes back
                await self.decode.call(lambda _: self.worker.cancel(dest))
