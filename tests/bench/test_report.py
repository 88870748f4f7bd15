"""Percentile, goodput and hit-rate arithmetic on known inputs."""

from __future__ import annotations

import pytest

from bench.ideal import IdealPrefixIndex
from bench.report import SLO, hit_rates, meets_slo, percentile, summarize, table
from bench.runner import RequestRecord, RunPlan, RunResult, default_num_requests
from bench.transport import StreamResult
from bench.workloads import make_workload


def record(
    ttft: float | None = 0.1,
    itl: tuple[float, ...] = (0.01, 0.01),
    ok: bool = True,
    prompt: int | None = 100,
    cached: int | None = None,
    ideal: int | None = None,
    out: int = 3,
    tag: str = "",
) -> RequestRecord:
    result = StreamResult(
        ok=ok, error=None if ok else "HTTP 500: boom", ttft_s=ttft, e2e_s=(ttft or 0) + sum(itl),
        itl_s=itl, num_chunks=len(itl) + 1, output_tokens=out, prompt_tokens=prompt,
        cached_tokens=cached, finish_reason="length", text="", token_ids=None,
    )
    return RequestRecord("s", 0, tag, None, 0.0, 3, prompt or 100, ideal, result)


def test_percentile_interpolates_linearly() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_goodput_needs_both_slos() -> None:
    slo = SLO(ttft_s=2.0, itl_s=0.2)
    assert meets_slo(record(ttft=1.9, itl=(0.1,) * 99 + (0.5,)), slo)  # p99 of 100 = 0.104
    assert not meets_slo(record(ttft=1.9, itl=(0.1,) * 90 + (0.5,) * 10), slo)  # p99 = 0.5
    assert not meets_slo(record(ttft=2.1), slo)
    assert meets_slo(record(ttft=0.5, itl=()), slo)  # one token: no interval to miss
    assert not meets_slo(record(ok=False), slo)

    plan = RunPlan(label="x-c1", seed="0", concurrency=1, rate=None, num_requests=4)
    run = RunResult(plan, "x", 2.0, (record(ttft=0.5), record(ttft=3.0), record(itl=(0.3,)), record(ok=False)))
    s = summarize(run, slo)
    assert (s.num_sent, s.num_ok, s.num_failed) == (4, 3, 1)
    assert s.goodput_req_s == pytest.approx(0.5) and s.goodput_share == pytest.approx(0.25)
    assert s.request_s == pytest.approx(1.5) and s.output_tok_s == pytest.approx(4.5)
    assert s.ttft_p50_ms == pytest.approx(500.0)
    assert s.errors == {"HTTP 500: boom": 1}
    assert "x-c1" in table([s])


def test_hit_rate_is_token_weighted_and_absent_when_unreported() -> None:
    records = [record(prompt=100, cached=0, ideal=0), record(prompt=300, cached=240, ideal=256)]
    cached, hit, ideal, vs = hit_rates(records)
    assert cached == 240
    assert hit == pytest.approx(240 / 400)  # not the mean of 0 and 0.8
    assert ideal == pytest.approx(256 / 400)
    assert vs == pytest.approx(240 / 256)
    assert hit_rates([record(cached=None)])[:2] == (None, None)
    assert hit_rates([record(ok=False, cached=50)])[:2] == (None, None)


def test_tags_get_their_own_figures_when_a_run_mixes_them() -> None:
    plan = RunPlan(label="mixed-c1", seed="0", concurrency=1, rate=None, num_requests=3)
    run = RunResult(plan, "mixed", 1.0, (record(tag="short"), record(tag="short"), record(ttft=1.0, tag="long")))
    s = summarize(run, SLO())
    assert set(s.by_tag) == {"short", "long"}
    assert s.by_tag["long"].ttft_p50_ms == pytest.approx(1000.0) and s.by_tag["short"].num_ok == 2


def test_ideal_counts_whole_pages_of_the_longest_earlier_prefix() -> None:
    index = IdealPrefixIndex(page_size=4)
    assert index.match_and_add([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert index.match([1, 2, 3, 4, 5, 6, 7, 0]) == 4  # second page differs
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9]) == 8  # the 9th token is not a full page
    assert index.match([9, 1, 2, 3, 4]) == 0  # same tokens, not a prefix


def test_default_request_counts_follow_benchmarks_md() -> None:
    random_w = make_workload("random")
    assert [default_num_requests(random_w, c, None) for c in (1, 8, 32)] == [12, 32, 64]
    multiturn = make_workload("multiturn")
    # whole 5-turn conversations, at least one per concurrent user
    assert [default_num_requests(multiturn, c, None) for c in (1, 8, 32)] == [15, 40, 160]
    assert default_num_requests(make_workload("tiered"), 8, None) == 64 * 5
    assert default_num_requests(random_w, None, 2.0) == 64
