"""Constrained decoding on baton-tiny's random weights: the grammar, not the model, makes every
output valid — for JSON schemas, regexes, Lark grammars, at temperature 0 and 1 — and hostile
constraints are refused with a clear error while the requests beside them run to the end.

The schemas bound every free-form field (maxLength, patterns, enums, integer ranges, decimals
via multipleOf): a random model never chooses to close an unbounded string, so only a finite
language is sure to complete within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import regex
import torch

from engine.async_engine import AsyncEngine
from engine.constraint import MAX_SCHEMA_DEPTH, Constraint, ConstraintError
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.errors import BatonError, ConfigError
from engine.job import Job
from engine.request import FinishReason
from engine.sampler import TokenMask, _apply_mask
from engine.sampling import SamplingParams
from engine.structured import GrammarCompiler
from engine.structured_config import StructuredConfig
from tests.json_prefix import close_json

pytestmark = pytest.mark.timeout(120)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["status", "items"],
    "additionalProperties": False,
}
SETTINGS = {
    "type": "object",
    "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "note": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["level", "ratio", "tags"],
    "additionalProperties": False,
}
REGEXES = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "ident": r"[a-z_][a-z0-9_]{0,11}",
}
# (greedy) + temperature 1 with three seeds
SAMPLINGS = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024))


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], FinishReason]]:
    for req_id, (prompt, params) in requests.items():
        engine.add_request(req_id, prompt, params)
    results = _continue(engine, *requests)
    engine.check_integrity()
    return results


def _params(constraint: Constraint, temperature: float, seed: int | None, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, constraint=constraint)


def _schema(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


def _text(engine: Engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens)


def assert_in_language(pattern: str, text: str, reason: FinishReason) -> None:
    """A finished output is in the pattern's language; one cut by max_tokens is a prefix of a
    string in it (regex's partial match: the text could still be completed)."""
    assert reason in (FinishReason.STOP, FinishReason.LENGTH), reason
    if reason == FinishReason.STOP:
        assert regex.fullmatch(pattern, text), (pattern, text)
    else:
        assert regex.fullmatch(pattern, text, partial=True), (pattern, text)


# -- valid outputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", [PERSON, ORDER, SETTINGS], ids=["person", "order", "settings"])
def test_outputs_parse_and_validate_at_temperature_0_and_1(engine: Engine, schema: dict[str, Any]) -> None:
    prompt = engine.tokenizer.encode("Reply in JSON:")
    requests = {f"s{i}": (prompt, _params(_schema(schema), t, seed)) for i, (t, seed) in enumerate(SAMPLINGS)}
    results = _run(engine, requests)
    texts = set()
    for tokens, reason in results.values():
        assert reason == FinishReason.STOP  # the grammar completed: no EOS needed
        text = _text(engine, tokens)
        jsonschema.validate(json.loads(text), schema)
        texts.add(text)
    assert len(texts) > 1  # the seeds did sample different outputs


def test_regex_outputs_fullmatch(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("Number:")
    requests = {
        f"{name}-{i}": (prompt, _params(Constraint("regex", rx), t, seed))
        for name, rx in REGEXES.items()
        for i, (t, seed) in enumerate(SAMPLINGS)
    }
    for req_id, (tokens, reason) in _run(engine, requests).items():
        assert reason == FinishReason.STOP
        assert re.fullmatch(REGEXES[req_id.split("-")[0]], _text(engine, tokens)), req_id


def test_lark_grammar_outputs_are_in_its_language(engine: Engine) -> None:
    grammar = 'start: "SELECT " COL (", " COL)* " FROM t" LIMIT?\nCOL: /[a-z]{1,6}/\nLIMIT: / LIMIT [1-9]/'
    prompt = engine.tokenizer.encode("SQL:")
    requests = {f"g{i}": (prompt, _params(Constraint("grammar", grammar), t, seed, 200)) for i, (t, seed) in enumerate(SAMPLINGS)}
    language = r"SELECT [a-z]{1,6}(, [a-z]{1,6})* FROM t( LIMIT [1-9])?"
    for tokens, reason in _run(engine, requests).values():
        assert_in_language(language, _text(engine, tokens), reason)


def test_json_object_yields_a_json_object(engine: Engine) -> None:
    # baton-tiny never closes a free-form string, so its objects are cut by max_tokens; what the
    # constraint guarantees is that the text is a JSON object, or a prefix that closes into one.
    prompt = engine.tokenizer.encode("JSON:")
    requests = {f"o{i}": (prompt, _params(Constraint("json_object"), t, seed, 48)) for i, (t, seed) in enumerate(SAMPLINGS)}
    for tokens, reason in _run(engine, requests).values():
        text = _text(engine, tokens)
        if reason == FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == FinishReason.LENGTH and len(tokens) == 48
            assert isinstance(json.loads(close_json(text)), dict), text


def test_max_tokens_mid_json_ends_with_length_and_a_truncated_output(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("JSON:")
    (tokens, reason), = _run(engine, {"cut": (prompt, _params(_schema(PERSON), 0.0, None, max_tokens=6))}).values()
    assert reason == FinishReason.LENGTH and len(tokens) == 6
    text = _text(engine, tokens)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # truncated, as documented (vLLM and OpenAI do the same)
    assert text.startswith('{"name": "')


def test_the_grammar_ends_the_request_and_eos_only_when_it_accepts(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("Digits:")
    three = Constraint("regex", "[0-9]{3}")
    # min_tokens and ignore_eos do not outlast the grammar: nothing can follow its last digit.
    params = replace(_params(three, 1.0, 7), min_tokens=10, ignore_eos=True)
    (tokens, reason), = _run(engine, {"d": (prompt, params)}).values()
    assert reason == FinishReason.STOP and re.fullmatch("[0-9]{3}", _text(engine, tokens))
    assert not set(tokens) & set(engine.eos_ids)
    # "a+" may end after any a: EOS is allowed from the first one on, never before.
    matcher = engine.structured.new_matcher(Constraint("regex", "a+"))
    assert not _allows(matcher.ll, engine.eos_ids[0])
    assert matcher.advance(engine.tokenizer.encode("a", add_special_tokens=False)[0]) is None
    assert _allows(matcher.ll, engine.eos_ids[0])
    assert matcher.advance(engine.eos_ids[0]) == FinishReason.STOP


def test_logprobs_follow_the_mask(engine: Engine) -> None:
    constraint = _schema(SETTINGS)
    prompt = engine.tokenizer.encode("JSON:")
    engine.add_request("lp", prompt, replace(_params(constraint, 1.0, 5), logprobs=5))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    matcher = engine.structured.new_matcher(constraint)
    for out in outs:
        (lp,) = out.logprobs
        assert math.isfinite(lp.logprob) and lp.token_id == out.token_ids[0]
        # Every alternative shown is a token the grammar allowed at that point.
        assert all(_allows(matcher.ll, token) for token, _ in lp.top)
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-4
        matcher.advance(out.token_ids[0])
    assert outs[-1].finish_reason == FinishReason.STOP


def test_unconstrained_requests_are_unchanged_by_constrained_ones_beside_them(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(3)]
    alone = _run(engine, {f"u{i}": (p, greedy) for i, p in enumerate(prompts)})
    mixed = {f"u{i}": (p, greedy) for i, p in enumerate(prompts)}
    mixed.update({f"c{i}": (p, _params(_schema(ORDER), 1.0, i)) for i, p in enumerate(prompts)})
    together = _run(engine, mixed)
    for i in range(3):
        assert together[f"u{i}"] == alone[f"u{i}"]
        jsonschema.validate(json.loads(_text(engine, together[f"c{i}"][0])), ORDER)


def test_the_mask_adds_minus_infinity_to_refused_tokens_of_its_rows_only() -> None:
    vocab = 100  # not a multiple of 32: the last word's high bits are padding
    allowed = torch.rand(2, vocab) < 0.3
    padded = torch.zeros(2, 128, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(2, 4, 32) << torch.arange(32)).sum(-1)  # bit t of word w = token 32w + t
    bits = words.where(words < 2**31, words - 2**32).to(torch.int32)
    with torch.inference_mode():
        logits = torch.randn(4, vocab)
    before = logits.clone()
    _apply_mask(logits, TokenMask([3, 1], bits))
    for row, k in ((3, 0), (1, 1)):
        assert torch.equal(logits[row][allowed[k]], before[row][allowed[k]])
        assert torch.isneginf(logits[row][~allowed[k]]).all()
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


# -- matcher state across preemption, the prefix cache and the hand-off -----------------------------


def test_preemption_and_prefix_cache_hits_keep_the_matcher_right(tiny_model_dir: Path, engine: Engine) -> None:
    constraint = _schema(PERSON)
    prompts = [list(range(200 + 40 * i, 240 + 40 * i)) for i in range(4)]
    requests = {f"p{i}": (p, _params(constraint, 1.0, 11 + i)) for i, p in enumerate(prompts)}
    expected = _run(engine, requests)
    # 12 pages of 16 tokens: four requests of ~100 tokens cannot all stay, so some are
    # preempted (recomputed later) mid-JSON.
    tight = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=12, max_model_len=192))
    requests = {k: (p, replace(params, max_tokens=140)) for k, (p, params) in requests.items()}
    for req_id, (prompt, params) in requests.items():
        tight.add_request(req_id, prompt, params)
    got: dict[str, list[int]] = {k: [] for k in requests}
    preempted = 0
    while tight.has_unfinished():
        for out in tight.step():
            got[out.req_id].extend(out.token_ids)
        assert tight.last_stats is not None
        preempted += tight.last_stats.num_preempted
    assert preempted > 0
    for req_id, (tokens, _reason) in expected.items():
        assert got[req_id] == tokens  # seeded: the same tokens after a recompute
        jsonschema.validate(json.loads(_text(engine, tokens)), PERSON)
    # The recomputes reused the preempted requests' own cached pages; a prompt run twice more
    # hits the cache the second time. The outputs do not change.
    assert tight.prefix_cache is not None and tight.prefix_cache.stats.hit_pages_by_tier[0] > 0
    prompt, params = requests["p0"]
    for again in ("again", "again2"):
        hits = tight.prefix_cache.stats.hit_tokens
        assert _run(tight, {again: (prompt, params)})[again][0] == expected["p0"][0]
    assert tight.prefix_cache.stats.hit_tokens > hits


def test_prefill_here_decode_there_continues_the_grammar(tiny_model_dir: Path, engine: Engine) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024)
    prefill, decode = Engine(cfg), Engine(cfg)
    prompt = engine.tokenizer.encode("Reply in JSON:")
    for i, (temperature, seed) in enumerate(SAMPLINGS[:2]):
        params = _params(_schema(ORDER), temperature, seed)
        (single, _), = _run(engine, {f"single{i}": (prompt, params)}).values()
        tokens = _handoff(prefill, decode, f"h{i}", prompt, params)
        assert tokens == single
        jsonschema.validate(json.loads(_text(engine, tokens)), ORDER)
    assert decode.free_pages_at_idle() == decode.pool.num_pages


def _handoff(prefill: Engine, decode: Engine, req_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    # What prefill/worker.py and decode/worker.py do: the first token under the mask on the
    # prefill side, then the decode side rebuilds the matcher from that token.
    prefill.add_request(req_id, prompt, replace(params, max_tokens=1), export_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    exported = prefill.take_exported(req_id)
    assert exported is not None
    pages = decode.reserve_pages(len(prompt))
    assert pages is not None
    decode.pool.kv[:, :, torch.tensor(pages)] = exported.kv.permute(1, 2, 0, 3, 4, 5)
    decode.add_prefilled(Job(req_id, tuple(prompt), params), exported.first_token, pages)
    tokens = [exported.first_token]
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.token_ids)
    return tokens


# -- hostile constraints ----------------------------------------------------------------------------


def _deep_schema(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("json_schema", '{"type": "string", "description": "' + "x" * (10 << 20) + '"}', "bytes; at most 65536"),
        ("json_schema", _deep_schema(1000), "nests 1001 levels deep"),
        ("json_schema", '{"type": "string", "pattern": "(x{1,100}){1,100}"}', "#/pattern is too complex"),
        ("json_schema", '{"patternProperties": {"a{100000}": {}}}', "repeats {100000}"),
        ("json_schema", '{"type": "object",', "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("regex", "[a-z]{1000}{1000}", "too complex"),
        ("regex", "(" * 40 + "a" + ")" * 40, "nests groups more than 32 deep"),
        ("regex", "a" * 5000, "at most 2000"),
        ("grammar", 'start: A\nA: /(ab{1,50}){1,200}/', "regex terminal 1 of the grammar is too complex"),
        ("grammar", "   ", "empty"),
        ("json_object", "{}", "takes no text"),
        ("yaml", "", "kind must be one of"),
    ],
)
def test_hostile_constraints_are_refused_when_built(kind: str, text: str, message: str) -> None:
    # Linear checks in the constructor: nothing reaches an engine or a compiler.
    with pytest.raises(ConstraintError, match=re.escape(message)) as info:
        Constraint(kind, text)
    assert info.value.field == "constraint" and isinstance(info.value, BatonError)  # the edge's 400


def test_the_schema_depth_bound_counts_json_containers() -> None:
    Constraint("json_schema", _deep_schema(MAX_SCHEMA_DEPTH - 1))
    with pytest.raises(ConstraintError):
        Constraint("json_schema", _deep_schema(MAX_SCHEMA_DEPTH))
    # Brackets inside strings are text, not nesting; equal schemas share one spec.
    a = Constraint("json_schema", '{"description": "[[[[{{{{", "type": "string"}')
    b = Constraint("json_schema", '{ "description":"[[[[{{{{",\n "type":"string" }')
    assert a == b and hash(a) == hash(b) and SamplingParams(constraint=a) == SamplingParams(constraint=b)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json_schema", '{"type": "foo"}'), "Invalid type: foo"),
        (Constraint("json_schema", '{"not": {"type": "string"}}'), "Unimplemented keys"),
        (Constraint("json_schema", '{"type": "string", "format": "bogus"}'), "Unknown format: bogus"),
        (Constraint("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
        (Constraint("regex", "([a-z"), "unclosed character class"),
        (Constraint("regex", "(?=a)a"), "look-around"),
        (Constraint("grammar", 'start: "a" rule_that_is_missing'), "rule_that_is_missing"),
    ],
)
def test_a_constraint_that_does_not_compile_fails_only_its_request(
    engine: Engine, constraint: Constraint, message: str
) -> None:
    prompt = list(range(300, 340))
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (expected, _), = _run(engine, {"alone": (prompt, free)}).values()
    engine.add_request("free", prompt, free)
    engine.step()
    used = engine.pool.pages.num_used
    with pytest.raises(ConstraintError, match=re.escape(message)) as info:
        engine.add_request("bad", prompt, SamplingParams(constraint=constraint))
    assert str(info.value).startswith("constraint: the ")
    assert engine.scheduler.get("bad") is None and engine.pool.pages.num_used == used  # nothing allocated
    (tokens, reason), = _continue(engine, "free").values()
    assert reason == FinishReason.LENGTH and tokens == expected[1:]


def test_pathological_regexes_within_the_bounds_compile_and_generate(engine: Engine) -> None:
    # Exponential for a backtracking matcher or a DFA; llguidance's lazy lexer takes them in its stride.
    regexes = {"nested": r"(a+)+b", "dotstar": r"(.*a){12}", "counted": r"(x{1,30}y){1,30}", "alt": r"(a|aa)*c"}
    requests = {name: ([5, 6, 7], _params(Constraint("regex", rx), 1.0, 3, max_tokens=64)) for name, rx in regexes.items()}
    results = _run(engine, requests)
    for name, (tokens, reason) in results.items():
        assert len(tokens) > 0
        assert_in_language(regexes[name], _text(engine, tokens), reason)


def test_compile_time_is_bounded_and_an_overrun_is_remembered(engine: Engine) -> None:
    cfg = StructuredConfig(compile_timeout_s=0.05)
    compiler = GrammarCompiler(engine.tokenizer.to_json, engine.model_config.vocab_size, engine.eos_ids, cfg)
    build = compiler._build

    def slow_build(constraint: Constraint) -> Any:  # a compile that takes 0.5 s
        time.sleep(0.5)
        return build(constraint)

    compiler._build = slow_build  # type: ignore[method-assign]
    try:
        constraint = _schema(PERSON)
        with pytest.raises(ConstraintError, match="took longer than 0.05 s to compile"):
            compiler.compile(constraint)
        deadline = time.monotonic() + 30
        while not compiler.is_cached(constraint) and time.monotonic() < deadline:
            time.sleep(0.01)
        compiler._build = build  # type: ignore[method-assign]
        with pytest.raises(ConstraintError, match="too complex"):  # refused again, from the cache
            compiler.compile(constraint)
    finally:
        compiler.close()


def test_the_compile_cache_is_bounded(engine: Engine) -> None:
    compiler = GrammarCompiler(
        engine.tokenizer.to_json, engine.model_config.vocab_size, engine.eos_ids, StructuredConfig(cache_size=2)
    )
    try:
        regexes = [Constraint("regex", f"[0-9]{{{n}}}") for n in (1, 2, 3)]
        for constraint in regexes:
            compiler.matcher(constraint)
        assert [compiler.is_cached(c) for c in regexes] == [False, True, True]
    finally:
        compiler.close()


@pytest.mark.parametrize(
    ("field", "value"), [("compile_timeout_s", 0.0), ("cache_size", 0), ("num_mask_threads", -1), ("num_compile_threads", 1.5)]
)
def test_structured_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"structured.{field}"):
        StructuredConfig(**{field: value})  # type: ignore[arg-type]
    assert StructuredConfig(overlap=None).resolve_overlap(torch.device("cuda")) is True


async def test_async_engine_compiles_off_the_step_thread_and_refuses_before_queueing(engine: Engine) -> None:
    front = AsyncEngine(engine)
    front.start()
    try:
        free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        constraint = Constraint("regex", r"[A-Z]{2}-[0-9]{4}")
        assert not engine.is_prepared(SamplingParams(constraint=constraint))

        async def collect(req_id: str, params: SamplingParams) -> list[int]:
            return [t async for out in front.generate(Job(req_id, (9, 10, 11), params)) for t in out.token_ids]

        bad = SamplingParams(constraint=Constraint("json_schema", '{"type": "foo"}'))
        results = await asyncio.gather(
            collect("free", free), collect("bad", bad), collect("ok", _params(constraint, 1.0, 4)),
            return_exceptions=True,
        )
        assert isinstance(results[1], ConstraintError) and "Invalid type: foo" in str(results[1])
        assert isinstance(results[0], list) and len(results[0]) == 20
        assert isinstance(results[2], list) and re.fullmatch(r"[A-Z]{2}-[0-9]{4}", _text(engine, results[2]))
        assert engine.is_prepared(SamplingParams(constraint=constraint))
    finally:
        await front.stop()


# -- helpers ----------------------------------------------------------------------------------------


def _continue(engine: Engine, *req_ids: str) -> dict[str, tuple[list[int], FinishReason]]:
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    reasons: dict[str, FinishReason] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.req_id].extend(out.token_ids)
            if out.finish_reason is not None:
                reasons[out.req_id] = out.finish_reason
    return {r: (tokens[r], reasons[r]) for r in req_ids}


def _allows(matcher: Any, token: int) -> bool:
    bits = matcher.compute_bitmask()
    return bool(bits[token // 8] >> (token % 8) & 1)
