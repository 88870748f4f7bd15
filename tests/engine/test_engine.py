"""Engine behaviour end to end on baton-tiny: finishing rules, logprobs, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.errors import ConfigError, RequestError
from engine.outputs import StepOutput
from engine.request import FinishReason
from engine.sampling import SamplingParams

PROMPT = [120, 45, 999, 3012, 77, 5150, 23, 8000]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256))


def _run(engine: Engine, params: SamplingParams, prompt: list[int] = PROMPT) -> list[StepOutput]:
    engine.add_request("t", prompt, params)
    outs: list[StepOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert engine.free_pages_at_idle() == engine.pool.num_pages
    return outs


def test_max_tokens_finishes_with_length_and_text_matches_decode(engine: Engine) -> None:
    outs = _run(engine, SamplingParams(max_tokens=20, temperature=0.0))
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 20 and outs[-1].finish_reason == FinishReason.LENGTH
    assert all(o.finish_reason is None for o in outs[:-1])
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(tokens)
    assert outs[-1].num_prompt_tokens == len(PROMPT) and outs[-1].num_output_tokens == 20


def test_stop_string_cuts_the_text_before_it(engine: Engine) -> None:
    full = "".join(o.text for o in _run(engine, SamplingParams(max_tokens=40, temperature=0.0)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    outs = _run(engine, SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,)))
    assert outs[-1].finish_reason == FinishReason.STOP
    assert "".join(o.text for o in outs) == full[: full.index(stop)]


def test_stop_token_ids_and_min_tokens(engine: Engine) -> None:
    first = _run(engine, SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids[0]
    stopped = _run(engine, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(first,)))
    assert [o.token_ids for o in stopped] == [(first,)] and stopped[0].finish_reason == FinishReason.STOP
    held = _run(engine, SamplingParams(max_tokens=6, min_tokens=4, temperature=0.0, stop_token_ids=(first,)))
    tokens = [t for o in held for t in o.token_ids]
    assert len(tokens) >= 4 and first not in tokens[:4]  # blocked until min_tokens


def test_logprobs_report_the_chosen_token_and_sorted_alternatives(engine: Engine) -> None:
    outs = _run(engine, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5))
    for out in outs:
        (lp,) = out.logprobs
        assert lp.token_id == out.token_ids[0]
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id  # greedy: the chosen one is top-1
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and lp.logprob == pytest.approx(values[0])


def test_invalid_requests_are_refused_before_allocation(engine: Engine) -> None:
    params = SamplingParams(max_tokens=8)
    cases = [
        ([], params, "prompt"),
        ([1, 2, 16_384], params, "prompt"),
        ([1, -1], params, "prompt"),
        (list(range(10, 260)), params, "max_tokens"),  # 250 + 8 > max_model_len 256
        ([1, 2], SamplingParams(max_tokens=8, logit_bias={16_384: 5.0}), "logit_bias"),
    ]
    for prompt, p, field in cases:
        with pytest.raises(RequestError) as info:
            engine.add_request("bad", prompt, p)
        assert info.value.field == field
    assert not engine.has_unfinished() and engine.free_pages_at_idle() == engine.pool.num_pages
    engine.add_request("dup", [5, 6], params)
    with pytest.raises(RequestError, match="already"):
        engine.add_request("dup", [5, 6], params)
    assert engine.abort("dup") and not engine.abort("dup")
    assert engine.free_pages_at_idle() == engine.pool.num_pages


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "int8"), ("page_size", 0), ("num_pages", -3), ("device", "tpu"), ("max_num_seqs", 1.5)],
)
def test_engine_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_bfloat16_on_cpu_runs_and_stays_close_to_float32(tiny_model_dir: Path, engine: Engine) -> None:
    import torch

    bf16 = Engine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_model_len=256))
    assert bf16.pool.kv.dtype == torch.bfloat16
    ref = engine.prompt_logits(PROMPT)
    got = bf16.prompt_logits(PROMPT)
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=0).item()
    assert cos > 0.99, f"bf16 logits drifted: cosine {cos:.4f}"
    outs = _run(bf16, SamplingParams(max_tokens=8, temperature=0.0))
    assert sum(len(o.token_ids) for o in outs) == 8
