"""Figures of a run (BENCHMARKS.md "Report per run"), as JSON and as a terminal table.

Latency percentiles interpolate linearly between order statistics (numpy's default) over
successful requests. Goodput counts the requests that met both SLOs: TTFT <= slo_ttft and
their own ITL p99 <= slo_itl (a one-token request has no interval and meets the ITL SLO).
The prefix-hit rate is token-weighted, sum(cached_tokens) / sum(prompt_tokens), over the
requests whose server reported cached tokens; the ideal (token mode) is the same ratio for
the longest earlier-seen prefix in whole pages (bench.ideal), and `hit_vs_ideal` is
sum(cached) / sum(ideal) — P4's figure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.runner import RequestRecord, RunResult

MAX_ERROR_KINDS = 5  # distinct error messages kept per run


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = 2.0
    itl_s: float = 0.2


@dataclass(frozen=True, slots=True)
class TagSummary:
    num_ok: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None


@dataclass(frozen=True, slots=True)
class RunSummary:
    label: str
    workload: str
    concurrency: int | None
    rate: float | None
    duration_s: float
    num_sent: int
    num_ok: int
    num_failed: int
    num_short: int  # finished but with fewer output tokens than requested (EOS not ignored?)
    errors: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_p50_ms: float | None
    e2e_p50_ms: float | None
    output_tok_s: float
    request_s: float
    goodput_req_s: float
    goodput_share: float | None
    slo_ttft_s: float
    slo_itl_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None
    prefix_hit_rate: float | None
    ideal_hit_rate: float | None
    hit_vs_ideal: float | None
    by_tag: dict[str, TagSummary]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _round4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    r = record.result
    if not r.ok or r.ttft_s is None or r.ttft_s > slo.ttft_s:
        return False
    itl_p99 = percentile(r.itl_s, 99)
    return itl_p99 is None or itl_p99 <= slo.itl_s


def hit_rates(records: Sequence[RequestRecord]) -> tuple[int | None, float | None, float | None, float | None]:
    """(cached tokens, hit rate, ideal hit rate, hit vs ideal) over successful requests."""
    ok = [r for r in records if r.result.ok]
    reported = [r for r in ok if r.result.cached_tokens is not None]
    cached = sum(r.result.cached_tokens or 0 for r in reported)
    prompt = sum(r.result.prompt_tokens or r.nominal_prompt_tokens for r in reported)
    hit = cached / prompt if reported and prompt else None
    with_ideal = [r for r in ok if r.ideal_cached_tokens is not None]
    ideal_sum = sum(r.ideal_cached_tokens or 0 for r in with_ideal)
    nominal = sum(r.nominal_prompt_tokens for r in with_ideal)
    ideal = ideal_sum / nominal if with_ideal and nominal else None
    both = [r for r in with_ideal if r.result.cached_tokens is not None]
    both_ideal = sum(r.ideal_cached_tokens or 0 for r in both)
    vs = sum(r.result.cached_tokens or 0 for r in both) / both_ideal if both and both_ideal else None
    return (cached if reported else None), hit, ideal, vs


def _tag_summary(records: Sequence[RequestRecord]) -> TagSummary:
    ok = [r.result for r in records if r.result.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itl_s]
    return TagSummary(
        num_ok=len(ok),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
    )


def summarize(run: RunResult, slo: SLO) -> RunSummary:
    records = run.records
    ok = [r for r in records if r.result.ok]
    results = [r.result for r in ok]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    itls = [x for r in results for x in r.itl_s]
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in results
        if r.ttft_s is not None and r.output_tokens > 1
    ]
    duration = max(run.duration_s, 1e-9)
    good = sum(1 for r in ok if meets_slo(r, slo))
    errors = Counter(r.result.error or "" for r in records if not r.result.ok)
    cached, hit, ideal, vs = hit_rates(records)
    tags = sorted({r.tag for r in records})
    return RunSummary(
        label=run.plan.label,
        workload=run.workload,
        concurrency=run.plan.concurrency,
        rate=run.plan.rate,
        duration_s=round(run.duration_s, 3),
        num_sent=len(records),
        num_ok=len(ok),
        num_failed=len(records) - len(ok),
        num_short=sum(1 for r in ok if r.result.output_tokens < r.output_len),
        errors=dict(errors.most_common(MAX_ERROR_KINDS)),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p90_ms=_ms(percentile(ttfts, 90)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        tpot_p50_ms=_ms(percentile(tpots, 50)),
        e2e_p50_ms=_ms(percentile([r.e2e_s for r in results], 50)),
        output_tok_s=round(sum(r.output_tokens for r in results) / duration, 2),
        request_s=round(len(ok) / duration, 3),
        goodput_req_s=round(good / duration, 3),
        goodput_share=round(good / len(records), 4) if records else None,
        slo_ttft_s=slo.ttft_s,
        slo_itl_s=slo.itl_s,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in results),
        output_tokens=sum(r.output_tokens for r in results),
        cached_tokens=cached,
        prefix_hit_rate=_round4(hit),
        ideal_hit_rate=_round4(ideal),
        hit_vs_ideal=_round4(vs),
        by_tag={t: _tag_summary([r for r in records if r.tag == t]) for t in tags} if len(tags) > 1 else {},
    )


def to_json(summary: RunSummary) -> dict[str, Any]:
    return asdict(summary)


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def table(summaries: Sequence[RunSummary]) -> str:
    """A fixed-width table, one line per run (latencies in ms)."""
    head = (
        f"{'run':<22} {'ok/sent':>9} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
        f"{'out tok/s':>9} {'req/s':>6} {'goodput':>7} {'hit':>6} {'/ideal':>6}"
    )
    lines = [head]
    for s in summaries:
        lines.append(
            f"{s.label[:22]:<22} {f'{s.num_ok}/{s.num_sent}':>9} {_fmt(s.ttft_p50_ms):>9} {_fmt(s.ttft_p90_ms):>7} "
            f"{_fmt(s.ttft_p99_ms):>7} {_fmt(s.itl_p50_ms, '.1f'):>8} {_fmt(s.itl_p99_ms, '.1f'):>7} "
            f"{s.output_tok_s:>9.1f} {s.request_s:>6.2f} {s.goodput_req_s:>7.2f} "
            f"{_fmt(s.prefix_hit_rate, '.1%'):>6} {_fmt(s.hit_vs_ideal, '.2f'):>6}"
        )
        for tag, t in s.by_tag.items():
            lines.append(
                f"  {tag[:20]:<20} {t.num_ok:>9} {_fmt(t.ttft_p50_ms):>9} {'':>7} {_fmt(t.ttft_p99_ms):>7} "
                f"{_fmt(t.itl_p50_ms, '.1f'):>8} {_fmt(t.itl_p99_ms, '.1f'):>7}"
            )
        for error, count in s.errors.items():
            lines.append(f"  {count} x {error[:100]}")
    return "\n".join(lines)
