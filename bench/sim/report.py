"""What `baton sim` reports per policy, and its table.

The window is the traffic's arrival span [0, end]: later turns of sessions still open at its
end are simulated (they load the fleet) but not counted, so every policy is measured on the
requests that arrived while the offered load was on.

    goodput      window requests meeting both SLOs (TTFT <= slo_ttft and the request's own
                 ITL p99 <= slo_itl, as bench.report counts them) / window seconds
    throughput   window requests finished / window seconds (a policy that falls behind
                 serves fewer turns of its closed-loop sessions in the window)
    TTFT, ITL    p50/p99 of window requests' TTFT; p99 over every inter-token gap
    hit          token-weighted: prompt tokens the computing worker took from its own cache
                 (device or host) / prompt tokens
    given up     pages of the best holder (index view, at placement) the choice did not reuse
                 / the best holders' pages
    imbalance    max / mean over workers (whole run): prefill busy seconds (imb P), decode
                 tokens (imb D)
    failed       all requests: saturated past the retry limit, too large, or still open at
                 the horizon
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from bench.sim.cache import EventBus
    from bench.sim.policies import Policy
    from bench.sim.workers import DecodeWorker, PrefillWorker, SimRequest


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    num_requests: int
    num_finished: int
    num_good: int
    num_failed: int
    window_s: float
    span_s: float  # until the last request finished
    goodput_rps: float
    throughput_rps: float
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p99_ms: float | None
    hit_rate: float
    host_hit_share: float  # of the hit tokens, those fetched from the host tier
    given_up: float
    imbalance_prefill: float
    imbalance_decode: float
    local_share: float  # requests prefilled on their decode worker
    num_saturated: int  # SATURATED answers (each retried)
    num_events: int  # KV events the workers emitted
    num_lost_events: int
    num_snapshots: int
    num_sim_events: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def p99_of(values: Sequence[float]) -> float:
    """numpy's default (linear) percentile, without numpy for short lists."""
    ordered = sorted(values)
    rank = 0.99 * (len(ordered) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


class RequestRecord(NamedTuple):
    """One finished request, kept when a run is asked to (tests, debugging)."""

    req_id: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    prefill_id: str | None
    decode_id: str | None
    is_local: bool
    hit_pages: int
    num_itl: int


class Recorder:
    def __init__(self, policy: str, page_size: int, slo: tuple[float, float], window_s: float,
                 keep_records: bool = False) -> None:
        self.policy = policy
        self.records: list[RequestRecord] | None = [] if keep_records else None
        self.page_size = page_size
        self.slo_ttft_s, self.slo_itl_s = slo
        self.window_s = window_s
        self.num_finished = 0  # in or after the window
        self.num_requests = 0
        self.num_failed = 0
        self.num_saturated = 0
        self.num_good = 0
        self.num_local = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.prompt_tokens = 0
        self.hit_pages = 0
        self.host_pages = 0
        self.best_pages = 0
        self.given_up_pages = 0
        self.output_tokens = 0
        self.last_finish_s = 0.0

    def finished(self, req: SimRequest) -> None:
        self.num_finished += 1
        self.last_finish_s = max(self.last_finish_s, req.finish_s)
        if req.arrival_s > self.window_s:
            req.itl_s = []
            return
        ttft = req.first_token_s - req.arrival_s
        self.ttft.append(ttft)
        self.itl.extend(req.itl_s)
        if ttft <= self.slo_ttft_s and (not req.itl_s or p99_of(req.itl_s) <= self.slo_itl_s):
            self.num_good += 1
        self.num_local += req.is_local
        self.prompt_tokens += req.num_tokens
        self.hit_pages += req.hit.num_pages
        self.host_pages += req.hit.num_host
        self.best_pages += req.best_hit_pages
        self.given_up_pages += max(0, req.best_hit_pages - req.chosen_hit_pages)
        self.output_tokens += req.output_len
        if self.records is not None:
            self.records.append(RequestRecord(req.req_id, req.arrival_s, req.first_token_s, req.finish_s,
                                              req.prefill_id, req.decode_id, req.is_local, req.hit.num_pages,
                                              len(req.itl_s)))  # fmt: skip
        req.itl_s = []  # kept here now

    def result(self, prefills: Iterable[PrefillWorker], decodes: Iterable[DecodeWorker], bus: EventBus,
               policy: Policy, num_sim_events: int) -> SimResult:
        n = len(self.ttft)
        window = self.window_s if self.window_s > 0 else max(self.last_finish_s, 1e-9)  # one-instant traces
        ttft = np.asarray(self.ttft) if n else None
        return SimResult(
            policy=self.policy, num_requests=self.num_requests, num_finished=self.num_finished,
            num_good=self.num_good, num_failed=self.num_failed, window_s=round(self.window_s, 3),
            span_s=round(self.last_finish_s, 3), goodput_rps=round(self.num_good / window, 3),
            throughput_rps=round(n / window, 3), output_tok_s=round(self.output_tokens / window, 1),
            ttft_p50_s=None if ttft is None else round(float(np.percentile(ttft, 50)), 4),
            ttft_p99_s=None if ttft is None else round(float(np.percentile(ttft, 99)), 4),
            itl_p99_ms=round(float(np.percentile(np.asarray(self.itl), 99)) * 1e3, 2) if self.itl else None,
            hit_rate=round(self.hit_pages * self.page_size / max(1, self.prompt_tokens), 4),
            host_hit_share=round(self.host_pages / max(1, self.hit_pages), 4),
            given_up=round(self.given_up_pages / max(1, self.best_pages), 4),
            imbalance_prefill=_imbalance([w.busy_s for w in prefills]),
            imbalance_decode=_imbalance([float(d.num_tokens) for d in decodes]),
            local_share=round(self.num_local / max(1, n), 4), num_saturated=self.num_saturated,
            num_events=bus.num_events, num_lost_events=bus.num_lost, num_snapshots=bus.num_snapshots,
            num_sim_events=num_sim_events,
        )


def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / max(1, len(loads))
    return round(max(loads) / mean, 2) if mean > 0 else 0.0


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: Sequence[SimResult]) -> list[str]:
    head = (f"{'policy':<13} {'goodput/s':>9} {'req/s':>7} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p99':>8} "
            f"{'hit':>6} {'gave up':>7} {'imb P':>6} {'imb D':>6} {'local':>6} {'failed':>6}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.policy:<13} {r.goodput_rps:>9.2f} {r.throughput_rps:>7.2f} {_f(r.ttft_p50_s, '7.2f')}s "
            f"{_f(r.ttft_p99_s, '7.2f')}s {_f(r.itl_p99_ms, '6.0f')}ms {r.hit_rate:>6.1%} {r.given_up:>7.1%} "
            f"{r.imbalance_prefill:>6.2f} {r.imbalance_decode:>6.2f} {r.local_share:>6.1%} {r.num_failed:>6}"
        )
    return lines


def ratios(results: Sequence[SimResult], ours: str = "baton") -> list[str]:
    """Goodput of `ours` against each other policy (P11's figures)."""
    by_name = {r.policy: r for r in results}
    mine = by_name.get(ours)
    if mine is None:
        return []
    return [f"goodput {ours} / {r.policy}: {mine.goodput_rps / r.goodput_rps:.2f}x" if r.goodput_rps > 0
            else f"goodput {ours} / {r.policy}: - ({r.policy} met no SLO)"
            for r in results if r.policy != ours]  # fmt: skip
