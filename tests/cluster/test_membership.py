"""Membership over a real etcd server on loopback (docs/architecture.md, Membership and control;
issue 6, acceptance 1).

One etcd per session (tests/etcd_server.py), short leases (1-2 s); each test uses its own
cluster name, so its keys are its own. A fault is proved before its outcome is asserted: the
worker process is dead, etcd is down (its PID exited, its port refuses), the key is gone.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd  # type: ignore[import-untyped]
import pytest

from cluster.membership.etcd import EtcdConfig, EtcdMembership
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
from tests.etcd_server import EtcdServer, TcpGate, is_listening

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
EVENT_WAIT_S = 5.0


class Cluster:
    """Memberships and gates of one test (its own cluster name), closed at its end."""

    def __init__(self, etcd: EtcdServer, name: str) -> None:
        self.etcd, self.name = etcd, name
        self.opened: list[EtcdMembership] = []
        self.gates: list[TcpGate] = []

    def cfg(self, port: int | None = None, ttl_s: int = 2) -> EtcdConfig:
        return EtcdConfig(port=port or self.etcd.port, cluster=self.name, lease_ttl_s=ttl_s,
                          request_timeout_s=2.0, retry_s=0.1)  # fmt: skip

    async def open(self, ttl_s: int = 2, gate: TcpGate | None = None) -> EtcdMembership:
        m = await EtcdMembership.open(self.cfg(gate.port if gate else None, ttl_s))
        self.opened.append(m)
        return m

    async def gate(self) -> TcpGate:
        gate = await TcpGate.open(self.etcd.port)
        self.gates.append(gate)
        return gate

    async def close(self) -> None:
        for m in self.opened:
            await m.close()
        for gate in self.gates:
            await gate.close()


@pytest.fixture
async def cluster(etcd: EtcdServer, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    if not etcd.is_running():  # a test that stopped it failed before it could restart it
        etcd.start()
    c = Cluster(etcd, request.node.name.replace("_", "-")[:60])
    yield c
    await c.close()


@pytest.fixture
async def raw(etcd: EtcdServer) -> AsyncIterator[aetcd.Client]:
    """A plain client, to look at the keys themselves."""
    client = aetcd.Client("127.0.0.1", etcd.port, timeout=2)
    yield client
    await client.close()


def worker(worker_id: str, role: Role = Role.PREFILL, num_pages: int = 64) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}.actor", "node-a", kv_address="127.0.0.1:7000",
                      num_pages=num_pages, page_size=16, max_num_seqs=8)  # fmt: skip


async def next_events(stream: EventStream, n: int, timeout_s: float = EVENT_WAIT_S) -> list[MemberEvent]:
    async with asyncio.timeout(timeout_s):
        return [await anext(stream) for _ in range(n)]


def kinds(events: list[MemberEvent]) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.worker.worker_id) for e in events]


async def wait_until(predicate: object, timeout_s: float, what: str) -> float:
    """Poll `predicate()` (sync or async) until true -> seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        result = predicate()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


# -- WorkerInfo on the wire ---------------------------------------------------------------------


def test_worker_info_round_trips_as_json_without_its_epoch() -> None:
    info = worker("p-0").with_epoch(7)
    data = info.to_json()
    assert b"epoch" not in data  # the backend's revision is the epoch
    assert WorkerInfo.from_json(data, epoch=7) == info
    assert WorkerInfo.from_json(data.replace(b"{", b'{"future_field":1,', 1), epoch=7) == info


@pytest.mark.parametrize("data", [
    b"not json", b"[1]", b'{"worker_id":"a"}',
    worker("a").to_json().replace(b'"prefill"', b'"both"'),
    worker("a").to_json().replace(b'"num_pages":64', b'"num_pages":"64"'),
    worker("a").to_json().replace(b'"num_pages":64', b'"num_pages":-1'),
    worker("a").to_json().replace(b'"a"', b'"../etc"'),
    b'{"pad":"' + b"x" * 20000 + b'"}',
])  # fmt: skip
def test_malformed_worker_info_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        WorkerInfo.from_json(data, epoch=1)


# -- registration -------------------------------------------------------------------------------


async def test_register_lists_watches_updates_and_deregisters(cluster: Cluster, raw: aetcd.Client) -> None:
    # Given a scheduler's view of an empty cluster, and a worker process
    scheduler, node = await cluster.open(), await cluster.open()
    events = scheduler.watch()
    assert scheduler.members() == {}
    # When two workers register
    e_prefill = await node.register(worker("p-0"))
    e_decode = await node.register(worker("d-0", Role.DECODE))
    # Then the keys exist under a lease, the view sees them join, and the epochs are the keys'
    # create revisions (increasing)
    for worker_id, epoch in (("p-0", e_prefill), ("d-0", e_decode)):
        kv = await raw.get(f"/{cluster.name}/workers/{worker_id}".encode())
        assert kv is not None and kv.lease != 0 and kv.create_revision == epoch
    assert e_decode > e_prefill > 0
    joined = await next_events(events, 2)
    assert kinds(joined) == [(EventKind.JOIN, "p-0"), (EventKind.JOIN, "d-0")]
    assert [e.worker.epoch for e in joined] == [e_prefill, e_decode]
    assert scheduler.members()["d-0"] == worker("d-0", Role.DECODE).with_epoch(e_decode)
    # and the same id cannot be registered twice
    with pytest.raises(WorkerIdTaken):
        await scheduler.register(worker("p-0"))
    # When a worker's capacity changes, it registers again: same epoch, an UPDATE
    assert await node.register(worker("p-0", num_pages=128)) == e_prefill
    (updated,) = await next_events(events, 1)
    assert (updated.kind, updated.worker.num_pages, updated.worker.epoch) == (EventKind.UPDATE, 128, e_prefill)
    # When one deregisters, its key is gone and the view sees it leave
    await node.deregister("d-0")
    assert await raw.get(f"/{cluster.name}/workers/d-0".encode()) is None
    (left,) = await next_events(events, 1)
    assert kinds([left]) == [(EventKind.LEAVE, "d-0")] and left.worker.epoch == e_decode
    # and a view opened now lists what is there
    late = await cluster.open()
    assert set(late.members()) == {"p-0"} and late.members()["p-0"].num_pages == 128
    assert scheduler.stats().num_bad_values == 0


async def test_dead_worker_leaves_within_ttl_plus_2s(cluster: Cluster, raw: aetcd.Client, etcd: EtcdServer) -> None:
    # Given a worker process registered with a 1 s lease
    ttl_s = 1
    scheduler = await cluster.open()
    events = scheduler.watch()
    code = (
        "import asyncio, sys\n"
        "from cluster.membership.protocol import Role, WorkerInfo\n"
        "from cluster.membership.etcd import EtcdConfig, EtcdMembership\n"
        "async def main():\n"
        f"    m = await EtcdMembership.open(EtcdConfig(port={etcd.port}, cluster='{cluster.name}', lease_ttl_s={ttl_s}))\n"
        "    print(await m.register(WorkerInfo('p-dead', Role.PREFILL, 'x', 'node-b')), flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        epoch = int(await asyncio.to_thread(proc.stdout.readline))
        (joined,) = await next_events(events, 1, timeout_s=10)
        assert (joined.kind, joined.worker.epoch) == (EventKind.JOIN, epoch)
        await asyncio.sleep(1.5 * ttl_s)  # its keepalive has been holding the lease past its TTL
        assert "p-dead" in scheduler.members()
    finally:
        proc.kill()  # When the worker dies (no deregistration, no revoke)
    assert proc.wait(10) == -9  # the fault happened
    killed = time.monotonic()
    # Then the view sees it leave within TTL + 2 s, and the key really is gone
    (left,) = await next_events(events, 1, timeout_s=ttl_s + 2)
    assert kinds([left]) == [(EventKind.LEAVE, "p-dead")] and left.worker.epoch == epoch
    assert time.monotonic() - killed <= ttl_s + 2
    assert await raw.get(f"/{cluster.name}/workers/p-dead".encode()) is None
    assert scheduler.check_epoch("p-dead", epoch) is False


async def test_lost_lease_registers_again_with_a_new_epoch_and_the_stale_one_is_refused(cluster: Cluster) -> None:
    # Given a worker that reaches etcd through a link we can cut, and a decode-side fence
    link = await cluster.gate()
    node = await cluster.open(ttl_s=1, gate=link)
    decode_side = await cluster.open()
    fence = EpochFence(decode_side)
    events = decode_side.watch()
    first = await node.register(worker("p-0"))
    await next_events(events, 1)
    assert fence.admit("p-0", first)
    # When the worker is partitioned from etcd for longer than its lease
    link.cut()
    (left,) = await next_events(events, 1, timeout_s=1 + 2)
    assert kinds([left]) == [(EventKind.LEAVE, "p-0")]  # the fault happened: its lease expired
    # Then, meanwhile, its commands are refused: it is not registered
    assert not fence.admit("p-0", first) and fence.num_refused_unknown == 1
    # When the link comes back, its keepalive finds the lease gone and registers again
    link.restore()
    (joined,) = await next_events(events, 1)
    assert joined.kind == EventKind.JOIN and joined.worker.worker_id == "p-0"
    second = joined.worker.epoch
    assert second > first
    await wait_until(lambda: node.stats().num_reregistrations == 1, 2, "the worker counted it")
    # Then the new epoch is admitted and the stale one refused, and counted as stale
    assert fence.admit("p-0", second)
    assert not fence.admit("p-0", first)
    assert (fence.num_admitted, fence.num_refused_stale, fence.num_refused_unknown) == (2, 1, 1)
    assert decode_side.check_epoch("p-0", second) and not decode_side.check_epoch("p-0", first)


async def test_etcd_restart_serving_continues_and_the_watch_resumes_without_lost_events(
    cluster: Cluster, etcd: EtcdServer
) -> None:
    # Given a scheduler (behind a link we control) that sees two workers
    link = await cluster.gate()
    scheduler = await cluster.open(gate=link)
    node = await cluster.open(ttl_s=2)
    events = scheduler.watch()
    epochs = {w: await node.register(worker(w)) for w in ("p-0", "d-0")}
    await next_events(events, 2)
    seen = scheduler.stats().revision
    # When etcd stops
    pid = etcd.pid
    assert etcd.stop() in (0, -15)  # etcd re-raises SIGTERM after its cleanup
    assert not etcd.is_running() and not is_listening(etcd.port)  # the fault happened: it is down
    await wait_until(lambda: not scheduler.stats().is_connected, 5, "the scheduler noticed")
    # Then serving continues on the last-known membership, and nobody new joins
    assert set(scheduler.members()) == {"p-0", "d-0"}
    assert all(scheduler.check_epoch(w, e) for w, e in epochs.items())
    with pytest.raises(MembershipUnavailable):
        await node.register(worker("p-1"))
    # When etcd comes back (same data dir and port) and the cluster changes before the
    # scheduler is back in touch
    link.cut()
    etcd.start()
    assert etcd.pid != pid and etcd.is_running()
    await wait_until(lambda: _try_register(node, worker("p-1")), 10, "a worker registers again")
    await node.deregister("d-0")
    await node.register(worker("p-0", num_pages=256))
    assert scheduler.stats().revision == seen and set(scheduler.members()) == {"p-0", "d-0"}
    # Then, once in touch, the scheduler's watch resumes from last_seen + 1 and gets every
    # change, in order, with no listing
    link.restore()
    changed = await next_events(events, 3)
    assert kinds(changed) == [(EventKind.JOIN, "p-1"), (EventKind.LEAVE, "d-0"), (EventKind.UPDATE, "p-0")]
    revisions = [e.revision for e in changed]
    assert revisions == sorted(revisions) and revisions[0] > seen
    stats = scheduler.stats()
    assert stats.is_connected and stats.num_relists == 1 and stats.num_resumes >= 1
    assert set(scheduler.members()) == {"p-0", "p-1"}
    # and the leases outlived etcd's restart: nobody lost its epoch
    assert scheduler.members()["p-0"].epoch == epochs["p-0"] and node.stats().num_reregistrations == 0


async def test_compacted_history_is_listed_again_and_diffed(cluster: Cluster, raw: aetcd.Client) -> None:
    # Given a scheduler that saw one worker, then lost touch
    link = await cluster.gate()
    scheduler = await cluster.open(gate=link)
    node = await cluster.open()
    events = scheduler.watch()
    await node.register(worker("p-0"))
    await next_events(events, 1)
    link.cut()
    await wait_until(lambda: not scheduler.stats().is_connected, 5, "the scheduler noticed")
    # When the cluster changes and etcd compacts that history away
    await node.deregister("p-0")
    epoch = await node.register(worker("d-0", Role.DECODE))
    await raw.compact(epoch)
    link.restore()
    # Then the scheduler lists again and reports the difference
    changed = await next_events(events, 2)
    assert kinds(changed) == [(EventKind.LEAVE, "p-0"), (EventKind.JOIN, "d-0")]
    assert scheduler.stats().num_relists == 2 and set(scheduler.members()) == {"d-0"}


async def test_open_fails_clearly_when_etcd_is_unreachable(cluster: Cluster) -> None:
    link = await cluster.gate()
    link.cut()
    with pytest.raises(MembershipUnavailable):
        await cluster.open(gate=link)


async def _try_register(m: EtcdMembership, info: WorkerInfo) -> bool:
    try:
        await m.register(info)
        return True
    except MembershipUnavailable:
        return False
