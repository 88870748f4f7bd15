"""One disaggregated request's flow, the same for the in-process P/D (cluster.fleet.pd) and the
Ray fleet (cluster.fleet.front), written against two worker sides (docs/architecture.md, One
request):

    for each path -- the placement's prefill workers in order, then decode-local (None):
        dest = decode.reserve(job, prefill)       pages + a one-time token; None: decode prefills
                                                  the request itself (and has started it)
        started = prefill.prefill(job, dest)      the first token; the pages are on their way
        yield started.first                       once: a re-run's first token is the one sent
        decode.hand_over(job, dest, started)      the request joins decode's batch once every
                                                  page arrived (tally.computed: where its
                                                  context came from)
      a side that fails raises Redispatch and the request goes down the next path (a failed
      prefill's reservation is cancelled here; a failed hand-over has given its pages back),
      or once down the same path again when the pages were damaged in flight (Redispatch.again)
    decode.outputs(job, handed)                   the rest of the stream
    not finished (cancelled, failed): aborted on the decode side and on a prefill side it was on

A re-run's first token equals the one already sent because the request is greedy or seeded
(`replayable` seeds an unseeded sampled request before its first path).

Spans (cluster.ops.tracing, under the edge's): baton.prefill per path tried (the worker, its
epoch, whether decode prefilled it itself), baton.decode from the first token on; the sides
write baton.transfer. Counts go to the front's `Tally`.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import NamedTuple, Protocol

from cluster.ops.tracing import NO_SPAN, RequestTrace, Span, first_token
from engine.job import Job
from engine.outputs import StepOutput
from engine.request import CachedTokens
from kvtransfer.transport import KVDestination


class Redispatch(Exception):
    """This path failed; the request goes down the next one -- or, `again`, down the same one
    once more first (its pages were damaged in flight: the copy they came from is still good)."""

    def __init__(self, again: bool = False) -> None:
        super().__init__()
        self.again = again


class Started(NamedTuple):
    """A prefill side's answer: the first token (finished: it ends the request, nothing moves)
    and the side's own handle on the pages it is moving (decode.hand_over reads it)."""

    first: StepOutput
    ticket: object


class Handed(NamedTuple):
    dest: KVDestination
    started: Started


class PrefillSide(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    async def prefill(self, job: Job, dest: KVDestination, span: Span) -> Started:
        """The first token, the push to `dest` under way; Redispatch if it failed."""
        ...

    def abort(self, req_id: str) -> None: ...


class DecodeSide(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    async def reserve(self, job: Job, prefill: PrefillSide | None) -> KVDestination | None:
        """Pages for `prefill` to fill; None when decode prefills the request itself."""
        ...

    async def hand_over(self, job: Job, dest: KVDestination, started: Started, trace: RequestTrace) -> None:
        """Wait for the pages; the request joins the batch, or Redispatch (pages back)."""
        ...

    def outputs(self, job: Job, handed: Handed | None) -> AsyncIterator[StepOutput]:
        """The request's outputs here: prefilled here (None), or from its handed-over pages."""
        ...

    def cancel(self, dest: KVDestination) -> None:
        """The reservation's pages go back (nothing will be moved into them)."""
        ...

    def abort(self, req_id: str) -> None: ...


class Tally(Protocol):
    def placed(self, job: Job, route: str) -> None:
        """A path was taken: "local" (decode prefills) or "disaggregated" (a prefill worker did)."""
        ...

    def redispatched(self, job: Job, to: str) -> None:
        """A path failed; the next is "prefill" (another worker), "local" or "same" (the same
        worker once more: its pages were damaged in flight)."""
        ...

    def computed(self, job: Job, cached: CachedTokens, decode: str, prefill: str | None) -> None:
        """The request's context is on `decode`, computed there (`prefill` None) or by
        `prefill` and handed over; `cached` of it was reused from that worker's cache."""
        ...


def replayable(job: Job) -> Job:
    """`job`, seeded when it samples without a seed: a re-run (another path, a migration) then
    draws the same stream, so the tokens already sent stay true."""
    if job.sampling.seed is not None or job.sampling.is_greedy:
        return job
    return replace(job, sampling=replace(job.sampling, seed=secrets.randbits(62)))


async def dispatch(
    job: Job, decode: DecodeSide, paths: Sequence[PrefillSide | None], trace: RequestTrace, tally: Tally
) -> AsyncIterator[StepOutput]:
    """The request's outputs down the first of `paths` that works (the last is None: decode-local)."""
    if not paths or paths[-1] is not None:  # a failed path always has a next one
        raise ValueError("paths must end with None (decode-local)")
    req_id = job.req_id
    prefill: PrefillSide | None = None
    handed: Handed | None = None
    sent_first = finished = False
    prefilling = decoding = NO_SPAN  # the path's prefill; decode from the first token on
    num_tokens = 0
    step, again = 0, False
    try:
        while True:  # each path ends in a break, a return or a Redispatch (the last, decode-local, breaks)
            prefill = paths[step]
            prefilling = trace.span("baton.prefill", req_id=req_id)
            try:
                dest = await decode.reserve(job, prefill)
                if dest is None:  # decode prefills it itself: `prefilling` ends with its first token
                    prefilling.set(worker=decode.name, epoch=decode.epoch, local=True)
                    tally.placed(job, "local")
                    break
                assert prefill is not None
                prefilling.set(worker=prefill.name, epoch=prefill.epoch, local=False)
                try:
                    started = await prefill.prefill(job, dest, prefilling)
                except Redispatch:
                    decode.cancel(dest)  # the pages go back at once
                    raise
                prefilling.end()
                tally.placed(job, "disaggregated")
                if started.first.finished:  # the first token ends it: nothing moves
                    decode.cancel(dest)
                    finished = True
                    if not sent_first:
                        decoding = first_token(trace, True, req_id=req_id, worker=decode.name)
                    yield started.first if not sent_first else _finish_only(started.first)
                    return
                if not sent_first:  # the first token goes to the edge before the pages move
                    sent_first = True
                    decoding = first_token(trace, False, req_id=req_id, worker=decode.name)
                    yield started.first
                await decode.hand_over(job, dest, started, trace)
                handed = Handed(dest, started)
                tally.computed(job, started.first.cached, decode.name, prefill.name)
                break
            except Redispatch as failed:  # to the next path: another prefill worker, or decode-local
                prefilling.end()
                if failed.again and not again:  # once a path: the same worker sends its copy again
                    again = True
                    tally.redispatched(job, "same")
                    continue
                step, again = step + 1, False
                tally.redispatched(job, "local" if paths[step] is None else "prefill")
        prefill = None  # done with: a cancel from here on concerns decode only
        skip_first = handed is None and sent_first  # a local re-run's first token was already sent
        async for out in decode.outputs(job, handed):
            if out.num_output_tokens == len(out.token_ids):  # the first token
                prefilling.end()
                if handed is None:
                    tally.computed(job, out.cached, decode.name, None)
                if not sent_first:
                    sent_first = True
                    decoding = first_token(trace, out.finished, req_id=req_id, worker=decode.name)
                if skip_first:
                    skip_first = False
                    if not out.finished:
                        continue
                    out = _finish_only(out)
            finished = out.finished
            num_tokens = out.num_output_tokens
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
        if not finished:  # cancelled or failed: every side it touched lets go
            decode.abort(req_id)
            if prefill is not None:
                prefill.abort(req_id)


def _finish_only(out: StepOutput) -> StepOutput:
    """A re-run's first output whose token the client already has: only the finish is news."""
    return replace(out, token_ids=(), text="", logprobs=())
