"""Decode graphs' bucketing and padding, run eagerly on CPU (capture is CUDA-only).

The graph path pads a decode batch up to its bucket with rows that write and read only the
pool's scratch page; greedy outputs through it must equal the plain runner's, and no real
page may be touched by a padding row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs, bucket_for, graph_batch_sizes
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams


def test_batch_sizes_cover_every_batch_with_bounded_padding() -> None:
    assert graph_batch_sizes(128) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(100)[-1] == 100
    for max_batch in (1, 3, 8, 20, 64, 100, 128, 256):
        sizes = graph_batch_sizes(max_batch)
        for n in range(1, max_batch + 1):
            b = bucket_for(n, sizes)
            assert b is not None and n <= b <= max_batch
            assert b - n < (8 if b <= 64 else 16)
        assert bucket_for(max_batch + 1, sizes) is None


@pytest.mark.parametrize(("num_prompts", "async_on"), [(1, False), (3, False), (6, False), (3, True), (6, True)])
def test_padded_graph_path_matches_the_plain_runner(tiny_model_dir: Path, num_prompts: int, async_on: bool) -> None:
    """With async scheduling, each graph step takes its rows' input tokens from the step before
    it on the device (DecodeGraphs.run's `carried`); the tokens must not change."""
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256, num_pages=96)
    plain = Engine(cfg)
    padded = Engine(dataclasses.replace(cfg, async_scheduling=async_on))
    graphs = DecodeGraphs(padded.model, padded.pool, 8, padded.max_model_len, "torch", capture=False)
    padded.runner.graphs = graphs
    scratch = padded.pool.kv[:, :, padded.pool.scratch_page].clone()
    prompts = [[5 + i, 300 + 7 * i, 11, 90 + i] * (3 + 5 * i) for i in range(num_prompts)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert padded.generate(prompts, greedy) == plain.generate(prompts, greedy)
    # Every page the plain engine wrote holds the same K/V in the padded one: padding rows
    # wrote the scratch page only.
    real = slice(0, padded.pool.num_pages)
    torch.testing.assert_close(padded.pool.kv[:, :, real], plain.pool.kv[:, :, real])
    if num_prompts not in graphs.sizes:
        assert not torch.equal(padded.pool.kv[:, :, padded.pool.scratch_page], scratch)
    assert padded.free_pages_at_idle() == padded.pool.num_pages
    assert graphs.num_carried_steps > 0 if async_on else graphs.num_carried_steps == 0


def test_a_batch_past_the_largest_graph_runs_eagerly(tiny_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128, num_pages=64)
    engine = Engine(cfg)
    graphs = DecodeGraphs(engine.model, engine.pool, 2, engine.max_model_len, "torch", capture=False)
    engine.runner.graphs = graphs
    outputs = engine.generate([[7, 8, 9]] * 3, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in outputs] == [4, 4, 4]
    with pytest.raises(ValueError, match="past the largest"):
        graphs.run([1, 2, 3], [0, 0, 0], [0, 0, 0], [[0], [0], [0]])
