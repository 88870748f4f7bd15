"""A drained decode worker's last work: handing its requests' context to the survivors.

A decode worker that drains with hand-off (recovery.drain_hand_off) has its requests moved by
the gateway to the other decode workers (docs/architecture.md, KV-preserving failover). The
whole context of such a request -- its prompt and every token generated so far -- is in this
worker's pages, and its prefix cache has them: the engine commits each full page after a step,
and a request that ends here (aborted by its move) leaves its pages cached. So this worker
serves the moved request as a prefill worker would: a one-token prefill of prompt + emitted
tokens that reuses every cached page, computes only the partial last page, samples the next
token, and pushes all the pages into the survivor's reservation (prefill.pushes: the same
transports and checksums as any push). Nothing of the context is recomputed, however long the
request ran and whether or not the prefill worker still holds a copy of its prompt.

    expect(req_ids)               at the drain's start: the requests the gateway may move
    submit(job, dest, moved, ...) a moved request's prefill (`moved`: its id here, aborted)
    take(outputs)                 after a step: the hand-offs' outputs leave the stream (nobody
                                  reads them here); each finished one -> PrefillDone
    abort(req_id)                 the caller gave up (or a request here ended by its move)
    is_waiting()                  a hand-off runs or may still come: the drain waits for it

A request the drain expected stops being waited for when it finishes here, when its hand-off
arrives, or HAND_OFF_WAIT_S after its abort (a client that went away: no hand-off comes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from engine.engine import Engine
from engine.job import Job
from engine.outputs import StepOutput
from kvtransfer.transport import KVDestination
from prefill.worker import PrefillDone, PrefillWorker, page_chunks

HAND_OFF_WAIT_S = 5.0  # an aborted request's hand-off comes within this (the gateway places it first)


class HandOffs:
    def __init__(self, engine: Engine, pages_per_chunk: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.pages_per_chunk = pages_per_chunk
        self.clock = clock
        self._jobs: dict[str, tuple[Job, KVDestination, bool]] = {}  # hand-off req_id -> (job, dest, on_device)
        self._expected: dict[str, float] = {}  # req_id here -> until when its hand-off may come
        self.num_handed_off = 0  # hand-offs whose pages went out (first token sampled)

    def __len__(self) -> int:
        return len(self._jobs)

    def expect(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._expected[req_id] = math.inf

    def submit(self, job: Job, dest: KVDestination, moved: str, on_device: bool = False) -> None:
        """Prefill `job` (prompt + the tokens emitted) here for `dest`: its cached pages are
        reused, the rest computed; its chunks come out of `take` once its first token is sampled."""
        self._expected.pop(moved, None)
        PrefillWorker.start(self.engine, job)
        self._jobs[job.req_id] = (job, dest, on_device)

    def take(self, outputs: Iterable[StepOutput]) -> tuple[list[StepOutput], list[tuple[str, PrefillDone | Exception]]]:
        """The outputs that are not hand-offs', and each hand-off that finished, by request id:
        its PrefillDone, or why it cannot be pushed."""
        kept: list[StepOutput] = []
        done: list[tuple[str, PrefillDone | Exception]] = []
        for out in outputs:
            entry = self._jobs.get(out.req_id)
            if entry is None:
                if out.finish_reason is not None:
                    self._expected.pop(out.req_id, None)  # it ended here: nothing will move
                kept.append(out)
                continue
            if out.finish_reason is None:
                continue
            del self._jobs[out.req_id]
            job, dest, on_device = entry
            exported = self.engine.take_exported(out.req_id)
            if exported is None or len(exported.kv) != len(dest.dest_page_ids):
                pages = len(exported.kv) if exported is not None else 0
                why = f"hand-off {out.req_id} failed: {pages} pages for {len(dest.dest_page_ids)} reserved"
                done.append((out.req_id, RuntimeError(why)))
                continue
            finished = out.finish_reason if PrefillWorker.ends_here(job, out.finish_reason) else None
            chunks = () if finished else page_chunks(dest, exported.kv, 0, dest.epoch, self.pages_per_chunk, on_device)
            first = replace(out, finish_reason=finished)  # LENGTH of the 1-token prefill is not the request's
            done.append((out.req_id, PrefillDone(out.req_id, exported.first_token, out.text, finished, dest, chunks, first)))
            self.num_handed_off += not finished
        return kept, done

    def abort(self, req_id: str) -> None:
        if self._jobs.pop(req_id, None) is not None:
            self.engine.abort(req_id)
            self.engine.take_exported(req_id)
        if req_id in self._expected:  # moved (its hand-off follows) or given up (none will)
            self._expected[req_id] = min(self._expected[req_id], self.clock() + HAND_OFF_WAIT_S)

    def is_waiting(self) -> bool:
        now = self.clock()
        for req_id in [r for r, until in self._expected.items() if until <= now]:
            del self._expected[req_id]
        return bool(self._jobs or self._expected)
