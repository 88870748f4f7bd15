"""The offline benchmark runs end to end and its figures are internally consistent."""

from __future__ import annotations

from pathlib import Path

from bench.offline import run_one
from engine.engine import Engine
from engine.engine_config import EngineConfig


def test_offline_run_reports_consistent_figures(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    result = run_one(engine, "baton-tiny", batch=4, prompt_len=20, output_len=6, seed=0)
    # One prefill step (all four prompts fit the token budget), then 5 decode steps.
    assert result.decode_steps == 5
    assert result.output_tok_s > 0 and result.decode_tok_s > 0
    assert 0.0 <= result.outside_forward_share < 1.0
    assert result.elapsed_s > 0
    assert not engine.has_unfinished()
    assert engine.free_pages_at_idle() == engine.pool.num_pages
