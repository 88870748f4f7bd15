"""Placement: which prefill worker computes a prompt, and which decode worker runs it (docs/architecture.md,
One request, step 2), by one cost model over measured numbers. Pure: no Ray, no I/O, so the
gateway and the simulator (`baton sim`) run the same code.

    place(req_id, hashes, num_tokens, tenant, session, slo)
      hits        index.match(hashes): per worker, the prompt's leading pages it holds, by tier
                  (the session's decode worker credited with the pages it took there: Sessions)
      candidates  per role: k sampled healthy workers + the m holding the longest prefix
                  (power-of-k choices: a decision costs O(k + m) candidates and O(m) holders,
                  whatever the fleet's size or how many workers hold the prefix; among
                  equally long holders the m start at a random one, so none is a hot spot)
      cost(W)     queue(W) + recomputed tokens x W's s/token + host, disk bytes / W's bandwidth
                  (+ pages fetched from a peer holding more / peer bandwidth, when cheaper)
      remote(D)   min over prefill candidates P of cost(P) + the prompt's pages / the P -> D
                  link's measured bandwidth (cluster.placement.links; transfer_bytes_per_s until measured)
      local(D)    cost(D) + the stall it imposes: its compute time x D's running requests (as
                  reported, or booked here since, whichever is more)
      total(D)    decode(D) + local(D) if the uncached part is short, or no prefill worker is
                  healthy, or local is cheaper than every remote one (a BATCH request on a D
                  with running requests: only when no prefill worker can take it: Classes);
                  else remote; the least total wins; SATURATED when no decode worker has
                  room, or when every healthy prefill worker is queued past the bound and the
                  uncached part is long; on a tie, the decode worker on the prefill worker's
                  host, then the freer one
    release_prefill(req_id), finish(req_id)   the in-flight book (queue, fairness)

Costs are seconds of latency the choice adds, summed over the requests it affects: this
request's wait, compute and page moves, and for a local prefill the stall of every request
in the decode worker's running batch (why disaggregation exists). decode(D) is the expected
output tokens x D's measured inter-token latency, inflated by its batch's fill.

Anti-hot-spot, explicitly: a worker's queue delay is the largest of what it reported, the
prefill tokens this placer has sent it since (a burst of one prefix does not herd onto the
hot worker between stats reports), and how long its oldest booked prefill has waited for its
first token (a stuck or slower-than-measured worker shows it at once, whatever its last
report said), so a cache-hot worker whose queue outweighs the
recomputation it saves loses to a cold idle one; a worker queued past max_queue_delay_s is
not a candidate; the k random candidates keep a cold worker in every decision.

Fairness: cache affinity on a worker is shared. A tenant's hit on worker W is credited only
while its in-flight prefills there stay under max(fairness_min_inflight, tenant_share x W's
in-flight prefills), or while no other tenant has one there. Past that, W is costed for the
tenant as if cold, so its next request goes where load is lowest (its prefix gets copied
there) and W's queue stays open to the tenants whose prefixes it also holds.

Locality given up: every decision records the hit it chose and the best hit any healthy
worker held (the `locality given up` metric is their difference).

Classes (engine.request.SloClass): a BATCH request is never prefilled by a decode worker that
has running requests while a prefill worker can take it, however short its uncached part or
cheap its local cost: its prompt would stall the running batch's tokens for throughput work
that can wait for a push instead. LATENCY and STANDARD requests are placed by the cost model
alone (the engines order and preempt by class: engine.scheduler).

Sessions: a request may name its conversation (`session`). The placer remembers, per session
(LRU, at most max_sessions), the decode worker it last went to and the prompt pages it took
there, and credits that worker with them (device tier) wherever they still lead the new
prompt, even before the index hears of them from the worker's KV events. The session's worker
is then a candidate whose local prefill is costed warm, and it is kept while its total is
within the session slack of the cheapest (max(session_slack x cheapest, session_slack_s)):
what the model does not count of a move (the pages pushed again, the conversation's cache
split over two workers). A worker queued, full or gone loses the session, whose record then
follows it to where it went.
"""

from __future__ import annotations

import enum
import itertools
import random
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from cluster.placement.global_index import NO_HIT, GlobalIndex, PrefixHit, PrefixMatch
from cluster.placement.links import Links
from engine.request import SloClass

_K = TypeVar("_K")



class Role(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class PlacementKind(enum.IntEnum):
    DISAGGREGATED = 0  # prefill on `prefill_id`, pages pushed to `decode_id`
    LOCAL = 1  # `decode_id` prefills it itself
    SATURATED = 2  # no room: 429 / RESOURCE_EXHAUSTED with retry_after_s


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What the gateway knows of one worker, filled from its stats reports."""

    worker_id: str
    role: Role
    prefill_s_per_token: float  # measured (a decode worker's too: it prefills short prompts)
    queue_delay_s: float = 0.0  # measured: how long a new prefill waits there now
    host_bytes_per_s: float = 8e9  # host tier -> device
    disk_bytes_per_s: float = 1e9  # disk tier -> device
    is_healthy: bool = True
    itl_s: float = 0.0  # decode: measured time per step at its present batch
    num_running: int = 0  # decode: requests in its batch
    num_waiting: int = 0  # decode: admitted, not yet in the batch
    max_running: int = 64  # decode: its batch limit
    num_free_pages: int = 0  # decode: free (or only cached) pages, reservations deducted


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    page_size: int = 16
    page_bytes: int = 1 << 20  # one page of KV, all layers, K and V
    transfer_bytes_per_s: float = 1e9  # prefill -> decode push
    peer_bytes_per_s: float = 0.0  # fetching pages from a peer that holds more; 0: off
    num_sampled: int = 2  # k: random candidates per role
    num_prefix_candidates: int = 2  # m: longest-prefix holders added per role
    local_prefill_tokens: int = 32  # an uncached part this short is prefilled by decode
    stall_weight: float = 1.0  # cost of a second of stall, per running decode request
    expected_output_tokens: int = 128  # the decode-side horizon
    max_queue_delay_s: float = 10.0  # a worker waiting longer is no candidate
    tenant_share: float = 0.5  # fairness: a tenant's share of a worker's in-flight prefills
    fairness_min_inflight: int = 2  # ... below which affinity is never withheld
    retry_after_s: float = 1.0  # told to clients when saturated
    max_sessions: int = 1 << 16  # sessions remembered (least recently placed forgotten first)
    session_slack: float = 0.5  # a session's worker is kept while it costs at most this much more ...
    session_slack_s: float = 0.05  # ... (relative, or these seconds, whichever is more) than the cheapest

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_bytes < 0 or self.num_sampled < 1 or self.num_prefix_candidates < 0:
            raise ValueError("page_size, num_sampled >= 1; page_bytes, num_prefix_candidates >= 0")
        if not self.transfer_bytes_per_s > 0 or self.peer_bytes_per_s < 0 or not 0 < self.tenant_share <= 1:
            raise ValueError("transfer_bytes_per_s > 0, peer_bytes_per_s >= 0, 0 < tenant_share <= 1")


@dataclass(frozen=True, slots=True)
class Placement:
    kind: PlacementKind
    decode_id: str | None
    prefill_id: str | None  # None: local or saturated
    hit: PrefixHit  # the chosen prefill site's cached pages of the prompt, by tier
    peer_id: str | None  # pages [hit, hit + num_peer_pages) are fetched from it
    num_peer_pages: int
    num_recompute_tokens: int
    best_hit_pages: int  # the longest prefix any healthy worker held
    best_hit_worker: str | None
    cost_s: float
    num_examined: int  # candidates costed (O(k + m), never the fleet)
    fallbacks: tuple[str, ...] = ()  # other prefill candidates, cheapest first (re-dispatch)
    retry_after_s: float = 0.0

    @property
    def locality_given_up(self) -> int:
        """Cached pages of the best holder this decision did not reuse."""
        return max(0, self.best_hit_pages - self.hit.num_pages - self.num_peer_pages)


@dataclass(slots=True)
class PlacerStats:
    num_placed: int = 0
    num_local: int = 0
    num_saturated: int = 0
    hit_pages: int = 0  # reused by the chosen site (own tiers and peer fetches)
    best_hit_pages: int = 0
    given_up_pages: int = 0  # locality given up, summed
    num_affinity_withheld: int = 0  # candidates costed cold by the fairness rule
    num_session_kept: int = 0  # requests of a known session placed on its worker
    num_session_moved: int = 0  # ... placed elsewhere (the cost model moved it)


class _Option(NamedTuple):
    cost_s: float
    worker_id: str
    hit: PrefixHit  # what it holds (used whether or not fairness credits it)
    peer_id: str | None
    num_peer_pages: int
    num_recompute_tokens: int  # what it will compute (its own hit is used, credited or not)
    compute_s: float  # as costed


class _Best(NamedTuple):
    total_s: float
    decode: WorkerStats
    path: _Option
    is_local: bool


@dataclass(slots=True)
class _Booking:
    tenant: str
    prefill_id: str  # who computes it: the decode worker itself when local
    decode_id: str
    num_tokens: int  # tokens it computes: the queue it adds there
    is_prefilling: bool = True


@dataclass(slots=True)
class _Session:
    decode_id: str  # where its last request went
    num_pages: int  # that request's full prompt pages, now held there
    last_hash: bytes  # the hash of the last of them (chained: it stands for all of them)


class _SessionHits:
    """The index's answer, with what the placer itself knows of a session: its decode worker
    holds the pages the session's last request took there (the index may not know yet)."""

    def __init__(self, hits: PrefixMatch, worker_id: str, held: PrefixHit) -> None:
        self._hits = hits
        self.worker_id = worker_id
        self.held = held

    def hit(self, worker_id: str) -> PrefixHit:
        found = self._hits.hit(worker_id)
        return self.held if worker_id == self.worker_id and self.held.num_pages > found.num_pages else found


class _Pool:
    """Healthy workers of one role: O(1) add, remove and k-sampling."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._pos: dict[str, int] = {}
        self.version = 0  # changes with membership

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._pos

    def add(self, worker_id: str) -> None:
        if worker_id not in self._pos:
            self._pos[worker_id] = len(self.ids)
            self.ids.append(worker_id)
            self.version += 1

    def discard(self, worker_id: str) -> None:
        pos = self._pos.pop(worker_id, None)
        if pos is None:
            return
        self.version += 1
        last = self.ids.pop()
        if last != worker_id:  # the last one fills the hole
            self.ids[pos] = last
            self._pos[last] = pos

    def sample(self, k: int, rng: random.Random) -> list[str]:
        return self.ids[:] if len(self.ids) <= k else rng.sample(self.ids, k)


class Placer:
    def __init__(
        self, index: GlobalIndex, cfg: PlacementConfig, rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.clock = clock
        self.links = Links(cfg.transfer_bytes_per_s, clock)  # per (prefill, decode): measured push bandwidth
        self.stats = PlacerStats()
        self._workers: dict[str, WorkerStats] = {}
        self._pools = {Role.PREFILL: _Pool(), Role.DECODE: _Pool()}
        self._bookings: dict[str, _Booking] = {}
        self._queued_tokens: defaultdict[str, int] = defaultdict(int)  # worker -> booked prefill tokens
        # worker -> its booked prefills, oldest first, with when they were booked: work that has
        # waited longer than the model says shows a worker slower than its reports (stuck)
        self._waiting: defaultdict[str, OrderedDict[str, float]] = defaultdict(OrderedDict)
        self._prefills: defaultdict[str, int] = defaultdict(int)  # worker -> booked prefills
        self._tenant_prefills: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._decodes: defaultdict[str, int] = defaultdict(int)  # worker -> booked requests
        self._masks: dict[Role, int] = {}
        self._masks_version: tuple[int, int, int] | None = None
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    # -- the fleet ----------------------------------------------------------------------------

    def update_worker(self, stats: WorkerStats) -> None:
        old = self._workers.get(stats.worker_id)
        if old is not None and old.role != stats.role:
            self._pools[old.role].discard(stats.worker_id)
        self._workers[stats.worker_id] = stats
        if stats.is_healthy:
            self._pools[stats.role].add(stats.worker_id)
        else:
            self._pools[stats.role].discard(stats.worker_id)

    def remove_worker(self, worker_id: str) -> None:
        stats = self._workers.pop(worker_id, None)
        if stats is not None:
            self._pools[stats.role].discard(worker_id)

    def is_healthy(self, worker_id: str) -> bool:
        stats = self._workers.get(worker_id)
        return stats is not None and worker_id in self._pools[stats.role]

    # -- one decision -------------------------------------------------------------------------

    def place(
        self, req_id: str, hashes: Sequence[bytes], num_tokens: int, tenant: str = "", session: str = "",
        slo: SloClass = SloClass.STANDARD,
    ) -> Placement:
        """Where `req_id` (its prompt's full-page hashes, its length in tokens, its session if
        it names one, its service class) goes. At least one token is always computed, so at
        most (num_tokens - 1) // page_size pages are hits."""
        cfg = self.cfg
        max_pages = max(0, (num_tokens - 1) // cfg.page_size)
        index_hits = self.index.match(hashes, max_pages)
        best_id, best_pages, holders = self._holders(index_hits)
        hits: PrefixMatch | _SessionHits = index_hits
        kept = self._session_hits(session, hashes, max_pages, index_hits)
        if kept is not None:
            hits = kept
            holders[Role.DECODE] = [kept.worker_id, *(w for w in holders[Role.DECODE] if w != kept.worker_id)]
            if kept.held.num_pages > best_pages:
                best_id, best_pages = kept.worker_id, kept.held.num_pages
        prefills = self._candidates(Role.PREFILL, holders[Role.PREFILL])
        decodes = self._candidates(Role.DECODE, holders[Role.DECODE])
        remote = sorted(
            (o for w in prefills if (o := self._option(w, hits, num_tokens, tenant, best_id, best_pages)) is not None),
            key=lambda o: o.cost_s,  # stable: ties go to the earlier candidate, in random order
        )
        num_pages = -(-num_tokens // cfg.page_size)
        best: _Best | None = None
        best_key: tuple[float, bool, int] | None = None
        home: _Best | None = None  # the session's decode worker, as costed
        for d in decodes:
            if d.num_free_pages < num_pages or d.num_waiting > d.max_running:
                continue  # no room: reserving would fail or queue behind a whole batch
            path, is_local = self._path(d, remote, bool(prefills), num_pages * cfg.page_bytes, hits, num_tokens,
                                        tenant, best_id, best_pages, slo)  # fmt: skip
            if path is None:
                continue
            total = self._decode_cost(d) + path.cost_s
            far = not is_local and not self.links.is_same_host(path.worker_id, d.worker_id)
            key = (total, far, -d.num_free_pages)
            if best_key is None or key < best_key:
                best, best_key = _Best(total, d, path, is_local), key
            if kept is not None and d.worker_id == kept.worker_id:
                home = _Best(total, d, path, is_local)
        if best is not None and home is not None and home.total_s <= best.total_s + self._session_slack(best.total_s):
            best = home  # the session stays unless moving saves more than the slack
        num_examined = len(prefills) + len(decodes)
        if best is None:
            self.stats.num_saturated += 1
            return Placement(PlacementKind.SATURATED, None, None, NO_HIT, None, 0, num_tokens, best_pages, best_id,
                             float("inf"), num_examined, retry_after_s=cfg.retry_after_s)
        if session:
            self._remember(session, best.decode.worker_id, hashes[:max_pages], kept)
        return self._record(req_id, tenant, best, remote, best_pages, best_id, num_examined)

    def _session_hits(
        self, session: str, hashes: Sequence[bytes], max_pages: int, hits: PrefixMatch
    ) -> _SessionHits | None:
        """The index's answer with the session's worker credited, when the session is known,
        its worker healthy, and the pages it took there still lead this prompt."""
        known = self._sessions.get(session) if session else None
        if known is None or known.decode_id not in self._pools[Role.DECODE]:
            return None
        n = known.num_pages
        leads = 0 < n <= min(max_pages, len(hashes)) and hashes[n - 1] == known.last_hash
        return _SessionHits(hits, known.decode_id, PrefixHit(num_device=n) if leads else NO_HIT)

    def _session_slack(self, best_s: float) -> float:
        """How much more a session's worker may cost than the cheapest: what the cost model
        does not see of moving a conversation (its pages pushed again, its cache split in two),
        so only a worker that is really loaded loses its session."""
        return max(self.cfg.session_slack_s, self.cfg.session_slack * best_s)

    def _remember(self, session: str, decode_id: str, hashes: Sequence[bytes], kept: _SessionHits | None) -> None:
        if kept is not None:
            if decode_id == kept.worker_id:
                self.stats.num_session_kept += 1
            else:
                self.stats.num_session_moved += 1
        self._sessions[session] = _Session(decode_id, len(hashes), hashes[-1] if hashes else b"")
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.cfg.max_sessions:
            self._sessions.popitem(last=False)

    def _path(
        self, d: WorkerStats, remote: list[_Option], has_prefill: bool, num_bytes: int,
        hits: PrefixMatch | _SessionHits, num_tokens: int, tenant: str, best_id: str | None, best_pages: int,
        slo: SloClass,
    ) -> tuple[_Option | None, bool]:
        """Local prefill on `d`, or the cheapest remote one with its push of `num_bytes` over
        its link to `d`: (the option, is it local).

        With healthy prefill workers that are all queued past the bound (`has_prefill` and no
        `remote`), only a short uncached part goes local: a long one would stall d's whole
        batch for its compute time, so the request waits for room (SATURATED) instead. A BATCH
        request goes local on a `d` with running requests only when there is no remote option."""
        pushed = [o._replace(cost_s=o.cost_s + num_bytes / self.links.bytes_per_s(o.worker_id, d.worker_id))
                  for o in remote]  # fmt: skip
        cheapest = min(pushed, key=lambda o: o.cost_s) if pushed else None
        local = self._option(d, hits, num_tokens, tenant, best_id, best_pages)
        if local is not None:
            # the batch it stalls: what d reported, or what this placer sent it since
            running = max(d.num_running, self._decodes.get(d.worker_id, 0))
            local = local._replace(cost_s=local.cost_s + local.compute_s * running * self.cfg.stall_weight)
            is_short = local.num_recompute_tokens <= self.cfg.local_prefill_tokens
            # throughput work takes a push rather than stall d's running requests
            may_stall = not (slo == SloClass.BATCH and running > 0 and cheapest is not None)
            if may_stall and (
                is_short or (cheapest is None and not has_prefill) or (cheapest and local.cost_s <= cheapest.cost_s)
            ):
                return local, True
        return cheapest, False

    def _option(
        self, w: WorkerStats, hits: PrefixMatch | _SessionHits, num_tokens: int, tenant: str,
        best_id: str | None, best_pages: int,
    ) -> _Option | None:
        """Prefill of the prompt on `w`: None when its queue is past the bound."""
        cfg = self.cfg
        queue_s = max(w.queue_delay_s, self._queued_tokens.get(w.worker_id, 0) * w.prefill_s_per_token,
                      self._oldest_wait_s(w.worker_id))  # fmt: skip
        if queue_s > cfg.max_queue_delay_s:
            return None
        hit = hits.hit(w.worker_id)
        credited = hit
        if hit.num_pages and not self._may_use_affinity(w.worker_id, tenant):
            credited = NO_HIT
            self.stats.num_affinity_withheld += 1
        fetch_s = (credited.num_host * cfg.page_bytes / w.host_bytes_per_s
                   + credited.num_disk * cfg.page_bytes / w.disk_bytes_per_s)
        page_fetch_s = cfg.page_bytes / cfg.peer_bytes_per_s if cfg.peer_bytes_per_s > 0 else float("inf")
        is_peer = best_id not in (None, w.worker_id) and page_fetch_s < cfg.page_size * w.prefill_s_per_token
        num_peer_costed = max(0, best_pages - credited.num_pages) if is_peer else 0
        reused = credited.num_pages + num_peer_costed
        compute_s = (num_tokens - reused * cfg.page_size) * w.prefill_s_per_token
        cost_s = queue_s + compute_s + fetch_s + (num_peer_costed * page_fetch_s if num_peer_costed else 0.0)
        # What it will do: its own hit is used whether or not fairness credited it.
        num_peer = max(0, best_pages - hit.num_pages) if is_peer else 0
        num_recompute = num_tokens - (hit.num_pages + num_peer) * cfg.page_size
        return _Option(cost_s, w.worker_id, hit, best_id if num_peer else None, num_peer, num_recompute, compute_s)

    def _oldest_wait_s(self, worker_id: str) -> float:
        """How long its oldest booked prefill has waited for its first token: a new one waits
        at least about as long (0 when nothing is booked there)."""
        waiting = self._waiting.get(worker_id)
        if not waiting:
            return 0.0
        return max(0.0, self.clock() - next(iter(waiting.values())))

    def _decode_cost(self, d: WorkerStats) -> float:
        """Expected output tokens x ITL now, inflated by the batch's fill (a fuller batch is
        about to get slower; past max_running, requests queue)."""
        load = max(d.num_running + d.num_waiting, self._decodes.get(d.worker_id, 0)) / max(1, d.max_running)
        return self.cfg.expected_output_tokens * d.itl_s * (1.0 + load)

    def _may_use_affinity(self, worker_id: str, tenant: str) -> bool:
        """The fairness rule (module docstring)."""
        total = self._prefills.get(worker_id, 0)
        mine = self._tenant_prefills.get((worker_id, tenant), 0)
        if mine == total:
            return True  # nobody else's requests there to crowd out
        return mine < max(self.cfg.fairness_min_inflight, self.cfg.tenant_share * total)

    def _candidates(self, role: Role, holders: list[str]) -> list[WorkerStats]:
        """k random healthy workers of `role`, plus its healthy ones holding the most."""
        chosen = dict.fromkeys(self._pools[role].sample(self.cfg.num_sampled, self.rng))
        chosen.update(dict.fromkeys(holders))
        return [self._workers[w] for w in chosen]

    def _holders(self, hits: PrefixMatch) -> tuple[str | None, int, dict[Role, list[str]]]:
        """The healthy worker holding the longest prefix (and its length), and per role the m
        healthy ones holding the most: O(m) holders looked at, however many hold it."""
        masks = self._role_masks()
        best = next(hits.ranked(masks[Role.PREFILL] | masks[Role.DECODE], self.rng), (None, 0))
        m = self.cfg.num_prefix_candidates
        tops = {role: [w for w, _ in itertools.islice(hits.ranked(masks[role], self.rng), m)] for role in Role}
        return best[0], best[1], tops

    def _role_masks(self) -> dict[Role, int]:
        """Each pool as an index mask, rebuilt only when membership changed (rarely)."""
        version = (self.index.slots_version, self._pools[Role.PREFILL].version, self._pools[Role.DECODE].version)
        if version != self._masks_version:
            self._masks = {role: self.index.mask_of(pool.ids) for role, pool in self._pools.items()}
            self._masks_version = version
        return self._masks

    def _record(
        self, req_id: str, tenant: str, best: _Best, remote: list[_Option], best_pages: int,
        best_id: str | None, num_examined: int,
    ) -> Placement:
        path, decode_id = best.path, best.decode.worker_id
        kind = PlacementKind.LOCAL if best.is_local else PlacementKind.DISAGGREGATED
        placement = Placement(
            kind, decode_id, None if best.is_local else path.worker_id, path.hit, path.peer_id,
            path.num_peer_pages, path.num_recompute_tokens, best_pages, best_id, best.total_s, num_examined,
            tuple(o.worker_id for o in remote if o.worker_id != path.worker_id),
        )
        self.finish(req_id)  # a re-placement of the same request replaces its booking
        self._book(req_id, _Booking(tenant, path.worker_id, decode_id, path.num_recompute_tokens))
        s = self.stats
        s.num_placed += 1
        s.num_local += best.is_local
        s.hit_pages += path.hit.num_pages + path.num_peer_pages
        s.best_hit_pages += best_pages
        s.given_up_pages += placement.locality_given_up
        return placement

    # -- the in-flight book -------------------------------------------------------------------

    def _book(self, req_id: str, booking: _Booking) -> None:
        self._bookings[req_id] = booking
        self._queued_tokens[booking.prefill_id] += booking.num_tokens
        self._waiting[booking.prefill_id][req_id] = self.clock()
        self._prefills[booking.prefill_id] += 1
        self._tenant_prefills[(booking.prefill_id, booking.tenant)] += 1
        self._decodes[booking.decode_id] += 1

    def release_prefill(self, req_id: str) -> None:
        """The prompt is computed (its first token is back): it no longer queues there."""
        booking = self._bookings.get(req_id)
        if booking is None or not booking.is_prefilling:
            return
        booking.is_prefilling = False
        _drop(self._queued_tokens, booking.prefill_id, booking.num_tokens)
        waiting = self._waiting.get(booking.prefill_id)
        if waiting is not None:
            waiting.pop(req_id, None)
            if not waiting:
                del self._waiting[booking.prefill_id]
        _drop(self._prefills, booking.prefill_id, 1)
        _drop(self._tenant_prefills, (booking.prefill_id, booking.tenant), 1)

    def finish(self, req_id: str) -> None:
        """The request ended (finished, failed or cancelled)."""
        self.release_prefill(req_id)
        booking = self._bookings.pop(req_id, None)
        if booking is not None:
            _drop(self._decodes, booking.decode_id, 1)

    def inflight(self, worker_id: str, tenant: str | None = None) -> int:
        """Prefills booked on a worker (of one tenant, if given)."""
        if tenant is None:
            return self._prefills.get(worker_id, 0)
        return self._tenant_prefills.get((worker_id, tenant), 0)


def _drop(counts: defaultdict[_K, int], key: _K, n: int) -> None:
    counts[key] -= n
    if counts[key] <= 0:
        del counts[key]
