"""Pinned prefixes (engine.pins) on a real engine: a pinned prefix survives eviction pressure
until its TTL (a clock the test moves), then ages out like any page; pins are bounded, can be
replaced, released and purged, and every page reference stays accounted for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PAGE = 16
POOL = 24  # pages: a pin may hold 12; each flood prompt takes 5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(model_dir: Path, clock: Clock) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_pages=POOL))
    engine.pins.clock = clock
    return engine


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 16_384, size=n).tolist()


def _run(engine: Engine, prompt: list[int], req_id: str, salt: str = "") -> int:
    """One request to the end; its cached prompt tokens."""
    engine.add_request(req_id, prompt, GREEDY, cache_salt=salt)
    hit = -1
    while engine.has_unfinished():
        for out in engine.step():
            assert not out.req_id.startswith("pin/")  # a pin's own request never streams
            hit = out.num_cached_tokens
        engine.check_integrity()
    return hit


def _flood(engine: Engine, rounds: int, seed: int = 100) -> None:
    """Distinct prompts until the cache has had to evict (and would evict the prefix too)."""
    for i in range(rounds):
        _run(engine, _tokens(seed + i, 70), f"flood{seed}-{i}")


def _settle(engine: Engine) -> None:
    while engine.has_unfinished():
        assert engine.step() == []  # only the pin's request runs, and it streams nothing
        engine.check_integrity()


def test_a_pinned_prefix_survives_eviction_until_its_ttl(tiny_model_dir: Path) -> None:
    clock = Clock()
    engine = _engine(tiny_model_dir, clock)
    system = _tokens(1, 100)  # 6 full pages + 4 tokens
    view = engine.pin_prefix("sys", system, "acme", ttl_s=60)
    assert (view.state, view.num_pages, view.num_tokens) == ("computing", 6, 100)
    _settle(engine)
    [view] = engine.pins.views()
    assert view.state == "held" and view.expires_in_s == 60
    _flood(engine, 6)
    cache = engine.prefix_cache
    assert cache is not None and cache.stats.evicted_pages > 0
    assert _run(engine, system + [7, 8, 9], "q1", "acme") == 96  # all 6 pages, under pressure
    assert _run(engine, system + [7, 8, 9], "q2", "globex") == 0  # pinned for acme only
    clock.now += 61
    engine.flush_cache()  # the idle loop's call: the TTL passed
    assert engine.pins.views() == [] and engine.pins.num_held_pages == 0
    _flood(engine, 6, seed=200)
    assert _run(engine, system + [7, 8, 9], "q3", "acme") == 0  # aged out like any other page
    engine.check_integrity()


def test_an_unpinned_prefix_is_evicted_by_the_same_pressure(tiny_model_dir: Path) -> None:
    """The control for the test above: without the pin, the flood evicts the prefix."""
    engine = _engine(tiny_model_dir, Clock())
    system = _tokens(1, 100)
    assert _run(engine, system + [1], "warm", "acme") == 0
    _flood(engine, 6)
    assert _run(engine, system + [7, 8, 9], "q1", "acme") == 0


def test_a_cached_prefix_is_held_at_once_and_pins_are_bounded(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, Clock())
    system = _tokens(2, 100)
    _run(engine, system + [1], "warm")
    view = engine.pin_prefix("sys", system, ttl_s=5)
    assert view.state == "held" and not engine.has_unfinished()  # nothing to compute
    with pytest.raises(RequestError, match="at most 12 pages"):
        engine.pin_prefix("big", _tokens(3, 7 * PAGE), ttl_s=5)  # 6 held + 7 > 12
    with pytest.raises(RequestError, match="whole pages"):
        engine.pin_prefix("tiny", _tokens(4, PAGE - 1), ttl_s=5)
    again = engine.pin_prefix("sys", system[:PAGE * 2], ttl_s=5)  # the same id: replaced
    assert again.num_pages == 2 and engine.pins.num_held_pages == 2
    engine.check_integrity()
    assert engine.unpin_prefix("sys") and not engine.unpin_prefix("sys")
    assert engine.pins.num_held_pages == 0
    engine.check_integrity()


def test_pins_that_share_a_prefix_hold_its_pages_once(tiny_model_dir: Path) -> None:
    """A system prompt and a longer prefix that starts with it, pinned apart: their shared pages
    are held twice (two references) but count once, in the worker's bound (half its pool, 12
    pages) as in what they hold, and the pages an idle engine can reuse are the cached ones no
    pin holds."""
    engine = _engine(tiny_model_dir, Clock())
    system = _tokens(5, 8 * PAGE)
    longer = system + _tokens(6, 4 * PAGE)
    _run(engine, longer + [1], "warm")  # 12 whole pages cached
    assert engine.pin_prefix("sys", system, ttl_s=60).state == "held"  # 8 pages
    assert engine.pin_prefix("sys-long", longer, ttl_s=60).state == "held"  # 12, 8 of them sys's: 12 in all
    assert engine.pins.num_held_pages == 12 and len(engine.pins.held_page_ids()) == 20
    with pytest.raises(RequestError, match=r"at most 12 pages on this worker \(12 held by other pins, 1 more"):
        engine.pin_prefix("other", _tokens(7, PAGE), ttl_s=5)
    engine.check_integrity()
    cache = engine.prefix_cache
    assert cache is not None
    assert engine.free_pages_at_idle() == engine.pool.pages.num_free + cache.num_cached_pages - 12
    engine.unpin_prefix("sys-long")
    assert engine.pins.num_held_pages == 8
    engine.check_integrity()


def test_purging_a_tenant_releases_its_pins_even_while_computing(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, Clock())
    engine.pin_prefix("a", _tokens(5, 40), "acme", ttl_s=60)
    engine.pin_prefix("b", _tokens(6, 40), "globex", ttl_s=60)
    engine.purge_tenant("acme")  # before either is computed
    _settle(engine)
    assert [(v.pin_id, v.state) for v in engine.pins.views()] == [("b", "held")]
    engine.check_integrity()


def test_pinning_an_id_again_while_it_computes_replaces_it(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, Clock())
    told: list[object] = []
    engine.pin_prefix("sys", _tokens(7, 40), "acme", ttl_s=60, on_done=told.append)
    again = engine.pin_prefix("sys", _tokens(8, 64), "acme", ttl_s=60)  # before the first is computed
    assert again.num_pages == 4 and told == ["released before its pages were computed"]
    _settle(engine)
    assert [(v.pin_id, v.num_pages, v.state) for v in engine.pins.views()] == [("sys", 4, "held")]
    engine.check_integrity()
