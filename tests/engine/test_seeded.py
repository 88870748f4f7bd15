"""Seeded sampling draws from (seed, position): the same tokens alone, in any batch, after preemption."""

from __future__ import annotations

from pathlib import Path

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams

SEEDED = SamplingParams(
    max_tokens=24, temperature=0.9, top_p=0.95, top_k=200, seed=42, ignore_eos=True
)
OTHER = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)


def _run(
    engine: Engine, batch: list[tuple[str, list[int], SamplingParams]]
) -> dict[str, list[int]]:
    for req_id, prompt, params in batch:
        engine.add_request(req_id, prompt, params)
    tokens: dict[str, list[int]] = {req_id: [] for req_id, _, _ in batch}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.req_id].extend(out.token_ids)
    return tokens


def test_seeded_request_gives_the_same_tokens_alone_and_in_batches(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    prompt = list(range(100, 160))
    alone = _run(engine, [("s", prompt, SEEDED)])["s"]
    assert len(alone) == 24
    noise = [(f"n{i}", list(range(200 + i, 240 + 3 * i)), OTHER) for i in range(7)]
    in_front = _run(engine, [("s", prompt, SEEDED), *noise])["s"]
    behind = _run(engine, [*noise[:3], ("s", prompt, SEEDED), *noise[3:]])["s"]
    assert in_front == alone
    assert behind == alone
    # A different seed gives a different sequence (the seed is really used).
    other_seed = _run(engine, [("t", prompt, SamplingParams(**{**_fields(SEEDED), "seed": 43}))])[
        "t"
    ]
    assert other_seed != alone


def test_seeded_request_survives_preemption(tiny_model_dir: Path) -> None:
    alone_engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    prompt = list(range(300, 340))
    alone = _run(alone_engine, [("s", prompt, SEEDED)])["s"]
    # 7 pages of 16: "a" (60 + 24 tokens) outgrows its 4 pages while "s" (40 tokens, 3
    # pages) runs beside it, so the later arrival, "s", is preempted and recomputed.
    tight = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=7))
    batch = [("a", list(range(10, 70)), OTHER), ("s", prompt, SEEDED)]
    for req_id, p, params in batch:
        tight.add_request(req_id, p, params)
    tokens: dict[str, list[int]] = {"a": [], "s": []}
    preempted = 0
    while tight.has_unfinished():
        for out in tight.step():
            tokens[out.req_id].extend(out.token_ids)
        assert tight.last_stats is not None
        preempted += tight.last_stats.num_preempted
    assert preempted > 0
    assert tokens["s"] == alone


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}
