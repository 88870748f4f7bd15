"""The P:D planner: decides the prefill:decode ratio and the total size from what the gateway
measures, one sample per period, and applies it one worker at a time (docs/architecture.md,
Membership and control). This module decides; cluster.ops.planner_loop samples and applies.

    sample = await sample_from(frontend, window)   TTFT and ITL p90 over the last period (the
                                                   gateway's histograms, differenced), every
                                                   node's NodeStatus (queues, cache counters)
    decision = planner.observe(sample)             add / remove one worker of one role, or None
    await scaler.add(role) | scaler.remove(role, victim)
                                                   LocalRayScaler: the Fleet's actors;
                                                   cluster.ops.planner_k8s.KubeRayScaler: the
                                                   RayCluster's worker groups
    planner.applied(decision, name) | planner.failed(decision)

What is read as which load (a p90 "over" is above scale_out_frac x its SLO):
    prefill-heavy   TTFT over, ITL not over, prompt tokens queued on the prefill workers and
                    not shrinking over the last out_samples (or a full one)  -> add prefill
    decode-heavy    ITL over, decode batches near max_running or requests waiting
                                                                            -> add decode
    spare           both p90s at most scale_in_frac x SLO (or no requests), nothing waiting on
                    decode -> remove one worker of the least loaded role among those that stay
                    in the band without it (load under scale_in_load_frac, its p90 x n/(n-1)
                    at most scale_in_frac x SLO); the victim is the healthy worker whose cache
                    is least valuable: fewest hit tokens over the last cache_window samples
                    (cumulative counters, differenced), then fewest cached pages
ITL over takes precedence: a full decode batch also delays first tokens. ITL over with decode
batches far from full is neither role's shortage (nothing is added; last_reason says so).

No flapping, by construction: the out and in thresholds are apart; a condition must hold for
out_samples (in_samples) consecutive samples; one action at a time, pending until the samples
show it done (the new worker healthy, the victim gone) or settle_timeout_s; then cooldown_s
with no action (a failed one backs off, doubling up to 8x). No scale-in while any worker drains
(ours or anyone's: "left" with requests still on it), below a minimum, or with a decode queue.
The planner does not replace failed workers (KubeRay recreates its pods); `min_*` bound only
scale-in.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

from cluster.ops.node_status import NodeStatus
from engine.errors import ConfigError

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
Action = Literal["add", "remove"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
LIVE = frozenset({"ok", "starting", "stalled"})  # counted toward the size (max limits)
QUANTILE = 0.9
MAX_BACKOFF = 8  # a failed action's cooldown doubles up to this factor


@dataclass(frozen=True, slots=True)
class Sample:
    time: float  # seconds, monotonic
    ttft_p90_s: float | None  # over the last window; None: no first token in it
    itl_p90_s: float | None
    requests: int  # finished in the window (for the reasons: a p90 of few is noisy, streaks absorb it)
    nodes: tuple[NodeStatus, ...]


@dataclass(frozen=True, slots=True)
class Limits:
    min_prefill: int = 1  # 0: decode prefills everything itself
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    min_total: int = 2
    max_total: int = 16

    def __post_init__(self) -> None:
        if not (0 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode <= self.max_decode):
            raise ConfigError("planner.limits", "need 0 <= min_prefill <= max_prefill, 1 <= min_decode <= max_decode")
        if not self.min_prefill + self.min_decode <= self.min_total <= self.max_total:
            raise ConfigError("planner.limits", "need min_prefill + min_decode <= min_total <= max_total")

    def min_of(self, role: Role) -> int:
        return self.min_prefill if role == "prefill" else self.min_decode

    def max_of(self, role: Role) -> int:
        return self.max_prefill if role == "prefill" else self.max_decode


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    limits: Limits = Limits()
    scale_out_frac: float = 1.0  # a p90 above this x its SLO is over
    scale_in_frac: float = 0.5  # both p90s at most this x their SLOs: room to scale in
    out_samples: int = 3  # consecutive samples an add needs
    in_samples: int = 10  # consecutive samples a remove needs
    cooldown_s: float = 60.0  # after an action settles (or fails), no other
    settle_timeout_s: float = 600.0  # an action not seen done by then is given up on
    decode_max_running: int = 64  # a decode worker's batch limit (max_num_seqs)
    decode_busy_frac: float = 0.9  # running >= this x max_running per worker: near max
    prefill_queue_tokens: int = 8192  # queued prompt tokens one prefill worker holds comfortably
    scale_in_load_frac: float = 0.5  # without the victim, the role's load stays under this
    cache_window: int = 30  # samples over which a victim's hit tokens are counted

    def __post_init__(self) -> None:
        if not (self.ttft_slo_s > 0 and self.itl_slo_s > 0):
            raise ConfigError("planner.slo", "SLOs must be positive")
        if not 0 < self.scale_in_frac < self.scale_out_frac:
            raise ConfigError("planner.scale_in_frac", "need 0 < scale_in_frac < scale_out_frac (the hysteresis band)")
        if min(self.out_samples, self.in_samples, self.cache_window, self.decode_max_running,
               self.prefill_queue_tokens) < 1:  # fmt: skip
            raise ConfigError("planner", "sample counts, decode_max_running and prefill_queue_tokens must be >= 1")
        if self.cooldown_s < 0 or self.settle_timeout_s <= 0:
            raise ConfigError("planner", "need cooldown_s >= 0 and settle_timeout_s > 0")


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    role: Role
    victim: str | None  # remove: the worker to drain and stop
    reason: str


class RoleLoad(NamedTuple):
    """One role's workers in one sample."""

    healthy: int  # health "ok": they serve
    live: int  # ok, starting or stalled: they count toward the size
    running: int
    waiting: int
    pending_tokens: int
    draining: bool  # a worker that left still has requests


def role_load(sample: Sample, role: Role) -> RoleLoad:
    nodes = [n for n in sample.nodes if n.role == role]
    ok = [n for n in nodes if n.health == "ok"]
    return RoleLoad(
        len(ok), sum(n.health in LIVE for n in nodes), sum(n.running for n in ok), sum(n.waiting for n in ok),
        sum(n.pending_tokens for n in ok), any(n.health == "left" and n.running + n.waiting > 0 for n in nodes),
    )  # fmt: skip


@dataclass(slots=True)
class _Pending:
    decision: Decision
    since: float
    expect_healthy: int  # add: the role's healthy count that means done
    name: str = ""  # add: the new worker's name once the scaler returned it ("" unknown)


class Planner:
    """Pure decisions: observe() a sample, get at most one Decision; no I/O, no clock."""

    def __init__(self, cfg: PlannerConfig | None = None) -> None:
        self.cfg = cfg or PlannerConfig()
        self._out = {role: 0 for role in ROLES}  # consecutive samples with the role under pressure
        self._in = 0  # consecutive samples with room to scale in
        self._backlogs: deque[float] = deque(maxlen=self.cfg.out_samples)  # prefill tokens queued per worker
        self._pending: _Pending | None = None
        self._quiet_until = -math.inf
        self._failures = 0
        self._now = 0.0
        self._hits: dict[str, deque[int]] = {}  # node -> its cumulative hit tokens, last samples
        self.last_reason = "no sample yet"  # why the last observe() returned what it did

    @property
    def pending(self) -> Decision | None:
        return self._pending.decision if self._pending is not None else None

    def observe(self, sample: Sample) -> Decision | None:
        self._now = sample.time
        self._record_hits(sample)
        if self._pending is not None and not self._settle(sample):
            self.last_reason = f"waiting for {self._pending.decision.action} {self._pending.decision.role}"
            return None
        loads = {role: role_load(sample, role) for role in ROLES}
        out, into = self._scale_out(sample, loads), self._scale_in(sample, loads)  # both: their streaks
        decision = out or into
        if decision is None:
            return None
        if sample.time < self._quiet_until:
            self.last_reason = f"cooling down ({self._quiet_until - sample.time:.0f} s left): {decision.reason}"
            return None
        expect = loads[decision.role].healthy + 1
        self._pending = _Pending(decision, sample.time, expect)
        self._reset_streaks()
        self.last_reason = decision.reason
        return decision

    def applied(self, decision: Decision, name: str = "") -> None:
        """The scaler did it (an add's new worker: `name`); it stays pending until seen done."""
        if self._pending is not None and self._pending.decision is decision:
            self._pending.name = name
            self._failures = 0

    def failed(self, decision: Decision) -> None:
        """The scaler failed: no action for cooldown_s x 2^(failures-1), up to MAX_BACKOFF x."""
        if self._pending is None or self._pending.decision is not decision:
            return
        self._pending = None
        self._failures += 1
        backoff = self.cfg.cooldown_s * min(2 ** (self._failures - 1), MAX_BACKOFF)
        self._quiet_until = self._now + backoff
        self._reset_streaks()

    # -- the pending action ---------------------------------------------------------------------

    def _settle(self, sample: Sample) -> bool:
        """True once the pending action shows in the samples (or timed out); starts the cooldown."""
        assert self._pending is not None
        p, d = self._pending, self._pending.decision
        if d.action == "add":
            new = next((n for n in sample.nodes if n.name == p.name), None) if p.name else None
            done = role_load(sample, d.role).healthy >= p.expect_healthy or (new is not None and new.health == "ok")
        else:
            victim = next((n for n in sample.nodes if n.name == d.victim), None)
            done = victim is None or victim.health == "down" or (
                victim.health == "left" and victim.running + victim.waiting == 0)  # fmt: skip
        if not done and sample.time - p.since < self.cfg.settle_timeout_s:
            return False
        if not done:
            logger.warning("planner: %s %s not seen done after %.0f s; going on", d.action, d.role,
                           sample.time - p.since)  # fmt: skip
        self._pending = None
        self._quiet_until = sample.time + self.cfg.cooldown_s
        self._reset_streaks()
        return True

    def _reset_streaks(self) -> None:
        self._out = {role: 0 for role in ROLES}
        self._in = 0

    # -- scale out ------------------------------------------------------------------------------

    def _scale_out(self, sample: Sample, loads: dict[Role, RoleLoad]) -> Decision | None:
        cfg = self.cfg
        ttft_over = _over(sample.ttft_p90_s, cfg.ttft_slo_s, cfg.scale_out_frac)
        itl_over = _over(sample.itl_p90_s, cfg.itl_slo_s, cfg.scale_out_frac)
        p, d = loads["prefill"], loads["decode"]
        backlog = p.pending_tokens / max(p.healthy, 1)
        busy = d.running >= cfg.decode_busy_frac * cfg.decode_max_running * max(d.healthy, 1)
        pressure = {"decode": itl_over and (busy or d.waiting > 0),
                    "prefill": ttft_over and not itl_over and (backlog > 0 or p.healthy == 0)}  # fmt: skip
        self._backlogs.append(backlog)
        for role in ROLES:
            self._out[role] = self._out[role] + 1 if pressure[role] else 0
        why = _latencies(sample, cfg)
        if self._out["decode"] >= cfg.out_samples:
            per = d.running / max(d.healthy, 1)
            return self._add("decode", loads, f"decode-heavy for {self._out['decode']} samples: {why}; decode "
                             f"running {per:.0f}/{cfg.decode_max_running} per worker, {d.waiting} waiting")  # fmt: skip
        if self._out["prefill"] < cfg.out_samples:
            return None
        before = self._backlogs[0]  # out_samples - 1 samples ago: every one of them under pressure
        if p.healthy and backlog < before and backlog < cfg.prefill_queue_tokens:
            self.last_reason = f"prefill queue shrinking ({before:.0f} -> {backlog:.0f} tokens/worker)"
            return None
        return self._add("prefill", loads, f"prefill-heavy for {self._out['prefill']} samples: {why}; "
                         f"{backlog:.0f} prompt tokens queued per prefill worker (was {before:.0f})")  # fmt: skip

    def _add(self, role: Role, loads: dict[Role, RoleLoad], why: str) -> Decision | None:
        lim, live = self.cfg.limits, loads[role].live
        total = sum(load.live for load in loads.values())
        if live + 1 > lim.max_of(role) or total + 1 > lim.max_total:
            self.last_reason = f"{why}; at the maximum ({live} {role}, {total} in all)"
            return None
        return Decision("add", role, None, f"{why}; {live} -> {live + 1} {role} workers")

    # -- scale in -------------------------------------------------------------------------------

    def _scale_in(self, sample: Sample, loads: dict[Role, RoleLoad]) -> Decision | None:
        cfg = self.cfg
        room = (
            not any(self._out.values())
            and not _over(sample.ttft_p90_s, cfg.ttft_slo_s, cfg.scale_in_frac)
            and not _over(sample.itl_p90_s, cfg.itl_slo_s, cfg.scale_in_frac)
            and loads["decode"].waiting == 0
            and not any(load.draining for load in loads.values())
        )
        self._in = self._in + 1 if room else 0
        if self._in < cfg.in_samples:
            if not any(self._out.values()):
                self.last_reason = "steady" if not room else f"room to scale in for {self._in} samples"
            return None
        total = sum(load.healthy for load in loads.values())
        options = [(self._load(role, load, load.healthy), -(load.healthy - cfg.limits.min_of(role)), role)
                   for role, load in loads.items() if self._can_remove(sample, role, load, total)]  # fmt: skip
        if not options:
            self.last_reason = "room to scale in, but every role is at its minimum or would be too loaded"
            return None
        now_load, _, role = min(options, key=lambda o: (o[0], o[1], ROLES.index(o[2])))
        victim, why_victim = self._victim(sample, role)
        if victim is None:
            return None
        n = loads[role].healthy
        return Decision("remove", role, victim, f"spare capacity for {self._in} samples: {_latencies(sample, cfg)}, "
                        f"at most {cfg.scale_in_frac:g} x SLO; {role} load {now_load:.2f} (the least); "
                        f"{n} -> {n - 1} {role} workers; {why_victim}")  # fmt: skip

    def _can_remove(self, sample: Sample, role: Role, load: RoleLoad, total: int) -> bool:
        """Above the minimums, and the same work on one worker fewer stays in the band: the role's
        load under scale_in_load_frac, its p90 (TTFT: prefill, ITL: decode) x n/(n-1) at most
        scale_in_frac x SLO (a latency scaled linearly: a queue grows faster, hence the band)."""
        cfg, n = self.cfg, load.healthy
        if n - 1 < cfg.limits.min_of(role) or total - 1 < cfg.limits.min_total:
            return False
        p90, slo = (sample.ttft_p90_s, cfg.ttft_slo_s) if role == "prefill" else (sample.itl_p90_s, cfg.itl_slo_s)
        if p90 is not None and (n == 1 or p90 * n / (n - 1) > cfg.scale_in_frac * slo):
            return False
        return self._load(role, load, n - 1) <= cfg.scale_in_load_frac

    def _load(self, role: Role, load: RoleLoad, workers: int) -> float:
        """The role's load on `workers` workers: decode batch fill, or prefill queue fill."""
        work, per = ((load.running + load.waiting, self.cfg.decode_max_running) if role == "decode"
                     else (load.pending_tokens, self.cfg.prefill_queue_tokens))  # fmt: skip
        if workers <= 0:
            return 0.0 if work == 0 else math.inf
        return work / (workers * per)

    def _victim(self, sample: Sample, role: Role) -> tuple[str | None, str]:
        """The healthy worker of `role` whose cache is least valuable, and why."""
        nodes = [n for n in sample.nodes if n.role == role and n.health == "ok"]
        if not nodes:
            return None, ""
        ranked = sorted(nodes, key=lambda n: (self.window_hits(n.name), cached_pages(n), n.running + n.waiting, n.name))
        v = ranked[0]
        return v.name, (f"victim {v.name}: {self.window_hits(v.name)} hit tokens in the last "
                        f"{self.cfg.cache_window} samples, {cached_pages(v)} cached pages (least valuable "
                        f"cache of {len(nodes)})")  # fmt: skip

    def _record_hits(self, sample: Sample) -> None:
        seen = set()
        for n in sample.nodes:
            seen.add(n.name)
            self._hits.setdefault(n.name, deque(maxlen=self.cfg.cache_window + 1)).append(n.cache.hit_tokens)
        for name in self._hits.keys() - seen:
            del self._hits[name]

    def window_hits(self, name: str) -> int:
        """Hit tokens `name` served over the recorded window (a counter that went back: restarted)."""
        counts = list(self._hits.get(name, ()))
        return sum(b - a if b >= a else b for a, b in zip(counts, counts[1:], strict=False))


def cached_pages(node: NodeStatus) -> int:
    return sum(t.pages_cached for t in node.cache.tiers)


def _over(value: float | None, slo: float, frac: float) -> bool:
    return value is not None and value > frac * slo


def _latencies(sample: Sample, cfg: PlannerConfig) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    return (f"TTFT p90 {fmt(sample.ttft_p90_s)} (SLO {cfg.ttft_slo_s:g} s), ITL p90 {fmt(sample.itl_p90_s)} "
            f"(SLO {cfg.itl_slo_s:g} s), {sample.requests} requests in the window")  # fmt: skip
