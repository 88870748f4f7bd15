"""Placement policies `baton sim` compares, all over the same real GlobalIndex:

    round-robin    prefill and decode workers in turn
    least-loaded   the prefill worker with the fewest prompt tokens outstanding, the decode
                   worker with the fewest requests outstanding (the router's own books)
    prefix-only    the prefill worker holding the longest prefix of the prompt, however loaded
                   (equal holders: a random one; no holder: round robin); decode least-loaded
    baton          cluster.placement.policy.Placer: one cost model over queues, hits, tiers and
                   transfers, conditional disaggregation, fairness; may answer SATURATED

Every decision reports, in the index's view, the hit of the prefill site it chose and the
longest hit any worker held (the baselines measure it with one index.match; the Placer
records it itself), so "locality given up" means the same for all.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

from bench.sim.workers import SimRequest
from cluster.placement.global_index import GlobalIndex, PrefixMatch
from cluster.placement.policy import PlacementConfig, PlacementKind, Placer, WorkerStats


class Decision(NamedTuple):
    kind: PlacementKind
    prefill_id: str | None  # None: local (on decode_id) or saturated
    decode_id: str | None
    chosen_hit_pages: int
    best_hit_pages: int
    retry_after_s: float = 0.0


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self, index: GlobalIndex, prefill_ids: Sequence[str], decode_ids: Sequence[str],
                 rng: random.Random, cfg: PlacementConfig, clock: Callable[[], float] = lambda: 0.0) -> None:
        if not prefill_ids or not decode_ids:
            raise ValueError("a fleet needs prefill and decode workers")
        self.index = index
        self.prefill_ids = list(prefill_ids)
        self.decode_ids = list(decode_ids)
        self.rng = rng
        self.cfg = cfg
        self.clock = clock  # simulated seconds
        self._all_mask = index.mask_of([*prefill_ids, *decode_ids])  # the slots never change in a run
        self._prefill_mask = index.mask_of(prefill_ids)
        self._turn = 0  # round robin's position
        self.prefill_books = _Books(self.prefill_ids)
        self.decode_books = _Books(self.decode_ids)
        self._sent: dict[str, tuple[str, str, int]] = {}  # req -> (prefill, decode, tokens)

    @abstractmethod
    def place(self, req: SimRequest) -> Decision: ...

    def prefill_done(self, req: SimRequest) -> None:
        """The prompt is computed (first token out): off the prefill worker's books."""
        sent = self._sent.get(req.req_id)
        if sent is not None:
            self.prefill_books.load[sent[0]] -= sent[2]

    def finished(self, req: SimRequest) -> None:
        """The request left its decode worker: off the books."""
        sent = self._sent.pop(req.req_id, None)
        if sent is not None:
            self.decode_books.load[sent[1]] -= 1

    def _book(self, req: SimRequest, hits: PrefixMatch, prefill_id: str) -> Decision:
        """Send to `prefill_id` and the least loaded decode worker, and keep the books."""
        decode_id = self.decode_books.least()
        self.prefill_books.load[prefill_id] += req.num_tokens
        self.decode_books.load[decode_id] += 1
        self._sent[req.req_id] = (prefill_id, decode_id, req.num_tokens)
        return self._decision(req, hits, prefill_id, decode_id)

    def _match(self, req: SimRequest) -> PrefixMatch:
        return self.index.match(req.hashes, max(0, (req.num_tokens - 1) // self.cfg.page_size))

    def _decision(self, req: SimRequest, hits: PrefixMatch, prefill_id: str, decode_id: str) -> Decision:
        best = next(hits.ranked(self._all_mask), (None, 0))[1]
        return Decision(PlacementKind.DISAGGREGATED, prefill_id, decode_id, hits.hit(prefill_id).num_pages, best)


class _Books:
    """A router's own view of load: what it sent and has not heard back about."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.load = dict.fromkeys(ids, 0)
        self._start = 0

    def least(self) -> str:
        """The least loaded; ties go to the first after a rotating start (no favourite)."""
        ids = list(self.load)
        self._start = (self._start + 1) % len(ids)
        order = ids[self._start :] + ids[: self._start]
        return min(order, key=self.load.__getitem__)


class RoundRobin(Policy):
    name: ClassVar[str] = "round-robin"

    def place(self, req: SimRequest) -> Decision:
        p = self.prefill_ids[self._turn % len(self.prefill_ids)]
        d = self.decode_ids[self._turn % len(self.decode_ids)]
        self._turn += 1
        return self._decision(req, self._match(req), p, d)


class LeastLoaded(Policy):
    name: ClassVar[str] = "least-loaded"

    def place(self, req: SimRequest) -> Decision:
        return self._book(req, self._match(req), self.prefill_books.least())


class PrefixOnly(Policy):
    name: ClassVar[str] = "prefix-only"

    def place(self, req: SimRequest) -> Decision:
        hits = self._match(req)
        holder = next(hits.ranked(self._prefill_mask, self.rng), None)
        if holder is None:
            prefill_id = self.prefill_ids[self._turn % len(self.prefill_ids)]
            self._turn += 1
        else:
            prefill_id = holder[0]
        return self._book(req, hits, prefill_id)


class Baton(Policy):
    name: ClassVar[str] = "baton"

    def __init__(self, index: GlobalIndex, prefill_ids: Sequence[str], decode_ids: Sequence[str],
                 rng: random.Random, cfg: PlacementConfig, clock: Callable[[], float] = lambda: 0.0) -> None:
        super().__init__(index, prefill_ids, decode_ids, rng, cfg, clock)
        self.placer = Placer(index, cfg, rng, clock=clock)  # the simulation's time, not the wall's

    def update(self, stats: Sequence[WorkerStats]) -> None:
        for s in stats:
            self.placer.update_worker(s)

    def place(self, req: SimRequest) -> Decision:
        got = self.placer.place(req.req_id, req.hashes, req.num_tokens, req.tenant)
        chosen = got.hit.num_pages + got.num_peer_pages
        return Decision(got.kind, got.prefill_id, got.decode_id, chosen, got.best_hit_pages, got.retry_after_s)

    def prefill_done(self, req: SimRequest) -> None:
        self.placer.release_prefill(req.req_id)

    def finished(self, req: SimRequest) -> None:
        self.placer.finish(req.req_id)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, PrefixOnly, Baton)}
