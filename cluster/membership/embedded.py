"""Membership for the embedded `baton up`, no etcd: the same interface over a Registry the
cluster runs itself -- as a Ray actor (spawn_registry + actor_port), or in-process for tests
and --no-ray (pass the Registry itself as the port).

    registry   workers with a heartbeat deadline; epoch = the registry's revision when one
               registered (it only grows); a log of the last `max_log` changes
    worker     epoch = register(info); heartbeat(worker_id, epoch) every ttl/3; False (it was
               expired: heartbeats missed) -> register again, a new epoch
    scheduler  snapshot at revision R, then changes(after=R) as a long-poll; a gap (the log
               moved past R) -> snapshot again and diff
    registry unreachable  members() answers the last-known view; nobody joins; the loops retry

Registry values cross Ray as frozen dataclasses (cluster/ conventions); nothing here leaves
the Ray cluster. `ray` is imported inside spawn_registry only (cluster.fleet.ray_runtime first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from cluster.membership.protocol import (
    EventKind,
    MemberEvent,
    MembershipUnavailable,
    MemberView,
    ViewBacked,
    WorkerIdTaken,
    WorkerInfo,
)

logger = logging.getLogger(__name__)


class Snapshot(NamedTuple):
    members: tuple[WorkerInfo, ...]
    revision: int
    ttl_s: float  # the registry's lease: workers heartbeat every ttl_s / 3


class Changes(NamedTuple):
    events: tuple[MemberEvent, ...]  # every change after `after`, in order
    revision: int
    is_complete: bool  # False: the log no longer reaches back to `after` (take a snapshot)


class Registry:
    """The registry's state; its methods are async so that one object serves in-process and
    as a Ray actor (ray.remote of this class) alike. Each change is one revision."""

    def __init__(self, ttl_s: float = 10.0, max_log: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.revision = 0
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}
        self._deadlines: dict[str, float] = {}
        self._log: deque[MemberEvent] = deque(maxlen=max_log)
        self._changed = asyncio.Event()

    async def register(self, info: WorkerInfo) -> WorkerInfo | None:
        """-> the registration (with its epoch); None when a live one holds the id."""
        self.expire()
        if info.worker_id in self._workers:
            return None
        info = info.with_epoch(self.revision + 1)
        self._workers[info.worker_id] = info
        self._deadlines[info.worker_id] = self._clock() + self.ttl_s
        self._record(EventKind.JOIN, info)
        return info

    async def update(self, info: WorkerInfo) -> bool:
        """New fields for the registration `info.epoch`; False when that is not current."""
        if not await self.heartbeat(info.worker_id, info.epoch):
            return False
        if self._workers[info.worker_id] != info:
            self._workers[info.worker_id] = info
            self._record(EventKind.UPDATE, info)
        return True

    async def heartbeat(self, worker_id: str, epoch: int) -> bool:
        self.expire()
        current = self._workers.get(worker_id)
        if current is None or current.epoch != epoch:
            return False
        self._deadlines[worker_id] = self._clock() + self.ttl_s
        return True

    async def deregister(self, worker_id: str, epoch: int) -> None:
        current = self._workers.get(worker_id)
        if current is not None and current.epoch == epoch:
            self._drop(worker_id)

    async def snapshot(self) -> Snapshot:
        self.expire()
        return Snapshot(tuple(self._workers.values()), self.revision, self.ttl_s)

    async def changes(self, after: int, wait_s: float) -> Changes:
        """Every change after revision `after`, waiting up to `wait_s` for one (a long-poll;
        expiry runs while it waits)."""
        deadline = self._clock() + wait_s
        self.expire()
        while self.revision <= after and (left := deadline - self._clock()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, self.ttl_s / 4))
            except TimeoutError:
                pass
            self.expire()
        oldest = self._log[0].revision if self._log else self.revision + 1
        if oldest > after + 1:  # the log moved past `after`: the caller takes a snapshot
            return Changes((), self.revision, False)
        return Changes(tuple(e for e in self._log if e.revision > after), self.revision, True)

    def expire(self) -> None:
        now = self._clock()
        for worker_id in [w for w, t in self._deadlines.items() if t < now]:
            logger.warning("worker %s missed its heartbeats: expired", worker_id)
            self._drop(worker_id)

    def _drop(self, worker_id: str) -> None:
        info = self._workers.pop(worker_id)
        del self._deadlines[worker_id]
        self._record(EventKind.LEAVE, info)

    def _record(self, kind: EventKind, info: WorkerInfo) -> None:
        self.revision += 1
        self._log.append(MemberEvent(kind, info, self.revision))
        self._changed.set()


class RegistryPort(Protocol):
    """How a member reaches the registry: the Registry itself, or actor_port(handle)."""

    async def register(self, info: WorkerInfo) -> WorkerInfo | None: ...
    async def update(self, info: WorkerInfo) -> bool: ...
    async def heartbeat(self, worker_id: str, epoch: int) -> bool: ...
    async def deregister(self, worker_id: str, epoch: int) -> None: ...
    async def snapshot(self) -> Snapshot: ...
    async def changes(self, after: int, wait_s: float) -> Changes: ...


class _ActorPort:
    def __init__(self, actor: Any) -> None:
        self._actor = actor  # ray.actor.ActorHandle[Registry]

    async def register(self, info: WorkerInfo) -> WorkerInfo | None:
        result: WorkerInfo | None = await self._actor.register.remote(info)
        return result

    async def update(self, info: WorkerInfo) -> bool:
        return bool(await self._actor.update.remote(info))

    async def heartbeat(self, worker_id: str, epoch: int) -> bool:
        return bool(await self._actor.heartbeat.remote(worker_id, epoch))

    async def deregister(self, worker_id: str, epoch: int) -> None:
        await self._actor.deregister.remote(worker_id, epoch)

    async def snapshot(self) -> Snapshot:
        result: Snapshot = await self._actor.snapshot.remote()
        return result

    async def changes(self, after: int, wait_s: float) -> Changes:
        result: Changes = await self._actor.changes.remote(after, wait_s)
        return result


def actor_port(actor: Any) -> RegistryPort:
    return _ActorPort(actor)


def spawn_registry(name: str, ttl_s: float = 10.0) -> Any:
    """The registry as a named actor of this Ray cluster (it lives as long as its creator, the
    gateway); workers find it by name (`ray.get_actor(name)`). It runs on the gateway's node:
    on another it would go down with that host and take membership with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(Registry).options(name=name, scheduling_strategy=here).remote(ttl_s)


class RayStats(NamedTuple):
    revision: int
    is_connected: bool
    num_relists: int
    num_reregistrations: int


@dataclass(slots=True)
class _Held:
    info: WorkerInfo  # with its epoch
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[None] | None = None


class RayMembership(ViewBacked):
    """Use `await RayMembership.open(port)`: it takes a snapshot before it returns."""

    def __init__(self, port: RegistryPort, ttl_s: float, retry_s: float, poll_wait_s: float, max_queued: int) -> None:
        self._port = port
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.poll_wait_s = poll_wait_s
        self._view = MemberView(max_queued)
        self._held: dict[str, _Held] = {}
        self._follower: asyncio.Task[None] | None = None
        self._is_connected = True
        self._is_closed = False
        self._num_relists = self._num_reregistrations = 0

    @classmethod
    async def open(
        cls, port: RegistryPort, retry_s: float = 0.5, poll_wait_s: float = 1.0, max_queued: int = 10_000
    ) -> RayMembership:
        try:
            snap = await port.snapshot()
        except Exception as exc:
            raise MembershipUnavailable("the membership registry is unreachable") from exc
        membership = cls(port, snap.ttl_s, retry_s, poll_wait_s, max_queued)
        membership._take(snap)
        membership._follower = asyncio.create_task(membership._follow(), name="baton-registry-follow")
        return membership

    async def register(self, info: WorkerInfo) -> int:
        held = self._held.get(info.worker_id)
        try:
            if held is not None:
                async with held.lock:
                    return await self._update(held, info)
            registered = await self._port.register(info)
        except Exception as exc:
            raise MembershipUnavailable(f"cannot register {info.worker_id}: the registry is unreachable") from exc
        if registered is None:
            raise WorkerIdTaken(info.worker_id)
        held = self._held[info.worker_id] = _Held(registered)
        held.task = asyncio.create_task(self._keepalive(held), name=f"baton-heartbeat-{info.worker_id}")
        return registered.epoch

    async def deregister(self, worker_id: str) -> None:
        held = self._held.pop(worker_id, None)
        if held is None:
            return
        if held.task is not None:
            held.task.cancel()
            await asyncio.gather(held.task, return_exceptions=True)
        try:
            await self._port.deregister(worker_id, held.info.epoch)
        except Exception as exc:
            logger.warning("%s: not deregistered (%r); it expires within %.0f s", worker_id, exc, self.ttl_s)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for worker_id in list(self._held):
            await self.deregister(worker_id)
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        self._view.close()

    def stats(self) -> RayStats:
        return RayStats(self._view.revision, self._is_connected, self._num_relists, self._num_reregistrations)

    # -- worker side --------------------------------------------------------------------------------

    async def _update(self, held: _Held, info: WorkerInfo) -> int:
        held.info = info.with_epoch(held.info.epoch)
        if not await self._port.update(held.info) and not await self._rejoin(held):
            raise WorkerIdTaken(info.worker_id)
        return held.info.epoch

    async def _keepalive(self, held: _Held) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                if await self._port.heartbeat(held.info.worker_id, held.info.epoch):
                    continue
                async with held.lock:
                    await self._rejoin(held)
            except Exception as exc:  # unreachable (a dead actor, a cut link): retry at the next tick
                logger.info("%s: heartbeat failed (%r)", held.info.worker_id, exc)

    async def _rejoin(self, held: _Held) -> bool:
        old = held.info.epoch
        registered = await self._port.register(held.info)
        if registered is None:
            logger.error("%s: the id is held by another registration; retrying", held.info.worker_id)
            return False
        held.info = registered
        self._num_reregistrations += 1
        logger.warning("%s expired and registered again: epoch %d -> %d", registered.worker_id, old, registered.epoch)
        return True

    # -- scheduler side -----------------------------------------------------------------------------

    async def _follow(self) -> None:
        while not self._is_closed:
            try:
                changes = await self._port.changes(self._view.revision, self.poll_wait_s)
                if not changes.is_complete:
                    self._take(await self._port.snapshot())
                for event in changes.events:
                    self._view.apply(event)
                if not self._is_connected:
                    logger.info("membership registry reachable again at revision %d", changes.revision)
                self._is_connected = True
                continue
            except Exception as exc:
                if self._is_connected:
                    logger.warning("registry unreachable (%r): serving on the last-known membership", exc)
                self._is_connected = False
            await asyncio.sleep(self.retry_s)

    def _take(self, snap: Snapshot) -> None:
        self._view.replace(snap.members, snap.revision)
        self._num_relists += 1
