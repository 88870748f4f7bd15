"""The P:D planner (cluster.ops.planner, cluster.ops.planner_k8s), without Ray.

Decisions run on metric series generated here, deterministically (seeded): a demand trace per
role, turned into samples by a small queueing model of the cluster (`Sim`) that also carries out
each decision (a new worker is "starting" for one sample, then "ok"; a victim leaves at once), so
a scale-out that worked shows in the next samples as it would on a real cluster. Given a trace,
when the planner runs, then the actions are the expected role, within the limits, never flapping.

The windowed p90 is checked on a real prometheus_client registry (EdgeMetrics) against numpy;
the KubeRay patch against the real k8s/base RayCluster and the KubeRay CRD schema; the real
`kubernetes` client against a loopback HTTP server that records the request.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import io
import json
import math
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import yaml

from cluster.ops.metrics import EdgeMetrics
from cluster.ops.node_status import NodeStatus
from cluster.ops.planner import Decision, Limits, Planner, PlannerConfig, Role, Sample
from cluster.ops.planner_k8s import MERGE_PATCH, KubeRayScaler, scale_patch
from cluster.ops.planner_loop import (
    LatencyWindow,
    LocalRayScaler,
    bucket_counts,
    histogram_quantile,
    run,
    sample_from,
)
from engine.env import kuberay_cluster
from engine.errors import ConfigError
from kvcache.report import CacheReport, TierReport
from tests.k8s.manifests import CRDS, crd_schema

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
RAYCLUSTER = ROOT / "k8s" / "base" / "raycluster.yaml"
PERIOD_S = 10.0
CFG = PlannerConfig(
    ttft_slo_s=1.0, itl_slo_s=0.1, limits=Limits(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6,
                                                 min_total=2, max_total=12),  # fmt: skip
    out_samples=3, in_samples=10, cooldown_s=60.0, settle_timeout_s=300.0, decode_max_running=64,
    prefill_queue_tokens=8192, cache_window=30,
)


# -- a cluster that answers to demand ---------------------------------------------------------------


@dataclass(frozen=True)
class Demand:
    prefill: float  # prompt work, in prefill workers' worth at full speed
    decode: float  # requests decoding at once


@dataclass
class Worker:
    role: Role
    health: str = "ok"
    hits: int = 0  # cumulative hit tokens
    hit_rate: int = 0  # hit tokens per sample
    cached: int = 0  # cached pages
    age: int = 0  # samples since it started


@dataclass
class Sim:
    """Samples from demand and the workers it has; carries out decisions like a scaler would."""

    workers: dict[str, Worker]
    seed: int = 0
    noise: float = 0.0  # lognormal sigma on both p90s
    t: float = 0.0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @classmethod
    def of(cls, prefill: int, decode: int, **kwargs: Any) -> Sim:
        workers = {f"prefill-{i}": Worker("prefill") for i in range(prefill)}
        workers |= {f"decode-{i}": Worker("decode") for i in range(decode)}
        return cls(workers, **kwargs)

    def count(self, role: Role) -> int:
        return sum(w.role == role and w.health == "ok" for w in self.workers.values())

    def sample(self, demand: Demand) -> Sample:
        self.t += PERIOD_S
        for w in self.workers.values():
            w.age += 1
            w.hits += w.hit_rate
            if w.health == "starting" and w.age > 1:
                w.health = "ok"
        n_p, n_d = self.count("prefill"), max(self.count("decode"), 1)
        u_p = demand.prefill / n_p if n_p else 0.0  # a prefill worker's utilisation
        queue = 4096 * u_p / max(1 - u_p, 0.05)  # prompt tokens queued per prefill worker
        per_d = demand.decode / n_d
        running, waiting = min(per_d, 64.0), max(per_d - 64.0, 0.0)
        ttft = 0.15 + queue / 8192 + 0.02 * waiting
        itl = 0.02 + 0.09 * (running / 64) ** 2
        idle = demand.prefill == 0 and demand.decode == 0
        jitter = (lambda: math.exp(self.rng.gauss(0, self.noise))) if self.noise else (lambda: 1.0)
        nodes = []
        for name, w in self.workers.items():
            ok = w.health == "ok"
            load = dict(pending_tokens=int(queue) if ok else 0) if w.role == "prefill" else \
                dict(running=int(running) if ok else 0, waiting=int(waiting) if ok else 0)  # fmt: skip
            nodes.append(NodeStatus(name, w.role, w.health, cache=cache(w.hits, w.cached), **load))
        return Sample(self.t, None if idle else ttft * jitter(), None if idle else itl * jitter(),
                      0 if idle else int(10 * demand.prefill + demand.decode), tuple(nodes))  # fmt: skip

    def apply(self, d: Decision) -> None:
        if d.action == "add":
            taken = [int(n.rsplit("-", 1)[1]) for n in self.workers if n.startswith(d.role)]
            self.workers[f"{d.role}-{max(taken, default=-1) + 1}"] = Worker(d.role, "starting")
        else:
            assert d.victim is not None and self.workers[d.victim].health == "ok"
            del self.workers[d.victim]


def cache(hits: int, cached: int) -> CacheReport:
    return CacheReport(query_tokens=2 * hits, hit_tokens=hits, tiers=(TierReport("device", 4096, 0, cached, hits),))


@dataclass(frozen=True)
class Acted:
    time: float
    decision: Decision


def drive(planner: Planner, sim: Sim, trace: Sequence[Demand]) -> list[Acted]:
    """Every sample of the trace through the planner; each decision carried out at once."""
    acted = []
    for demand in trace:
        decision = planner.observe(sim.sample(demand))
        if decision is not None:
            sim.apply(decision)
            planner.applied(decision)
            acted.append(Acted(sim.t, decision))
    return acted


def ramp(start: Demand, end: Demand, steps: int, hold: int) -> list[Demand]:
    out = [Demand(start.prefill + (end.prefill - start.prefill) * i / steps,
                  start.decode + (end.decode - start.decode) * i / steps) for i in range(steps)]  # fmt: skip
    return out + [end] * hold


def assert_no_flapping(acted: Sequence[Acted], cfg: PlannerConfig) -> None:
    for a, b in zip(acted, acted[1:], strict=False):
        assert b.time - a.time >= cfg.cooldown_s, (a, b)
        reversal = {a.decision.action, b.decision.action} == {"add", "remove"} and a.decision.role == b.decision.role
        assert not (reversal and b.time - a.time < cfg.cooldown_s + cfg.in_samples * PERIOD_S), (a, b)


# -- which role --------------------------------------------------------------------------------------


def test_prefill_heavy_ramp_adds_prefill_and_not_decode() -> None:
    sim = Sim.of(1, 2, seed=1, noise=0.05)
    trace = ramp(Demand(0.2, 40), Demand(2.0, 40), steps=40, hold=60)
    acted = drive(Planner(CFG), sim, trace)
    assert acted, "a prefill-heavy ramp must add capacity"
    assert all(a.decision == replace(a.decision, action="add", role="prefill") for a in acted), acted
    assert sim.count("prefill") >= 3 and sim.count("decode") == 2
    assert all("prefill-heavy" in a.decision.reason and "prompt tokens queued" in a.decision.reason for a in acted)
    assert_no_flapping(acted, CFG)
    end = sim.sample(trace[-1])
    assert end.ttft_p90_s is not None and end.ttft_p90_s < CFG.ttft_slo_s  # the adds worked


def test_decode_heavy_adds_decode_even_with_ttft_over() -> None:
    # The decode batches fill up: ITL over, requests wait on decode (which also pushes TTFT up).
    sim = Sim.of(2, 1, seed=2, noise=0.05)
    trace = ramp(Demand(0.4, 20), Demand(0.4, 200), steps=30, hold=60)
    acted = drive(Planner(CFG), sim, trace)
    assert acted and all((a.decision.action, a.decision.role) == ("add", "decode") for a in acted), acted
    assert sim.count("decode") >= 4 and sim.count("prefill") == 2
    assert all("decode-heavy" in a.decision.reason and "waiting" in a.decision.reason for a in acted)
    end = sim.sample(trace[-1])
    assert end.itl_p90_s is not None and end.itl_p90_s < CFG.itl_slo_s


def test_ttft_over_with_a_shrinking_prefill_queue_waits() -> None:
    """A queue that drains on its own is not a reason to add (open loop: recorded samples)."""
    planner = Planner(CFG)
    nodes = lambda queue: (NodeStatus("prefill-0", "prefill", "ok", pending_tokens=queue),  # noqa: E731
                           NodeStatus("decode-0", "decode", "ok", running=10))  # fmt: skip
    queues = [6000, 5500, 5000, 4500, 4000, 3500, 3000]
    decisions = [planner.observe(Sample(i * PERIOD_S, 1.5, 0.03, 20, nodes(q))) for i, q in enumerate(queues)]
    assert decisions == [None] * len(queues)
    assert "shrinking" in planner.last_reason
    # The queue stops shrinking: added once the last out_samples samples show it (3000, 3000, 3500).
    growing = [planner.observe(Sample((7 + i) * PERIOD_S, 1.5, 0.03, 20, nodes(q))) for i, q in enumerate((3000, 3500))]
    assert growing[0] is None and growing[1] is not None and growing[1].role == "prefill"
    assert "3500 prompt tokens queued per prefill worker (was 3000)" in growing[1].reason


def test_itl_over_without_a_full_decode_batch_adds_nothing() -> None:
    """TTFT over with a growing prefill queue reads as prefill-heavy only while ITL is fine; ITL over
    with decode batches far from full is neither role's shortage: nothing is added."""
    planner = Planner(CFG)
    nodes = lambda queue: (NodeStatus("prefill-0", "prefill", "ok", pending_tokens=queue),  # noqa: E731
                           NodeStatus("decode-0", "decode", "ok", running=20))  # fmt: skip
    assert all(planner.observe(Sample(i * PERIOD_S, 2.0, 0.15, 20, nodes(1000 * i))) is None for i in range(20))
    d = planner.observe(Sample(20 * PERIOD_S, 2.0, 0.05, 20, nodes(20_000)))  # ITL back: prefill's turn
    assert d is None and planner.observe(Sample(21 * PERIOD_S, 2.0, 0.05, 20, nodes(21_000))) is None
    d = planner.observe(Sample(22 * PERIOD_S, 2.0, 0.05, 20, nodes(22_000)))
    assert d is not None and (d.action, d.role) == ("add", "prefill")


# -- no flapping ---------------------------------------------------------------------------------------


def test_noise_around_the_threshold_does_not_flap() -> None:
    # Prefill demand where 2 workers sit right at the TTFT SLO, decode where ITL sits at its SLO,
    # with 25 % lognormal noise on both p90s and on the demand itself: 400 samples (66 min).
    rng = random.Random(7)
    trace = [Demand(1.26 * math.exp(rng.gauss(0, 0.05)), 120 * math.exp(rng.gauss(0, 0.05))) for _ in range(400)]
    sim = Sim.of(2, 2, seed=8, noise=0.25)
    acted = drive(Planner(CFG), sim, trace)
    assert_no_flapping(acted, CFG)
    assert len(acted) <= 4, acted  # settles: a worker or two more, then nothing
    assert not any(a.decision.action == "remove" for a in acted), acted


def test_a_daily_wave_is_followed_without_flapping() -> None:
    # Three cycles of a 40-minute wave (prefill and decode out of phase), 10 % demand noise, 25 %
    # on the p90s: workers are added on the way up and removed on the way down.
    rng = random.Random(3)
    wave = lambda i, phase: 1 + 0.7 * math.sin(2 * math.pi * i / 240 + phase)  # noqa: E731
    trace = [Demand(1.2 * wave(i, 0) * math.exp(rng.gauss(0, 0.1)), 100 * wave(i, 1) * math.exp(rng.gauss(0, 0.1)))
             for i in range(720)]  # fmt: skip
    sim = Sim.of(2, 2, seed=103, noise=0.25)
    acted = drive(Planner(CFG), sim, trace)
    assert_no_flapping(acted, CFG)
    assert 6 <= len(acted) <= 30, acted
    for a in acted:  # an add while demand is high or rising, a remove while it is low or falling
        i, phase = int(a.time / PERIOD_S) - 1, 0 if a.decision.role == "prefill" else 1
        level, rising = wave(i, phase), wave(i + 1, phase) > wave(i, phase)
        assert (level > 1 or rising) if a.decision.action == "add" else (level < 1 or not rising), (a, level)


def test_alternating_samples_never_build_a_streak() -> None:
    planner = Planner(CFG)
    nodes = (NodeStatus("prefill-0", "prefill", "ok", pending_tokens=9000),
             NodeStatus("prefill-1", "prefill", "ok", pending_tokens=9000),
             NodeStatus("decode-0", "decode", "ok", running=64, waiting=5),
             NodeStatus("decode-1", "decode", "ok", running=64, waiting=5))  # fmt: skip
    over, under = (2.0, 0.2), (0.3, 0.02)  # (TTFT, ITL): way over / under the in threshold
    for i in range(200):
        ttft, itl = over if i % 2 else under
        assert planner.observe(Sample(i * PERIOD_S, ttft, itl, 50, nodes)) is None


# -- scale in ------------------------------------------------------------------------------------------


def idle_sim() -> Sim:
    """3 + 3 workers; whose cache is worth what (hit tokens per sample; cached pages):"""
    sim = Sim.of(3, 3)
    w = sim.workers
    w["prefill-0"].hit_rate, w["prefill-0"].cached = 100, 50  # in use
    w["prefill-1"].hits, w["prefill-1"].cached = 1_000_000, 40  # a large counter, but nothing lately
    w["prefill-2"].cached = 60
    w["decode-0"].hit_rate, w["decode-0"].cached = 5, 10
    w["decode-1"].hit_rate, w["decode-1"].cached = 50, 10
    w["decode-2"].cached = 100
    return sim


def test_idle_scales_in_to_the_minimums_least_valuable_cache_first() -> None:
    sim = idle_sim()
    acted = drive(Planner(CFG), sim, [Demand(0, 0)] * 200)
    removed = [(a.decision.role, a.decision.victim) for a in acted]
    assert removed == [("prefill", "prefill-1"), ("decode", "decode-2"), ("prefill", "prefill-2"),
                       ("decode", "decode-0")]  # fmt: skip
    assert set(sim.workers) == {"prefill-0", "decode-1"}
    assert all(a.decision.action == "remove" for a in acted)
    assert "victim prefill-1: 0 hit tokens in the last 30 samples, 40 cached pages" in acted[0].decision.reason
    assert_no_flapping(acted, CFG)


def test_scale_in_leaves_the_role_inside_the_band_without_the_victim() -> None:
    """Both p90s under half their SLO is not enough: one worker fewer must not push the role's
    p90 (x n/(n-1)) over half its SLO, nor its load over scale_in_load_frac."""

    def samples(ttft: float, running: int) -> list[Sample]:
        nodes = (NodeStatus("prefill-0", "prefill", "ok"), NodeStatus("prefill-1", "prefill", "ok"),
                 NodeStatus("decode-0", "decode", "ok", running=running),
                 NodeStatus("decode-1", "decode", "ok", running=running))  # fmt: skip
        return [Sample(i * PERIOD_S, ttft, 0.02, 30, nodes) for i in range(30)]

    def decisions(ttft: float, running: int) -> list[tuple[str, str]]:
        planner = Planner(CFG)
        return [(d.action, d.role) for s in samples(ttft, running) if (d := planner.observe(s)) is not None]

    assert decisions(0.4, 20) == []  # prefill: 0.4 x 2/1 > 0.5; decode: 40 running on one > 0.5 x 64
    assert decisions(0.2, 20) == [("remove", "prefill")]
    assert decisions(0.4, 10) == [("remove", "decode")]


def test_scale_in_keeps_the_minimums() -> None:
    cfg = replace(CFG, limits=Limits(min_prefill=2, max_prefill=6, min_decode=1, max_decode=6, min_total=4,
                                     max_total=12))  # fmt: skip
    sim = idle_sim()
    acted = drive(Planner(cfg), sim, [Demand(0, 0)] * 200)
    assert [a.decision.role for a in acted] == ["decode", "prefill"]  # 6 -> 4 (min_total), prefill >= 2
    assert sim.count("prefill") == 2 and sim.count("decode") == 2


def test_an_unhealthy_worker_is_never_the_victim() -> None:
    sim = idle_sim()
    for name, health in (("prefill-3", "stalled"), ("decode-3", "starting"), ("decode-4", "down")):
        sim.workers[name] = Worker("prefill" if name.startswith("prefill") else "decode", health)
    sim.workers["decode-3"].age = -10_000  # stays "starting"
    acted = drive(Planner(CFG), sim, [Demand(0, 0)] * 200)
    victims = {a.decision.victim for a in acted}
    assert victims == {"prefill-1", "prefill-2", "decode-2", "decode-0"}
    assert {"prefill-3", "decode-3", "decode-4"} <= set(sim.workers)


def test_no_scale_in_while_a_worker_drains() -> None:
    planner = Planner(CFG)
    ok = [NodeStatus(f"{r}-{i}", r, "ok") for r in ("prefill", "decode") for i in range(2)]
    draining = NodeStatus("decode-9", "decode", "left", running=3)
    for i in range(50):
        assert planner.observe(Sample(i * PERIOD_S, None, None, 0, (*ok, draining))) is None
    drained = replace(draining, running=0)
    decisions = [planner.observe(Sample((50 + i) * PERIOD_S, None, None, 0, (*ok, drained))) for i in range(10)]
    assert decisions[:9] == [None] * 9 and decisions[9] is not None and decisions[9].action == "remove"


# -- limits and one action at a time -------------------------------------------------------------------


def test_maximums_hold() -> None:
    cfg = replace(CFG, limits=Limits(min_prefill=1, max_prefill=2, min_decode=1, max_decode=6, min_total=2,
                                     max_total=12))  # fmt: skip
    sim = Sim.of(1, 1, seed=3)
    acted = drive(Planner(cfg), sim, [Demand(5.0, 20)] * 100)
    assert [(a.decision.action, a.decision.role) for a in acted] == [("add", "prefill")]
    assert sim.count("prefill") == 2
    # max_total: 2 + 2 in all with prefill under pressure
    cfg = replace(CFG, limits=Limits(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, min_total=2,
                                     max_total=4))  # fmt: skip
    planner, sim = Planner(cfg), Sim.of(2, 2, seed=4)
    assert drive(planner, sim, [Demand(5.0, 20)] * 100) == []
    assert "at the maximum" in planner.last_reason


def test_never_acts_while_an_action_is_pending() -> None:
    planner = Planner(CFG)
    nodes = (NodeStatus("prefill-0", "prefill", "ok", pending_tokens=20_000),
             NodeStatus("decode-0", "decode", "ok", running=64, waiting=30))  # fmt: skip
    overloaded = lambda i: Sample(i * PERIOD_S, 5.0, 0.5, 10, nodes)  # noqa: E731  (nothing ever changes)
    first = [planner.observe(overloaded(i)) for i in range(3)]
    assert first[:2] == [None, None] and first[2] is not None
    assert planner.pending is first[2]
    # The new worker never shows up: nothing else happens until settle_timeout_s, then cooldown_s.
    times = [i * PERIOD_S for i in range(3, 60)]
    later = [(t, planner.observe(overloaded(int(t / PERIOD_S)))) for t in times]
    acted = [(t, d) for t, d in later if d is not None]
    assert acted and acted[0][0] >= 2 * PERIOD_S + CFG.settle_timeout_s + CFG.cooldown_s
    assert len(acted) == 1


@pytest.mark.parametrize("gone", ["absent", "down", "left"])
def test_a_removal_is_pending_until_the_victim_is_gone(gone: str) -> None:
    planner = Planner(CFG)
    nodes = [NodeStatus(f"{r}-{i}", r, "ok") for r in ("prefill", "decode") for i in range(3)]
    decisions = [planner.observe(Sample(i * PERIOD_S, None, None, 0, tuple(nodes))) for i in range(10)]
    removal = decisions[-1]
    assert decisions[:-1] == [None] * 9 and removal is not None and removal.victim is not None
    victim, role = removal.victim, removal.role
    # Still "ok", then "left" with requests on it (draining): 20 samples, under settle_timeout_s.
    for i in range(20):
        draining = [replace(n, health="left", running=2) if n.name == victim and i >= 10 else n for n in nodes]
        assert planner.observe(Sample((10 + i) * PERIOD_S, None, None, 0, tuple(draining))) is None
        assert planner.pending is removal
    ended = {"absent": [], "down": [NodeStatus(victim, role, "down")], "left": [NodeStatus(victim, role, "left")]}
    rest = tuple(n for n in nodes if n.name != victim) + tuple(ended[gone])
    after = [planner.observe(Sample(30 * PERIOD_S, None, None, 0, rest))]
    assert after == [None] and planner.pending is None  # done: the cooldown starts now
    after += [planner.observe(Sample((31 + i) * PERIOD_S, None, None, 0, rest)) for i in range(19)]
    acted = [i for i, d in enumerate(after) if d is not None]
    assert acted and acted[0] == max(CFG.in_samples - 1, CFG.cooldown_s / PERIOD_S)


def test_config_rejects_a_band_without_hysteresis() -> None:
    with pytest.raises(ConfigError, match="hysteresis"):
        PlannerConfig(scale_in_frac=1.0, scale_out_frac=1.0)
    with pytest.raises(ConfigError, match="min_decode"):
        Limits(min_decode=0)
    with pytest.raises(ConfigError, match="min_total"):
        Limits(min_prefill=2, min_decode=2, min_total=3)


# -- the loop and the local scaler ---------------------------------------------------------------------


class Pool:
    """The Fleet's add_worker / drain_worker, recorded."""

    def __init__(self, fail: bool = False, hang: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail, self.hang = fail, hang

    async def add_worker(self, role: str) -> str:
        self.calls.append(("add", role))
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise RuntimeError("no room for another actor")
        return f"{role}-9"

    async def drain_worker(self, name: str) -> None:
        self.calls.append(("drain", name))


def sampler(samples: Sequence[Sample]) -> Callable[[], Any]:
    it: Iterator[Sample] = iter(samples)

    async def next_sample() -> Sample:
        return next(it)

    return next_sample


async def test_run_applies_decisions_through_the_local_scaler() -> None:
    sim = idle_sim()
    samples = [sim.sample(Demand(0, 0)) for _ in range(10)]
    pool = Pool()
    done = await run(Planner(CFG), LocalRayScaler(pool), sampler(samples), 0.001, asyncio.Event(),
                     max_samples=len(samples))  # fmt: skip
    assert [(d.action, d.role, d.victim) for d in done] == [("remove", "prefill", "prefill-1")]
    assert pool.calls == [("drain", "prefill-1")]
    assert await LocalRayScaler(pool).add("decode") == "decode-9"
    assert pool.calls[-1] == ("add", "decode")


async def test_a_failing_action_backs_off() -> None:
    nodes = (NodeStatus("prefill-0", "prefill", "ok", pending_tokens=20_000),
             NodeStatus("decode-0", "decode", "ok", running=10))  # fmt: skip
    samples = [Sample(i * PERIOD_S, 5.0, 0.02, 10, nodes) for i in range(150)]
    pool, planner = Pool(fail=True), Planner(CFG)
    sample_fn, tries = sampler(samples), []

    async def recording() -> Sample:
        s = await sample_fn()
        tries.append((s.time, len(pool.calls)))
        return s

    done = await run(planner, LocalRayScaler(pool), recording, 0.001, asyncio.Event(), max_samples=150)
    assert done == [] and planner.pending is None
    times = [t for (t, calls), (_, after) in zip(tries, tries[1:] + [(0.0, len(pool.calls))], strict=True)
             if after > calls]  # fmt: skip
    assert times[0] == 2 * PERIOD_S  # out_samples
    # the cooldown doubles per failure, up to MAX_BACKOFF x (the streak kept building meanwhile)
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == [60.0, 120.0, 240.0, 480.0, 480.0]


async def test_an_action_that_hangs_times_out() -> None:
    nodes = (NodeStatus("prefill-0", "prefill", "ok", pending_tokens=20_000),
             NodeStatus("decode-0", "decode", "ok", running=10))  # fmt: skip
    samples = [Sample(i * PERIOD_S, 5.0, 0.02, 10, nodes) for i in range(4)]
    pool, planner = Pool(hang=True), Planner(CFG)
    done = await run(planner, LocalRayScaler(pool), sampler(samples), 0.001, asyncio.Event(),
                     action_timeout_s=0.05, max_samples=4)  # fmt: skip
    assert done == [] and pool.calls == [("add", "prefill")] and planner.pending is None


async def test_run_stops_on_the_event_and_on_cancel() -> None:
    node = (NodeStatus("decode-0", "decode", "ok"),)

    async def forever() -> Sample:
        return Sample(0.0, None, None, 0, node)

    stop = asyncio.Event()
    task = asyncio.create_task(run(Planner(CFG), LocalRayScaler(Pool()), forever, 30.0, stop))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(task, 2.0) == []
    task = asyncio.create_task(run(Planner(CFG), LocalRayScaler(Pool()), forever, 30.0, asyncio.Event()))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)


async def test_a_failing_sample_is_skipped() -> None:
    calls = 0

    async def flaky() -> Sample:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise ConnectionError("gateway busy")
        return Sample(calls * PERIOD_S, None, None, 0, (NodeStatus("decode-0", "decode", "ok"),))

    assert await run(Planner(CFG), LocalRayScaler(Pool()), flaky, 0.001, asyncio.Event(), max_samples=6) == []
    assert calls == 6


async def test_a_slow_sample_is_skipped_at_the_period_or_awaited_to_its_own_bound() -> None:
    observed: list[float] = []

    class Recording(Planner):
        def observe(self, sample: Sample) -> Decision | None:
            observed.append(sample.time)
            return super().observe(sample)

    async def slow() -> Sample:  # 10 ms: ten periods of 1 ms, far inside a 30 s bound
        await asyncio.sleep(0.01)
        return Sample(0.0, None, None, 0, (NodeStatus("decode-0", "decode", "ok"),))

    assert await run(Recording(CFG), LocalRayScaler(Pool()), slow, 0.001, asyncio.Event(), max_samples=3) == []
    assert observed == []  # each one past the period: skipped
    await run(Recording(CFG), LocalRayScaler(Pool()), slow, 0.001, asyncio.Event(), max_samples=3, sample_timeout_s=30.0)
    assert len(observed) == 3


# -- windowed p90 from the gateway's histograms -------------------------------------------------------


def test_histogram_quantile_is_prometheus() -> None:
    b = ((1.0, 10.0), (2.0, 20.0), (math.inf, 20.0))
    assert histogram_quantile(0.5, b) == 1.0
    assert histogram_quantile(0.75, b) == 1.5
    assert histogram_quantile(0.25, b) == 0.5  # the first bucket starts at 0
    assert histogram_quantile(0.9, ((1.0, 0.0), (2.0, 1.0), (math.inf, 10.0))) == 2.0  # +Inf: highest finite
    assert histogram_quantile(0.9, ((1.0, 0.0), (math.inf, 0.0))) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, b)


def bucket_of(value: float, bounds: Sequence[float]) -> tuple[float, float]:
    lower = 0.0
    for upper in bounds:
        if value <= upper:
            return lower, upper
        lower = upper
    return lower, math.inf


def test_window_p90_matches_numpy_within_its_bucket() -> None:
    metrics = EdgeMetrics()
    window = LatencyWindow(metrics)
    bounds = [le for le, _ in bucket_counts(metrics.ttft)][:-1]
    rng = np.random.default_rng(11)
    first = rng.lognormal(mean=math.log(0.3), sigma=0.8, size=5000)
    for v in first:
        metrics.ttft.observe(float(v))
    metrics.requests.labels("http", "ok").inc(40)
    read = window.read()
    true = float(np.percentile(first, 90))
    assert read.ttft_p90_s is not None
    lo, hi = bucket_of(true, bounds)
    assert lo <= read.ttft_p90_s <= hi, (read.ttft_p90_s, true, (lo, hi))
    assert read.itl_p90_s is None and read.requests == 40
    # The next window holds only what came after: a slower distribution, ITL too.
    second = rng.uniform(2.6, 4.9, size=3000)
    for v in second:
        metrics.ttft.observe(float(v))
        metrics.itl.observe(float(v) / 100)
    metrics.requests.labels("grpc", "error").inc(3)
    read = window.read()
    assert read.ttft_p90_s is not None and read.itl_p90_s is not None
    lo, hi = bucket_of(float(np.percentile(second, 90)), bounds)
    assert (lo, hi) == (2.5, 5) and lo <= read.ttft_p90_s <= hi
    lo, hi = bucket_of(float(np.percentile(second / 100, 90)), bounds)
    assert lo <= read.itl_p90_s <= hi
    assert read.requests == 3
    assert window.read() == (None, None, 0)


async def test_sample_from_a_gateway() -> None:
    class Gateway:
        def __init__(self) -> None:
            self.metrics = EdgeMetrics()

        async def nodes(self) -> list[NodeStatus]:
            return [NodeStatus("prefill-0", "prefill", "ok", pending_tokens=7), NodeStatus("decode-0", "decode", "ok")]

    gw = Gateway()
    window = LatencyWindow(gw.metrics)
    for v in (0.2,) * 9 + (0.7,):
        gw.metrics.ttft.observe(v)
    s = await sample_from(gw, window, now=123.0)
    assert s.time == 123.0 and s.itl_p90_s is None and s.requests == 0
    assert s.ttft_p90_s is not None and 0.1 < s.ttft_p90_s <= 0.25
    assert [n.name for n in s.nodes] == ["prefill-0", "decode-0"] and s.nodes[0].pending_tokens == 7


# -- KubeRay -------------------------------------------------------------------------------------------


def raycluster(**replicas: int) -> dict[str, Any]:
    rc: dict[str, Any] = yaml.safe_load(RAYCLUSTER.read_text())
    for g in rc["spec"]["workerGroupSpecs"]:
        g["replicas"] = replicas.get(g["groupName"], g["replicas"])
    return rc


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


def groups(rc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}


def test_patch_adds_a_decode_replica_to_the_real_raycluster() -> None:
    rc = raycluster()
    patch = scale_patch(rc, Decision("add", "decode", None, "test"))
    assert set(patch) == {"spec"} and set(patch["spec"]) == {"workerGroupSpecs"}  # no resourceVersion: not read
    patched = merge(rc, patch)
    before, after = groups(rc), groups(patched)
    assert after["decode"]["replicas"] == before["decode"]["replicas"] + 1
    assert after["decode"]["scaleStrategy"] == {"workersToDelete": []}
    assert after["prefill"] == before["prefill"]  # the list is whole, the other group as it was
    assert {k: v for k, v in after["decode"].items() if k not in ("replicas", "scaleStrategy")} == \
        {k: v for k, v in before["decode"].items() if k != "replicas"}  # fmt: skip
    validate_raycluster(patched)


def test_patch_removes_the_named_prefill_pod() -> None:
    rc = raycluster(prefill=3)
    rc["metadata"]["resourceVersion"] = "4711"
    patch = scale_patch(rc, Decision("remove", "prefill", "prefill-2", "test"), "baton-prefill-worker-x7k2p")
    assert patch["metadata"] == {"resourceVersion": "4711"}  # a concurrent change: 409, not overwritten
    after = groups(merge(rc, patch))
    assert after["prefill"]["replicas"] == 2
    assert after["prefill"]["scaleStrategy"] == {"workersToDelete": ["baton-prefill-worker-x7k2p"]}
    assert after["decode"] == groups(rc)["decode"]
    validate_raycluster(merge(rc, patch))


def test_patch_refuses_what_the_group_does_not_allow() -> None:
    with pytest.raises(ValueError, match="outside 1..16"):
        scale_patch(raycluster(), Decision("remove", "decode", "decode-0", "test"), "pod")  # minReplicas 1
    with pytest.raises(ValueError, match="outside 1..16"):
        scale_patch(raycluster(prefill=16), Decision("add", "prefill", None, "test"))
    with pytest.raises(ValueError, match="names the pod"):
        scale_patch(raycluster(decode=2), Decision("remove", "decode", "decode-0", "test"), None)
    rc = raycluster()
    rc["spec"]["workerGroupSpecs"] = rc["spec"]["workerGroupSpecs"][:1]
    with pytest.raises(ValueError, match="no worker group 'decode'"):
        scale_patch(rc, Decision("add", "decode", None, "test"))


@functools.cache
def raycluster_validator() -> Any:
    """The KubeRay CRD's schema, strict (unknown fields are errors), as tests/k8s checks manifests."""
    schema = crd_schema(CRDS / "kuberay" / "ray.io_rayclusters.yaml", "v1")
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)


def validate_raycluster(obj: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in raycluster_validator().iter_errors(obj)]
    assert not errors, errors


class FakeCustomObjects:
    """CustomObjectsApi's two calls: serves `obj`, records every call (and the drains around them)."""

    def __init__(self, obj: dict[str, Any], log: list[Any]) -> None:
        self.obj, self.log = obj, log

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     **kwargs: Any) -> Any:  # fmt: skip
        self.log.append(("get", group, version, namespace, plural, name))
        return copy.deepcopy(self.obj)

    def patch_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                       body: Any, **kwargs: Any) -> Any:  # fmt: skip
        self.log.append(("patch", group, version, namespace, plural, name, body, kwargs["_content_type"]))
        self.obj = merge(self.obj, body)
        return self.obj


async def test_kuberay_scaler_drains_then_patches() -> None:
    log: list[Any] = []
    api = FakeCustomObjects(raycluster(decode=3), log)

    async def drain(name: str) -> None:
        log.append(("drain", name))

    async def spawn(role: str) -> str:
        log.append(("spawn", role))
        return f"{role}-9"

    pods = {"decode-1": "baton-decode-worker-abcde"}

    async def pod_of(name: str) -> str:
        return pods[name]

    scaler = KubeRayScaler("baton", "baton", pod_of, api=api, drain=drain, spawn=spawn)
    await scaler.remove("decode", "decode-1")
    assert [entry[0] for entry in log] == ["drain", "get", "patch"]
    assert log[0] == ("drain", "decode-1")
    assert log[1] == ("get", "ray.io", "v1", "baton", "rayclusters", "baton")
    _, *target, body, content_type = log[2]
    assert target == ["ray.io", "v1", "baton", "rayclusters", "baton"] and content_type == MERGE_PATCH
    assert groups(api.obj)["decode"]["replicas"] == 2
    assert groups(api.obj)["decode"]["scaleStrategy"]["workersToDelete"] == ["baton-decode-worker-abcde"]
    del log[:]
    assert await scaler.add("prefill") == "prefill-9"  # the pod is made room for first, then its actor
    assert [entry[0] for entry in log] == ["get", "patch", "spawn"] and log[-1] == ("spawn", "prefill")
    assert groups(api.obj)["prefill"]["replicas"] == 2
    assert groups(api.obj)["decode"]["scaleStrategy"]["workersToDelete"] == ["baton-decode-worker-abcde"]
    # A worker that cannot be placed on a pod: nothing drained, nothing patched.
    del log[:]
    with pytest.raises(KeyError):
        await scaler.remove("decode", "decode-7")
    assert log == []


async def test_a_pod_whose_actor_did_not_start_is_reused_by_the_next_add() -> None:
    log: list[Any] = []
    api = FakeCustomObjects(raycluster(decode=1), log)
    tries = iter([TimeoutError("no pod in time"), "decode-1"])

    async def spawn(role: str) -> str:
        log.append(("spawn", role))
        outcome = next(tries)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    scaler = KubeRayScaler("baton", "baton", _no_pod, api=api, spawn=spawn)
    with pytest.raises(TimeoutError):
        await scaler.add("decode")
    assert groups(api.obj)["decode"]["replicas"] == 2  # the pod was asked for
    assert await scaler.add("decode") == "decode-1"
    assert groups(api.obj)["decode"]["replicas"] == 2  # and reused: no second pod
    assert [e[0] for e in log] == ["get", "patch", "spawn", "spawn"]


async def test_kuberay_dry_run_prints_the_patch_and_changes_nothing() -> None:
    log: list[Any] = []
    rc = raycluster(prefill=2)
    api = FakeCustomObjects(rc, log)
    out = io.StringIO()

    async def drain(name: str) -> None:
        log.append(("drain", name))

    async def pod_of(name: str) -> str:
        return f"pod-of-{name}"

    scaler = KubeRayScaler("baton", "baton", pod_of, api=api, drain=drain, dry_run=True, out=out)
    await scaler.remove("prefill", "prefill-1")
    await scaler.add("decode")
    assert [entry[0] for entry in log] == ["get", "get"]  # read, never patched nor drained
    printed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert printed == [scale_patch(rc, Decision("remove", "prefill", "prefill-1", ""), "pod-of-prefill-1"),
                       scale_patch(rc, Decision("add", "decode", None, ""))]  # fmt: skip
    assert groups(merge(rc, printed[0]))["prefill"]["scaleStrategy"] == {"workersToDelete": ["pod-of-prefill-1"]}


class _ApiServer(BaseHTTPRequestHandler):
    """One RayCluster behind GET and merge PATCH, with the API server's optimistic concurrency: a
    patch carrying a stale metadata.resourceVersion gets 409; each write bumps it. `interfere`
    writes once, right after the first GET (someone else's change landing in between)."""

    obj: dict[str, Any] = {}
    requests: list[tuple[str, str, str, Any]] = []
    interfere: dict[str, Any] | None = None

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    @classmethod
    def _write(cls, patch: dict[str, Any]) -> None:
        cls.obj = merge(cls.obj, patch)
        cls.obj["metadata"]["resourceVersion"] = str(int(cls.obj["metadata"]["resourceVersion"]) + 1)

    def do_GET(self) -> None:  # noqa: N802
        self.requests.append(("GET", self.path, "", None))
        self._reply(200, self.obj)
        if type(self).interfere is not None:
            type(self)._write(type(self).interfere or {})
            type(self).interfere = None

    def do_PATCH(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(("PATCH", self.path, self.headers["Content-Type"], body))
        if body.get("metadata", {}).get("resourceVersion", self.obj["metadata"]["resourceVersion"]) != \
                self.obj["metadata"]["resourceVersion"]:  # fmt: skip
            self._reply(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict",
                              "code": 409, "message": "the object has been modified"})  # fmt: skip
            return
        type(self)._write(body)
        self._reply(200, self.obj)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def test_the_real_kubernetes_client_merge_patches_and_rereads_on_conflict() -> None:
    kubernetes = pytest.importorskip("kubernetes")
    rc = raycluster()
    rc["metadata"] |= {"namespace": "baton", "resourceVersion": "17"}
    _ApiServer.obj, _ApiServer.requests = rc, []
    # an operator scales prefill to 3 between the scaler's GET and its PATCH
    _ApiServer.interfere = {"spec": {"workerGroupSpecs": [g | {"replicas": 3} if g["groupName"] == "prefill"
                                                          else g for g in rc["spec"]["workerGroupSpecs"]]}}  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        conf = kubernetes.client.Configuration()
        conf.host = f"http://127.0.0.1:{server.server_address[1]}"
        api = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(conf))
        await KubeRayScaler("baton", "baton", _no_pod, api=api).add("decode")
    finally:
        server.shutdown()
        server.server_close()
    path = "/apis/ray.io/v1/namespaces/baton/rayclusters/baton"
    assert [(r[0], r[1].split("?")[0]) for r in _ApiServer.requests] == [("GET", path), ("PATCH", path)] * 2
    first, second = _ApiServer.requests[1], _ApiServer.requests[3]
    assert first[1] == path + "?fieldManager=baton-planner" and first[2] == MERGE_PATCH
    assert first[3]["metadata"] == {"resourceVersion": "17"}  # refused: 409
    assert second[3]["metadata"] == {"resourceVersion": "18"}
    after = groups(_ApiServer.obj)
    assert after["decode"]["replicas"] == 2 and after["prefill"]["replicas"] == 3  # theirs kept, ours applied
    assert _ApiServer.obj["metadata"]["resourceVersion"] == "19"


async def _no_pod(name: str) -> str:
    raise KeyError(name)


def test_the_head_pods_environment_names_its_raycluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_RAYCLUSTER", "baton-b")
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert kuberay_cluster() is None  # off Kubernetes, or a pod that does not say
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    assert kuberay_cluster() == ("baton-b", "serving")


def test_planner_k8s_imports_without_the_kubernetes_client() -> None:
    code = ("import sys; import cluster.ops.planner_k8s; "
            "assert 'kubernetes' not in sys.modules, 'kubernetes imported eagerly'")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
