"""`baton scale`'s rules (cluster.fleet.scalers.ScaleControl), around a recording scaler (the
scaler against real Ray actors and a RayCluster: tests/cluster/test_ray_drain.py): one scale at
a time, none while the planner owns the counts, a caller that leaves does not stop one half
way, the least busy worker goes first; a colocated gateway has no pools to scale."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import httpx
import pytest

from cluster.edge.http_api import HttpConfig
from cluster.errors import EdgeError, Kind
from cluster.fleet.fleet import Fleet
from cluster.fleet.scalers import ScaleControl, pod_of_worker
from kvtransfer.select import WorkerPlace
from tests.cluster.conftest import ServerHandle

pytestmark = pytest.mark.timeout(60)


@dataclass
class Worker:
    name: str
    num_inflight: int = 0
    is_alive: bool = True
    is_member: bool = True
    actor: object = None


@dataclass
class Pools:
    """The Fleet's attributes ScaleControl reads."""

    prefills: list[Worker] = field(default_factory=list)
    decodes: list[Worker] = field(default_factory=list)

    def handle(self, name: str) -> Worker | None:
        return next((w for w in (*self.prefills, *self.decodes) if w.name == name), None)


class Recording:
    """A Scaler that changes `pools` as a real one would, each call after `gate` opens."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.calls: list[tuple[str, str]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def add(self, role: str) -> str:
        await self.gate.wait()
        group = self.pools.prefills if role == "prefill" else self.pools.decodes
        name = f"{role}-{len(group) + 10}"
        group.append(Worker(name))
        self.calls.append(("add", name))
        return name

    async def remove(self, role: str, victim: str) -> None:
        await self.gate.wait()
        group = self.pools.prefills if role == "prefill" else self.pools.decodes
        group[:] = [w for w in group if w.name != victim]
        self.calls.append(("remove", victim))


def _control(pools: Pools, planner_owns: bool = False) -> tuple[ScaleControl, Recording]:
    scaler = Recording(pools)
    return ScaleControl(cast(Fleet, pools), scaler, planner_owns), scaler  # type: ignore[arg-type]


async def test_each_role_reaches_its_target_least_busy_first() -> None:
    pools = Pools([Worker("prefill-0")], [Worker("decode-0", 3), Worker("decode-1", 0), Worker("decode-2", 0)])
    control, scaler = _control(pools)
    report = await control.scale({"prefill": 3, "decode": 1})
    assert report == {
        "prefill": {"before": 1, "after": 3, "added": ["prefill-11", "prefill-12"], "drained": []},
        "decode": {"before": 3, "after": 1, "added": [], "drained": ["decode-2", "decode-1"]},  # idle, newest first
    }
    assert [w.name for w in pools.decodes] == ["decode-0"]  # the busy one stays
    assert await control.scale({"decode": 1}) == {"decode": {"before": 1, "after": 1, "added": [], "drained": []}}
    pools.decodes.append(Worker("decode-5", is_member=False))  # draining already: not counted
    assert (await control.scale({"decode": 1}))["decode"]["before"] == 1 and len(scaler.calls) == 4


async def test_one_scale_at_a_time_and_none_while_the_planner_owns_the_counts() -> None:
    pools = Pools([Worker("prefill-0")], [Worker("decode-0")])
    control, scaler = _control(pools)
    scaler.gate.clear()  # the first scale waits inside its add
    first = asyncio.create_task(control.scale({"decode": 2}))
    await asyncio.sleep(0)
    with pytest.raises(EdgeError) as busy:
        await control.scale({"prefill": 2})
    assert busy.value.kind == Kind.ABORTED and busy.value.kind.http_status == 409
    first.cancel()  # its caller went away: the scale goes on to the end
    await asyncio.sleep(0)
    scaler.gate.set()
    running = control._running
    assert running is not None
    assert (await running)["decode"]["after"] == 2
    assert [w.name for w in pools.decodes] == ["decode-0", "decode-11"]
    owned, _ = _control(pools, planner_owns=True)
    with pytest.raises(EdgeError, match="planner") as refused:
        await owned.scale({"decode": 3})
    assert refused.value.kind == Kind.ABORTED


def test_a_colocated_gateway_has_no_pools_to_scale(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(http=HttpConfig(port=0, enable_admin=True))
    reply = httpx.post(handle.url + "/admin/scale", json={"decode": 2}, timeout=30)
    assert reply.status_code == 409 and "colocated" in reply.json()["error"]["message"]
    off = make_server()  # admin routes off: not there at all, whatever the body
    for body in ({"decode": 2}, {"decode": "x"}, {}):
        assert httpx.post(off.url + "/admin/scale", json=body, timeout=30).status_code == 404


class _Placed:
    """An actor handle whose place_of names the pod its worker runs in."""

    def __init__(self, place: WorkerPlace) -> None:
        self.place_of = SimpleNamespace(remote=lambda: asyncio.sleep(0, place))


async def test_a_worker_names_its_pod_from_the_downward_api() -> None:
    """On KubeRay each worker pod has POD_NAME (k8s/base/raycluster.yaml), which its actor
    reports, and that pod is the one a scale-in names, whatever the node's host name; without
    it the Ray node's host name stands in (real actors: tests/cluster/test_ray_drain.py)."""
    worker = Worker("decode-0", actor=_Placed(WorkerPlace("node-a", 7, host="10.0.0.5", pod="baton-decode-x7k2p")))
    pools = Pools(decodes=[worker])
    assert await pod_of_worker(cast(Fleet, pools), "decode-0") == "baton-decode-x7k2p"
    with pytest.raises(KeyError):
        await pod_of_worker(cast(Fleet, pools), "decode-1")
