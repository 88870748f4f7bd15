"""The decode role: reserve pages, receive them, decode in the continuous batch.

    reserve(job)        allocate pages for the prompt; a KVDestination with a one-time token
    (transport)         chunks land through `receiver` (token, epoch and checksum checked)
    start_prefilled()   every page arrived: the request joins the batch after its first token
    start_local(job)    or prefill here, when the uncached part of the prompt is short
                        (conditional disaggregation)
    step()              one engine step; expired reservations return their pages first
    abort(req_id)       the client went away: the request, or its reservation, lets go

A reservation ends in exactly one of: admitted (start_prefilled), cancelled (cancel / abort),
expired while open (its transfer deadline passed), or expired once complete but never admitted
(its admission lease, from the moment the last page arrived, passed). Every ending but
admission returns the pages to the pool; `on_settle` hears of every completion and failure.
The leading pages that had arrived verified are offered to the prefix cache first
(Engine.keep_pages): a transfer damaged or cut part-way costs a re-run here only the pages from
the first one that did not arrive (`num_kept_pages` counts them).

A plain class: cluster/ wraps it in a Ray actor; tests drive it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from engine.engine import Engine
from engine.job import Job
from engine.outputs import StepOutput
from engine.request import NOT_CACHED, CachedTokens, SloClass
from kvcache.hashing import page_hashes
from kvtransfer.codec import TransferError
from kvtransfer.jobs import AbortedIds
from kvtransfer.transport import KVDestination, PoolReceiver, Reservation, ReservationBook


class _Receiver:
    """The pool's KVReceiver, noting when each transfer completes or fails."""

    def __init__(self, inner: PoolReceiver, worker: DecodeWorker) -> None:
        self.inner = inner
        self.worker = worker

    def accept(self, header: pb.PageChunkHeader) -> bool:
        return self.inner.accept(header)

    def refusal(self, header: pb.PageChunkHeader) -> str:
        return self.inner.refusal(header)

    def store(self, header: pb.PageChunkHeader, pages: torch.Tensor) -> int:
        done = self.inner.store(header, pages)
        if self.inner.is_complete(header.transfer_id):
            self.worker.completed_at[header.transfer_id] = self.worker.clock()
            self.worker.on_settle()
        return done

    def is_complete(self, transfer_id: str) -> bool:
        return self.inner.is_complete(transfer_id)

    def abort(self, transfer_id: str) -> None:
        self.inner.abort(transfer_id)
        self.worker.on_settle()


class DecodeWorker:
    def __init__(
        self,
        engine: Engine,
        address: str = "decode-0",
        reservation_ttl_s: float = 10.0,
        local_prefill_tokens: int = 32,
        admit_lease_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_settle: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.address = address
        self.reservation_ttl_s = reservation_ttl_s
        self.local_prefill_tokens = local_prefill_tokens
        self.admit_lease_s = admit_lease_s  # how long a complete transfer waits for admission
        self.clock = clock
        self.on_settle = on_settle
        self.book = ReservationBook(engine.model_config.num_layers, on_release=self._release, clock=clock)
        self.receiver = _Receiver(PoolReceiver(engine.pool, self.book), self)
        self.completed_at: dict[str, float] = {}  # transfer_id -> when its last page arrived
        self._dests: dict[str, KVDestination] = {}  # req_id -> its reservation, until it ends
        self._jobs: dict[str, Job] = {}  # transfer_id -> the job its pages are for, until it ends
        self.num_kept_pages = 0  # verified pages of failed transfers offered to the prefix cache
        # a placement that arrives after its abort (Ray does not order an async actor's calls;
        # a constraint compiles between them) takes nothing; it comes within the reservation TTL
        self._aborted = AbortedIds(reservation_ttl_s, clock)
        self.num_lease_expired = 0
        self.num_reserved_pages = 0  # held by reservations (open or complete, not admitted)

    # -- placement ----------------------------------------------------------------------------

    def cached_tokens(self, job: Job) -> int:
        """Prompt tokens this worker's prefix cache holds (a read: nothing is pinned).
        Counts tenant-salted pages only; an operator-shared prefix is not credited here."""
        cache = self.engine.prefix_cache
        if cache is None:
            return 0
        ps = self.engine.cfg.page_size
        max_pages = (len(job.prompt_ids) - 1) // ps  # at least one token is always computed
        hashes = page_hashes(job.prompt_ids[: max_pages * ps], ps, job.cache_salt.encode(), self.engine.fingerprint)
        n = 0
        for page_hash in hashes:
            if page_hash not in cache:
                break
            n += 1
        return n * ps

    def prefers_local(self, job: Job) -> bool:
        """The uncached part of the prompt is short: cheaper to prefill here than to move.
        Never for a BATCH job while requests run here: its prefill would stall them for
        throughput work (cluster.placement.policy, Classes); a push costs it nothing it needs."""
        if job.slo == SloClass.BATCH and self.engine.scheduler.running:
            return False
        return len(job.prompt_ids) - self.cached_tokens(job) <= self.local_prefill_tokens

    # -- reservations -------------------------------------------------------------------------

    def was_aborted(self, req_id: str) -> bool:
        """Its caller gave it up (abort came first): place it nowhere, start nothing."""
        return req_id in self._aborted

    def reserve(self, job: Job, sender_epoch: int) -> KVDestination | None:
        if self.was_aborted(job.req_id):
            raise RuntimeError(f"{job.req_id} was aborted: nothing is reserved for it")
        if (old := self._dests.get(job.req_id)) is not None:
            self.cancel(old)  # a new placement of the request supersedes the one before
        pages = self.engine.reserve_pages(len(job.prompt_ids))
        if pages is None:
            return None
        dest = self.book.reserve(self.address, job.req_id, pages, sender_epoch, self.reservation_ttl_s)
        self._dests[job.req_id] = dest
        self._jobs[dest.transfer_id] = job
        self.num_reserved_pages += len(pages)
        return dest

    def is_settled(self, dest: KVDestination) -> bool:
        """The transfer ended: complete (admissible) or released (failed, expired, cancelled)."""
        return self.book.get(dest.transfer_id) is None

    def is_complete(self, dest: KVDestination) -> bool:
        return dest.transfer_id in self.book.completed

    def cancel(self, dest: KVDestination, aborted: bool = False) -> None:
        """The transfer failed or the request went elsewhere (or, `aborted`, its caller left:
        a chunk still on its way is told so): the pages go back."""
        if not self.book.release(dest.transfer_id, aborted):
            done = self.book.completed.pop(dest.transfer_id, None)
            if done is not None:
                self._release(done)

    def start_prefilled(
        self, job: Job, dest: KVDestination, first_token: int, cached: CachedTokens = NOT_CACHED
    ) -> None:
        done = self.book.completed.pop(dest.transfer_id, None)
        if done is None:
            raise TransferError(f"transfer {dest.transfer_id} did not complete")
        self._forget(done)
        self.engine.add_prefilled(job, first_token, list(done.page_ids), cached)

    def start_local(self, job: Job) -> None:
        if self.was_aborted(job.req_id):
            raise RuntimeError(f"{job.req_id} was aborted: it is not started")
        self.engine.add(job)

    def abort(self, req_id: str) -> None:
        """Stop `req_id` wherever it is: running, still waiting on its pages, or not yet
        placed (its placement, arriving later, is refused: `was_aborted`)."""
        self._aborted.add(req_id)
        dest = self._dests.get(req_id)
        if dest is not None:
            self.cancel(dest, aborted=True)
        self.engine.abort(req_id)

    # -- the loop -----------------------------------------------------------------------------

    def expire(self) -> int:
        """Release open reservations past their deadline and complete ones past their
        admission lease; how many ended."""
        n = len(self.book.expire())
        now = self.clock()
        self._aborted.expire()
        stale = [t for t, at in self.completed_at.items() if at + self.admit_lease_s <= now]
        for transfer_id in stale:
            res = self.book.completed.pop(transfer_id, None)
            self.completed_at.pop(transfer_id, None)
            if res is not None:
                self.num_lease_expired += 1
                self._release(res)
        if n or stale:
            self.on_settle()
        return n + len(stale)

    def step(self) -> list[StepOutput]:
        self.expire()
        return self.engine.step()

    def _forget(self, res: Reservation) -> Job | None:
        self.num_reserved_pages -= len(res.page_ids)
        self.completed_at.pop(res.transfer_id, None)
        if (dest := self._dests.get(res.req_id)) is not None and dest.transfer_id == res.transfer_id:
            del self._dests[res.req_id]
        return self._jobs.pop(res.transfer_id, None)

    def _release(self, res: Reservation) -> None:
        job = self._forget(res)
        if job is not None and job.reuse_cache:  # what arrived verified stays reusable here
            self.num_kept_pages += self.engine.keep_pages(job, self._verified(res))
        self.engine.release_pages(list(res.page_ids))

    def _verified(self, res: Reservation) -> tuple[int, ...]:
        """The reservation's leading pages whose every layer arrived (checked and stored)."""
        full = (1 << self.book.num_layers) - 1
        n = next((i for i, page in enumerate(res.page_ids) if res.layers.get(page) != full), len(res.page_ids))
        return res.page_ids[:n]
