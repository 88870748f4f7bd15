"""Membership for the embedded `baton up` (cluster/membership/embedded.py): the registry in-process
(fast, most cases), then once as a real Ray actor on the session's local Ray.

A member reaches the registry through a port the test can cut: a partition of that member
only (its heartbeats fail, the registry expires it), proved by the registry's own answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.membership.embedded import (
    Changes,
    RayMembership,
    Registry,
    RegistryPort,
    Snapshot,
    actor_port,
    spawn_registry,
)
from cluster.membership.protocol import (
    EpochFence,
    EventKind,
    EventStream,
    MemberEvent,
    MembershipUnavailable,
    Role,
    WorkerIdTaken,
    WorkerInfo,
)

pytestmark = pytest.mark.timeout(60)

TTL_S = 0.6


class CutPort:
    """A registry port whose link the test cuts (every call fails) and restores."""

    def __init__(self, port: RegistryPort) -> None:
        self.port = port
        self.is_cut = False

    def _check(self) -> None:
        if self.is_cut:
            raise ConnectionError("link cut")

    async def register(self, info: WorkerInfo) -> WorkerInfo | None:
        self._check()
        return await self.port.register(info)

    async def update(self, info: WorkerInfo) -> bool:
        self._check()
        return await self.port.update(info)

    async def heartbeat(self, worker_id: str, epoch: int) -> bool:
        self._check()
        return await self.port.heartbeat(worker_id, epoch)

    async def deregister(self, worker_id: str, epoch: int) -> None:
        self._check()
        await self.port.deregister(worker_id, epoch)

    async def snapshot(self) -> Snapshot:
        self._check()
        return await self.port.snapshot()

    async def changes(self, after: int, wait_s: float) -> Changes:
        self._check()
        return await self.port.changes(after, min(wait_s, 0.2))  # notice a cut soon


def worker(worker_id: str, role: Role = Role.PREFILL, num_pages: int = 64) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}.actor", "node-a", num_pages=num_pages)


async def next_events(stream: EventStream, n: int, timeout_s: float = 5.0) -> list[MemberEvent]:
    async with asyncio.timeout(timeout_s):
        return [await anext(stream) for _ in range(n)]


def kinds(events: list[MemberEvent]) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.worker.worker_id) for e in events]


@pytest.fixture
async def opened() -> AsyncIterator[list[RayMembership]]:
    ms: list[RayMembership] = []
    yield ms
    for m in ms:
        await m.close()


async def open_member(opened: list[RayMembership], port: RegistryPort) -> RayMembership:
    m = await RayMembership.open(port, retry_s=0.05, poll_wait_s=0.2)
    opened.append(m)
    return m


async def test_register_watch_update_deregister(opened: list[RayMembership]) -> None:
    registry = Registry(ttl_s=TTL_S)
    scheduler, node = await open_member(opened, registry), await open_member(opened, registry)
    events = scheduler.watch()
    e_prefill = await node.register(worker("p-0"))
    e_decode = await node.register(worker("d-0", Role.DECODE))
    assert e_decode > e_prefill > 0
    joined = await next_events(events, 2)
    assert kinds(joined) == [(EventKind.JOIN, "p-0"), (EventKind.JOIN, "d-0")]
    with pytest.raises(WorkerIdTaken):
        await scheduler.register(worker("p-0"))
    await asyncio.sleep(2 * TTL_S)  # heartbeats hold the registrations past their TTL
    assert await node.register(worker("p-0", num_pages=128)) == e_prefill
    await node.deregister("d-0")
    changed = await next_events(events, 2)
    assert kinds(changed) == [(EventKind.UPDATE, "p-0"), (EventKind.LEAVE, "d-0")]
    assert scheduler.members()["p-0"] == worker("p-0", num_pages=128).with_epoch(e_prefill)
    assert set((await registry.snapshot()).members) == {worker("p-0", num_pages=128).with_epoch(e_prefill)}


async def test_partitioned_worker_expires_comes_back_with_a_new_epoch_and_the_stale_one_is_refused(
    opened: list[RayMembership],
) -> None:
    registry = Registry(ttl_s=TTL_S)
    link = CutPort(registry)
    node, decode_side = await open_member(opened, link), await open_member(opened, registry)
    fence = EpochFence(decode_side)
    events = decode_side.watch()
    first = await node.register(worker("p-0"))
    await next_events(events, 1)
    assert fence.admit("p-0", first)
    link.is_cut = True
    (left,) = await next_events(events, 1, timeout_s=TTL_S + 2)
    assert kinds([left]) == [(EventKind.LEAVE, "p-0")]
    assert not await registry.heartbeat("p-0", first)  # the fault happened: the registry dropped it
    assert not fence.admit("p-0", first)
    link.is_cut = False
    (joined,) = await next_events(events, 1)
    second = joined.worker.epoch
    assert joined.kind == EventKind.JOIN and second > first
    assert fence.admit("p-0", second) and not fence.admit("p-0", first)
    assert (fence.num_admitted, fence.num_refused_stale, fence.num_refused_unknown) == (2, 1, 1)


async def test_unreachable_registry_serves_last_known_then_catches_up_past_a_lost_log(
    opened: list[RayMembership],
) -> None:
    registry = Registry(ttl_s=TTL_S, max_log=2)
    link = CutPort(registry)
    scheduler, node = await open_member(opened, link), await open_member(opened, registry)
    events = scheduler.watch()
    epochs = {w: await node.register(worker(w)) for w in ("p-0", "p-1")}
    await next_events(events, 2)
    link.is_cut = True
    async with asyncio.timeout(2):
        while scheduler.stats().is_connected:  # its long-poll in flight has returned
            await asyncio.sleep(0.02)
    with pytest.raises(MembershipUnavailable):
        await scheduler.register(worker("p-9"))  # nobody joins through a cut link
    await node.deregister("p-0")
    for w in ("d-0", "d-1", "d-2"):  # more changes than the registry's log holds
        await node.register(worker(w, Role.DECODE))
    await asyncio.sleep(0.3)
    assert all(scheduler.check_epoch(w, e) for w, e in epochs.items())  # serving goes on
    link.is_cut = False
    changed = await next_events(events, 4)
    assert kinds(changed) == [(EventKind.LEAVE, "p-0"), (EventKind.JOIN, "d-0"),
                              (EventKind.JOIN, "d-1"), (EventKind.JOIN, "d-2")]  # fmt: skip
    assert scheduler.stats().num_relists == 2 and set(scheduler.members()) == {"p-1", "d-0", "d-1", "d-2"}


async def test_registry_as_a_ray_actor(ray_cluster: Any, opened: list[RayMembership]) -> None:
    import ray

    actor = spawn_registry("baton-test-membership", ttl_s=TTL_S)
    try:
        link = CutPort(actor_port(actor))
        scheduler = await open_member(opened, actor_port(ray.get_actor("baton-test-membership")))
        node = await open_member(opened, link)
        events = scheduler.watch()
        first = await node.register(worker("p-0"))
        (joined,) = await next_events(events, 1)
        assert (joined.kind, joined.worker.epoch) == (EventKind.JOIN, first)
        link.is_cut = True  # the worker stops heartbeating: the actor expires it
        (left,) = await next_events(events, 1, timeout_s=TTL_S + 2)
        assert kinds([left]) == [(EventKind.LEAVE, "p-0")]
        link.is_cut = False
        (joined,) = await next_events(events, 1)
        assert joined.worker.epoch > first
        await asyncio.to_thread(kill_and_prove, actor)  # the registry dies: serving goes on
        with pytest.raises(MembershipUnavailable):
            await node.register(worker("p-1"))
        assert set(scheduler.members()) == {"p-0"}
        assert scheduler.check_epoch("p-0", joined.worker.epoch)
    finally:
        ray.kill(actor)


def kill_and_prove(actor: Any, timeout_s: float = 30.0) -> None:
    """ray.kill only asks: call until Ray answers RayActorError (bounded)."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{actor} still answers {timeout_s} s after ray.kill")
