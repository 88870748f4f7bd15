"""Standing pins (cluster.fleet.pins): which pins a worker that joins gets, for how long, and
what the gateway's book says of it. The workers here answer as the actors do (PinView or why
not); the path on a real Ray fleet is test_ray_drain's planner test."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import Counter

from cluster.edge.pins import PinBook, worker_pin_id
from cluster.fleet.pins import MIN_REAPPLY_TTL_S, StandingPin, StandingPins
from cluster.fleet.workers import DecodeHandle, PrefillHandle
from engine.pins import PinAnswer, PinView

pytestmark = pytest.mark.timeout(30)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)  # a coroutine: awaitable as an ObjectRef is


class _Worker:
    """An actor's pin surface: it holds what it was asked to pin, or refuses over `budget` pins."""

    def __init__(self, budget: int = 8, unpin_gate: asyncio.Event | None = None) -> None:
        self.held: dict[str, tuple[tuple[int, ...], str, float]] = {}  # pin id -> (prompt, salt, ttl)
        self.asked: list[str] = []  # every pin id it was asked to pin, in order
        self.budget = budget
        self.gate = unpin_gate
        self.pin_prefix = _Method(self._pin)
        self.unpin_prefix = _Method(self._unpin)

    async def _pin(self, pin_id: str, prompt: tuple[int, ...], salt: str, ttl_s: float, wait_s: float) -> PinView | str:
        self.asked.append(pin_id)
        if self.gate is not None:
            await self.gate.wait()
        if len(self.held) >= self.budget:
            return "the worker's pins hold half its pool"
        self.held[pin_id] = (prompt, salt, ttl_s)
        return PinView(pin_id, len(prompt), len(prompt) // 16, "held", ttl_s)

    async def _unpin(self, pin_id: str) -> bool:
        return self.held.pop(pin_id, None) is not None


def _pins() -> tuple[StandingPins, Counter]:
    counter = Counter("baton_pins_reapplied", "test", ["role", "outcome"], registry=None)
    return StandingPins(counter), counter


def _stand(pins: StandingPins, pin_id: str, role: str, ttl_s: float = 600.0, taken: bool = True) -> None:
    answer: PinAnswer = ("w", PinView(pin_id, 32, 2, "held", ttl_s) if taken else "refused")
    pins.stand(pin_id, StandingPin(role, tuple(range(32)), "acme", time.monotonic() + ttl_s, 5.0), [answer])


def _count(counter: Counter, role: str, outcome: str) -> float:
    return counter.labels(role, outcome)._value.get()


async def test_a_joined_worker_gets_the_pins_of_the_role_it_serves() -> None:
    pins, counter = _pins()
    _stand(pins, "acme:sys", "")  # where prompts are computed
    _stand(pins, "acme:p", "prefill")
    _stand(pins, "acme:d", "decode")
    _stand(pins, "acme:gone", "", taken=False)  # no worker took it: it does not stand
    prefill, decode = _Worker(), _Worker()
    await pins.reapply(PrefillHandle("prefill-1", prefill, 1), has_prefill=True)
    await pins.reapply(DecodeHandle("decode-1", decode, "127.0.0.1:1"), has_prefill=True)
    assert sorted(prefill.held) == ["acme:p", "acme:sys"] and sorted(decode.held) == ["acme:d"]
    assert prefill.held["acme:sys"][:2] == (tuple(range(32)), "acme")
    assert _count(counter, "prefill", "held") == 2 and _count(counter, "decode", "held") == 1

    # With no prefill worker routable, prompts are computed on the decode workers: "" goes there.
    lone = _Worker()
    await pins.reapply(DecodeHandle("decode-2", lone, "127.0.0.1:2"), has_prefill=False)
    assert sorted(lone.held) == ["acme:d", "acme:sys"]


async def test_a_reapplied_pin_lasts_what_is_left_of_its_ttl_and_an_ended_one_is_forgotten() -> None:
    pins, _ = _pins()
    _stand(pins, "acme:long", "", ttl_s=600.0)
    _stand(pins, "acme:short", "", ttl_s=MIN_REAPPLY_TTL_S / 2)  # less left than a pin may ask for
    worker = _Worker()
    await pins.reapply(PrefillHandle("prefill-1", worker, 1), has_prefill=True)
    assert list(worker.held) == ["acme:long"] and 590.0 < worker.held["acme:long"][2] <= 600.0
    assert len(pins) == 1


async def test_an_unpinned_pin_is_not_reapplied_nor_left_behind() -> None:
    pins, _ = _pins()
    _stand(pins, "acme:a", "")
    _stand(pins, "acme:b", "")
    pins.drop("acme:a")
    gate = asyncio.Event()
    worker = _Worker(unpin_gate=gate)
    reapplying = asyncio.ensure_future(pins.reapply(PrefillHandle("prefill-1", worker, 1), has_prefill=True))
    await asyncio.sleep(0)  # the re-pin of b is on its way to the worker
    pins.drop("acme:b")  # unpinned while it was: the worker lets it go once it answers
    gate.set()
    await reapplying
    assert worker.asked == ["acme:b"] and worker.held == {}  # pinned there once, then let go


async def test_the_book_shows_what_a_joined_worker_answered() -> None:
    book = PinBook()
    first: list[PinAnswer] = [("prefill-0", PinView("acme:sys", 32, 2, "held", 600.0))]
    book.record("acme", "sys", "", 32, 600.0, first)
    pins, counter = _pins()
    pins.on_answer = book.answered
    _stand(pins, worker_pin_id("acme", "sys"), "")
    _stand(pins, worker_pin_id("acme", "more"), "")  # no record in this book: nothing to update
    await pins.reapply(PrefillHandle("prefill-1", _Worker(budget=1), 1), has_prefill=True)
    [rec] = book.records()
    assert rec.workers == {"prefill-0": "held", "prefill-1": "held"}
    await pins.reapply(PrefillHandle("prefill-2", _Worker(budget=0), 1), has_prefill=True)
    [rec] = book.records()
    assert rec.workers["prefill-2"] == "the worker's pins hold half its pool"
    assert _count(counter, "prefill", "refused") == 3  # acme:more on prefill-1 (over its budget), both on prefill-2
