"""Closed-loop, open-loop, timed and replay runs against the conftest's FakeOpenAIServer (a
test double for the client side): request counts, the concurrency bound, turn ordering, the
time cap."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from bench.client import ClientConfig, StreamClient
from bench.prompts import MissingTokenIds, PromptMode, PromptRenderer
from bench.runner import RunPlan, RunResult, execute
from bench.trace import TraceEntry, TraceWorkload
from bench.workloads import Workload, make_workload
from tests.bench.conftest import FAKE_MODEL, Behaviour, FakeOpenAIServer, fake_output_ids

TOKENS = PromptRenderer(PromptMode.TOKENS, vocab_size=16384)


async def run(
    server: FakeOpenAIServer, workload: Workload, renderer: PromptRenderer = TOKENS, **plan: Any
) -> RunResult:
    fields: dict[str, Any] = {"label": "t", "seed": "0", "concurrency": None, "rate": None, "num_requests": 8}
    fields.update(plan)
    async with StreamClient(ClientConfig(url=server.url, model=FAKE_MODEL)) as client:
        return await execute(RunPlan(progress=False, **fields), workload, client, renderer)


async def test_closed_loop_sends_the_budget_with_at_most_n_in_flight(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(chunk_delay_s=0.01)
    w = make_workload("random", ["prompt_len=16", "output_len=4"])
    result = await run(fake_server, w, concurrency=3, num_requests=10)
    assert len(result.records) == 10 and all(r.result.ok for r in result.records)
    assert fake_server.state.max_in_flight == 3
    assert [r.start_s for r in result.records] == sorted(r.start_s for r in result.records)
    assert {r.nominal_prompt_tokens for r in result.records} == {16}


async def test_multiturn_sends_turn_k_plus_1_after_turn_k_with_its_actual_output(fake_server: FakeOpenAIServer) -> None:
    w = make_workload("multiturn", ["turns=3", "message_len=8", "output_len=4"])
    result = await run(fake_server, w, concurrency=2, num_requests=6, page_size=4)
    assert all(r.result.ok for r in result.records)
    by_session: dict[str, list[Any]] = defaultdict(list)
    for r in result.records:
        by_session[r.session_id].append(r)
    assert len(by_session) == 2
    for turns in by_session.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.start_s >= prev.start_s + prev.result.e2e_s  # sent only after the previous finished
    # what the server saw: prompt_k+1 = prompt_k + output_k (the double's ids) + 8 new tokens
    prompts = [req["prompt"] for req in fake_server.state.requests]
    assert sorted(len(p) for p in prompts) == [8, 8, 20, 20, 32, 32]
    for p in prompts:
        if len(p) > 8:
            prev = next(q for q in prompts if len(q) == len(p) - 12 and p[: len(q)] == q)
            assert p[len(prev) : len(prev) + 4] == fake_output_ids(prev, 4)
    # the last turn asks for no ids (nothing follows it); earlier turns do
    assert [bool(req.get("return_token_ids")) for req in fake_server.state.requests if len(req["prompt"]) == 32] == [False, False]
    # turn 1 (20 tokens) starts with turn 0's prompt + output: 12 tokens, 3 pages of 4 seen
    assert [r.ideal_cached_tokens for r in result.records if r.turn == 1] == [12, 12]


async def test_token_mode_history_fails_fast_when_the_server_returns_no_ids(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(honour_token_ids=False)
    w = make_workload("multiturn", ["turns=2", "message_len=4", "output_len=2"])
    with pytest.raises(MissingTokenIds):
        await run(fake_server, w, concurrency=1, num_requests=4)
    text = PromptRenderer(PromptMode.TEXT, vocab_size=16384)
    result = await run(fake_server, w, text, concurrency=1, num_requests=4)
    assert len(result.records) == 4 and all(r.result.ok for r in result.records)
    assert result.records[0].ideal_cached_tokens is None  # no ids to compare in text mode


async def test_tiered_interleaves_more_sessions_than_the_concurrency(fake_server: FakeOpenAIServer) -> None:
    w = make_workload("tiered", ["context_len=8", "num_active=5", "turns=2"])
    result = await run(fake_server, w, concurrency=2, num_requests=10)
    assert fake_server.state.max_in_flight <= 2
    first_five = sorted(result.records, key=lambda r: r.start_s)[:5]  # in the order sent (records: as done)
    assert [r.turn for r in first_five] == [0] * 5 and len({r.session_id for r in first_five}) == 5
    # Without extra active sessions a slot runs one session's turns back to back. (At c=2 which
    # slot finishes first is timing: a slow first turn lets the other slot start a third session,
    # as seen under a loaded suite; one slot shows the order deterministically.)
    fake_server.reset()
    plain = await run(fake_server, make_workload("multiturn", ["turns=2"]), concurrency=1, num_requests=4)
    assert all(r.result.ok for r in plain.records), [(r.session_id, r.turn, r.result.error) for r in plain.records]
    assert [r.turn for r in plain.records] == [0, 1, 0, 1] and len({r.session_id for r in plain.records}) == 2


async def test_open_loop_sends_the_budget_on_poisson_arrivals(fake_server: FakeOpenAIServer) -> None:
    w = make_workload("random", ["prompt_len=8", "output_len=2"])
    result = await run(fake_server, w, rate=200.0, num_requests=6)
    assert len(result.records) == 6 and all(r.result.ok for r in result.records)
    assert result.plan.concurrency is None and result.records[0].start_s > 0  # first arrival is not at t=0


async def test_time_cap_ends_a_run_and_marks_in_flight_requests(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(stall_s=5.0)
    w = make_workload("random", ["prompt_len=8", "output_len=2"])
    result = await run(fake_server, w, concurrency=2, num_requests=8, time_cap_s=0.4)
    assert result.duration_s < 3.0
    assert len(result.records) == 2
    assert all(not r.result.ok and r.result.error == "time cap (0.4 s)" for r in result.records)


async def test_mixed_injects_long_prompts_while_the_loop_runs(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(chunk_delay_s=0.01)
    params = ["short_len=8", "short_output_len=10", "long_len=64", "long_output_len=2", "long_interval_s=0.1"]
    result = await run(fake_server, make_workload("mixed", params), concurrency=2, num_requests=12)
    tags = [r.tag for r in result.records]
    assert "long" in tags and "short" in tags and len(tags) <= 12
    assert all(r.nominal_prompt_tokens == 64 for r in result.records if r.tag == "long")


async def test_trace_replay_follows_timestamps_and_tenants(fake_server: FakeOpenAIServer) -> None:
    entries = (TraceEntry(0, 20, 2, (1, 2)), TraceEntry(150, 20, 2, (1, 3), "a"), TraceEntry(300, 12, 2, (1,), "b"))
    w = TraceWorkload(entries, block_size=16)
    result = await run(fake_server, w, num_requests=3)
    assert [r.session_id for r in result.records] == ["trace-0", "trace-1", "trace-2"]
    assert [r.start_s >= t - 0.01 for r, t in zip(result.records, (0.0, 0.15, 0.3), strict=True)] == [True] * 3
    assert [req.get("user") for req in fake_server.state.requests] == [None, "a", "b"]
    assert [r.ideal_cached_tokens for r in result.records] == [0, 16, 0]  # block 1 cut to 12 < a page
