"""The prefill role: compute a prompt's KV, sample its first token, hand the pages over.

    submit(job, dest)  queue the prompt (prefix match and chunked prefill are the engine's)
    step()             run one engine step; every prompt that finished yields a PrefillDone:
                       its first token (for the edge, at once) and the page chunks for `dest`
    (caller)           pushes the chunks with its KVSender, then tells the decode worker the
                       first token; pages of shared prefixes stay in this worker's cache

A plain class: cluster/ wraps it in a Ray actor; tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.engine import Engine
from engine.outputs import StepOutput
from engine.request import FinishReason
from engine.sampling import SamplingParams
from kvtransfer.codec import WireChunk
from kvtransfer.transport import KVDestination, build_chunks


@dataclass(frozen=True, slots=True)
class PrefillJob:
    req_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class PrefillDone:
    req_id: str
    first_token: int
    text: str  # the first token's text, for the edge
    finish_reason: FinishReason | None  # set when the first token already ends the request
    dest: KVDestination
    chunks: tuple[WireChunk, ...]  # empty when the request is finished
    output: StepOutput  # the first token as the edge streams it (logprobs, cached tokens)


class PrefillWorker:
    def __init__(self, engine: Engine, epoch: int = 1, pages_per_chunk: int = 32) -> None:
        self.engine = engine
        self.epoch = epoch  # fencing token: decode refuses pages from a stale epoch
        self.pages_per_chunk = pages_per_chunk
        self._jobs: dict[str, tuple[PrefillJob, KVDestination]] = {}

    def submit(self, job: PrefillJob, dest: KVDestination) -> None:
        self.start(self.engine, job)
        self._jobs[job.req_id] = (job, dest)

    @staticmethod
    def start(engine: Engine, job: PrefillJob) -> None:
        """Queue the prefill of `job` on `engine`: one token, sampled with the request's own
        parameters (the seed is keyed on the position, so decode continues the same stream)."""
        first = replace(job.sampling, max_tokens=1, min_tokens=min(job.sampling.min_tokens, 1))
        engine.add_request(job.req_id, job.prompt_ids, first, job.priority, job.cache_salt, export_kv=True)

    def abort(self, req_id: str) -> None:
        self._jobs.pop(req_id, None)
        self.engine.abort(req_id)
        self.engine.take_exported(req_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[PrefillDone]:
        done = []
        for out in self.engine.step():
            if out.finish_reason is None:
                continue
            job, dest = self._jobs.pop(out.req_id)
            exported = self.engine.take_exported(out.req_id)
            assert exported is not None
            finished = out.finish_reason if self.ends_here(job, out.finish_reason) else None
            chunks: tuple[WireChunk, ...] = ()
            if finished is None:
                # a page-major block: each chunk is a slice of it, sent without a copy
                chunks = tuple(build_chunks(dest, exported.kv, self.epoch, self.pages_per_chunk))
            first = replace(out, finish_reason=finished)  # LENGTH of the 1-token prefill is not the request's
            done.append(PrefillDone(out.req_id, exported.first_token, out.text, finished, dest, chunks, first))
        return done

    @staticmethod
    def ends_here(job: PrefillJob, reason: FinishReason) -> bool:
        # LENGTH is only real when the client asked for one token; STOP (EOS, a stop id or
        # a stop string on the first token) always ends the request.
        return reason != FinishReason.LENGTH or job.sampling.max_tokens == 1
