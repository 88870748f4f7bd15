"""Workloads are deterministic per seed, have BENCHMARKS.md's shapes, and share exactly what
they are meant to share."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench.prompts import (
    WORDS,
    MissingTokenIds,
    Output,
    PromptMode,
    PromptRenderer,
    Segment,
    segment_ids,
)
from bench.workloads import (
    AgentWorkload,
    BurstAgentWorkload,
    MixedWorkload,
    MultiturnWorkload,
    TenantRagWorkload,
    TieredWorkload,
    Workload,
    make_workload,
)

TOKENS = PromptRenderer(PromptMode.TOKENS, vocab_size=16384)
TEXT = PromptRenderer(PromptMode.TEXT, vocab_size=16384)
TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "engine" / "assets" / "tokenizer.json"


def first_prompts(workload: Workload, seed: str, n: int, renderer: PromptRenderer = TOKENS) -> list[list[int] | str]:
    return [renderer.render(s.prompt_parts(0, [])) for s in itertools.islice(workload.sessions(seed), n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("name", ["random", "rag", "multiturn", "agent", "code", "mixed", "tiered", "burst-agent",
                                  "tenant-rag"])
def test_same_seed_same_prompts_other_seed_other_prompts(name: str) -> None:
    w = make_workload(name)
    assert first_prompts(w, "s1", 4) == first_prompts(make_workload(name), "s1", 4)
    assert first_prompts(w, "s1", 4) != first_prompts(w, "s2", 4)
    assert first_prompts(w, "s1", 2, TEXT) == first_prompts(w, "s1", 2, TEXT)


@pytest.mark.parametrize(("name", "prompt_len", "output_len"), [("random", 256, 128), ("code", 1000, 64)])
def test_unshared_workloads_have_their_lengths_and_no_common_prefix(name: str, prompt_len: int, output_len: int) -> None:
    w = make_workload(name)
    sessions = list(itertools.islice(w.sessions("s"), 6))
    prompts = [TOKENS.render(s.prompt_parts(0, [])) for s in sessions]
    assert all(isinstance(p, list) and len(p) == prompt_len for p in prompts)
    assert {s.turns[0].output_len for s in sessions} == {output_len}
    assert all(common_prefix(a, b) == 0 for a, b in itertools.combinations(prompts, 2))  # type: ignore[arg-type]


def test_rag_prompts_share_exactly_the_2000_token_system_prompt() -> None:
    w = make_workload("rag")
    prompts = first_prompts(w, "s", 5)
    assert all(len(p) == 2050 for p in prompts)
    for a, b in itertools.combinations(prompts, 2):
        assert common_prefix(a, b) == 2000  # type: ignore[arg-type]
    assert next(iter(w.sessions("s"))).turns[0].output_len == 64


def test_multiturn_history_grows_with_each_turn_and_carries_the_actual_outputs() -> None:
    session = next(iter(MultiturnWorkload().sessions("s")))
    assert len(session.turns) == 5 and {t.output_len for t in session.turns} == {32}
    outputs = [Output(f" out{k}", tuple(range(200 + 32 * k, 232 + 32 * k))) for k in range(5)]
    prompts = [TOKENS.render(session.prompt_parts(k, outputs[:k])) for k in range(5)]
    for k in range(1, 5):
        prev, cur = prompts[k - 1], prompts[k]
        assert isinstance(prev, list) and isinstance(cur, list)
        # turn k = turn k-1's prompt + its output + a new 50-token message
        assert cur[: len(prev)] == prev
        assert cur[len(prev) : len(prev) + 32] == list(outputs[k - 1].token_ids or ())
        assert len(cur) == len(prev) + 32 + 50
    text = [TEXT.render(session.prompt_parts(k, outputs[:k])) for k in range(3)]
    assert isinstance(text[2], str) and text[2].startswith(str(text[1]) + " out1")
    with pytest.raises(ValueError):
        session.prompt_parts(2, outputs[:1])


def test_token_mode_history_without_output_ids_needs_a_tokenizer() -> None:
    session = next(iter(MultiturnWorkload().sessions("s")))
    with pytest.raises(MissingTokenIds):
        TOKENS.render(session.prompt_parts(1, [Output(" text only", None)]))


def test_agent_shares_system_and_tools_and_grows_a_trajectory() -> None:
    w = AgentWorkload()
    a, b = itertools.islice(w.sessions("s"), 2)
    pa, pb = TOKENS.render(a.prompt_parts(0, [])), TOKENS.render(b.prompt_parts(0, []))
    assert isinstance(pa, list) and isinstance(pb, list)
    assert len(pa) == 1500 + 1000 + 50 and common_prefix(pa, pb) == 2500
    outputs = [Output("", tuple([7] * 32))] * 4
    lengths = [a.nominal_prompt_len(k) for k in range(5)]
    assert lengths == [2550 + k * (32 + 100) for k in range(5)]
    assert [len(TOKENS.render(a.prompt_parts(k, outputs[:k]))) for k in range(5)] == lengths


def test_mixed_sends_long_prompts_on_a_timer_and_zero_turns_them_off() -> None:
    w = MixedWorkload()
    short = next(iter(w.sessions("s")))
    assert short.tag == "short" and short.turns[0].output_len == 256
    timed = list(itertools.islice(w.timed("s"), 3))
    assert [t for t, _ in timed] == [3.0, 6.0, 9.0]
    assert all(s.tag == "long" and s.nominal_prompt_len(0) == 4000 for _, s in timed)
    assert list(make_workload("mixed", ["long_interval_s=0"]).timed("s")) == []


def test_burst_agent_fans_each_task_out_at_once_over_a_shared_fleet_prefix() -> None:
    w = BurstAgentWorkload()
    timed = list(itertools.islice(w.timed("s"), 3 * w.fanout))
    assert timed == list(itertools.islice(BurstAgentWorkload().timed("s"), 3 * w.fanout))  # from the seed
    assert [t for t, _ in timed] == sorted(t for t, _ in timed)
    bursts = [timed[i * w.fanout : (i + 1) * w.fanout] for i in range(3)]
    for burst in bursts:  # a burst's agents arrive within spread_s of each other
        assert burst[-1][0] - burst[0][0] <= w.spread_s
    assert bursts[0][0][0] < w.spread_s  # the first burst at once
    prompts = [TOKENS.render(s.prompt_parts(0, [])) for _, s in timed]
    assert all(isinstance(p, list) and len(p) == 4400 for p in prompts)
    fleet = w.system_len + w.tools_len
    same_burst = common_prefix(prompts[0], prompts[1])  # type: ignore[arg-type]
    other_burst = common_prefix(prompts[0], prompts[w.fanout])  # type: ignore[arg-type]
    assert (same_burst, other_burst) == (fleet + w.task_len, fleet)


def test_tenant_rag_draws_hot_documents_per_tenant_in_bursts() -> None:
    w = TenantRagWorkload()
    timed = list(itertools.islice(w.timed("s"), 400))
    assert [(t, s.session_id) for t, s in timed] == [(t, s.session_id) for t, s in itertools.islice(w.timed("s"), 400)]
    assert {s.tenant for _, s in timed} == {f"t{i}" for i in range(w.tenants)}
    assert all(s.nominal_prompt_len(0) == 400 + 3 * 1300 + 100 for _, s in timed)
    docs = [seg.key for _, s in timed for seg in s.turns[0].new_parts if "/doc/" in seg.key]
    counts = sorted(docs.count(d) for d in set(docs))
    assert counts[-1] > 2 * counts[0]  # Zipf: the hottest document is drawn far more than the coldest
    in_burst = sum(1 for t, _ in timed if t % w.period_s < w.burst_s)
    share = w.burst_s / w.period_s
    assert in_burst / len(timed) > 2 * share  # arrivals bunch into the bursts


def test_tiered_opens_each_session_with_unique_context_and_interleaves_many() -> None:
    w = TieredWorkload(base="agent", context_len=300, num_active=40, turns=3)
    assert w.active_sessions == 40 and w.turns_per_session == 3
    a, b = itertools.islice(w.sessions("s"), 2)
    pa, pb = TOKENS.render(a.prompt_parts(0, [])), TOKENS.render(b.prompt_parts(0, []))
    assert len(pa) == 2500 + 300 + 50 and common_prefix(pa, pb) == 2500  # type: ignore[arg-type]
    m = make_workload("tiered", ["context_len=100"])
    assert isinstance(m, TieredWorkload) and next(iter(m.sessions("s"))).nominal_prompt_len(0) == 150


def test_params_override_fields_and_bad_ones_are_refused() -> None:
    w = make_workload("random", ["prompt_len=10", "output_len=3"])
    assert first_prompts(w, "s", 1)[0] == first_prompts(make_workload("random"), "s", 1)[0][:10]
    for bad in (["nope=1"], ["prompt_len"], ["prompt_len=x"], ["base=other"]):
        with pytest.raises(ValueError):
            make_workload("tiered" if bad == ["base=other"] else "random", bad)
    with pytest.raises(ValueError):
        make_workload("nonexistent")


def test_segments_are_prefix_stable_and_avoid_low_ids() -> None:
    full = segment_ids("k", 512, 16384)
    assert segment_ids("k", 100, 16384) == full[:100]
    assert min(full) >= 100 and max(full) < 16384
    assert TOKENS.render((Segment("k", 5),)) == full[:5]


def test_text_mode_words_are_one_token_each_on_baton_tiny() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER_JSON))
    assert all(len(tok.encode(" " + w, add_special_tokens=False).ids) == 1 for w in WORDS)
    prompt = TEXT.render(next(iter(make_workload("rag").sessions("s"))).prompt_parts(0, []))
    assert isinstance(prompt, str)
    assert len(tok.encode(prompt, add_special_tokens=False).ids) == 2050
