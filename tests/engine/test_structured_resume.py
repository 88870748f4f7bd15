"""A constrained request that moved (issue 24): its new worker gets the prompt + the tokens it
already emitted (`Job.num_resumed` of them, the prompt's tail), advances a fresh grammar matcher
over them, and goes on exactly where the lost worker stopped -- the same tokens as the run that
was never interrupted (greedy, and seeded: the draw is keyed on the position), whether the new
engine prefills the request itself or a prefill engine samples its first token under the mask.
Tokens the grammar refuses fail that request alone; tokens that complete it end it "stop".
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.constraint import Constraint
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.job import Job
from engine.request import FinishReason
from engine.sampling import SamplingParams
from tests.engine.test_structured import ORDER, PERSON, REGEXES

pytestmark = pytest.mark.timeout(120)

Output = tuple[list[int], FinishReason]


@pytest.fixture(scope="module")
def cfg(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def engine(cfg: EngineConfig) -> Engine:
    return Engine(cfg)


def _run(engine: Engine, job: Job) -> Output:
    """`job` added and the engine run until nothing is left: its tokens and finish reason."""
    engine.add(job)
    tokens: list[int] = []
    reason: FinishReason | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.req_id == job.req_id:
                tokens.extend(out.token_ids)
                reason = out.finish_reason if out.finish_reason is not None else reason
    engine.check_integrity()
    assert reason is not None
    return tokens, reason


def _moved(job: Job, emitted: list[int], req_id: str) -> Job:
    """What RayFront.generate sends after a decode worker was lost with `emitted` sent."""
    sampling = replace(job.sampling, max_tokens=job.sampling.max_tokens - len(emitted))
    return replace(job, req_id=req_id, prompt_ids=job.prompt_ids + tuple(emitted), sampling=sampling,
                   num_resumed=len(emitted))  # fmt: skip


def _job(engine: Engine, constraint: Constraint, temperature: float = 0.0, seed: int | None = None) -> Job:
    prompt = tuple(engine.tokenizer.encode("Reply:"))
    return Job("whole", prompt, SamplingParams(max_tokens=300, temperature=temperature, seed=seed, constraint=constraint))


CASES = [
    ("person", Constraint("json_schema", json.dumps(PERSON)), 0.0, None),
    ("order", Constraint("json_schema", json.dumps(ORDER)), 0.0, None),
    ("order-seeded", Constraint("json_schema", json.dumps(ORDER)), 1.0, 5),
    ("phone", Constraint("regex", REGEXES["phone"]), 0.0, None),
    ("date", Constraint("regex", REGEXES["date"]), 0.0, None),
]


def _check_valid(engine: Engine, name: str, constraint: Constraint, tokens: list[int]) -> None:
    text = engine.tokenizer.decode(tokens)
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
    else:
        assert re.fullmatch(constraint.text, text), (name, text)


@pytest.mark.parametrize(("name", "constraint", "temperature", "seed"), CASES, ids=[c[0] for c in CASES])
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(
    engine: Engine, name: str, constraint: Constraint, temperature: float, seed: int | None
) -> None:
    job = _job(engine, constraint, temperature, seed)
    whole, reason = _run(engine, job)
    assert reason == FinishReason.STOP and len(whole) >= 4
    _check_valid(engine, name, constraint, whole)
    for cut in sorted({1, len(whole) // 2, len(whole) - 1}):  # after the first token, mid-way, one before the end
        rest, rest_reason = _run(engine, _moved(job, whole[:cut], f"moved-{cut}"))
        assert whole[:cut] + rest == whole, (name, cut)
        assert rest_reason == FinishReason.STOP


@pytest.mark.parametrize(("name", "constraint"), [(c[0], c[1]) for c in CASES[1:4:2]], ids=["order", "phone"])
def test_a_resumed_request_prefilled_elsewhere_samples_its_first_token_under_the_resumed_mask(
    cfg: EngineConfig, engine: Engine, name: str, constraint: Constraint
) -> None:
    """The path across disaggregation: the prefill engine resumes the grammar, samples the next
    token under its mask; the decode engine resumes it again and goes on past that token."""
    job = _job(engine, constraint)
    whole, _ = _run(engine, job)
    prefill, decode = Engine(cfg), Engine(cfg)
    cut = len(whole) // 2
    moved = _moved(job, whole[:cut], "moved")
    prefill.add(replace(moved, sampling=replace(moved.sampling, max_tokens=1)), export_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    exported = prefill.take_exported("moved")
    assert exported is not None and exported.first_token == whole[cut]
    pages = decode.reserve_pages(len(moved.prompt_ids))
    assert pages is not None
    decode.pool.kv[:, :, torch.tensor(pages)] = exported.kv.permute(1, 2, 0, 3, 4, 5)
    decode.add_prefilled(moved, exported.first_token, pages)
    tokens = [exported.first_token]
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.token_ids)
    assert whole[:cut] + tokens == whole
    _check_valid(engine, name, constraint, whole)
    assert decode.free_pages_at_idle() == decode.pool.num_pages


def test_resumed_tokens_that_complete_the_grammar_end_the_request_stop(engine: Engine) -> None:
    job = _job(engine, Constraint("regex", REGEXES["phone"]))
    whole, _ = _run(engine, job)
    tokens, reason = _run(engine, _moved(job, whole, "complete"))
    # Nothing can follow: EOS is the only token the mask allows, and the grammar says "stop".
    assert reason == FinishReason.STOP and len(tokens) == 1 and tokens[0] in engine.eos_ids
    assert engine.tokenizer.decode(tokens) == ""


def test_resumed_tokens_the_grammar_refuses_fail_that_request_only(engine: Engine) -> None:
    job = _job(engine, Constraint("regex", REGEXES["phone"]))
    letters = engine.tokenizer.encode("abc", add_special_tokens=False)
    beside = Job("beside", job.prompt_ids, replace(job.sampling, max_tokens=8, constraint=None))
    engine.add(beside)
    with pytest.raises(RequestError, match=r"constraint: the output emitted before the request moved \(num_resumed=1\) breaks"):
        engine.add(_moved(job, letters, "refused"))
    assert engine.scheduler.get("refused") is None
    assert _run(engine, replace(beside, req_id="after"))[1] == FinishReason.LENGTH  # the engine goes on
    # Refused on the decode side of a hand-off: the reserved pages go back to the pool.
    free = engine.pool.pages.num_free
    moved = _moved(job, letters, "refused-prefilled")
    pages = engine.reserve_pages(len(moved.prompt_ids))
    assert pages is not None and engine.pool.pages.num_free < free
    with pytest.raises(RequestError, match="constraint"):
        engine.add_prefilled(moved, letters[0], pages)
    assert engine.pool.pages.num_free == free
    engine.check_integrity()


def test_the_resumed_count_is_bounded_by_the_prompt(engine: Engine) -> None:
    job = _job(engine, Constraint("regex", REGEXES["phone"]))
    for bad in (-1, len(job.prompt_ids)):
        with pytest.raises(RequestError, match="num_resumed"):
            engine.add(replace(job, req_id=f"bad{bad}", num_resumed=bad))
    # The resumed tokens are prompt: the model's context bounds them with it.
    long = replace(job, req_id="long", prompt_ids=job.prompt_ids + (0,) * 1000, num_resumed=1000)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add(long)
