"""RayFront's routes from drained decode workers to survivors (cluster.fleet.front): one route
call per pair however many requests move at once, and a drained worker's routes forgotten once
it is gone, so the map holds a few pairs rather than one for every drain ever. The logic around
the Ray calls, with the route call and the fleet's map as doubles (the hand-off itself runs on
real Ray actors in tests/faults/test_failover.py and tests/multihost/test_host_faults.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.fleet.front import RayFront, _Lost, _RayHandOff

pytestmark = pytest.mark.timeout(30)


@dataclass
class Worker:
    name: str
    is_alive: bool = True


def front(workers: list[Worker], answers: dict[tuple[str, str], bool]) -> tuple[Any, list[tuple[str, str]]]:
    """A RayFront with only what the hand-off routes touch: its fleet's decode workers, its
    config, and a route call that says it was asked (`asked`) and answers from `answers` once the
    test lets it (`gate`)."""
    f: Any = object.__new__(RayFront)
    f.fleet = SimpleNamespace(decode_of={w.name: w for w in workers})
    f.cfg = SimpleNamespace(preserve_kv=True)
    f._hand_off_routes = {}
    f.gate, f.asked = asyncio.Event(), asyncio.Event()
    calls: list[tuple[str, str]] = []

    async def route_hand_off(source: Worker, target: Worker) -> bool:
        calls.append((source.name, target.name))
        f.asked.set()
        await f.gate.wait()
        return answers[(source.name, target.name)]

    f._route_hand_off = route_hand_off
    return f, calls


async def test_one_route_call_a_pair_and_gone_workers_routes_forgotten() -> None:
    d1, d2, d3, d4 = (Worker(n) for n in ("d1", "d2", "d3", "d4"))
    f, calls = front([d1, d2, d3, d4], {("d1", "d2"): True, ("d3", "d2"): False, ("d4", "d2"): True})
    # three requests moved off d1 at once: one route call, every one of them handed off by d1
    moving = [asyncio.ensure_future(f._hand_off_source(_Lost("d1", 0.0, f"r{i}"), d2)) for i in range(3)]
    await f.asked.wait()  # the three were scheduled before the route call: each waits on it now
    assert calls == [("d1", "d2")] and not any(m.done() for m in moving)
    f.gate.set()
    sides = await asyncio.gather(*moving)
    assert all(isinstance(s, _RayHandOff) and s.handle is d1 for s in sides)
    assert [s.moved for s in sides] == ["r0", "r1", "r2"]
    # a pair that cannot route: no hand-off (the request takes the other paths), asked once
    assert await f._hand_off_source(_Lost("d3", 0.0, "r3"), d2) is None
    assert await f._hand_off_source(_Lost("d3", 0.0, "r4"), d2) is None
    assert calls == [("d1", "d2"), ("d3", "d2")]
    # d1 left the fleet and d3 died: a new pair's route forgets theirs
    del f.fleet.decode_of["d1"]
    d3.is_alive = False
    assert set(f._hand_off_routes) == {("d1", "d2"), ("d3", "d2")}
    assert isinstance(await f._hand_off_source(_Lost("d4", 0.0, "r5"), d2), _RayHandOff)
    assert set(f._hand_off_routes) == {("d4", "d2")}
    assert calls[-1] == ("d4", "d2")


@pytest.mark.parametrize("lost", [None, _Lost("d1", 0.0), _Lost("gone", 0.0, "r1"), _Lost("d2", 0.0, "r1")],
                         ids=["not-lost", "not-moved", "source-gone", "source-is-target"])  # fmt: skip
async def test_no_route_is_asked_without_a_live_drained_source(lost: _Lost | None) -> None:
    d1, d2 = Worker("d1"), Worker("d2")
    f, calls = front([d1, d2], {})
    assert await f._hand_off_source(lost, d2) is None
    assert calls == [] and f._hand_off_routes == {}


async def test_preservation_off_hands_nothing_off() -> None:
    d1, d2 = Worker("d1"), Worker("d2")
    f, calls = front([d1, d2], {("d1", "d2"): True})
    f.cfg.preserve_kv = False
    assert await f._hand_off_source(_Lost("d1", 0.0, "r1"), d2) is None and calls == []
