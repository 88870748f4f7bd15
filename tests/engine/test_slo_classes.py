"""Service classes on a real engine (baton-tiny): a LATENCY request that finds no seat or no
pages takes them from running BATCH requests, which are recomputed later and end with the
tokens an uninterrupted greedy run gives; a STANDARD request waits its turn instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.request import SloClass
from engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
BATCH_PROMPTS = {"b0": [120, 45, 999, 3012, 77, 5150, 23, 8000, 14], "b1": [301, 302, 303, 304, 305, 306, 307]}
LATE_PROMPT = [640, 641, 642, 643, 644]


def _engine(model: Path, async_on: bool = False, **kw: object) -> Engine:
    cfg = dict(model=str(model), dtype="float32", max_model_len=64, async_scheduling=async_on, page_size=4)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def want(tiny_model_dir: Path) -> dict[str, list[int]]:
    """Each request's tokens run alone, uninterrupted."""
    engine = _engine(tiny_model_dir)
    prompts = {**BATCH_PROMPTS, "late": LATE_PROMPT}
    return {req_id: engine.generate([prompt], GREEDY)[0] for req_id, prompt in prompts.items()}


def _run_with_a_late_arrival(engine: Engine, slo: SloClass) -> tuple[dict[str, list[int]], int, list[int]]:
    """Two BATCH requests decode for three steps, then a request of class `slo` arrives: every
    request's tokens, the step that gave the newcomer its first token (1: the step after it
    arrived) and how many requests each step from then on preempted."""
    for req_id, prompt in BATCH_PROMPTS.items():
        engine.add(Job(req_id, tuple(prompt), GREEDY, slo=SloClass.BATCH))
    tokens: dict[str, list[int]] = {req_id: [] for req_id in [*BATCH_PROMPTS, "late"]}
    for _ in range(3):
        for out in engine.step():
            tokens[out.req_id].extend(out.token_ids)
    engine.add(Job("late", tuple(LATE_PROMPT), GREEDY, slo=slo))
    first_at, preempted, steps = 0, [], 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        preempted.append(engine.last_stats.num_preempted if engine.last_stats else 0)
        for out in outs:
            tokens[out.req_id].extend(out.token_ids)
        first_at = first_at or (steps if tokens["late"] else 0)
        assert steps < 200
    engine.check_integrity()
    assert engine.free_pages_at_idle() == engine.pool.num_pages
    return tokens, first_at, preempted


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_a_latency_request_takes_a_batch_requests_seat_and_the_batch_output_does_not_change(
    tiny_model_dir: Path, want: dict[str, list[int]], async_on: bool
) -> None:
    engine = _engine(tiny_model_dir, async_on, max_num_seqs=2)
    tokens, first_at, preempted = _run_with_a_late_arrival(engine, SloClass.LATENCY)
    assert preempted[0] == 1 and engine.num_preempted_total == 1  # one seat, taken at once
    assert first_at == (2 if async_on else 1)  # async scheduling reads a step's tokens a step later
    assert tokens == want  # preemption by recompute: the batch request's tokens are the same


def test_a_latency_request_takes_a_batch_requests_pages(tiny_model_dir: Path, want: dict[str, list[int]]) -> None:
    # 7 pages of 4 tokens: the batch requests hold 3 each when late arrives (12 and 10 tokens),
    # late needs 2: b1 (the later) gives its 3 up. (Later b0 needs all 7 pages for its 25
    # tokens, and page pressure preempts it, not late, until late ends.)
    engine = _engine(tiny_model_dir, num_pages=7, enable_prefix_cache=False)
    tokens, first_at, preempted = _run_with_a_late_arrival(engine, SloClass.LATENCY)
    assert (preempted[0], first_at) == (1, 1)
    assert tokens == want


def test_a_standard_request_waits_for_a_seat_instead(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_num_seqs=2)
    tokens, first_at, preempted = _run_with_a_late_arrival(engine, SloClass.STANDARD)
    assert engine.num_preempted_total == 0 and not any(preempted)
    assert first_at == GREEDY.max_tokens - 3 + 1  # the step after the batch requests ended
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())
