"""Random add / step / abort sequences never leak or corrupt a page."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.builtin import RandomModelSpec, create_model
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams

MICRO = RandomModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    seed=3,
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model_dir = create_model(MICRO, tmp_path_factory.mktemp("micro"))
    # 12 pages of 4 tokens: small enough that a few requests force preemption.
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        page_size=4,
        num_pages=12,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_prefill_chunk=8,
    )
    return Engine(cfg)


add = st.tuples(
    st.just("add"), st.integers(1, 30), st.integers(1, 10), st.integers(0, 2), st.booleans()
)
step = st.tuples(st.just("step"), st.integers(1, 4))
abort = st.tuples(st.just("abort"), st.integers(0, 20))
operations = st.lists(st.one_of(add, step, abort), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, finish=st.booleans())
def test_random_sequences_leave_every_page_free(
    engine: Engine, ops: list[tuple], finish: bool
) -> None:
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority, seeded = op
            req_id = f"p{len(added)}"
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.8 if seeded else 0.0,
                seed=len(added) if seeded else None,
            )
            engine.add_request(
                req_id, [5 + (i * 7) % 500 for i in range(prompt_len)], params, priority
            )
            added.append(req_id)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                engine.check_integrity()
        elif added:
            engine.abort(added[op[1] % len(added)])
            engine.check_integrity()
    if finish:
        for _ in range(2000):  # bounded: every request here finishes within a few hundred steps
            if not engine.has_unfinished():
                break
            engine.step()
            engine.check_integrity()
    for req_id in added:
        engine.abort(req_id)
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.free_pages_at_idle() == engine.pool.num_pages
    assert engine.prefix_cache is not None
    engine.prefix_cache.clear()  # nothing holds a cached page at idle, so all of them go
    assert engine.pool.pages.num_free == engine.pool.num_pages
