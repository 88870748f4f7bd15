"""Placement scenarios: exact decisions from the cost model over a real GlobalIndex.

Given workers with measured numbers and cached prefixes (loaded into the index as snapshots),
When a request is placed, Then the prefill and decode workers, the hit, the locality given
up and the number of candidates examined are exactly what the numbers say."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from cluster.placement.global_index import GlobalIndex, PrefixHit, PrefixMatch
from cluster.placement.policy import (
    Placement,
    PlacementConfig,
    PlacementKind,
    Placer,
    Role,
    WorkerStats,
)
from engine.request import SloClass
from kvcache.events import Tier

PS = 16
SPT = 1e-4  # prefill seconds per token: 1,000 tokens take 0.1 s
CFG = PlacementConfig(page_size=PS, page_bytes=64 << 10, transfer_bytes_per_s=1e9)


def _pages(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:08d}".encode().ljust(16, b".") for i in range(n)]


def _prefill(name: str, **kw: float) -> WorkerStats:
    return WorkerStats(name, Role.PREFILL, kw.pop("spt", SPT), **kw)  # type: ignore[arg-type]


def _decode(name: str, **kw: float) -> WorkerStats:
    base = dict(itl_s=0.01, num_running=8, max_running=64, num_free_pages=10_000)
    base.update(kw)
    return WorkerStats(name, Role.DECODE, base.pop("spt", SPT), **base)  # type: ignore[arg-type]


def _fleet(workers: list[WorkerStats], cfg: PlacementConfig = CFG, seed: int = 0,
           cached: dict[str, list[bytes]] | None = None) -> Placer:
    index = GlobalIndex()
    for w in workers:
        index.load_snapshot(w.worker_id, 1, 0, [(h, Tier.DEVICE) for h in (cached or {}).get(w.worker_id, [])])
    placer = Placer(index, cfg, random.Random(seed))
    for w in workers:
        placer.update_worker(w)
    return placer


def test_a_follow_up_turn_goes_to_the_worker_holding_its_prefix() -> None:
    history = _pages("conv", 24)  # turn 1's prompt and answer: 20 pages cached on p7
    prompt_tokens = 24 * PS + 5
    for seed in range(20):  # whichever two workers the sampling draws, p7 is examined
        placer = _fleet([_prefill(f"p{i}") for i in range(16)] + [_decode("d0"), _decode("d1")],
                        seed=seed, cached={"p7": history[:20]})
        got = placer.place("r1", history, prompt_tokens)
        assert (got.kind, got.prefill_id, got.hit) == (PlacementKind.DISAGGREGATED, "p7", PrefixHit(20, 0, 0))
        assert got.num_recompute_tokens == prompt_tokens - 20 * PS
        assert (got.best_hit_worker, got.best_hit_pages, got.locality_given_up) == ("p7", 20, 0)
        assert math.isfinite(got.cost_s)


def test_an_overloaded_hot_worker_loses_to_an_idle_cold_one_when_the_numbers_say_so() -> None:
    prefix = _pages("doc", 62)
    tokens = 1000  # p0 holds 60 of its 62 full pages: 40 tokens left to compute there
    workers = [_prefill("p0", queue_delay_s=0.5), _prefill("p1"), _decode("d0", num_running=40)]
    placer = _fleet(workers, cached={"p0": prefix[:60]})
    cold = placer.place("r1", prefix, tokens)  # p0: 0.5 + 40 x 1e-4 > p1: 1000 x 1e-4
    assert (cold.prefill_id, cold.hit, cold.num_recompute_tokens) == ("p1", PrefixHit(), 1000)
    assert (cold.best_hit_worker, cold.best_hit_pages, cold.locality_given_up) == ("p0", 60, 60)
    assert placer.stats.given_up_pages == 60 and placer.stats.best_hit_pages == 60
    placer.finish("r1")
    placer.update_worker(replace(workers[0], queue_delay_s=0.05))  # now 0.054 < 0.1
    hot = placer.place("r2", prefix, tokens)
    assert (hot.prefill_id, hot.hit, hot.locality_given_up) == ("p0", PrefixHit(60, 0, 0), 0)
    assert hot.fallbacks == ("p1",)  # re-dispatch order if p0 fails


def test_a_burst_on_one_prefix_spills_over_before_any_stats_report() -> None:
    """Reported queues stay 0 (no stats arrive during the burst); the placer's own book of
    what it sent p0 makes p0's queue grow until the cold worker is cheaper."""
    prefix = _pages("sys", 62)
    placer = _fleet([_prefill("p0"), _prefill("p1"), _decode("d0", num_running=40)], cached={"p0": prefix[:60]})
    chosen = [placer.place(f"r{i}", prefix, 1000).prefill_id for i in range(30)]
    # Each request adds 40 tokens (4 ms) to p0's queue; p1 costs 0.1 s cold: 25 fit first.
    assert chosen[:25] == ["p0"] * 25 and chosen[25] == "p1"
    assert placer.inflight("p0") == chosen.count("p0")
    for i in range(30):
        placer.release_prefill(f"r{i}")  # their first tokens are back
    assert placer.inflight("p0") == 0 and placer.place("again", prefix, 1000).prefill_id == "p0"


def test_a_worker_queued_past_the_bound_is_no_candidate_and_a_full_fleet_is_saturated() -> None:
    placer = _fleet([_prefill("p0", queue_delay_s=11.0), _decode("d0", num_running=40, queue_delay_s=11.0)])
    got = placer.place("r1", _pages("x", 10), 170)
    assert got.kind == PlacementKind.SATURATED and got.retry_after_s == CFG.retry_after_s
    placer = _fleet([_prefill("p0"), _decode("d0", num_free_pages=5)])  # 11 pages needed
    assert placer.place("r2", _pages("x", 10), 170).kind == PlacementKind.SATURATED
    assert placer.stats.num_saturated == 1 and placer.inflight("p0") == 0


def test_k_sampling_examines_a_bounded_number_of_candidates_in_any_fleet() -> None:
    cfg = replace(CFG, num_sampled=3, num_prefix_candidates=2)
    shared = _pages("shared", 8)  # a system prompt every other worker holds
    workers = [_prefill(f"p{i}") for i in range(1000)] + [_decode(f"d{i}") for i in range(1000)]
    cached = {f"p{i}": shared for i in range(0, 1000, 2)} | {"p333": _pages("conv", 30)}
    placer = _fleet(workers, cfg, cached=cached)
    costed: list[str] = []
    option = placer._option
    placer._option = lambda w, *a: costed.append(w.worker_id) or option(w, *a)  # type: ignore[method-assign]
    looked_at: list[tuple[str, int]] = []  # holders the placer took from the index's answer
    match = placer.index.match

    def counted_match(*args: Any) -> PrefixMatch:
        got = match(*args)
        ranked = got.ranked
        got.ranked = lambda *a: (looked_at.append(h) or h for h in ranked(*a))  # type: ignore[method-assign]
        return got

    placer.index.match = counted_match  # type: ignore[method-assign]
    for i in range(200):
        prompt = shared if i % 2 else _pages("conv", 32)
        got = placer.place(f"r{i}", prompt, len(prompt) * PS + 1)
        assert got.num_examined <= 2 * (3 + 2)  # k + m per role, whatever the fleet holds
        if i % 2 == 0:
            assert got.prefill_id == "p333"  # the only holder is always among them
        placer.finish(f"r{i}")
    assert len(costed) <= 200 * 2 * (3 + 2)
    assert len(looked_at) <= 200 * (1 + 2 + 2)  # the best, then m per role: not `shared`'s 500


def test_equally_good_holders_share_the_load() -> None:
    """A system prompt every worker holds, an idle fleet: no worker is everyone's favourite."""
    system = _pages("system", 32)
    workers = [_prefill(f"p{i}") for i in range(8)] + [_decode(f"d{i}", num_running=40) for i in range(4)]
    placer = _fleet(workers, cached={w.worker_id: system for w in workers})
    chosen = []
    for i in range(400):
        got = placer.place(f"r{i}", system, 32 * PS + 100)
        chosen.append((got.prefill_id, got.decode_id))
        placer.finish(f"r{i}")
    by_prefill = {p: sum(c[0] == p for c in chosen) for p in {c[0] for c in chosen}}
    assert len(by_prefill) == 8 and max(by_prefill.values()) < 2 * 400 / 8, by_prefill
    assert len({c[1] for c in chosen}) == 4


def test_fairness_caps_a_tenants_concentration_of_affinity_on_one_worker() -> None:
    a_prefix, b_prefix = _pages("a", 62), _pages("b", 62)
    workers = [_prefill("p0"), _prefill("p1"), _decode("d0", num_running=40)]
    placer = _fleet(workers, cached={"p0": a_prefix[:60] + b_prefix[:60]})
    for i in range(2):
        assert placer.place(f"b{i}", b_prefix, 1000, tenant="B").prefill_id == "p0"
    for i in range(2):
        assert placer.place(f"a{i}", a_prefix, 1000, tenant="A").prefill_id == "p0"
    # A has 2 of p0's 4 in-flight prefills: at its share (max(2, 0.5 x 4)), p0 is cold for
    # A: 16 ms of queue + 0.1 s of compute, against p1's 0.1 s.
    third = placer.place("a2", a_prefix, 1000, tenant="A")
    assert (third.prefill_id, third.locality_given_up) == ("p1", 60)
    assert placer.stats.num_affinity_withheld == 1
    # B is at its share too, but p0 costed cold (0.116 s) still beats p1 behind a2 (0.2 s);
    # there it reuses its pages all the same.
    b2 = placer.place("b2", b_prefix, 1000, tenant="B")
    assert (b2.prefill_id, b2.num_recompute_tokens, placer.stats.num_affinity_withheld) == ("p0", 40, 2)
    for req_id in ("a2", "b2"):
        placer.release_prefill(req_id)
    placer.finish("b0")  # A has 2 of 3: still not under max(2, 1.5)
    assert placer.place("a3", a_prefix, 1000, tenant="A").prefill_id == "p1"
    placer.release_prefill("a3")
    placer.finish("b1")  # nobody else on p0: A may concentrate there freely
    assert placer.place("a4", a_prefix, 1000, tenant="A").prefill_id == "p0"


def test_a_lone_tenant_is_never_capped() -> None:
    prefix = _pages("solo", 62)
    placer = _fleet([_prefill("p0"), _prefill("p1", queue_delay_s=0.05), _decode("d0", num_running=40)],
                    cached={"p0": prefix[:60]})
    assert [placer.place(f"r{i}", prefix, 1000, tenant="A").prefill_id for i in range(8)] == ["p0"] * 8
    assert placer.stats.num_affinity_withheld == 0


def test_conditional_disaggregation_by_the_same_numbers() -> None:
    prompt = _pages("turn", 6)
    # The decode worker holds 5 of 6 pages: 20 tokens left, under local_prefill_tokens.
    placer = _fleet([_prefill("p0"), _decode("d0", num_running=40)], cached={"d0": prompt[:5]})
    short = placer.place("r1", prompt, 100)
    assert (short.kind, short.decode_id, short.prefill_id, short.hit) == (PlacementKind.LOCAL, "d0", None, PrefixHit(5))
    # A long uncached prompt: an idle decode worker stalls nobody, and skips the transfer ...
    long_prompt = _pages("long", 125)
    idle = _fleet([_prefill("p0"), _decode("d0", num_running=0)])
    assert idle.place("r2", long_prompt, 2000).kind == PlacementKind.LOCAL
    # ... a busy one would stall its 40 running requests for 0.2 s each: prefill elsewhere.
    busy = _fleet([_prefill("p0"), _decode("d0", num_running=40)])
    got = busy.place("r3", long_prompt, 2000)
    assert (got.kind, got.prefill_id, got.decode_id) == (PlacementKind.DISAGGREGATED, "p0", "d0")
    busy.update_worker(replace(_prefill("p0"), is_healthy=False))  # no prefill worker: local
    assert busy.place("r4", long_prompt, 2000).kind == PlacementKind.LOCAL


def test_a_batch_request_is_pushed_rather_than_stall_a_busy_decode_worker() -> None:
    prompt = _pages("turn", 6)
    # d0 holds 5 of 6 pages: 20 tokens left, short enough to prefill there ...
    placer = _fleet([_prefill("p0"), _decode("d0", num_running=40)], cached={"d0": prompt[:5]})
    standard = placer.place("s1", prompt, 100)
    assert (standard.kind, standard.decode_id, standard.prefill_id) == (PlacementKind.LOCAL, "d0", None)
    # ... but a batch request's prefill would stall d0's 40 running requests: p0 computes it
    batch = placer.place("b1", prompt, 100, slo=SloClass.BATCH)
    assert (batch.kind, batch.decode_id, batch.prefill_id) == (PlacementKind.DISAGGREGATED, "d0", "p0")
    assert batch.num_recompute_tokens == 100 and batch.hit == PrefixHit()  # p0 holds none of it
    latency = placer.place("l1", prompt, 100, slo=SloClass.LATENCY)
    assert (latency.kind, latency.prefill_id) == (PlacementKind.LOCAL, None)  # the cost model as is
    # An idle decode worker stalls nobody, and without a prefill worker there is no other way.
    idle = _fleet([_prefill("p0"), _decode("d0", num_running=0)], cached={"d0": prompt[:5]})
    assert idle.place("b2", prompt, 100, slo=SloClass.BATCH).kind == PlacementKind.LOCAL
    alone = _fleet([_decode("d0", num_running=40)], cached={"d0": prompt[:5]})
    assert alone.place("b3", prompt, 100, slo=SloClass.BATCH).kind == PlacementKind.LOCAL


def test_the_decode_worker_by_free_pages_and_batch_load() -> None:
    prompt = _pages("q", 64)
    placer = _fleet([_prefill("p0"), _decode("d0", num_running=60), _decode("d1", num_running=10)])
    assert placer.place("r1", prompt, 1025).decode_id == "d1"
    placer.update_worker(_decode("d1", num_running=10, num_free_pages=64))  # 65 pages needed
    assert placer.place("r2", prompt, 1025).decode_id == "d0"


def test_lower_tiers_cost_their_bandwidth() -> None:
    prefix = _pages("tiered", 62)
    workers = [_prefill("p0", disk_bytes_per_s=1e8), _prefill("p1"), _decode("d0", num_running=40)]
    placer = _fleet(workers)
    placer.index.load_snapshot("p0", 1, 0, [(h, Tier.DISK) for h in prefix[:60]])
    placer.index.load_snapshot("p1", 1, 0, [(h, Tier.HOST) for h in prefix[:50]])
    # p0: 40 tokens + 60 x 64 KiB at 100 MB/s (39 ms) = 43 ms; p1: 200 tokens + 50 pages at 8 GB/s = 20 ms
    got = placer.place("r1", prefix, 1000)
    assert (got.prefill_id, got.hit, got.locality_given_up) == ("p1", PrefixHit(0, 50, 0), 10)


def test_a_peer_fetch_beats_recomputing_when_its_bandwidth_does() -> None:
    prefix = _pages("peer", 62)
    cfg = replace(CFG, peer_bytes_per_s=1e9)  # 64 KiB in 66 us < 16 tokens in 1.6 ms
    placer = _fleet([_prefill("p0", queue_delay_s=0.5), _prefill("p1"), _decode("d0", num_running=40)], cfg,
                    cached={"p0": prefix[:60]})
    got = placer.place("r1", prefix, 1000)
    assert (got.prefill_id, got.peer_id, got.num_peer_pages, got.num_recompute_tokens) == ("p1", "p0", 60, 40)
    assert got.locality_given_up == 0


def test_bookings_follow_the_request() -> None:
    prefix = _pages("b", 62)
    placer = _fleet([_prefill("p0"), _decode("d0", num_running=40)])
    first: Placement = placer.place("r1", prefix, 1000, tenant="T")
    again = placer.place("r1", prefix, 1000, tenant="T")  # a re-dispatch replaces the booking
    assert first.prefill_id == again.prefill_id == "p0" and placer.inflight("p0", "T") == 1
    placer.finish("r1")
    placer.finish("r1")  # idempotent
    assert placer.inflight("p0") == 0 and placer.inflight("p0", "T") == 0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlacementConfig(tenant_share=0)
    with pytest.raises(ValueError):
        PlacementConfig(num_sampled=0)


def test_a_long_cold_prompt_waits_when_every_prefill_worker_is_queued_past_the_bound() -> None:
    # DESIGN §3: decode prefills only a short uncached part, or when no prefill worker is healthy.
    busy = [_prefill("p0", queue_delay_s=60.0), _prefill("p1", queue_delay_s=60.0), _decode("d0", num_running=0)]
    long = _fleet(busy).place("r1", _pages("cold", 100), 100 * PS + 3)
    assert (long.kind, long.retry_after_s > 0) == (PlacementKind.SATURATED, True)
    short = _fleet(busy).place("r2", [], 20)
    assert (short.kind, short.decode_id) == (PlacementKind.LOCAL, "d0")
    alone = _fleet([_decode("d0")]).place("r3", _pages("cold", 100), 100 * PS + 3)
    assert (alone.kind, alone.decode_id) == (PlacementKind.LOCAL, "d0")  # no prefill worker at all


def test_the_stall_of_a_local_prefill_counts_the_requests_booked_since_the_last_report() -> None:
    # d0 reported an empty batch and computes twice as fast as p0; each request placed on d0
    # since then is in the batch a local prefill stalls, so local placements thin out (counting
    # only the reported batch, 6 of these 8 went local).
    placer = _fleet([_prefill("p0", spt=2 * SPT), _decode("d0", num_running=0, spt=SPT)],
                    replace(CFG, local_prefill_tokens=0, transfer_bytes_per_s=1e12))  # fmt: skip
    kinds = [placer.place(f"r{i}", _pages(f"c{i}", 30), 30 * PS + 1).kind for i in range(8)]
    assert kinds[0] == PlacementKind.LOCAL
    assert kinds.count(PlacementKind.LOCAL) <= 3


def test_a_stuck_holder_shows_in_how_long_its_booked_work_has_waited() -> None:
    """Its reports say idle (they are stale, or it is stuck while answering them); the prefills
    booked there an age ago still have no first token: a new request with its prefix goes to
    the cold worker, and comes back to the holder once it moves again."""
    now = [0.0]
    history = _pages("conv", 24)
    index = GlobalIndex()
    index.load_snapshot("hot", 1, 0, [(h, Tier.DEVICE) for h in history[:20]])
    index.load_snapshot("cold", 1, 0, [])
    placer = Placer(index, CFG, random.Random(0), clock=lambda: now[0])
    for w in (_prefill("hot"), _prefill("cold"), _decode("d0")):
        placer.update_worker(w)
    first = placer.place("r1", history, 24 * PS + 5)
    assert first.prefill_id == "hot"
    now[0] = 0.01  # a moment later: queued behind r1 is still cheaper than recomputing
    assert placer.place("r2", history, 24 * PS + 5).prefill_id == "hot"
    now[0] = 2.0  # r1 and r2 have waited 2 s for a prefill the model says takes ~0.04 s
    stuck = placer.place("r3", history, 24 * PS + 5)
    assert stuck.prefill_id == "cold" and stuck.locality_given_up == 20
    placer.release_prefill("r1")
    placer.release_prefill("r2")  # it moved again
    placer.finish("r3")
    assert placer.place("r4", history, 24 * PS + 5).prefill_id == "hot"


def test_the_measured_link_decides_between_decode_workers_and_a_tie_stays_on_the_host() -> None:
    # d0 shares p0's host, d1 is across a link; both idle and equally free
    tokens = 2000  # 125 pages of 64 KiB: 8 MB to push
    placer = _fleet([_prefill("p0"), _decode("d0"), _decode("d1")])
    placer.links.clock = lambda: 100.0
    placer.links.set_same_host("p0", "d0", True)
    for seed in range(8):  # costs tie (no link measured yet): the same-host decode worker wins
        placer.rng = random.Random(seed)
        got = placer.place(f"t{seed}", _pages(f"t{seed}", 125), tokens)
        placer.finish(f"t{seed}")
        assert (got.prefill_id, got.decode_id) == ("p0", "d0")
    # measured: p0 -> d1 moves 2 GB/s (faster than the configured 1 GB/s); the same-host
    # pushes, slowed by a busy CPU (0.01 GB/s), are not a link's measure
    for _ in range(4):
        placer.links.observe("p0", "d0", 8 << 20, (8 << 20) / 1e7)
        placer.links.observe("p0", "d1", 8 << 20, (8 << 20) / 2e9)
    assert placer.links.bytes_per_s("p0", "d0") == CFG.transfer_bytes_per_s
    assert placer.links.bytes_per_s("p0", "d1") == pytest.approx(2e9)
    got = placer.place("r1", _pages("r1", 125), tokens)
    assert (got.prefill_id, got.decode_id) == ("p0", "d1")
    decode_s = CFG.expected_output_tokens * 0.01 * (1 + 8 / 64)  # the horizon at d1's ITL and fill
    push_s = 125 * CFG.page_bytes / 2e9  # over the measured link, not transfer_bytes_per_s
    assert got.cost_s == pytest.approx(decode_s + tokens * SPT + push_s, rel=1e-9)


def test_a_link_measured_slow_is_tried_again_once_its_measure_ages() -> None:
    """Placement sends nothing over a link it judges slow, so no push would revise that: an
    unused link's time per byte goes back toward the configured rate, half the way per
    AGE_HALF_LIFE_S."""
    from cluster.placement.links import AGE_HALF_LIFE_S, Links

    now = [0.0]
    links = Links(1e9, clock=lambda: now[0])
    links.observe("p", "d", 8 << 20, (8 << 20) / 1e7)  # a burst of contention: 10 MB/s
    assert links.bytes_per_s("p", "d") == pytest.approx(1e7)
    now[0] = AGE_HALF_LIFE_S
    assert links.bytes_per_s("p", "d") == pytest.approx(1 / (0.5 / 1e7 + 0.5 / 1e9))
    now[0] = 20 * AGE_HALF_LIFE_S
    assert links.bytes_per_s("p", "d") == pytest.approx(1e9, rel=1e-3)
    links.observe("p", "d", 8 << 20, (8 << 20) / 1e8)  # a push again: measured from here
    assert links.bytes_per_s("p", "d") < 1e8


def test_links_skip_pushes_too_small_to_measure_and_follow_a_changed_link() -> None:
    from cluster.placement.links import MIN_BYTES, Links

    links = Links(1e9)
    links.observe("p", "d", MIN_BYTES - 1, 1e-6)  # latency, not bandwidth
    assert links.bytes_per_s("p", "d") == 1e9
    for _ in range(20):
        links.observe("p", "d", 1 << 20, (1 << 20) / 4e8)
    assert links.bytes_per_s("p", "d") == pytest.approx(4e8)
    for _ in range(24):  # shaped to a tenth: followed within a few half-lives
        links.observe("p", "d", 1 << 20, (1 << 20) / 4e7)
    assert links.bytes_per_s("p", "d") < 5e7
    links.forget("d")
    assert links.bytes_per_s("p", "d") == 1e9


def test_a_session_stays_on_its_decode_worker_before_the_index_hears_of_its_pages() -> None:
    """Turn 1 of a conversation went to some decode worker; the index has not heard of its
    pages yet (empty). Turn 2 names the session: its worker is credited with turn 1's prompt
    pages, so the short new part is prefilled there. Without the session, the same prompt
    looks cold everywhere and goes to a prefill worker, on whichever decode worker."""
    turn1 = _pages("conv", 20)
    turn2 = turn1 + _pages("more", 2)  # turn 1's prompt, its answer and a new question
    for seed in range(10):
        placer = _fleet([_prefill("p0"), _decode("d0"), _decode("d1")], seed=seed)
        first = placer.place("r1", turn1, 20 * PS + 5, session="s")
        placer.finish("r1")
        home = first.decode_id
        got = placer.place("r2", turn2, 22 * PS + 5, session="s")
        assert (got.kind, got.decode_id, got.hit) == (PlacementKind.LOCAL, home, PrefixHit(20, 0, 0))
        assert got.num_recompute_tokens == 2 * PS + 5
        assert placer.stats.num_session_kept == 1 and placer.stats.num_session_moved == 0
        placer.finish("r2")
        cold = placer.place("r3", turn2, 22 * PS + 5)
        assert (cold.kind, cold.hit) == (PlacementKind.DISAGGREGATED, PrefixHit())


def test_the_cost_model_moves_a_session_off_a_full_worker_and_the_session_follows() -> None:
    turn1, turn2 = _pages("conv", 20), _pages("conv", 22)
    workers = [_prefill("p0"), _decode("d0"), _decode("d1")]
    placer = _fleet(workers)
    home = placer.place("r1", turn1, 20 * PS + 5, session="s").decode_id
    placer.finish("r1")
    other = "d1" if home == "d0" else "d0"
    placer.update_worker(_decode(home, num_free_pages=0))  # no room on the session's worker
    moved = placer.place("r2", turn2, 22 * PS + 5, session="s")
    assert moved.decode_id == other and placer.stats.num_session_moved == 1
    placer.finish("r2")
    placer.update_worker(_decode(home))  # room again: the session stays where it moved
    again = placer.place("r3", _pages("conv", 23), 23 * PS + 5, session="s")
    assert (again.decode_id, again.kind, again.hit) == (other, PlacementKind.LOCAL, PrefixHit(22, 0, 0))


def test_a_session_whose_pages_no_longer_lead_the_prompt_is_credited_nothing() -> None:
    placer = _fleet([_prefill("p0"), _decode("d0"), _decode("d1")])
    home = placer.place("r1", _pages("conv", 20), 20 * PS + 5, session="s").decode_id
    placer.finish("r1")
    got = placer.place("r2", _pages("other", 22), 22 * PS + 5, session="s")  # another prompt, same key
    assert got.hit == PrefixHit() and got.kind == PlacementKind.DISAGGREGATED
    assert got.decode_id == home  # still preferred on a tie


def test_sessions_are_bounded() -> None:
    placer = _fleet([_prefill("p0"), _decode("d0")], cfg=replace(CFG, max_sessions=2))
    for i in range(5):
        placer.place(f"r{i}", _pages(f"c{i}", 4), 4 * PS + 1, session=f"s{i}")
        placer.finish(f"r{i}")
    assert list(placer._sessions) == ["s3", "s4"]


def test_a_session_stays_within_its_slack_and_moves_off_a_loaded_worker() -> None:
    turn1, turn2 = _pages("conv", 20), _pages("conv", 22)
    # a little busier than the other worker: kept; far busier (and slower for it): moved
    for running, itl_s, stays in ((2, 0.01, True), (40, 0.03, False)):
        placer = _fleet([_prefill("p0"), _decode("d0", num_running=0), _decode("d1", num_running=0)])
        home = placer.place("r1", turn1, 20 * PS + 5, session="s").decode_id
        placer.finish("r1")
        assert home is not None
        placer.update_worker(_decode(home, num_running=running, itl_s=itl_s))
        got = placer.place("r2", turn2, 22 * PS + 40, session="s")
        assert (got.decode_id == home) is stays, (running, got)
