"""Membership as the Ray deployment uses it (cluster.membership.protocol's interface, either backend).

    m = await open_membership(cfg, registry_name)       the gateway: follows who is in
    member = await WorkerMember.join(cfg, registry_name, info)
                                                        a worker actor: registers itself, keeps
                                                        its lease alive; member.epoch follows a
                                                        re-registration; member.leave() on drain

`ray` backend: the registry is a named actor the gateway spawned (cluster.membership.embedded);
`etcd`: leases under /{cluster}/workers/ (cluster.membership.etcd). A worker id still held by
a dead predecessor's lease (a restarted gateway's actors) frees within the lease TTL: joining
retries that long before it gives up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.disagg_config import MembershipConfig
from cluster.fleet import worker_signals
from cluster.membership.protocol import Membership, Role, WorkerIdTaken, WorkerInfo
from cluster.placement.kv_log import MAX_BATCH, KVEventLog
from kvcache.events import KVEvent, Tier

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 70  # the process exit code when the engine failed (EX_SOFTWARE)
JOIN_GRACE_S = 2.0  # past the lease TTL, for a predecessor's registration to expire
DRAIN_TIMEOUT_S = 300.0  # a drain gives in-flight requests this long (k8s: below the grace period)
DRAIN_QUIET_S = 0.5  # idle this long ends a drain: calls the gateway had sent meanwhile land first
DRAIN_POLL_S = 0.05


async def open_membership(cfg: MembershipConfig, registry_name: str) -> Membership:
    if cfg.backend == "etcd":
        from cluster.membership.etcd import EtcdConfig, EtcdMembership

        return await EtcdMembership.open(
            EtcdConfig(cfg.etcd_host, cfg.etcd_port, cfg.cluster, cfg.lease_ttl_s, access=cfg.etcd_access)
        )
    import ray

    from cluster.membership.embedded import RayMembership, actor_port

    return await RayMembership.open(actor_port(ray.get_actor(registry_name)))


def spawn_registry(cfg: MembershipConfig, registry_name: str) -> Any:
    """The gateway's registry actor when the backend is `ray` (None for etcd)."""
    if cfg.backend != "ray":
        return None
    from cluster.membership.embedded import spawn_registry as spawn

    return spawn(registry_name, float(cfg.lease_ttl_s))


class WorkerMember:
    def __init__(self, membership: Membership, worker_id: str) -> None:
        self.membership = membership
        self.worker_id = worker_id
        self.has_left = False

    @classmethod
    async def join(cls, cfg: MembershipConfig, registry_name: str, info: WorkerInfo) -> WorkerMember:
        membership = await open_membership(cfg, registry_name)
        end = time.monotonic() + cfg.lease_ttl_s + JOIN_GRACE_S
        while True:
            try:
                await membership.register(info)
                return cls(membership, info.worker_id)
            except WorkerIdTaken:
                if time.monotonic() > end:
                    await membership.close()
                    raise
                await asyncio.sleep(0.25)  # a predecessor's lease, expiring

    @property
    def epoch(self) -> int:
        """The current registration's epoch (0 after leave)."""
        if self.has_left:
            return 0
        return self.membership.held_epoch(self.worker_id) or 0

    async def leave(self) -> None:
        """Deregister now (drain, shutdown): the gateway routes nothing new here."""
        if not self.has_left:
            self.has_left = True
            await self.membership.deregister(self.worker_id)

    async def close(self) -> None:
        await self.leave()
        await self.membership.close()


@dataclass(frozen=True, slots=True)
class DrainReport:
    seconds: float
    abandoned: int  # requests still unfinished at the timeout (they fail when the actor goes)


class Registration:
    """One worker actor's membership and lifecycle (both roles have one): `join` once started;
    `drain` (the planner, the pod's preStop through the gateway, or SIGTERM through
    cluster.fleet.worker_signals): leave membership so no new work comes, finish what is in flight
    (the gateway's calls already on their way too: DRAIN_QUIET_S of idleness ends it), give
    up on the rest at the timeout. Its KV log's epoch follows the registration's (`follow_epoch`),
    so the gateway's index reloads from a snapshot when a lost lease brought a new one. What it
    needs of the worker comes as callables: whether it is idle, how much is unfinished, and who
    else must learn a new epoch."""

    def __init__(
        self, role: Role, kv_log: KVEventLog, is_idle: Callable[[], bool], num_unfinished: Callable[[], int],
        on_epoch: Callable[[int], None] | None = None, exit_on_failure: bool = False,
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        self.role = role
        self.on_drain = on_drain  # told once a drain starts (a decode worker then hands its requests off)
        self.kv_log = kv_log
        self.is_idle = is_idle
        self.num_unfinished = num_unfinished
        self.on_epoch = on_epoch
        self.exit_on_failure = exit_on_failure  # spawned with a restart budget (cluster.fleet.actors)
        self.member: WorkerMember | None = None
        self.draining = False
        self.drain_timeout_s = DRAIN_TIMEOUT_S

    async def join(self, cfg: MembershipConfig, registry_name: str, info: WorkerInfo) -> int:
        """Register `info` -> its epoch. Joining again while registered is a no-op (a gateway
        that took a blip for a death asks again)."""
        if self.member is not None and not self.draining:
            return self.member.epoch
        self.member = await WorkerMember.join(cfg, registry_name, info)
        self.follow_epoch()
        return self.member.epoch

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Not-ready, out of membership, in-flight work finished (or abandoned at the timeout)."""
        start = time.monotonic()
        end = start + (self.drain_timeout_s if timeout_s is None else timeout_s)
        self.draining = True
        if self.on_drain is not None:
            self.on_drain()
        try:
            await self.leave()
        except Exception as exc:  # unreachable backend: the lease runs out by itself
            logger.warning("drain: leaving membership failed (%r); the lease expires instead", exc)
        idle_since: float | None = None
        while (now := time.monotonic()) < end:
            if not self.is_idle():
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= DRAIN_QUIET_S:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        report = DrainReport(time.monotonic() - start, self.num_unfinished())
        logger.warning("drained in %.2f s; %d requests abandoned", report.seconds, report.abandoned)
        return report

    async def leave(self) -> None:
        member, self.member = self.member, None  # a later join registers anew (a new epoch)
        if member is not None:
            await member.close()

    def follow_epoch(self) -> None:
        """A new registration's epoch (a lost lease, a rejoin) reaches the KV log and the worker."""
        epoch = self.member.epoch if self.member is not None else 0
        if epoch and epoch != self.kv_log.epoch:
            logger.info("%s: epoch %d -> %d", self.member.worker_id if self.member else "", self.kv_log.epoch, epoch)
            self.kv_log.set_epoch(epoch)
            if self.on_epoch is not None:
                self.on_epoch(epoch)

    def engine_failed(self, exc: BaseException) -> None:
        """The engine raised out of a step: its state (pages, batch) is in doubt. With a
        restart budget the process ends now (exit code EXIT_ENGINE_FAILED): the gateway sees
        the actor die, moves its requests, and once Ray has started a fresh process, has it
        rejoin under a new epoch (Fleet._revive). Without one the actor stays, failing
        every call, as `baton up` in one process has nothing to restart it."""
        logger.critical("%s: engine failed (%r); %s", self.role.name.lower(), exc,
                        "exiting for a restart" if self.exit_on_failure else "no restart budget: serving nothing")
        if self.exit_on_failure:
            os._exit(EXIT_ENGINE_FAILED)


class WorkerActor:
    """What both roles' actors answer the gateway and the platform, as Ray methods over what
    the actor has: its Registration (join, drain, leave), its KV log (events, snapshot, the
    fingerprint page hashes carry) and its engine's fault points (drills). A subclass passes
    them in and adds its role's methods; nothing here is a hook for it to fill."""

    def __init__(self, registration: Registration, kv_log: KVEventLog, engine: Engine) -> None:
        self.registration = registration
        self.kv_log = kv_log
        self.fingerprint_bytes = engine.fingerprint
        self.faults = engine.faults
        self.kernels = engine.kernels  # fixed once the engine is built: every stats report carries it

    async def join(self, cfg: MembershipConfig, registry_name: str, worker_id: str) -> int:
        """Register this actor (its Ray actor name is its address) -> its epoch; from now on
        SIGTERM drains it (cluster.fleet.worker_signals)."""
        import ray

        ctx = ray.get_runtime_context()
        info = WorkerInfo(worker_id, self.registration.role, ctx.get_actor_name() or "", ctx.get_node_id(),
                          kv_address=self.kv_address())  # fmt: skip
        epoch = await self.registration.join(cfg, registry_name, info)
        worker_signals.on_sigterm(asyncio.get_running_loop(), self.drain_and_exit)
        return epoch

    def kv_address(self) -> str:
        """Where senders push this worker's pages ("" for a worker that serves none)."""
        return ""

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        return await self.registration.drain(timeout_s)

    async def leave(self) -> None:
        await self.registration.leave()

    async def drain_and_exit(self) -> None:
        """SIGTERM's path (and the end of the gateway's drain_worker): drain unless a drain
        already ran, release what outlives the process, exit 0 (Ray records an intended exit)."""
        import ray

        try:
            if not self.registration.draining:
                await self.registration.drain()
            await self.close()
        finally:
            ray.get_runtime_context().current_actor.exit.remote()

    async def close(self) -> None:
        """Release what outlives the process (each role's own); leave membership first."""
        await self.registration.leave()

    async def exit(self) -> None:
        import ray

        ray.actor.exit_actor()

    async def inject_fault(self, point: str, times: int = 1, after: int = 0) -> None:
        """Drills and the fault suite only: the engine's `point` fails its next `times` passes,
        once `after` passes have gone through (engine.faults; refused unless the worker's
        environment allows injection)."""
        self.faults.arm(point, times, after)

    async def clear_faults(self) -> None:
        self.faults.clear()

    async def kv_events(self, after_seq: int, limit: int = MAX_BATCH) -> tuple[KVEvent, ...]:
        """The prefix cache's KV events after `after_seq`, at most `limit`."""
        return self.kv_log.events(after_seq, limit)

    async def kv_snapshot(self) -> tuple[int, int, list[tuple[bytes, Tier]]]:
        """(epoch, last event seq, every cached page and its tier) for the gateway's index."""
        return self.kv_log.snapshot()

    async def fingerprint(self) -> bytes:
        """The model identity its page hashes carry (the gateway hashes prompts with it)."""
        return self.fingerprint_bytes
