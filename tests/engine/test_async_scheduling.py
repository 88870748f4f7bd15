"""Async scheduling (EngineConfig.async_scheduling) on CPU: the engine launches step k+1 with
step k's tokens still on the device (PENDING in output_ids, fed to the next step through the
runner's Carry) and reads them back a step later. Whatever the mix of requests, the outputs
must be the synchronous engine's: the same tokens, text, finish reasons and counts, and every
page back at idle. On CPU the "launch" is synchronous, so this checks the bookkeeping, which
is the same code the CUDA-graph path runs (bench/gpu_check.py times it on a device)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from engine import sampler as sampler_mod
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.outputs import StepOutput
from engine.request import FinishReason
from engine.runner import PENDING
from engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _engine(model: Path, async_on: bool, **kw: object) -> Engine:
    cfg = dict(model=str(model), dtype="float32", max_model_len=256, async_scheduling=async_on, seed=7)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def _drive(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]], abort_at: dict[int, str] | None = None) -> dict[str, list[StepOutput]]:
    held = {}
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
        held[req_id] = engine.scheduler.get(req_id)
    outs: dict[str, list[StepOutput]] = defaultdict(list)
    steps = 0
    engine.deferred_steps = 0  # type: ignore[attr-defined]
    engine.decode_tokens = 0  # type: ignore[attr-defined]  # computed, kept or not
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.req_id].append(out)
        steps += 1
        engine.deferred_steps += engine._inflight is not None  # type: ignore[attr-defined]
        engine.decode_tokens += engine.last_stats.num_decode_tokens if engine.last_stats else 0  # type: ignore[attr-defined]
        if abort_at and steps in abort_at:
            pending = engine._inflight is not None and any(r.req_id == abort_at[steps] for r, _ in engine._inflight.pending)
            engine.aborted_in_flight = pending  # type: ignore[attr-defined]
            engine.abort(abort_at[steps])
        assert steps < 2_000
    engine.check_integrity()
    assert engine.free_pages_at_idle() == engine.pool.num_pages
    for req_id, req_outs in outs.items():
        assert all(t != PENDING for o in req_outs for t in o.token_ids)
        request = held[req_id]
        assert request is not None and PENDING not in request.output_ids
        if req_outs[-1].finish_reason != FinishReason.ABORT:
            assert len(request.output_ids) == req_outs[-1].num_output_tokens
    return dict(outs)


def _summary(outs: dict[str, list[StepOutput]]) -> dict[str, tuple[object, ...]]:
    return {
        req_id: (
            [t for o in seq for t in o.token_ids],
            "".join(o.text for o in seq),
            seq[-1].finish_reason,
            [o.num_output_tokens for o in seq],
        )
        for req_id, seq in outs.items()
    }


def _mix(probe: Engine) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded rows (deferred), rows that are not (logprobs, penalties, min_tokens),
    a stop string and a stop token found from a first run on `probe` (left idle), prompts
    that share a prefix."""
    base = [120, 45, 999, 3012, 77, 5150, 23, 8000] * 3
    first = probe.generate([base], SamplingParams(max_tokens=30, temperature=0.0))[0]
    text = probe.tokenizer.decode(first)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    return [
        ("greedy", base, SamplingParams(max_tokens=30, temperature=0.0)),
        ("greedy-long", base + [11, 12], SamplingParams(max_tokens=60, temperature=0.0)),
        ("seeded", base[:10], SamplingParams(max_tokens=25, temperature=0.9, top_k=50, top_p=0.9, seed=3)),
        ("stop-string", base, SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,))),
        ("stop-token", base, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(first[5],))),
        ("logprobs", base[:12], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)),
        ("penalty", base[:9], SamplingParams(max_tokens=15, temperature=0.0, repetition_penalty=1.3)),
        ("min-tokens", base[:7], SamplingParams(max_tokens=18, min_tokens=9, temperature=0.0)),
        ("one-token", base[:5], SamplingParams(max_tokens=1, temperature=0.0)),
    ]


@pytest.mark.parametrize("nucleus", ["race", "sort"])
def test_async_outputs_equal_the_synchronous_engines(
    tiny_model_dir: Path, nucleus: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if nucleus == "sort":  # top_p as on CUDA, where the race's read-back would stall the device
        monkeypatch.setattr(sampler_mod, "_SORTED_NUCLEUS_DEVICES", frozenset({"cpu"}))
    sync = _engine(tiny_model_dir, False)
    requests = _mix(_engine(tiny_model_dir, False))
    want = _summary(_drive(sync, requests))
    eng = _engine(tiny_model_dir, True)
    got = _summary(_drive(eng, requests))
    assert got == want
    assert eng.deferred_steps > 20  # type: ignore[attr-defined]
    # A request that ends on a token (stop string, stop token) costs at most one dropped decode
    # token; one that ends on max_tokens costs none: it is not scheduled past its last token.
    extra = eng.decode_tokens - sync.decode_tokens  # type: ignore[attr-defined]
    assert 0 <= extra <= 2
    assert want["stop-string"][2] == FinishReason.STOP and want["stop-token"][2] == FinishReason.STOP
    assert want["greedy-long"][2] == FinishReason.LENGTH


def test_async_under_page_pressure_and_an_abort_mid_flight(tiny_model_dir: Path) -> None:
    """Few pages: requests are preempted while their token is in flight and recomputed later;
    one is aborted between steps with a token in flight. The survivors' outputs are the
    synchronous engine's."""
    base = [300 + i for i in range(40)]
    requests = [(f"r{i}", base[i:] + [i], SamplingParams(max_tokens=40, temperature=0.0)) for i in range(6)]
    sync = _drive(_engine(tiny_model_dir, False, num_pages=24, enable_prefix_cache=False), requests, {6: "r2"})
    eng = _engine(tiny_model_dir, True, num_pages=24, enable_prefix_cache=False)
    got = _drive(eng, requests, {6: "r2"})
    assert eng.num_preempted_total > 0 and eng.deferred_steps > 20  # type: ignore[attr-defined]
    assert eng.aborted_in_flight  # type: ignore[attr-defined]
    survivors = {k: v for k, v in _summary(got).items() if k != "r2"}
    assert survivors == {k: v for k, v in _summary(sync).items() if k != "r2"}
    assert all(o.finish_reason != FinishReason.STOP for seq in got.values() for o in seq)


def test_async_is_off_on_cpu_by_default_and_on_when_asked(tiny_model_dir: Path) -> None:
    assert not Engine(EngineConfig(model=str(tiny_model_dir), max_model_len=64)).async_scheduling
    assert _engine(tiny_model_dir, True).async_scheduling


def test_turning_async_off_with_a_step_in_flight_reads_it_first(tiny_model_dir: Path) -> None:
    prompt = [120, 45, 999, 3012, 77, 5150, 23, 8000]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    want = _summary(_drive(_engine(tiny_model_dir, False), [("a", prompt, params), ("b", prompt[:5], params)]))
    eng = _engine(tiny_model_dir, True)
    eng.add_request("a", prompt, params)
    eng.add_request("b", prompt[:5], params)
    outs: dict[str, list[StepOutput]] = defaultdict(list)
    for step in range(200):
        if not eng.has_unfinished():
            break
        eng.async_scheduling = step % 3 != 2  # off every third step, with a step in flight
        for out in eng.step():
            outs[out.req_id].append(out)
    assert _summary(dict(outs)) == want
    assert eng.free_pages_at_idle() == eng.pool.num_pages


def test_a_failed_step_keeps_the_step_in_flight_for_the_next(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that raises (a drill's injected fault) after a deferred step: the deferred
    tokens are not lost; the next step reads them and the outputs are the synchronous ones."""
    from engine.env import FAULT_INJECTION_ENV as ENV
    from engine.faults import InjectedFault

    monkeypatch.setenv(ENV, "1")
    prompt = [120, 45, 999, 3012, 77, 5150, 23, 8000]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = _summary(_drive(_engine(tiny_model_dir, False), [("a", prompt, params)]))
    eng = _engine(tiny_model_dir, True)
    eng.add_request("a", prompt, params)
    outs: dict[str, list[StepOutput]] = defaultdict(list)
    for _ in range(3):
        for out in eng.step():
            outs[out.req_id].append(out)
    assert eng._inflight is not None
    eng.faults.arm("forward")
    with pytest.raises(InjectedFault):
        eng.step()
    assert eng._inflight is not None and not eng._inflight.resolved
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.req_id].append(out)
    assert _summary(dict(outs)) == want
