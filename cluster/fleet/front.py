"""Disaggregated serving on Ray, seen from the gateway: the EngineFront the HTTP and gRPC edges
call when the engines live in PrefillActors and DecodeActors (docs/architecture.md, One request).

    generate(req)
      p = placer.place(prompt's page hashes)    cluster.placement.policy over a GlobalIndex fed by the
                                                workers' KV events: decode worker, prefill worker
                                                (+ fallbacks), or LOCAL; SATURATED -> 429
      subscribe to p.decode's output stream
      dest = decode.place(job, prefill.epoch)   pages reserved -> KVDestination; or None: the
                                                placement is LOCAL, or the uncached part is short
                                                (or no room): decode prefills it itself
      first = prefill.prefill(job, dest)        -> the edge at once; the push runs meanwhile
      decode.admit(job, dest, first)            joins the batch once every page arrived
      outputs: decode's per-step batches, demultiplexed by cluster.fleet.workers.DecodeHandle

    failure (prefill dead, push refused, transfer deadline): the reservation is cancelled (its
    pages return to the pool) and the request goes to the next healthy prefill worker, then to
    decode-local prefill. A re-run's first token is the one already sent (greedy, or seeded:
    an unseeded sampled request gets a seed here, so a re-run draws the same stream), so it is
    not sent twice. Cancellation aborts the request on every worker it touched.

The index: every KV_POLL_S the gateway reads each live worker's new KV events (kv_events,
bounded batches) into its GlobalIndex, named by the gateway's worker names; a worker that
joined, changed epoch or lost events (a gap) is reloaded from its kv_snapshot. The Placer
gets each worker's WorkerStats from the stats already polled (decode: with every output
batch; prefill: the health poll): health, running and waiting requests, free pages
(reservations deducted), a prefill worker's measured s/token (until it has one: the others'
mean, or PREFILL_S_PER_TOKEN) and its queue (its pending prompt tokens x that rate; the
placer also counts the tokens it booked there since, until their first token). Not measured
yet, so defaults (module constants below): a decode worker prefilling at
DECODE_PREFILL_FACTOR times the prefill workers' mean (its prefill shares its steps with its
batch), the decode ITL (ITL_S), a push's bandwidth (PlacementConfig's default).

`ray` is imported after cluster.fleet.ray_runtime (which sets Ray's environment first).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from cluster.disagg_config import DisaggConfig
from cluster.edge.frontend import ModelView, PoolUsage
from cluster.errors import EdgeError, Kind
from cluster.fleet import ray_runtime  # noqa: F401  (before `ray`)
from cluster.fleet.registration import DrainReport
from cluster.fleet.transfer_metrics import TransferMetrics
from cluster.fleet.worker_msgs import PrefillResult, PrefillStats, TransferReport
from cluster.fleet.workers import DecodeHandle, Outputs, PrefillHandle, WorkerLost
from cluster.membership.protocol import EventKind, Membership, MembershipLagged, WorkerInfo
from cluster.membership.protocol import Role as MemberRole
from cluster.ops.node_status import NodeStatus
from cluster.ops.tracing import NO_SPAN, RequestTrace, Span, first_token, trace_of
from cluster.placement.global_index import NO_HIT, GlobalIndex
from cluster.placement.pair_health import PairHealth, PairRoute
from cluster.placement.policy import (
    Placement,
    PlacementConfig,
    PlacementKind,
    Placer,
    Role,
    WorkerStats,
)
from engine.outputs import StepOutput, StepStats
from engine.sampling import SamplingParams
from kvcache.events import KVEvent, Tier
from kvcache.hashing import page_hashes
from kvcache.report import CacheReport
from kvtransfer.jobs import PrefillJob
from kvtransfer.transport import KVDestination

import ray  # isort: skip

if TYPE_CHECKING:
    from cluster.fleet.launch import Spawner

logger = logging.getLogger(__name__)

HEALTH_PERIOD_S = 1.0
STOP_S = 5.0  # for the actors' own cleanup at shutdown
KV_POLL_S = 0.05  # KV events of every worker, this often
PREFILL_S_PER_TOKEN = 2e-4  # default until workers report a measured rate (baton-tiny, one core)
DECODE_PREFILL_FACTOR = 2.0  # a decode worker's prefill: its batch stalls meanwhile
ITL_S = 0.02  # default decode step time until workers report it
ADD_WORKER_S = 300.0  # a new actor loads its model and joins within this


class _Placed(NamedTuple):
    first: StepOutput
    dest: KVDestination
    transfer_id: str
    prefill: PrefillHandle


class _Redispatch(Exception):
    """This path failed; the request goes down the next one."""


class _Stalled(Exception):
    """The prefill worker stalled or died while the request waited on it."""


class RayFront:
    def __init__(
        self, model: ModelView, prefills: Sequence[PrefillHandle], decodes: Sequence[DecodeHandle], cfg: DisaggConfig,
        fingerprint: bytes = b"", page_size: int = 16, max_running: int = 64, page_bytes: int = 1 << 20,
        placement: PlacementConfig | None = None, membership: Membership | None = None, registry: Any = None,
        registry_name: str = "", spawner: Spawner | None = None, routes: Sequence[PairRoute] = (),
    ) -> None:
        self.model = model  # cluster.fleet.launch.GatewayModel: the tokenizer and config, no weights
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.cfg = cfg
        self.metrics = TransferMetrics()
        self.pairs = PairHealth(cfg.pair_failures, cfg.pair_retry_s)  # which pairs' transfers work
        self.fingerprint = fingerprint  # the engines' (page hashes carry it)
        self.page_size = page_size
        self.max_running = max_running  # a decode worker's batch limit (max_num_seqs)
        self.index = GlobalIndex()
        self.placer = Placer(self.index, placement or PlacementConfig(
            page_size=page_size, page_bytes=page_bytes, local_prefill_tokens=cfg.local_prefill_tokens))
        self._prefill_of = {p.name: p for p in self.prefills}
        self._decode_of = {d.name: d for d in self.decodes}
        self._routed(routes)
        self._kv_after: dict[str, int] = {}  # worker -> the last event seq read from it
        self._turn = 0  # the round_robin placement's (DisaggConfig.placement)
        for p in self.prefills:
            self.index.add_worker(p.name, p.epoch)
        for d in self.decodes:
            self.index.add_worker(d.name, 1)  # DecodeActor's epoch
        self._refresh_workers()
        self._health: asyncio.Task[None] | None = None
        self._kv: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Future[Any]] = set()  # fire-and-forget calls in flight
        self.membership = membership
        self.registry = registry  # the `ray` backend's registry actor (it goes with the gateway)
        self.registry_name = registry_name  # what workers join (WorkerMember.join)
        self.spawner = spawner  # add_worker's (None: this gateway cannot start workers)
        self._members: asyncio.Task[None] | None = None
        self._retired: set[str] = set()  # drained or dead for good: never reused, adopted or revived
        self._reviving: set[str] = set()  # dead workers being brought back (_revive)
        self._spawned: dict[str, Any] = {}  # add_worker's actors: the creator's handles keep them alive
        self.num_member_events = {kind.name.lower(): 0 for kind in EventKind}

    # -- the surface the Frontend uses --------------------------------------------------------

    @property
    def engine(self) -> ModelView:
        return self.model

    @property
    def is_alive(self) -> bool:
        return any(d.is_alive for d in self.decodes)

    @property
    def heartbeat(self) -> float:
        return max((d.heartbeat for d in self.decodes if d.is_alive), default=0.0)

    @property
    def last_stats(self) -> StepStats | None:
        return None  # pool_usage reports the running batches instead

    def nodes(self) -> list[NodeStatus]:
        """Every worker, from the stats already polled (cluster.ops.node_status)."""
        now, nodes, hosts = time.monotonic(), [], self.pairs.hosts()
        for p in self.prefills:
            s = p.stats
            health = ("down" if not p.is_alive else "stalled" if p.is_stalled else "left" if not p.is_member
                      else "starting" if s is None else "ok")  # fmt: skip
            nodes.append(NodeStatus(
                p.name, "prefill", health, p.epoch, s.num_running if s else 0, 0,
                s.num_pending_tokens if s else 0, 0, s.num_pinned_pages if s else 0,
                s.num_transfers if s else 0, s.num_failed_transfers if s else 0,
                s.cache if s else CacheReport(), now - p.reported_at if s else 0.0, s.num_preempted if s else 0,
                hosts.get(p.name, ""),
            ))  # fmt: skip
        for d in self.decodes:
            t = d.stats
            health = ("down" if not d.is_alive else "stalled" if d.is_stalled else "left" if not d.is_member
                      else "starting" if t is None else "ok")  # fmt: skip
            nodes.append(NodeStatus(
                d.name, "decode", health, d.epoch, t.num_running if t else 0, t.num_waiting if t else 0, 0,
                t.num_reserved_pages if t else 0, cache=t.cache if t else CacheReport(),
                age_s=now - d.heartbeat if t else 0.0, preemptions=t.num_preempted if t else 0,
                host=hosts.get(d.name, ""),
            ))  # fmt: skip
        return nodes

    def pool_usage(self) -> PoolUsage:
        stats = [d.stats for d in self.decodes if d.stats is not None]
        cached = sum(s.num_cached_pages for s in stats)
        return PoolUsage(sum(s.num_used_pages for s in stats) - cached, cached,
                         sum(s.num_pages for s in stats), sum(s.num_running for s in stats))

    def start(self) -> None:
        for d in self.decodes:
            self._watch_decode(d)
            d.start()
        self._health = asyncio.create_task(self._watch_workers())
        self._kv = asyncio.create_task(self._follow_kv())
        if self.membership is not None:
            self._members = asyncio.create_task(self._follow_members(self.membership))

    async def stop(self) -> None:
        for task in (self._health, self._kv, self._members):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for d in self.decodes:
            await d.stop()
        # Let live actors close what outlives a process (a decode worker's /dev/shm region,
        # sockets), then end them: the actors are this gateway's and go with it.
        closing = [p.actor.close.remote() for p in self.prefills if p.is_alive]
        closing += [d.actor.stop.remote() for d in self.decodes if d.is_alive]
        await asyncio.wait([asyncio.ensure_future(_ray_await(ref)) for ref in closing], timeout=STOP_S)
        for actor in [p.actor for p in self.prefills] + [d.actor for d in self.decodes]:
            ray.kill(actor)
        self._spawned.clear()
        if self.membership is not None:
            await self.membership.close()
        if self.registry is not None:
            ray.kill(self.registry)

    # -- one request ----------------------------------------------------------------------------

    async def generate(
        self, req_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, priority: int = 0,
        cache_salt: str = "",
    ) -> AsyncIterator[StepOutput]:
        """The request's outputs. When its decode worker is lost mid-stream, the request moves:
        prompt + the tokens already emitted go to a healthy pair as a new attempt (at most
        cfg.max_migrations times), and the stream goes on with no gap and no repeat. With no
        capacity left, the WorkerLost (or the placement's refusal) reaches the client."""
        if sampling.seed is None and not sampling.is_greedy:
            sampling = replace(sampling, seed=secrets.randbits(62))  # a re-run replays the stream
        trace = trace_of(req_id)  # the edge's span (cluster.ops.tracing), or one that records nothing
        prompt, emitted = tuple(prompt_ids), 0
        for attempt in range(self.cfg.max_migrations + 1):
            job = PrefillJob(req_id if attempt == 0 else f"{req_id}@{attempt}", prompt, _continued(sampling, emitted),
                             priority, cache_salt)  # fmt: skip
            base = emitted
            try:
                async for out in self._attempt(job, trace):
                    if base:  # counted from the original request's start, under its id
                        out = replace(out, req_id=req_id, num_output_tokens=out.num_output_tokens + base,
                                      num_prompt_tokens=len(prompt_ids))  # fmt: skip
                    prompt += tuple(out.token_ids)
                    emitted += len(out.token_ids)
                    yield out
                return
            except WorkerLost as exc:
                # A constrained request's grammar state lives on the lost worker: a new one
                # would start the grammar over mid-output, so it fails rather than moves.
                if attempt == self.cfg.max_migrations or (emitted and sampling.constraint is not None):
                    raise
                self.metrics.migrations.inc()
                logger.warning("%s: %s; moving it with %d tokens emitted (attempt %d)", req_id, exc, emitted,
                               attempt + 2)  # fmt: skip

    async def _attempt(self, job: PrefillJob, trace: RequestTrace) -> AsyncIterator[StepOutput]:
        """One placement of the request and its stream (generate moves it if the decode side is lost)."""
        req_id = job.req_id
        with trace.span("baton.placement", req_id=req_id) as placing:
            placement = await self._placement(job)
            placing.set(kind=placement.kind.name.lower(), decode_worker=placement.decode_id or "",
                        prefill_worker=placement.prefill_id or "", hit_pages=placement.hit.num_pages,
                        peer_pages=placement.num_peer_pages, locality_given_up=placement.locality_given_up,
                        recompute_tokens=placement.num_recompute_tokens, fallbacks=len(placement.fallbacks))
        decode = self._decode_of[placement.decode_id or ""]
        try:
            queue = decode.subscribe(req_id)
        except BaseException:
            self.placer.finish(req_id)
            raise
        prefill: PrefillHandle | None = None
        sent_first = is_local = finished = False
        prefilling = decoding = NO_SPAN  # this attempt's prefill; decode from the first token on
        num_tokens = 0
        try:
            paths = self._paths(placement, decode.name)  # None: local
            for step, prefill in enumerate(paths):
                prefilling = trace.span("baton.prefill", req_id=req_id)
                try:
                    placed = await self._place(job, decode, prefill, prefilling)
                    self.placer.release_prefill(req_id)  # computed: it no longer queues there
                    if placed is None:  # decode prefills it itself
                        is_local = True
                        break
                    if not sent_first:  # the first token goes to the edge before the pages move
                        sent_first = True
                        decoding = first_token(trace, placed.first.finished, req_id=req_id, worker=decode.name)
                        yield placed.first
                        if placed.first.finished:
                            finished = True
                            return
                    await self._hand_over(job, decode, placed, trace)
                    break
                except _Redispatch:  # to the next path: another prefill worker, or decode-local
                    self.metrics.redispatches.labels("local" if paths[step + 1] is None else "prefill").inc()
            prefill = None
            # A local re-run's first token was already sent by a prefill worker.
            async for out in self._stream(decode, queue, is_local and sent_first, prefilling):
                if not sent_first:
                    sent_first = True
                    decoding = first_token(trace, out.finished, req_id=req_id, worker=decode.name)
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
            self.placer.finish(req_id)
            decode.unsubscribe(req_id)
            if not finished:  # cancelled or failed: every worker it touched lets go
                self._fire(decode.actor.abort.remote(req_id))
                if prefill is not None:
                    self._fire(prefill.actor.abort.remote(req_id))

    async def _stream(
        self, decode: DecodeHandle, queue: Outputs, skip_first: bool, prefilling: Span = NO_SPAN
    ) -> AsyncIterator[StepOutput]:
        """decode's outputs of the request; its first token ends `prefilling` (a local prefill)."""
        async for out in decode.outputs(queue):
            if out.num_output_tokens == len(out.token_ids):  # the first token
                prefilling.end()
                if skip_first:
                    skip_first = False
                    if not out.finished:
                        continue
                    out = replace(out, token_ids=(), text="", logprobs=())  # only the finish is news
            yield out

    async def _place(
        self, job: PrefillJob, decode: DecodeHandle, prefill: PrefillHandle | None, prefilling: Span = NO_SPAN
    ) -> _Placed | None:
        """Start the request down this path: None when decode prefills it itself (`prefilling`
        ends with its first token, in _stream); else the first token from `prefill`, whose push
        to decode has started."""
        epoch = prefill.epoch if prefill is not None else None
        dest: KVDestination | None = await self._decode_call(decode, decode.actor.place.remote(job, epoch))
        if dest is None:
            self.metrics.placements.labels("local").inc()
            prefilling.set(worker=decode.name, epoch=decode.epoch, local=True)
            return None
        assert prefill is not None
        prefilling.set(worker=prefill.name, epoch=prefill.epoch, local=False)
        prefill.num_inflight += 1
        try:
            result: PrefillResult = await self._prefill_call(prefill, prefill.actor.prefill.remote(job, dest))
        except Exception as exc:
            self._fire(decode.actor.cancel.remote(dest))  # the pages go back at once
            prefilling.fail(self._prefill_failed(prefill, job, exc))
            prefilling.end()
            raise _Redispatch from None
        finally:
            prefill.num_inflight -= 1
        prefilling.end()
        self.metrics.placements.labels("disaggregated").inc()
        if result.output.finished:  # the first token ends it: nothing moves
            self._fire(decode.actor.cancel.remote(dest))
        return _Placed(result.output, dest, result.transfer_id, prefill)

    async def _hand_over(self, job: PrefillJob, decode: DecodeHandle, placed: _Placed, trace: RequestTrace) -> None:
        """Wait for the push; the request joins decode's batch, or _Redispatch (pages freed)."""
        wait_s = self.cfg.transfer_deadline_s
        admit = decode.actor.admit.remote(job, placed.dest, placed.first, wait_s)  # waits there
        failed: str | None = None
        report: TransferReport | None = None
        got: TransferReport
        with trace.span("baton.transfer", req_id=job.req_id, prefill_worker=placed.prefill.name,
                        decode_worker=decode.name) as transfer:  # fmt: skip
            self.metrics.inflight.inc()
            try:
                call = placed.prefill.actor.push_result.remote(placed.transfer_id)
                report = got = await asyncio.wait_for(_ray_await(call), wait_s + 1)
                self.metrics.observe(got)
                transfer.set(transport=got.transport, bytes=got.num_bytes, pages=got.num_pages,
                             seconds=got.seconds)  # fmt: skip
                if not got.accepted:
                    failed = got.error
                    self.metrics.failures.labels(_reason(failed)).inc()
            except Exception as exc:
                failed = self._prefill_failed(placed.prefill, job, exc)  # counted there
            finally:
                self.metrics.inflight.dec()
            if failed is not None:
                self._fire(decode.actor.cancel.remote(placed.dest))  # admit then answers False at once
            if not await self._decode_call(decode, admit, wait_s + 2):
                if failed is None:  # the push said yes, but the pages did not all arrive in time
                    failed = "deadline"
                    self.metrics.failures.labels(failed).inc()
                logger.info("%s: transfer %s failed (%s); re-dispatching", job.req_id, placed.transfer_id, failed)
                transfer.fail(_reason(failed))
                if placed.prefill.is_alive:  # a dead worker is not its link's fault
                    self.pairs.failed(placed.prefill.name, decode.name, failed)
                raise _Redispatch
            self.pairs.succeeded(placed.prefill.name, decode.name)
            if report is not None:  # what the push measured of the link
                self.placer.links.observe(placed.prefill.name, decode.name, report.num_bytes, report.wire_seconds)

    # -- workers ----------------------------------------------------------------------------------

    async def _placement(self, job: PrefillJob) -> Placement:
        """Where the request goes (cluster.placement.policy): its decode worker and prefill path."""
        if not any(d.is_routable for d in self.decodes):
            raise EdgeError(Kind.UNAVAILABLE, "no decode worker is available", None, 1.0)
        await self._ensure_stats()
        self._refresh_workers()
        if self.cfg.placement == "round_robin":
            return self._round_robin(job)
        ps = self.page_size
        num_pages = (len(job.prompt_ids) - 1) // ps  # at least one token is always computed
        hashes = page_hashes(job.prompt_ids[: num_pages * ps], ps, job.cache_salt.encode(), self.fingerprint)
        p = self.placer.place(job.req_id, hashes, len(job.prompt_ids), job.cache_salt)
        if p.kind == PlacementKind.SATURATED:
            self.metrics.saturated.inc()
            raise EdgeError(Kind.RESOURCE_EXHAUSTED, "server overloaded: no decode worker has room; retry later",
                            None, p.retry_after_s)  # fmt: skip
        self.metrics.given_up.inc(p.locality_given_up)
        return p

    def _round_robin(self, job: PrefillJob) -> Placement:
        """The comparison policy: decode and prefill workers in turn, caches ignored (the decode
        worker still prefills a prompt whose uncached part there is short)."""
        decodes = [d for d in self.decodes if d.is_routable]
        prefills = [p.name for p in self.prefills if p.is_routable]
        self._turn += 1
        decode = decodes[self._turn % len(decodes)].name
        if not prefills:
            return Placement(PlacementKind.LOCAL, decode, None, NO_HIT, None, 0, len(job.prompt_ids), 0, None, 0.0, 0)
        first = self._turn % len(prefills)
        order = prefills[first:] + prefills[:first]
        return Placement(PlacementKind.DISAGGREGATED, decode, order[0], NO_HIT, None, 0, len(job.prompt_ids), 0,
                         None, 0.0, 0, tuple(order[1:]))  # fmt: skip

    def _paths(self, p: Placement, decode: str) -> list[PrefillHandle | None]:
        """The prefill workers to try in order (the placement's, then its fallbacks) whose pair
        with `decode` moves pages (cluster.placement.pair_health), then decode-local (None). A LOCAL
        placement is local at once."""
        if p.kind == PlacementKind.LOCAL:
            return [None]
        named = [self._prefill_of[w] for w in (p.prefill_id, *p.fallbacks) if w in self._prefill_of]
        return [*(h for h in named if h.is_routable and self.pairs.can_route(h.name, decode)), None]

    async def _ensure_stats(self) -> None:
        """A decode worker's first stats (until its output stream reports): free pages matter."""
        missing = [d for d in self.decodes if d.is_alive and d.stats is None]
        for d in missing:
            try:
                d.stats = await self._decode_call(d, d.actor.stats.remote(), 5 * HEALTH_PERIOD_S)
            except WorkerLost:
                pass

    def _refresh_workers(self) -> None:
        """The placer's view of every worker, from the stats last reported."""
        measured = [p.stats.prefill_s_per_token for p in self.prefills if p.stats and p.stats.prefill_s_per_token]
        mean_rate = sum(measured) / len(measured) if measured else PREFILL_S_PER_TOKEN  # for the unmeasured
        for p in self.prefills:
            rate = (p.stats.prefill_s_per_token if p.stats is not None else 0.0) or mean_rate
            queued = p.stats.num_pending_tokens if p.stats is not None else 0
            self.placer.update_worker(WorkerStats(p.name, Role.PREFILL, rate, queue_delay_s=queued * rate,
                                                  is_healthy=p.is_routable))  # fmt: skip
        decode_rate = DECODE_PREFILL_FACTOR * mean_rate
        for d in self.decodes:
            s = d.stats
            free = s.num_free_pages_at_idle - s.num_reserved_pages if s is not None else 0
            self.placer.update_worker(WorkerStats(
                d.name, Role.DECODE, decode_rate, is_healthy=d.is_routable and s is not None,
                itl_s=ITL_S, num_running=s.num_running if s else 0, num_waiting=s.num_waiting if s else 0,
                max_running=self.max_running, num_free_pages=free,
            ))  # fmt: skip

    async def _follow_kv(self) -> None:
        """Every worker's KV events into the index; a snapshot when the index asks for one."""
        while True:
            workers: list[tuple[str, Any, bool, int | None]] = [
                (p.name, p.actor, p.is_alive, None) for p in self.prefills]  # their stats come each second
            workers += [(d.name, d.actor, d.is_alive, d.stats.last_event_seq if d.stats else None)
                        for d in self.decodes]  # with every output batch: a quiet one is skipped
            for name, actor, alive, reported in workers:
                if not alive:
                    if name in self._kv_after:
                        self.index.remove_worker(name)
                        del self._kv_after[name]
                    continue
                state = self.index.sync_state(name)
                if reported is not None and reported <= self._kv_after.get(name, -1) and state and not state.is_stale:
                    continue
                try:
                    await self._sync_kv(name, actor)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # its health poll decides whether it is gone
                    logger.debug("KV events of %s: %r", name, exc)
            await asyncio.sleep(KV_POLL_S)

    async def _sync_kv(self, name: str, actor: Any) -> None:
        after = self._kv_after.get(name, 0)
        events: tuple[KVEvent, ...] = await asyncio.wait_for(_ray_await(actor.kv_events.remote(after)), STOP_S)
        wants_snapshot = False
        for event in events:
            wants_snapshot |= self.index.apply(replace(event, worker_id=name)) is not None
            after = event.seq
        self._kv_after[name] = after
        state = self.index.sync_state(name)
        if wants_snapshot or state is None or state.is_stale:
            snap: tuple[int, int, list[tuple[bytes, Tier]]] = await asyncio.wait_for(
                _ray_await(actor.kv_snapshot.remote()), STOP_S)
            epoch, seq, entries = snap
            self.index.load_snapshot(name, epoch, seq, entries)
            self._kv_after[name] = max(after, seq)

    async def _prefill_call(self, prefill: PrefillHandle, ref: Any) -> PrefillResult:
        """The prefill's first token, bounded by the reservation; _Stalled as soon as the
        worker stalls or dies (the request moves on without waiting out the deadline)."""
        call = _abandonable(_ray_await(ref))
        trouble = asyncio.ensure_future(prefill.trouble.wait())
        try:
            done, _ = await asyncio.wait({call, trouble}, timeout=self.cfg.reservation_ttl_s,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            trouble.cancel()
        if call in done:
            result: PrefillResult = call.result()
            return result
        call.cancel()
        if trouble in done:
            raise _Stalled(f"prefill worker {prefill.name} stalled or died")
        raise TimeoutError

    def _prefill_failed(self, prefill: PrefillHandle, job: PrefillJob, exc: BaseException) -> str:
        if isinstance(exc, ray.exceptions.RayActorError):
            prefill.mark_dead(exc)
            reason = "prefill worker died"
        elif isinstance(exc, _Stalled):
            reason = "prefill worker stalled"
        elif isinstance(exc, TimeoutError):
            reason = "deadline"
        else:
            logger.warning("%s: prefill on %s failed: %r", job.req_id, prefill.name, exc)
            reason = "prefill error"
        self._fire(prefill.actor.abort.remote(job.req_id))
        self.metrics.failures.labels(_reason(reason)).inc()
        return reason

    async def _decode_call(self, decode: DecodeHandle, ref: Any, timeout_s: float | None = None) -> Any:
        """A call to `decode`, bounded; WorkerLost (the request moves) as soon as it stalls or dies."""
        call = _abandonable(_ray_await(ref))
        trouble = asyncio.ensure_future(decode.trouble.wait())
        try:
            done, _ = await asyncio.wait({call, trouble}, timeout=timeout_s or self.cfg.reservation_ttl_s,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            trouble.cancel()
        if call not in done:
            call.cancel()
            if trouble in done:
                raise WorkerLost(f"decode worker {decode.name} stalled or failed")
            raise TimeoutError
        try:
            return call.result()
        except ray.exceptions.RayActorError:
            decode.mark_dead()
            raise WorkerLost(f"decode worker {decode.name} failed") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, Exception):  # e.g. the engine refusing the request
                raise cause from None
            raise

    async def _watch_workers(self) -> None:
        """Every HEALTH_PERIOD_S: the prefill workers' stats (decode ones report with every
        batch), each bounded by the watchdog: one that does not answer in cfg.watchdog_s is
        stalled (its in-flight prefills move at once; it gets work again when it answers);
        and a dead worker is revived if Ray restarts it (cfg.max_restarts)."""
        while True:
            await asyncio.gather(*(self._poll_prefill(p) for p in self.prefills if p.is_alive))
            handles: list[PrefillHandle | DecodeHandle] = [*self.prefills, *self.decodes]
            for handle in handles:
                if not handle.is_alive and self.cfg.max_restarts and handle.name not in self._reviving | self._retired:
                    self._reviving.add(handle.name)
                    self._fire(self._revive(handle))
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _poll_prefill(self, p: PrefillHandle) -> None:
        call = _abandonable(_ray_await(p.actor.stats.remote()))
        try:
            done, _ = await asyncio.wait({call}, timeout=self.cfg.watchdog_s)
            if not done:
                if p.mark_stalled(self.cfg.watchdog_s):
                    self.metrics.stalls.labels("prefill").inc()
                call.cancel()
                return
            stats: PrefillStats = call.result()
            if p.pid is not None and stats.pid and stats.pid != p.pid:
                # Ray restarted the actor before a call failed on the old process (the poll
                # that would have timed out in between): it is a fresh worker that has not
                # joined membership, so it goes the revive way, not back into rotation.
                p.mark_dead(f"its process changed ({p.pid} -> {stats.pid}): Ray restarted it")
                return
            p.pid = p.pid or stats.pid or None
            p.stats = stats
            p.reported_at = time.monotonic()
            p.mark_answering()
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as exc:
            p.mark_dead(exc)

    def _watch_decode(self, d: DecodeHandle) -> None:
        def stalled() -> None:
            self.metrics.stalls.labels("decode").inc()

        d.on_stall = stalled

    async def _revive(self, handle: PrefillHandle | DecodeHandle) -> None:
        """A worker's actor died. Ray restarts it when it has restarts left (a failed engine
        exits on purpose: Registered._engine_failed): the fresh process is started, rejoins
        membership under its old name (a new epoch; its predecessor's lease must run out
        first), and is routed to and from, and the handle serves again. An actor that is dead
        for good (killed, drained, out of restarts) answers RayActorError: it stays down."""
        from cluster.fleet.launch import route

        role = "decode" if isinstance(handle, DecodeHandle) else "prefill"
        try:
            async with asyncio.timeout(ADD_WORKER_S):
                pid: int | None = None
                if isinstance(handle, DecodeHandle):
                    address: str = await _ray_await(handle.actor.start.remote())
                else:
                    pid = await _ray_await(handle.actor.ping.remote())
                epoch: int = await _ray_await(handle.actor.join.remote(self.cfg.membership, self.registry_name,
                                                                      handle.name))  # fmt: skip
                if isinstance(handle, DecodeHandle):
                    routes = await route([(p.name, p.actor) for p in self.prefills if p.is_alive],
                                         [(handle.name, handle.actor, address)], self.cfg.transport)  # fmt: skip
                else:
                    routes = await route([(handle.name, handle.actor)], self._live_decodes(), self.cfg.transport)
                self._routed(routes)
        except ray.exceptions.ActorUnavailableError as exc:  # restarting: the next health period asks again
            logger.info("%s worker %s is not back yet: %s", role, handle.name, type(exc).__name__)
            return
        except ray.exceptions.RayActorError as exc:
            logger.warning("%s worker %s is dead for good: %s", role, handle.name, type(exc).__name__)
            self._retired.add(handle.name)  # never tried again
            return
        except Exception as exc:  # the next health period tries again
            logger.warning("%s worker %s: restart not rejoined yet (%r)", role, handle.name, exc)
            return
        finally:
            self._reviving.discard(handle.name)
        if isinstance(handle, DecodeHandle):
            handle.revive(address, epoch)
        else:
            handle.revive(epoch, pid)
        self.index.add_worker(handle.name, epoch)  # its cache is empty: stale until its snapshot
        self.metrics.restarts.labels(role).inc()
        logger.warning("%s worker %s restarted and rejoined (epoch %d)", role, handle.name, epoch)

    def _routed(self, routes: Sequence[PairRoute]) -> None:
        """Pairs (re)routed: their health starts over; placement learns which share a host."""
        self.pairs.routed(routes)
        for r in routes:
            self.placer.links.set_same_host(r.prefill, r.decode, bool(r.prefill_host) and
                                            r.prefill_host == r.decode_host)  # fmt: skip

    def _live_decodes(self) -> list[tuple[str, Any, str]]:
        return [(d.name, d.actor, d.address) for d in self.decodes if d.is_alive]

    # -- membership -------------------------------------------------------------------------------

    async def _follow_members(self, membership: Membership) -> None:
        """Joins, leaves and new epochs (cluster.membership.protocol): a worker that left (its lease
        ran out, or it drained) gets no new work but keeps what it runs; one that came back
        with a new epoch is routable again, its KV events reload the index; a worker this
        gateway did not launch (the planner's, another `baton serve`'s) is adopted."""
        while True:
            stream = membership.watch()  # read members() and watch() with no await between
            self._reconcile(membership.members())
            try:
                async for event in stream:
                    self.num_member_events[event.kind.name.lower()] += 1
                    if event.kind == EventKind.LEAVE:
                        self._set_member(event.worker.worker_id, None)
                    else:
                        self._set_member(event.worker.worker_id, event.worker)
                        if self._handle(event.worker.worker_id) is None and event.worker.worker_id not in self._retired:
                            await self._adopt(event.worker)
            except MembershipLagged:
                logger.warning("membership watch lagged: reading the members again")
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("following membership failed; retrying")
                await asyncio.sleep(HEALTH_PERIOD_S)
            finally:
                stream.close()

    def _reconcile(self, members: Mapping[str, WorkerInfo]) -> None:
        for name in [*self._prefill_of, *self._decode_of]:
            self._set_member(name, members.get(name))

    def _handle(self, worker_id: str) -> PrefillHandle | DecodeHandle | None:
        return self._prefill_of.get(worker_id) or self._decode_of.get(worker_id)

    def _set_member(self, worker_id: str, info: WorkerInfo | None) -> None:
        handle = self._handle(worker_id)
        if handle is None:
            return
        if info is None:
            if handle.is_member:
                logger.warning("%s left membership: no new work goes there", worker_id)
            handle.is_member = False
            return
        if info.epoch != handle.epoch:
            logger.warning("%s registered again: epoch %d -> %d", worker_id, handle.epoch, info.epoch)
            handle.epoch = info.epoch  # reservations for its pushes carry the new one
            self.index.add_worker(worker_id, info.epoch)  # stale until its snapshot of the new epoch
        handle.is_member = True

    async def _adopt(self, info: WorkerInfo) -> None:
        """A worker that joined on its own: find its actor by name and route pages to and from it."""
        from cluster.fleet.launch import route

        try:
            actor = ray.get_actor(info.address)
            if info.role == MemberRole.PREFILL:
                self._routed(await route([(info.worker_id, actor)], self._live_decodes(), self.cfg.transport))
                prefill = PrefillHandle(info.worker_id, actor, info.epoch)
                self.prefills.append(prefill)
                self._prefill_of[info.worker_id] = prefill
            else:
                address: str = await asyncio.wait_for(_ray_await(actor.start.remote()), STOP_S)
                self._routed(await route([(p.name, p.actor) for p in self.prefills if p.is_alive],
                                              [(info.worker_id, actor, address)], self.cfg.transport))  # fmt: skip
                decode = DecodeHandle(info.worker_id, actor, address, self.cfg.poll_wait_s, epoch=info.epoch,
                                      watchdog_s=self.cfg.watchdog_s)  # fmt: skip
                self.decodes.append(decode)
                self._decode_of[info.worker_id] = decode
                self._watch_decode(decode)
                decode.start()
        except Exception as exc:
            logger.warning("cannot adopt %s (%s at %r): %s", info.worker_id, info.role, info.address, exc)
            return
        self.index.add_worker(info.worker_id, info.epoch)
        logger.info("adopted %s worker %s (epoch %d)", info.role, info.worker_id, info.epoch)

    # -- scaling (the planner's) -----------------------------------------------------------------

    async def add_worker(self, role: str, timeout_s: float = ADD_WORKER_S) -> str:
        """Start one more `role` worker ("prefill" or "decode"); returns its name once the
        gateway routes to it (it joins membership, _follow_members adopts it)."""
        if self.spawner is None or self.membership is None:
            raise RuntimeError("this gateway was not launched with a spawner and membership")
        if role not in ("prefill", "decode"):
            raise ValueError(f"role is prefill or decode, not {role!r}")
        named = self._prefill_of if role == "prefill" else self._decode_of
        taken = [int(n.rsplit("-", 1)[1]) for n in (*named, *self._retired) if n.rsplit("-", 1)[1].isdigit()
                 and n.startswith(f"{role}-")]  # fmt: skip
        index = max(taken, default=-1) + 1
        name = f"{role}-{index}"
        async with asyncio.timeout(timeout_s):
            self._spawned[name] = await self.spawner.start_worker(role, index)
            while name not in named:
                await asyncio.sleep(0.05)
        logger.info("added %s", name)
        return name

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> DrainReport:
        """Drain `name` (no new work from now on; what it runs finishes), then stop it and
        forget it. Its requests in flight complete normally: 0 failed by design."""
        handle = self._handle(name)
        if handle is None:
            raise KeyError(f"no worker named {name!r}")
        handle.is_member = False  # before its LEAVE arrives: nothing new goes there from now on
        self._retired.add(name)
        report: DrainReport = await _ray_await(handle.actor.drain.remote(timeout_s))
        if isinstance(handle, DecodeHandle):
            handle.fail_all(WorkerLost(f"decode worker {name} was drained"))  # only what the timeout abandoned
            await handle.stop()
            self.decodes.remove(handle)
            del self._decode_of[name]
        else:
            self.prefills.remove(handle)
            del self._prefill_of[name]
        try:
            await asyncio.wait_for(_ray_await(handle.actor.drain_and_exit.remote()), STOP_S)
        except Exception as exc:  # it exits during the call: the actor's death is the answer
            logger.debug("%s exited: %r", name, exc)
        self.index.remove_worker(name)
        self.placer.remove_worker(name)
        self.placer.links.forget(name)
        self.pairs.forget(name)  # gone from /status's routes and baton_kv_pair_*
        self._kv_after.pop(name, None)
        self._spawned.pop(name, None)
        logger.info("drained and removed %s in %.2f s (%d abandoned)", name, report.seconds, report.abandoned)
        return report

    def _fire(self, ref: Any) -> None:
        """A call whose answer nobody waits for; its failure (a dead actor) is only logged."""
        task = asyncio.ensure_future(_ray_await(ref))
        self._pending.add(task)
        task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Future[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("fire-and-forget call failed: %r", task.exception())


async def _ray_await(ref: Any) -> Any:
    return await ref


def _abandonable(coro: Any) -> asyncio.Future[Any]:
    """A call the caller may stop waiting for (a stall, a cancel): its late failure is
    retrieved here, not left as "Task exception was never retrieved"."""
    call: asyncio.Future[Any] = asyncio.ensure_future(coro)
    call.add_done_callback(lambda f: f.cancelled() or f.exception())
    return call


def _continued(sampling: SamplingParams, emitted: int) -> SamplingParams:
    """The rest of a request that already emitted `emitted` tokens (they are now prompt)."""
    if not emitted:
        return sampling
    return replace(sampling, max_tokens=max(1, sampling.max_tokens - emitted),
                   min_tokens=max(0, sampling.min_tokens - emitted))  # fmt: skip


def _reason(text: str) -> str:
    for key in ("died", "deadline", "refused", "aborted", "transport"):
        if key in text:
            return key
    return "other"
