"""bench.closed_loop keeps its streams in flight, classifies every step, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.closed_loop import main, run_loop
from engine.engine import Engine
from engine.engine_config import EngineConfig


@pytest.mark.parametrize("policy", ["least-uncached", "fcfs"])
def test_a_closed_loop_reports_its_steps_and_frees_every_page(tiny_model_dir: Path, policy: str) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", scheduler_policy=policy,
                                 enable_prefix_cache=False))  # fmt: skip
    result = run_loop(engine, concurrency=3, requests=7, prompt_len=24, output_len=6)
    assert result.policy == policy  # the engine's own, not a label passed beside it
    assert result.requests >= 7 and result.output_tok_s > 0
    assert result.ttft_p50_ms > 0 and result.tpot_p50_ms > 0
    steps = result.steps
    # the loop opens with prompt work and no decode rows beside it
    assert steps["prompt"].steps >= 1 and steps["prompt"].mean_prompt_tokens >= 24
    assert steps["decode"].steps >= 5 and steps["decode"].mean_prompt_tokens == 0
    # each finished request was replaced at once: every finished prompt was computed, and at most
    # the `concurrency` prompts sent after them besides (nothing is preempted in a pool this size)
    prompt_tokens = sum(k.prompt_tokens for k in steps.values())
    assert 24 * result.requests <= prompt_tokens <= 24 * (result.requests + 3)
    # the streams still running at the end were aborted: every page is back
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.free_pages_at_idle() == engine.pool.num_pages


@pytest.mark.parametrize("argv", [["--policies", "sjf"], ["--policies", ""], ["--concurrency", "9", "--requests", "4"],
                                  ["--output-len", "1"]])  # fmt: skip
def test_bad_arguments_are_refused_before_a_model_loads(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "bench.closed_loop: error:" in capsys.readouterr().err
