"""Disaggregated serving on Ray, seen from the gateway: the EngineFront the HTTP and gRPC edges
call when the engines live in PrefillActors and DecodeActors (docs/architecture.md, One request).
This is the request flow; the workers themselves -- health, the index, membership, adding and
draining -- are the Fleet's (cluster.fleet.fleet).

    generate(req)
      p = placer.place(prompt's page hashes)    cluster.placement.policy over a GlobalIndex fed by the
                                                workers' KV events: decode worker, prefill worker
                                                (+ fallbacks), or LOCAL; SATURATED -> 429
      subscribe to p.decode's output stream
      dispatch(job, decode, paths)              cluster.fleet.dispatch, over the actors as sides:
        decode.place(job, prefill.epoch)        pages reserved -> KVDestination; or None: the
                                                placement is LOCAL, or the uncached part is short
                                                (or no room): decode prefills it itself
        prefill.prefill(job, dest)              -> the edge at once; the push runs meanwhile
        decode.admit(job, dest, first)          joins the batch once every page arrived
      outputs: decode's per-step batches, demultiplexed by cluster.fleet.workers.DecodeHandle

    failure (prefill dead, push refused, transfer deadline): the reservation is cancelled (its
    pages return to the pool) and the request goes to the next healthy prefill worker, then to
    decode-local prefill. A re-run's first token is the one already sent (greedy, or seeded:
    an unseeded sampled request gets a seed here, so a re-run draws the same stream), so it is
    not sent twice. Cancellation aborts the request on every worker it touched. A decode worker
    lost mid-stream: the request moves to another pair with the tokens it emitted, a
    constraint's grammar resumed after them (generate). Its context comes from wherever it still
    exists (docs/architecture.md, KV-preserving failover): a drained worker pushes it itself
    (_RayHandOff, decode.handoff), else the prefill worker's retained copy, else it is computed.

`ray` is imported after cluster.fleet.ray_runtime (which sets Ray's environment first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

from cluster.disagg_config import DisaggConfig
from cluster.edge.frontend import ModelView, PoolUsage
from cluster.errors import EdgeError, Kind
from cluster.fleet import ray_runtime  # noqa: F401  (before `ray`)
from cluster.fleet.calls import Stalled, decode_call, prefill_call, ray_await
from cluster.fleet.dispatch import Handed, PrefillSide, Redispatch, Started, dispatch, replayable
from cluster.fleet.fleet import Fleet, StartsWorkers
from cluster.fleet.pins import StandingPin, StandingPins, pin_worker, pins_decode, unpin_worker
from cluster.fleet.routes import route
from cluster.fleet.transfer_metrics import TransferMetrics
from cluster.fleet.worker_msgs import PrefillResult
from cluster.fleet.workers import DecodeHandle, Outputs, PrefillHandle, WorkerLost
from cluster.membership.protocol import Membership
from cluster.ops.node_status import NodeStatus
from cluster.ops.tracing import RequestTrace, Span, trace_of
from cluster.placement.global_index import NO_HIT, GlobalIndex
from cluster.placement.pair_health import PairHealth, PairRoute
from cluster.placement.policy import Placement, PlacementConfig, PlacementKind, Placer
from engine.job import Job
from engine.outputs import StepOutput, StepStats
from engine.pins import PinAnswer
from engine.request import CachedTokens
from engine.sampling import SamplingParams
from kvcache.hashing import page_hashes
from kvtransfer.codec import CHECKSUM_MISMATCH
from kvtransfer.jobs import TransferReport
from kvtransfer.transport import KVDestination

import ray  # isort: skip

logger = logging.getLogger(__name__)

ROUTE_CALL_S = 30.0  # a drained worker told how to reach a survivor (an nccl channel opens within it)


class RayFront:
    def __init__(
        self, model: ModelView, prefills: Sequence[PrefillHandle], decodes: Sequence[DecodeHandle], cfg: DisaggConfig,
        fingerprint: bytes = b"", page_size: int = 16, max_running: int = 64, page_bytes: int = 1 << 20,
        placement: PlacementConfig | None = None, membership: Membership | None = None, registry: Any = None,
        registry_name: str = "", spawner: StartsWorkers | None = None, routes: Sequence[PairRoute] = (),
    ) -> None:
        self.model = model  # cluster.fleet.launch.GatewayModel: the tokenizer and config, no weights
        self.cfg = cfg
        self.metrics = TransferMetrics()
        self.pairs = PairHealth(cfg.pair_failures, cfg.pair_retry_s)  # which pairs' transfers work
        self.fingerprint = fingerprint  # the engines' (page hashes carry it)
        self.page_size = page_size
        self.index = GlobalIndex()
        self.placer = Placer(self.index, placement or PlacementConfig(
            page_size=page_size, page_bytes=page_bytes, local_prefill_tokens=cfg.local_prefill_tokens))
        self.fleet = Fleet(prefills, decodes, cfg, self.index, self.placer, self.pairs, self.metrics, max_running,
                           membership, registry, registry_name, spawner, routes)  # fmt: skip
        self._turn = 0  # the round_robin placement's (DisaggConfig.placement)
        self._moving: dict[str, tuple[_Lost, RequestTrace]] = {}  # migrated attempts until computed()
        self._hand_off_routes: dict[tuple[str, str], asyncio.Task[bool]] = {}  # (drained, survivor) -> routed
        self.pins = StandingPins(self.metrics.pins_reapplied)
        self.fleet.on_join = self._joined

    # -- the surface the Frontend uses --------------------------------------------------------

    @property
    def engine(self) -> ModelView:
        return self.model

    @property
    def is_alive(self) -> bool:
        return self.fleet.is_alive

    def is_live(self, max_heartbeat_age_s: float) -> bool:
        """The gateway runs no engine: its own event loop, which answers this call, is what
        lives here. Decode workers being down (all of them: one pod pulling its image) makes it
        not ready, never not live -- a restart would end every actor it owns."""
        return True

    @property
    def last_stats(self) -> StepStats | None:
        return None  # pool_usage reports the running batches instead

    def nodes(self) -> list[NodeStatus]:
        return self.fleet.nodes()

    def pool_usage(self) -> PoolUsage:
        return self.fleet.pool_usage()

    def start(self) -> None:
        self.fleet.start()

    async def stop(self) -> None:
        await self.fleet.stop()

    # -- pinned prefixes (cluster.edge.pins) ----------------------------------------------------

    async def pin_prefix(
        self, role: str, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float, wait_s: float
    ) -> list[PinAnswer]:
        """Pin on every routable worker of `role` ("": the prefill workers, or the decode
        workers when there are none; one that left or stalls gets no work, nor pins): each
        one's answer. The pin stands (cluster.fleet.pins): workers that join later get it too."""
        prefills: list[PrefillHandle | DecodeHandle] = [p for p in self.fleet.prefills if p.is_routable]
        if pins_decode(role, bool(prefills)):
            targets: list[PrefillHandle | DecodeHandle] = [d for d in self.fleet.decodes if d.is_routable]
        else:
            targets = prefills
        expires_at = time.monotonic() + ttl_s
        answers = list(await asyncio.gather(*(pin_worker(h, pin_id, prompt_ids, cache_salt, ttl_s, wait_s)
                                              for h in targets)))  # fmt: skip
        self.pins.stand(pin_id, StandingPin(role, prompt_ids, cache_salt, expires_at, wait_s), answers)
        return answers

    async def unpin_prefix(self, pin_id: str) -> int:
        """Release a pin on every live worker (of both roles); how many had it."""
        self.pins.drop(pin_id)
        handles: list[PrefillHandle | DecodeHandle] = [*self.fleet.prefills, *self.fleet.decodes]
        handles = [h for h in handles if h.is_alive]
        return sum(await asyncio.gather(*(unpin_worker(h, pin_id) for h in handles)))

    def follow_pins(self, answered: Callable[[str, PinAnswer], None]) -> None:
        self.pins.on_answer = answered

    def _joined(self, handle: PrefillHandle | DecodeHandle) -> None:
        if len(self.pins):
            self.fleet.pending.fire(self.pins.reapply(handle, any(p.is_routable for p in self.fleet.prefills)))

    # -- one request ----------------------------------------------------------------------------

    async def generate(self, job: Job) -> AsyncIterator[StepOutput]:
        """The request's outputs. When its decode worker is lost mid-stream, the request moves:
        prompt + the tokens already emitted go to a healthy pair as a new attempt (at most
        cfg.max_migrations times), and the stream goes on with no gap and no repeat. A
        constrained request's new workers advance its grammar over those tokens first
        (Job.num_resumed), so its mask goes on where the lost worker's stopped. With no
        capacity left, the WorkerLost (or the placement's refusal) reaches the client."""
        job = replayable(job)  # a re-run (another path, a migration) replays the stream
        req_id, sampling = job.req_id, job.sampling
        trace = trace_of(req_id)  # the edge's span (cluster.ops.tracing), or one that records nothing
        prompt, emitted = job.prompt_ids, 0
        lost: _Lost | None = None
        for attempt in range(self.cfg.max_migrations + 1):
            this = replace(job, req_id=req_id if attempt == 0 else f"{req_id}@{attempt}", prompt_ids=prompt,
                           sampling=_continued(sampling, emitted), num_resumed=job.num_resumed + emitted,
                           reuse_cache=job.reuse_cache and (attempt == 0 or self.cfg.preserve_kv))  # fmt: skip
            base = emitted
            if lost is not None:  # computed() says where its context came from
                self._moving[this.req_id] = (lost, trace)
            try:
                async for out in self._attempt(this, trace, lost):
                    if base:  # counted from the original request's start, under its id
                        out = replace(out, req_id=req_id, num_output_tokens=out.num_output_tokens + base,
                                      num_prompt_tokens=len(job.prompt_ids))  # fmt: skip
                    prompt += tuple(out.token_ids)
                    emitted += len(out.token_ids)
                    yield out
                return
            except WorkerLost as exc:
                if attempt == self.cfg.max_migrations:
                    raise
                self.metrics.migrations.inc()
                lost = _Lost(exc.worker, time.monotonic(), this.req_id if exc.handing_off else "")
                logger.warning("%s: %s; moving it with %d tokens emitted (attempt %d)", req_id, exc, emitted,
                               attempt + 2)  # fmt: skip
            finally:
                self._moving.pop(this.req_id, None)  # computed() took it, or the attempt never got there

    def computed(self, job: Job, cached: CachedTokens, decode: str, prefill: str | None) -> None:
        """Tally: a migrated request's context is on its new decode worker. How much of it was
        fetched from a copy -- another worker's ("peer": the prefill worker that pushed it,
        from its retained copy or any tier the index named), the drained worker's it left
        ("drained": its hand-off) or the decode worker's own tiers ("own") -- and how much
        recomputed, in metrics and a baton.migration span."""
        moving = self._moving.pop(job.req_id, None)
        if moving is None:
            return
        lost, trace = moving
        context = len(job.prompt_ids)
        fetched = min(cached.total, context)
        source = "own" if prefill is None else "drained" if prefill == lost.decode else "peer"
        self.metrics.migrated_tokens.labels("fetched", source).inc(fetched)
        self.metrics.migrated_tokens.labels("recomputed", "").inc(context - fetched)
        with trace.span("baton.migration", req_id=job.req_id) as span:
            span.set(from_worker=lost.decode, to_worker=decode, via=prefill or "", source=source,
                     context_tokens=context, fetched_tokens=fetched, recomputed_tokens=context - fetched,
                     fetched_device=cached.device, fetched_host=cached.host, fetched_disk=cached.disk,
                     seconds_since_loss=time.monotonic() - lost.at)  # fmt: skip

    async def _attempt(self, job: Job, trace: RequestTrace, lost: _Lost | None) -> AsyncIterator[StepOutput]:
        """One placement of the request and its stream (generate moves it if the decode side is
        lost; `lost`: it moved, and its first output is the wait resume_seconds measures)."""
        req_id = job.req_id
        with trace.span("baton.placement", req_id=req_id) as placing:
            placement = await self._placement(job)
            placing.set(kind=placement.kind.name.lower(), decode_worker=placement.decode_id or "",
                        prefill_worker=placement.prefill_id or "", hit_pages=placement.hit.num_pages,
                        peer_pages=placement.num_peer_pages, locality_given_up=placement.locality_given_up,
                        recompute_tokens=placement.num_recompute_tokens, fallbacks=len(placement.fallbacks))
        handle = self.fleet.decode_of[placement.decode_id or ""]
        try:
            paths = self._paths(placement, handle.name)
            if (source := await self._hand_off_source(lost, handle)) is not None:
                paths.insert(0, source)  # the drained worker holds all of the context
            decode = _RayDecode(self, handle, handle.subscribe(req_id))  # before it starts: no output unseen
        except BaseException:
            self.placer.finish(req_id)
            raise
        try:
            async for out in dispatch(job, decode, paths, trace, self):
                if lost is not None:
                    self.metrics.resume_seconds.observe(time.monotonic() - lost.at)
                    lost = None
                yield out
        finally:
            self.placer.finish(req_id)
            handle.unsubscribe(req_id)

    # -- the Tally dispatch() counts on ---------------------------------------------------------

    def placed(self, job: Job, route: str) -> None:
        self.metrics.placements.labels(route).inc()
        self.placer.release_prefill(job.req_id)  # computed, or decode's: it no longer queues there

    def redispatched(self, job: Job, to: str) -> None:
        self.metrics.redispatches.labels(to).inc()

    # -- where it goes ----------------------------------------------------------------------------

    async def _placement(self, job: Job) -> Placement:
        """Where the request goes (cluster.placement.policy): its decode worker and prefill path."""
        if not any(d.is_routable for d in self.fleet.decodes):
            raise EdgeError(Kind.UNAVAILABLE, "no decode worker is available", None, 1.0)
        await self.fleet.ensure_stats()
        self.fleet.refresh()
        if self.cfg.placement == "round_robin":
            return self._round_robin(job)
        ps = self.page_size
        num_pages = (len(job.prompt_ids) - 1) // ps  # at least one token is always computed
        hashes = page_hashes(job.prompt_ids[: num_pages * ps], ps, job.cache_salt.encode(), self.fingerprint)
        p = self.placer.place(job.req_id, hashes, len(job.prompt_ids), job.tenant, job.session, job.slo)
        if p.kind == PlacementKind.SATURATED:
            self.metrics.saturated.inc()
            raise EdgeError(Kind.RESOURCE_EXHAUSTED, "server overloaded: no decode worker has room; retry later",
                            None, p.retry_after_s)  # fmt: skip
        self.metrics.given_up.inc(p.locality_given_up)
        return p

    def _round_robin(self, job: Job) -> Placement:
        """The comparison policy: decode and prefill workers in turn, caches ignored (the decode
        worker still prefills a prompt whose uncached part there is short)."""
        decodes = [d for d in self.fleet.decodes if d.is_routable]
        prefills = [p.name for p in self.fleet.prefills if p.is_routable]
        self._turn += 1
        decode = decodes[self._turn % len(decodes)].name
        if not prefills:
            return Placement(PlacementKind.LOCAL, decode, None, NO_HIT, None, 0, len(job.prompt_ids), 0, None, 0.0, 0)
        first = self._turn % len(prefills)
        order = prefills[first:] + prefills[:first]
        return Placement(PlacementKind.DISAGGREGATED, decode, order[0], NO_HIT, None, 0, len(job.prompt_ids), 0,
                         None, 0.0, 0, tuple(order[1:]))  # fmt: skip

    def _paths(self, p: Placement, decode: str) -> list[PrefillSide | None]:
        """The prefill workers to try in order (the placement's, then its fallbacks) whose pair
        with `decode` moves pages (cluster.placement.pair_health), then decode-local (None). A LOCAL
        placement is local at once."""
        if p.kind == PlacementKind.LOCAL:
            return [None]
        prefill_of = self.fleet.prefill_of
        named = [prefill_of[w] for w in (p.prefill_id, *p.fallbacks) if w in prefill_of]
        return [*(_RayPrefill(self, h) for h in named if h.is_routable and self.pairs.can_route(h.name, decode)),
                None]  # fmt: skip

    async def _hand_off_source(self, lost: _Lost | None, target: DecodeHandle) -> _RayHandOff | None:
        """The drained decode worker a moved request left, as the first path to `target`: it
        pushes the request's whole context, generated tokens included. None when the request
        was lost otherwise, preservation is off, or that worker cannot reach `target`."""
        if lost is None or not lost.moved or not self.cfg.preserve_kv:
            return None
        source = self.fleet.decode_of.get(lost.decode)
        if source is None or source is target or not source.is_alive:
            return None
        pair = (source.name, target.name)
        routed = self._hand_off_routes.get(pair)
        if routed is None:  # once a pair, however many requests move at once
            self._forget_hand_off_routes()
            routed = self._hand_off_routes[pair] = asyncio.ensure_future(self._route_hand_off(source, target))
        return _RayHandOff(self, source, lost.moved) if await asyncio.shield(routed) else None

    def _forget_hand_off_routes(self) -> None:
        """Routes from drained workers that are gone: a draining worker's routes serve only
        while it lives, so the map holds a few pairs, not one for each drain ever."""
        decode_of = self.fleet.decode_of
        for pair in [(s, t) for s, t in self._hand_off_routes if s not in decode_of or not decode_of[s].is_alive]:
            del self._hand_off_routes[pair]

    async def _route_hand_off(self, source: DecodeHandle, target: DecodeHandle) -> bool:
        """Tell the drained worker how to reach `target` (cluster.fleet.routes): whether it can."""
        try:
            [got] = await asyncio.wait_for(route([(source.name, source.actor)],
                                                 [(target.name, target.actor, target.address)], self.cfg.transport),
                                           ROUTE_CALL_S)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 -- no hand-off: the request takes the other paths
            logger.warning("drained decode worker %s cannot reach %s: %r", source.name, target.name, exc)
            return False
        if got.error:
            logger.warning("drained decode worker %s cannot reach %s: %s", source.name, target.name, got.error)
        return not got.error

    def prefill_failed(self, prefill: PrefillHandle | DecodeHandle, job: Job, exc: BaseException) -> str:
        """Why a call to `prefill` (a prefill worker, or a drained decode worker handing a
        request off) failed (counted, its request aborted there; a dead worker marked)."""
        if isinstance(exc, ray.exceptions.RayActorError):
            prefill.mark_dead(exc)
            reason = "prefill worker died"
        elif isinstance(exc, Stalled | WorkerLost):  # WorkerLost: a drained worker handing off
            reason = "prefill worker stalled"
        elif isinstance(exc, TimeoutError):
            reason = "deadline"
        else:
            logger.warning("%s: prefill on %s failed: %r", job.req_id, prefill.name, exc)
            reason = "prefill error"
        self.fleet.pending.fire(prefill.actor.abort.remote(job.req_id))
        self.metrics.failures.labels(_reason(reason)).inc()
        return reason


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


class _Lost(NamedTuple):
    decode: str  # the worker it was lost with
    at: float  # time.monotonic() when the gateway learned it
    moved: str = ""  # the request's id there, when that worker drains and hands it off


class _Push(NamedTuple):
    """A Ray prefill side's ticket: which worker pushes the pages (a prefill worker, or a
    drained decode worker handing a request off), under which transfer."""

    prefill: PrefillHandle | DecodeHandle
    transfer_id: str

    @property
    def is_pair(self) -> bool:
        """A prefill -> decode pair, whose health and link the gateway keeps."""
        return isinstance(self.prefill, PrefillHandle)

    @property
    def can_resend(self) -> bool:
        """Its sender may send its copy once more (damaged in flight)."""
        return self.prefill.is_routable if self.is_pair else self.prefill.is_alive


class _Named(Protocol):
    name: str
    epoch: int


class _Side:
    """A worker as dispatch() sees it: named, and fenced by the epoch, as its handle is now."""

    handle: _Named

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def epoch(self) -> int:
        return self.handle.epoch


class _RayPrefill(_Side):
    """A prefill actor as dispatch() sees it (cluster.fleet.dispatch.PrefillSide)."""

    handle: PrefillHandle

    def __init__(self, front: RayFront, handle: PrefillHandle) -> None:
        self.front, self.handle = front, handle

    async def prefill(self, job: Job, dest: KVDestination, span: Span) -> Started:
        handle = self.handle
        handle.num_inflight += 1
        try:
            result: PrefillResult = await prefill_call(
                handle, handle.actor.prefill.remote(job, dest), self.front.cfg.reservation_ttl_s)
        except Exception as exc:
            span.fail(self.front.prefill_failed(handle, job, exc))
            raise Redispatch from None
        finally:
            handle.num_inflight -= 1
        return Started(result.output, _Push(handle, result.transfer_id))

    def abort(self, req_id: str) -> None:
        self.front.fleet.pending.fire(self.handle.actor.abort.remote(req_id))


class _RayHandOff(_Side):
    """A draining decode worker as dispatch() sees a prefill side: it pushes the context of the
    request that ran there as `moved` from its own cached pages (decode.handoff)."""

    handle: DecodeHandle

    def __init__(self, front: RayFront, handle: DecodeHandle, moved: str) -> None:
        self.front, self.handle, self.moved = front, handle, moved

    async def prefill(self, job: Job, dest: KVDestination, span: Span) -> Started:
        handle = self.handle
        try:
            result: PrefillResult = await decode_call(
                handle, handle.actor.hand_off.remote(job, dest, self.moved), self.front.cfg.reservation_ttl_s)
        except Exception as exc:
            span.fail(self.front.prefill_failed(handle, job, exc))
            raise Redispatch from None
        return Started(result.output, _Push(handle, result.transfer_id))

    def abort(self, req_id: str) -> None:
        self.front.fleet.pending.fire(self.handle.actor.abort.remote(req_id))


class _RayDecode(_Side):
    """A decode actor as dispatch() sees it (cluster.fleet.dispatch.DecodeSide), for one request
    whose outputs `queue` receives."""

    handle: DecodeHandle

    def __init__(self, front: RayFront, handle: DecodeHandle, queue: Outputs) -> None:
        self.front, self.handle, self.queue = front, handle, queue

    async def reserve(self, job: Job, prefill: PrefillSide | None) -> KVDestination | None:
        epoch = prefill.epoch if prefill is not None else None
        dest: KVDestination | None = await decode_call(
            self.handle, self.handle.actor.place.remote(job, epoch), self.front.cfg.reservation_ttl_s)
        return dest

    async def hand_over(self, job: Job, dest: KVDestination, started: Started, trace: RequestTrace) -> None:
        """Wait for the push; the request joins decode's batch, or Redispatch (pages freed)."""
        front, decode = self.front, self.handle
        push = started.ticket
        assert isinstance(push, _Push)
        wait_s = front.cfg.transfer_deadline_s
        admit = decode.actor.admit.remote(job, dest, started.first, wait_s)  # waits there
        failed: str | None = None
        report: TransferReport | None = None
        got: TransferReport
        with trace.span("baton.transfer", req_id=job.req_id, prefill_worker=push.prefill.name,
                        decode_worker=decode.name) as transfer:  # fmt: skip
            front.metrics.inflight.inc()
            try:
                call = push.prefill.actor.push_result.remote(push.transfer_id)
                report = got = await asyncio.wait_for(ray_await(call), wait_s + 1)
                front.metrics.observe(got)
                transfer.set(transport=got.transport, bytes=got.num_bytes, pages=got.num_pages,
                             seconds=got.seconds)  # fmt: skip
                if not got.accepted:
                    failed = got.error
                    front.metrics.failures.labels(_reason(failed)).inc()
            except Exception as exc:
                failed = front.prefill_failed(push.prefill, job, exc)  # counted there
            finally:
                front.metrics.inflight.dec()
            if failed is not None:
                self.cancel(dest)  # admit then answers False at once
            if not await decode_call(decode, admit, wait_s + 2):
                if failed is None:  # the push said yes, but the pages did not all arrive in time
                    failed = "deadline"
                    front.metrics.failures.labels(failed).inc()
                logger.info("%s: transfer %s failed (%s); re-dispatching", job.req_id, push.transfer_id, failed)
                transfer.fail(_reason(failed))
                if push.prefill.is_alive and push.is_pair:  # a dead worker is not its link's fault
                    front.pairs.failed(push.prefill.name, decode.name, failed)
                # bytes damaged on the way: the worker's copy is good, so it sends it once more
                raise Redispatch(again=failed == CHECKSUM_MISMATCH and push.can_resend)
            if not push.is_pair:
                return
            front.pairs.succeeded(push.prefill.name, decode.name)
            if report is not None:  # what the push measured of the link
                front.placer.links.observe(push.prefill.name, decode.name, report.num_bytes, report.wire_seconds)

    def outputs(self, job: Job, handed: Handed | None) -> AsyncIterator[StepOutput]:
        return self.handle.outputs(self.queue)  # started on the actor by place() or admit()

    def cancel(self, dest: KVDestination) -> None:
        self.front.fleet.pending.fire(self.handle.actor.cancel.remote(dest))

    def abort(self, req_id: str) -> None:
        self.front.fleet.pending.fire(self.handle.actor.abort.remote(req_id))
