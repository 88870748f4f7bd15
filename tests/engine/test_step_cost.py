"""Stall-free batching: the step cost model learns per-token costs, and with an inter-token
target the scheduler sizes prompt chunks to what the target leaves after the decode rows
(deterministic: the model is fed known step times, never the clock)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_cost import WARMUP, StepCostModel, StepShape, StepWorth, key_weight
from kvcache.pool import PagePool
from tests.engine.test_scheduler import apply, req

# A machine where a step costs 2 ms + 0.1 ms a prompt token + 0.02 ms per 1k keys a prompt token
# reads + 0.5 ms a decode row + 0.05 ms per 1k keys the decode rows read.
TRUE = (2e-3, 1e-4, 2e-5, 5e-4, 5e-5)


def _cost(shape: StepShape) -> float:
    return float(shape.features() @ np.array(TRUE))


def _fitted() -> StepCostModel:
    model = StepCostModel()
    rng = np.random.default_rng(0)
    for _ in range(200):
        shape = StepShape(int(rng.integers(0, 512)), int(rng.integers(0, 2_000_000)), int(rng.integers(0, 64)),
                          int(rng.integers(0, 200_000)))  # fmt: skip
        model.observe(shape, _cost(shape))
    return model


def test_the_model_recovers_per_token_costs_from_step_times() -> None:
    model = _fitted()
    assert model.theta == pytest.approx(TRUE, rel=1e-3, abs=1e-7)
    decodes = StepShape(decode_rows=32, decode_keys=32 * 4000)
    # 50 ms target: 2 + 16 + 6.4 ms of decode leaves 25.6 ms; a prompt token at 2k context costs 0.14 ms
    assert model.prefill_budget(decodes, 0.05, 2000) == int(0.0256 / 1.4e-4)
    assert model.prefill_budget(decodes, 0.01, 2000) == 0  # the decode rows alone take longer


def test_no_budget_before_warm_up_or_from_a_senseless_fit() -> None:
    model = StepCostModel()
    for _ in range(WARMUP - 1):
        model.observe(StepShape(100, 0, 4, 400), 0.02)
    assert model.prefill_budget(StepShape(decode_rows=4), 0.05, 0) is None
    model.observe(StepShape(), 1.0)  # an empty step teaches nothing
    model.observe(StepShape(100, 0, 4, 400), -1.0)  # nor a nonsense time
    assert model.num_observed == WARMUP - 1


def _scheduler(target_s: float | None, min_prefill: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_prefill_chunk=512, page_size=4,
                          itl_target_s=target_s, min_prefill_tokens=min_prefill)  # fmt: skip
    s = Scheduler(cfg, PagePool(4096))
    s.costs = _fitted()
    return s


def _decoding(s: Scheduler, n: int, prompt_len: int) -> None:
    for i in range(n):
        s.add(req(f"d{i}", prompt_len))
        while s.get(f"d{i}") is not None and s.get(f"d{i}").num_pending > 1:  # type: ignore[union-attr]
            apply(s.schedule())


def test_prompt_chunks_fill_what_the_target_leaves_and_decode_rows_never_wait() -> None:
    s = _scheduler(0.05)
    _decoding(s, 8, 400)
    long = req("long", 4000)
    s.add(long)
    step = apply(s.schedule())
    assert all(step[f"d{i}"] == 1 for i in range(8))  # every decode row runs
    decodes = StepShape(decode_rows=8, decode_keys=sum(s.get(f"d{i}").num_tokens - 1 for i in range(8)))  # type: ignore[union-attr]
    context = 512 // 2  # the long prompt starts from nothing: half a chunk of context, on average
    budget = s.costs.prefill_budget(decodes, 0.05, context)
    assert budget is not None and 8 < budget < 512
    # the decode rows each grew by a token since the budget was taken: within a token's cost
    assert abs(step["long"] - budget) <= 2


def test_an_overloaded_step_still_moves_prompts_by_the_floor_and_no_target_is_the_static_budget() -> None:
    tight = _scheduler(0.001, min_prefill=16)  # less than the decode rows alone
    _decoding(tight, 4, 100)
    tight.add(req("p", 1000))
    assert apply(tight.schedule())["p"] == 16
    static = _scheduler(None)
    _decoding(static, 4, 100)
    static.add(req("p", 1000))
    assert apply(static.schedule())["p"] == 512  # max_prefill_chunk, as before
    idle = _scheduler(0.001)  # nothing decodes: no inter-token latency to protect
    idle.add(req("q", 1000))
    assert apply(idle.schedule())["q"] == 1000  # the step's budget alone caps it


def test_an_engine_with_a_target_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 16_384, size=n).tolist() for n in (40, 700, 1500, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(target: float | None) -> tuple[list[list[int]], int]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", itl_target_ms=target))
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            out[f"r{i}"] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.req_id].extend(o.token_ids)
        worth = engine.scheduler.worth  # least-uncached's burst rule measured the model's steps
        assert worth.key_weight > 0 and worth.step_s is not None and worth.unit_s is not None
        return [out[f"r{i}"] for i in range(len(prompts))], engine.scheduler.costs.num_observed

    plain, unobserved = run(None)
    targeted, observed = run(5.0)
    assert targeted == plain
    assert observed > WARMUP  # the engine fed its cost model every step
    assert unobserved == 0  # without a target the step loop does no cost-model work
    with pytest.raises(Exception, match="itl_target_ms"):
        EngineConfig(model=str(tiny_model_dir), itl_target_ms=0)


def _burst(s: Scheduler, n: int, prompt_len: int) -> list[str]:
    ids = [f"b{i}" for i in range(n)]
    for i in ids:
        s.add(req(i, prompt_len))
    return ids


def _measured(step_s: float = 2e-3, unit_s: float = 1e-4) -> StepWorth:
    worth = StepWorth()  # key weight 0: a prompt token costs unit_s whatever its context
    worth.step_s, worth.unit_s = step_s, unit_s
    return worth


def test_step_worth_measures_a_step_and_a_prompt_tokens_work() -> None:
    worth = StepWorth(key_weight=1e-3)
    assert worth.chunk_s(100, 0) is None
    worth.observe(StepShape(prefill_tokens=100, prefill_keys=100 * 100), 0.055)  # no base yet: all of it
    assert worth.unit_s == pytest.approx(0.055 / 110)
    for rows in (8, 8, 7, 8, 9) * 20:  # decode-only steps of 5 ms, whatever the rows
        worth.observe(StepShape(decode_rows=rows, decode_keys=rows * 500), 0.005)
    assert worth.step_s == pytest.approx(0.005)
    for n, context in ((50, 2000), (400, 0), (512, 1024)) * 40:  # 0.1 ms a unit of work above the 5 ms
        shape = StepShape(n, n * (context + n), 8, 8 * 500)
        worth.observe(shape, 0.005 + 1e-4 * (n + 1e-3 * shape.prefill_keys))
    assert worth.unit_s == pytest.approx(1e-4, rel=1e-3)  # the first guess has faded
    assert worth.chunk_s(50, 2000) == pytest.approx(1e-4 * 50 * (1 + 1e-3 * 2050), rel=1e-3)


def test_a_models_key_weight_is_its_attention_flops_per_key_over_its_projection_flops_per_token() -> None:
    # baton-tiny: 4 layers, hidden 256, MLP 1024, 4 heads / 2 KV heads of 64
    projections = 2 * 4 * (256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 1024)
    assert key_weight(4, 256, 1024, 4, 2, 64) == pytest.approx(4 * 4 * 256 / projections)


def test_a_burst_of_prompts_gets_first_tokens_one_step_after_another_when_batching_them_only_delays() -> None:
    # a step without prompt work costs 2 ms; a 100-token prompt 10 ms, worth 2 steps alone: one
    # prompt a step, shortest remaining first, while the ones already prefilled decode beside it
    s = _scheduler(None)
    s.worth = _measured()
    ids = _burst(s, 4, 100)
    for k in range(4):
        step = apply(s.schedule())
        assert {i: n for i, n in step.items() if n > 1} == {ids[k]: 100}
        assert all(step[i] == 1 for i in ids[:k])
    # 12-token prompts cost 1.2 ms each: a step takes them until they are worth 4 ms
    s = _scheduler(None)
    s.worth = _measured()
    ids = _burst(s, 8, 12)
    assert apply(s.schedule()) == dict.fromkeys(ids[:4], 12)


def test_before_the_costs_are_measured_or_under_fcfs_a_burst_shares_one_step() -> None:
    s = _scheduler(None)  # a fresh StepWorth: nothing measured
    ids = _burst(s, 4, 100)
    assert apply(s.schedule()) == dict.fromkeys(ids, 100)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_prefill_chunk=512, page_size=4,
                          policy="fcfs")  # fmt: skip
    fcfs = Scheduler(cfg, PagePool(4096))
    fcfs.worth = _measured()
    ids = _burst(fcfs, 4, 100)
    assert apply(fcfs.schedule()) == dict.fromkeys(ids, 100)
