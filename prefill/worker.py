"""The prefill role: compute a prompt's KV, sample its first token, hand the pages over.

    submit(job, dest)  queue the prompt (prefix match and chunked prefill are the engine's);
                       `on_device`: its chunks stay on the pool's device (the nccl transport),
                       else they are encoded for the wire (grpc, shm)
    step()             run one engine step; every prompt that finished yields a PrefillDone:
                       its first token (for the edge, at once) and the page chunks for `dest`
    take_ready()       (optional, after a step) the whole pages computed since the last call
                       of prompts still computing, as chunks: a caller that streams them while
                       the rest computes gets only the remaining pages with the PrefillDone
    (caller)           pushes the chunks with its KVSender, then tells the decode worker the
                       first token; pages of shared prefixes stay in this worker's cache
    retained           with a Retention: each finished prompt's pages are held (a retained
                       copy, kvcache.retained) until `hold_s`, or `lease_s` after the caller
                       says its push ended (pushed), so a decode worker lost after the
                       hand-over leaves the context here

    prompt pages:  | 0 | 1 | 2 | 3 | 4 |5..|      a chunked prefill, 2 pages a step
    step 1:        |=======|                      take_ready -> pages 0-1
    step 2:                |=======|              take_ready -> pages 2-3
    step 3 (last):                 |=====|        PrefillDone -> pages 4-5, the last flagged

The last page always comes with the PrefillDone (the step that computes the prompt's last
token is the one that finishes it), so the chunk flagged last is always the final one sent.
A plain class: cluster/ wraps it in a Ray actor; tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.engine import Engine
from engine.job import Job
from engine.outputs import StepOutput
from engine.request import FinishReason, Request
from kvcache.retained import RetainedCopies
from kvtransfer.codec import (
    ChunkMeta,
    CodecLimits,
    DeviceChunk,
    WireChunk,
    chunk_pages,
    encode_chunk,
)
from kvtransfer.nccl import device_chunks
from kvtransfer.transport import KVDestination

Chunk = WireChunk | DeviceChunk  # on the wire (grpc, shm) or on the device (nccl)


@dataclass(frozen=True, slots=True)
class PrefillDone:
    req_id: str
    first_token: int
    text: str  # the first token's text, for the edge
    finish_reason: FinishReason | None  # set when the first token already ends the request
    dest: KVDestination
    chunks: tuple[Chunk, ...]  # empty when the request is finished
    output: StepOutput  # the first token as the edge streams it (logprobs, cached tokens)


@dataclass(frozen=True, slots=True)
class PagesReady:
    """Whole pages of a prompt still computing, for its transfer (no chunk flagged last)."""

    req_id: str
    dest: KVDestination
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class Retention:
    """How long and how much a prefill worker keeps of the prompts it pushed (kvcache.retained)."""

    max_pages: int = 0  # 0: nothing is retained
    lease_s: float = 30.0  # past the push's end (acknowledged or failed)
    hold_s: float = 60.0  # at most, when no end is ever reported (the push's own bounds end it first)


class PrefillWorker:
    def __init__(
        self, engine: Engine, epoch: int = 1, pages_per_chunk: int | None = None, limits: CodecLimits | None = None,
        retention: Retention = Retention(),
    ) -> None:
        self.engine = engine
        # its prompts' pages stream out piece by piece while the next piece computes
        engine.scheduler.cfg = replace(engine.scheduler.cfg, stream_chunks=True)
        self.epoch = epoch  # fencing token: decode refuses pages from a stale epoch
        kv = engine.pool.kv  # [layers, 2, pages, ...]: one page is kv[:, :, i]
        self.pages_per_chunk = chunk_pages(kv[:, :, 0].numel() * kv.element_size(), pages_per_chunk, limits)
        self._jobs: dict[str, tuple[Job, KVDestination]] = {}
        self._num_taken: dict[str, int] = {}  # pages handed out by take_ready, per request
        self._on_device: set[str] = set()  # requests whose chunks stay on the device
        self.retention = retention
        self.retained = RetainedCopies(engine.prefix_cache, engine.pool.pages, retention.max_pages)

    def submit(self, job: Job, dest: KVDestination, on_device: bool = False) -> None:
        self.start(self.engine, job)
        self._jobs[job.req_id] = (job, dest)
        self._num_taken[job.req_id] = 0
        if on_device:
            self._on_device.add(job.req_id)

    @staticmethod
    def start(engine: Engine, job: Job) -> None:
        """Queue the prefill of `job` on `engine`: one token, sampled with the request's own
        parameters (the seed is keyed on the position, so decode continues the same stream)."""
        first = replace(job.sampling, max_tokens=1, min_tokens=min(job.sampling.min_tokens, 1))
        engine.add(replace(job, sampling=first), export_kv=True)

    def abort(self, req_id: str) -> None:
        self._jobs.pop(req_id, None)
        self._num_taken.pop(req_id, None)
        self._on_device.discard(req_id)
        self.retained.release(req_id, "released")  # its caller is gone: nobody resumes from it
        self.engine.abort(req_id)
        self.engine.take_exported(req_id)

    def pushed(self, req_id: str) -> None:
        """The request's push ended (acknowledged or not): its copy is kept one lease from now."""
        self.retained.lease(req_id, self.retention.lease_s)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[PrefillDone]:
        done = []
        for out in self.engine.step():
            if out.finish_reason is None:
                continue
            job, dest = self._jobs.pop(out.req_id)
            taken = self._num_taken.pop(out.req_id)
            on_device = out.req_id in self._on_device
            self._on_device.discard(out.req_id)
            exported = self.engine.take_exported(out.req_id)
            assert exported is not None and taken < len(exported.kv)
            if len(exported.kv) != len(dest.dest_page_ids):
                raise ValueError(f"{len(exported.kv)} pages for {len(dest.dest_page_ids)} reserved")
            finished = out.finish_reason if self.ends_here(job, out.finish_reason) else None
            chunks: tuple[Chunk, ...] = ()
            if finished is None:
                if self.retained.max_pages:  # the request goes on elsewhere: its context stays here too
                    self.retained.hold(out.req_id, exported.page_hashes, self.retention.hold_s)
                # a page-major block: each chunk is a slice of it
                chunks = self._chunks(dest, exported.kv[taken:], taken, on_device)
            first = replace(out, finish_reason=finished)  # LENGTH of the 1-token prefill is not the request's
            done.append(PrefillDone(out.req_id, exported.first_token, out.text, finished, dest, chunks, first))
        return done

    def take_ready(self) -> list[PagesReady]:
        """The whole pages computed since the last call (a cached prefix counts as computed),
        for every prompt still computing."""
        ready = []
        page_size = self.engine.cfg.page_size
        for req_id, (job, dest) in self._jobs.items():
            request = self.engine.scheduler.get(req_id)
            if request is None:
                continue
            taken = self._num_taken[req_id]
            # never the last page: it fills in the finishing step, and comes with PrefillDone
            full = min(request.num_computed_tokens, len(job.prompt_ids) - 1) // page_size
            if full > taken:
                kv = self._pages(request, taken, full)
                ready.append(PagesReady(req_id, dest, self._chunks(dest, kv, taken, req_id in self._on_device)))
                self._num_taken[req_id] = full
        return ready

    def _pages(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Pages start..end-1 of a running request, page-major and contiguous on the pool's
        device (as the engine's export lays them out): [n, layers, 2, page_size, kv_heads, head_dim]."""
        index = torch.tensor(request.page_ids[start:end], dtype=torch.int64, device=self.engine.device)
        return self.engine.pool.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()

    def _chunks(self, dest: KVDestination, kv: torch.Tensor, first_page: int, on_device: bool) -> tuple[Chunk, ...]:
        return page_chunks(dest, kv, first_page, self.epoch, self.pages_per_chunk, on_device)

    @staticmethod
    def ends_here(job: Job, reason: FinishReason) -> bool:
        # LENGTH is only real when the client asked for one token; STOP (EOS, a stop id or
        # a stop string on the first token) always ends the request.
        return reason != FinishReason.LENGTH or job.sampling.max_tokens == 1


def page_chunks(
    dest: KVDestination, kv: torch.Tensor, first_page: int, epoch: int, pages_per_chunk: int, on_device: bool
) -> tuple[Chunk, ...]:
    """`kv` (page-major: kv[i] is dest page first_page + i) in chunks of `pages_per_chunk`,
    sent under `epoch`: on the pool's device (the nccl transport) or encoded for the wire; the
    chunk holding the reservation's last page is flagged last."""
    if on_device:
        return tuple(device_chunks(dest, kv, epoch, first_page, pages_per_chunk))
    chunks: list[Chunk] = []
    for start in range(0, len(kv), pages_per_chunk):
        end = min(start + pages_per_chunk, len(kv))
        pages = dest.dest_page_ids[first_page + start : first_page + end]
        is_last = first_page + end == len(dest.dest_page_ids)
        meta = ChunkMeta(dest.req_id, dest.transfer_id, dest.token, epoch, pages, is_last=is_last)
        chunks.append(encode_chunk(meta, kv[start:end]))
    return tuple(chunks)
