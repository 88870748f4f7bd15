"""The workers behind one gateway, apart from the request flow (cluster.fleet.front): their
handles, their health, their KV events into the index, membership, and adding or draining them.

    Fleet.start()
      per decode worker: its output stream (decode's stats come with every batch)
      _watch_workers    every HEALTH_PERIOD_S: prefill stats, under the watchdog (a silent
                        worker is stalled); a dead worker is revived when Ray restarts it
      _follow_kv        every KV_POLL_S: each live worker's new KV events into the GlobalIndex;
                        a snapshot when the index asks for one (joined, new epoch, a gap)
      _follow_members   joins, leaves and new epochs; a worker this gateway did not start is
                        adopted (found by its actor name, routed to and from)
    add_worker / drain_worker   the planner's: one more worker of a role, or one fewer

The placer's view of the workers (refresh, ensure_stats) comes from the stats already polled:
health, running and waiting requests, free pages (reservations deducted), a prefill worker's
measured s/token (until it has one: the others' mean, or PREFILL_S_PER_TOKEN) and its queue.
Not measured yet, so defaults: a decode worker prefilling at DECODE_PREFILL_FACTOR times the
prefill workers' mean (its prefill shares its steps with its batch), the decode ITL (ITL_S).

`ray` is imported after cluster.fleet.ray_runtime (which sets Ray's environment first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from cluster.disagg_config import DisaggConfig
from cluster.edge.frontend import PoolUsage
from cluster.fleet import ray_runtime  # noqa: F401  (before `ray`)
from cluster.fleet.calls import Pending, abandonable, decode_call, ray_await
from cluster.fleet.registration import DrainReport
from cluster.fleet.routes import route
from cluster.fleet.transfer_metrics import TransferMetrics
from cluster.fleet.worker_msgs import PrefillStats
from cluster.fleet.workers import DecodeHandle, PrefillHandle, WorkerLost
from cluster.membership.protocol import EventKind, Membership, MembershipLagged, WorkerInfo
from cluster.membership.protocol import Role as MemberRole
from cluster.ops.node_status import NodeStatus
from cluster.placement.global_index import GlobalIndex
from cluster.placement.pair_health import PairHealth, PairRoute
from cluster.placement.policy import Placer, Role, WorkerStats
from engine.kernel_info import EngineKernels
from kvcache.events import KVEvent, Tier
from kvcache.report import CacheReport

import ray  # isort: skip

logger = logging.getLogger(__name__)

HEALTH_PERIOD_S = 1.0
STOP_S = 5.0  # for the actors' own cleanup at shutdown
KV_POLL_S = 0.05  # KV events of every worker, this often
PREFILL_S_PER_TOKEN = 2e-4  # default until workers report a measured rate (baton-tiny, one core)
DECODE_PREFILL_FACTOR = 2.0  # a decode worker's prefill: its batch stalls meanwhile
ITL_S = 0.02  # default decode step time until workers report it
ADD_WORKER_S = 300.0  # a new actor loads its model and joins within this


class StartsWorkers(Protocol):
    """What add_worker needs of a launcher (cluster.fleet.launch.Spawner)."""

    async def start_worker(self, role: str, index: int, timeout_s: float = ...) -> Any: ...


class Fleet:
    def __init__(
        self, prefills: Sequence[PrefillHandle], decodes: Sequence[DecodeHandle], cfg: DisaggConfig,
        index: GlobalIndex, placer: Placer, pairs: PairHealth, metrics: TransferMetrics, max_running: int = 64,
        membership: Membership | None = None, registry: Any = None, registry_name: str = "",
        spawner: StartsWorkers | None = None, routes: Sequence[PairRoute] = (),
    ) -> None:
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.prefill_of = {p.name: p for p in self.prefills}
        self.decode_of = {d.name: d for d in self.decodes}
        self.cfg = cfg
        self.index = index
        self.placer = placer
        self.pairs = pairs
        self.metrics = metrics
        self.max_running = max_running  # a decode worker's batch limit (max_num_seqs)
        self.membership = membership
        self.registry = registry  # the `ray` backend's registry actor (it goes with the gateway)
        self.registry_name = registry_name  # what workers join (WorkerMember.join)
        self.spawner = spawner  # add_worker's (None: this gateway cannot start workers)
        self.pending = Pending()  # fire-and-forget calls in flight
        self.num_member_events = {kind.name.lower(): 0 for kind in EventKind}
        self.routed(routes)
        for p in self.prefills:
            self.index.add_worker(p.name, p.epoch)
        for d in self.decodes:
            self.index.add_worker(d.name, 1)  # DecodeActor's epoch
        self.refresh()
        self._kv_after: dict[str, int] = {}  # worker -> the last event seq read from it
        self._tasks: list[asyncio.Task[None]] = []
        self._retired: set[str] = set()  # drained or dead for good: never reused, adopted or revived
        self._reviving: set[str] = set()  # dead workers being brought back (_revive)
        self._spawned: dict[str, Any] = {}  # add_worker's actors: the creator's handles keep them alive
        # Told of each worker that starts serving after launch with an empty engine: one adopted
        # (the planner's, another gateway's) or one Ray restarted (RayFront re-applies pins).
        self.on_join: Callable[[PrefillHandle | DecodeHandle], None] = lambda handle: None

    @property
    def is_alive(self) -> bool:
        return any(d.is_alive for d in self.decodes)

    def handle(self, worker_id: str) -> PrefillHandle | DecodeHandle | None:
        return self.prefill_of.get(worker_id) or self.decode_of.get(worker_id)

    def start(self) -> None:
        for d in self.decodes:
            self._watch_decode(d)
            d.start()
        self._tasks = [asyncio.create_task(self._watch_workers()), asyncio.create_task(self._follow_kv())]
        if self.membership is not None:
            self._tasks.append(asyncio.create_task(self._follow_members(self.membership)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for d in self.decodes:
            await d.stop()
        # Let live actors close what outlives a process (a decode worker's /dev/shm region,
        # sockets), then end them: the actors are this gateway's and go with it.
        closing = [p.actor.close.remote() for p in self.prefills if p.is_alive]
        closing += [d.actor.close.remote() for d in self.decodes if d.is_alive]
        if closing:  # asyncio.wait refuses an empty set (every actor already dead)
            await asyncio.wait([asyncio.ensure_future(ray_await(ref)) for ref in closing], timeout=STOP_S)
        for actor in [p.actor for p in self.prefills] + [d.actor for d in self.decodes]:
            ray.kill(actor)
        self._spawned.clear()
        if self.membership is not None:
            await self.membership.close()
        if self.registry is not None:
            ray.kill(self.registry)

    # -- what operators and placement see ---------------------------------------------------------

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
                hosts.get(p.name, ""), p.pid or 0, s.num_retained_pages if s else 0,
                s.kernels if s else EngineKernels(),
            ))  # fmt: skip
        for d in self.decodes:
            t = d.stats
            health = ("down" if not d.is_alive else "stalled" if d.is_stalled else "left" if not d.is_member
                      else "starting" if t is None else "ok")  # fmt: skip
            nodes.append(NodeStatus(
                d.name, "decode", health, d.epoch, t.num_running if t else 0, t.num_waiting if t else 0, 0,
                t.num_reserved_pages if t else 0, cache=t.cache if t else CacheReport(),
                age_s=now - d.heartbeat if t else 0.0, preemptions=t.num_preempted if t else 0,
                host=hosts.get(d.name, ""), pid=t.pid if t else 0, kernels=t.kernels if t else EngineKernels(),
            ))  # fmt: skip
        return nodes

    def pool_usage(self) -> PoolUsage:
        stats = [d.stats for d in self.decodes if d.stats is not None]
        cached = sum(s.num_cached_pages for s in stats)
        return PoolUsage(sum(s.num_used_pages for s in stats) - cached, cached,
                         sum(s.num_pages for s in stats), sum(s.num_running for s in stats))

    async def ensure_stats(self) -> None:
        """A decode worker's first stats (until its output stream reports): free pages matter."""
        missing = [d for d in self.decodes if d.is_alive and d.stats is None]
        for d in missing:
            try:
                d.stats = await decode_call(d, d.actor.stats.remote(), 5 * HEALTH_PERIOD_S)
            except WorkerLost:
                pass

    def refresh(self) -> None:
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

    def routed(self, routes: Sequence[PairRoute]) -> None:
        """Pairs (re)routed: their health starts over; placement learns which share a host."""
        self.pairs.routed(routes)
        for r in routes:
            self.placer.links.set_same_host(r.prefill, r.decode, bool(r.prefill_host) and
                                            r.prefill_host == r.decode_host)  # fmt: skip

    # -- the index --------------------------------------------------------------------------------

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
        events: tuple[KVEvent, ...] = await asyncio.wait_for(ray_await(actor.kv_events.remote(after)), STOP_S)
        wants_snapshot = False
        for event in events:
            wants_snapshot |= self.index.apply(replace(event, worker_id=name)) is not None
            after = event.seq
        self._kv_after[name] = after
        state = self.index.sync_state(name)
        if wants_snapshot or state is None or state.is_stale:
            snap: tuple[int, int, list[tuple[bytes, Tier]]] = await asyncio.wait_for(
                ray_await(actor.kv_snapshot.remote()), STOP_S)
            epoch, seq, entries = snap
            self.index.load_snapshot(name, epoch, seq, entries)
            self._kv_after[name] = max(after, seq)

    # -- health -----------------------------------------------------------------------------------

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
                    self.pending.fire(self._revive(handle))
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _poll_prefill(self, p: PrefillHandle) -> None:
        call = abandonable(ray_await(p.actor.stats.remote()))
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
        d.may_hand_off = lambda: any(o.is_routable for o in self.decodes if o is not d)

    async def _revive(self, handle: PrefillHandle | DecodeHandle) -> None:
        """A worker's actor died. Ray restarts it when it has restarts left (a failed engine
        exits on purpose: Registration.engine_failed): the fresh process is started, rejoins
        membership under its old name (a new epoch; its predecessor's lease must run out
        first), and is routed to and from, and the handle serves again. An actor that is dead
        for good (killed, drained, out of restarts) answers RayActorError: it stays down."""
        role = "decode" if isinstance(handle, DecodeHandle) else "prefill"
        try:
            async with asyncio.timeout(ADD_WORKER_S):
                pid: int | None = None
                if isinstance(handle, DecodeHandle):
                    address: str = await ray_await(handle.actor.start.remote())
                else:
                    pid = await ray_await(handle.actor.ping.remote())
                epoch: int = await ray_await(handle.actor.join.remote(self.cfg.membership, self.registry_name,
                                                                     handle.name))  # fmt: skip
                if isinstance(handle, DecodeHandle):
                    routes = await route([(p.name, p.actor) for p in self.prefills if p.is_alive],
                                         [(handle.name, handle.actor, address)], self.cfg.transport)  # fmt: skip
                else:
                    routes = await route([(handle.name, handle.actor)], self._live_decodes(), self.cfg.transport)
                self.routed(routes)
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
        self.on_join(handle)

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
                        if self.handle(event.worker.worker_id) is None and event.worker.worker_id not in self._retired:
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
        for name in [*self.prefill_of, *self.decode_of]:
            self._set_member(name, members.get(name))

    def _set_member(self, worker_id: str, info: WorkerInfo | None) -> None:
        handle = self.handle(worker_id)
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
        joined: PrefillHandle | DecodeHandle
        try:
            actor = ray.get_actor(info.address)
            if info.role == MemberRole.PREFILL:
                self.routed(await route([(info.worker_id, actor)], self._live_decodes(), self.cfg.transport))
                prefill = PrefillHandle(info.worker_id, actor, info.epoch)
                self.prefills.append(prefill)
                self.prefill_of[info.worker_id] = joined = prefill
            else:
                address: str = await asyncio.wait_for(ray_await(actor.start.remote()), STOP_S)
                self.routed(await route([(p.name, p.actor) for p in self.prefills if p.is_alive],
                                        [(info.worker_id, actor, address)], self.cfg.transport))  # fmt: skip
                decode = DecodeHandle(info.worker_id, actor, address, self.cfg.poll_wait_s, epoch=info.epoch,
                                      watchdog_s=self.cfg.watchdog_s)  # fmt: skip
                self.decodes.append(decode)
                self.decode_of[info.worker_id] = joined = decode
                self._watch_decode(decode)
                decode.start()
        except Exception as exc:
            logger.warning("cannot adopt %s (%s at %r): %s", info.worker_id, info.role, info.address, exc)
            return
        self.index.add_worker(info.worker_id, info.epoch)
        logger.info("adopted %s worker %s (epoch %d)", info.role, info.worker_id, info.epoch)
        self.on_join(joined)

    # -- scaling (the planner's) -----------------------------------------------------------------

    async def add_worker(self, role: str, timeout_s: float = ADD_WORKER_S) -> str:
        """Start one more `role` worker ("prefill" or "decode"); returns its name once the
        gateway routes to it (it joins membership, _follow_members adopts it)."""
        if self.spawner is None or self.membership is None:
            raise RuntimeError("this gateway was not launched with a spawner and membership")
        if role not in ("prefill", "decode"):
            raise ValueError(f"role is prefill or decode, not {role!r}")
        named = self.prefill_of if role == "prefill" else self.decode_of
        taken = [int(n.rsplit("-", 1)[1]) for n in (*named, *self._retired) if n.rsplit("-", 1)[1].isdigit()
                 and n.startswith(f"{role}-")]  # fmt: skip
        index = max(taken, default=-1) + 1
        name = f"{role}-{index}"
        async with asyncio.timeout(timeout_s):
            self._spawned[name] = await self.spawner.start_worker(role, index, timeout_s)
            while name not in named:
                await asyncio.sleep(0.05)
        logger.info("added %s", name)
        return name

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> DrainReport:
        """Drain `name` (no new work from now on), then stop it and forget it. A decode
        worker configured to hand off (recovery.drain_hand_off) says so in its stats and its
        requests move to the others at once (DecodeHandle: they resume from copies of their
        pages, as after a loss), else they finish there; a prefill worker finishes what it
        computes and pushes. 0 failed by design."""
        handle = self.handle(name)
        if handle is None:
            raise KeyError(f"no worker named {name!r}")
        handle.is_member = False  # before its LEAVE arrives: nothing new goes there from now on
        self._retired.add(name)
        report: DrainReport = await ray_await(handle.actor.drain.remote(timeout_s))
        if isinstance(handle, DecodeHandle):
            handle.fail_all(WorkerLost(f"decode worker {name} was drained", name))  # only what the timeout abandoned
            await handle.stop()
            self.decodes.remove(handle)
            del self.decode_of[name]
        else:
            self.prefills.remove(handle)
            del self.prefill_of[name]
        try:
            await asyncio.wait_for(ray_await(handle.actor.drain_and_exit.remote()), STOP_S)
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
