"""The CPU decode step in one call (engine/cpu_decode.py, engine/csrc/decode_step.c) against the
fused forward it replaces, the reference: the same hidden states bit for bit and the same pool
writes, for one row and many, with a shared prefix, a QKV bias (Qwen2) and 16-bit KV; the
engine uses it exactly where its kernels are the model's own; bad input is refused before
anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.builtin import RandomModelSpec, create_model
from engine.cpu_decode import CpuDecodeStep
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.runner import ModelRunner, order_decodes
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerOutput

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, **kw: object) -> Engine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512, num_pages=96,
                       attention_backend="cpu", **kw)  # type: ignore[arg-type]  # fmt: skip
    return Engine(cfg)


def _decode_batch(engine: Engine, prompts: list[list[int]]) -> SchedulerOutput:
    """The prompts prefilled (one step each, through the fused path) and their first tokens
    sampled; then the scheduler's next step: every row a decode row."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    out = engine.scheduler.schedule()
    assert out.scheduled and all(s.num_new == 1 for s in out.scheduled)
    return out


def _forward_both(engine: Engine, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, pool) after the step through the decode step, then (hidden, pool) through the
    fused layers, each from the pool as it was before the step (left so afterwards)."""
    runner: ModelRunner = engine.runner
    model = runner.model
    before = engine.pool.kv.clone()
    driver = model.decode_step
    assert isinstance(driver, CpuDecodeStep)
    results = []
    for step in (driver, None):
        engine.pool.kv.copy_(before)
        model.decode_step = step
        decodes, keys = order_decodes(out.scheduled)
        input_ids, positions, slots = runner._flat_inputs(decodes)
        meta = runner._metadata([], decodes, slots, keys)
        hidden = model.forward(input_ids, positions, meta, engine.pool)
        results.append((hidden, engine.pool.kv.clone()))
    model.decode_step = driver
    (h1, kv1), (h2, kv2) = results
    assert not torch.equal(kv1, before)  # the step wrote its tokens' K/V
    engine.pool.kv.copy_(before)
    return h1, kv1, h2, kv2


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
def test_the_decode_step_is_the_fused_forward_bit_for_bit(tiny_model_dir: Path, kv_dtype: str) -> None:
    engine = _engine(tiny_model_dir, kv_cache_dtype=kv_dtype)
    shared = [3, 50, 900, 7] * 20  # five pages in common: the plan reads them once for both rows
    prompts = [shared + [11], shared + [12, 13], [5] * 200, [9, 8]]  # long enough to split across threads
    h1, kv1, h2, kv2 = _forward_both(engine, _decode_batch(engine, prompts))
    assert h1.shape == (4, engine.model.cfg.hidden_size)
    assert torch.equal(h1, h2)
    assert torch.equal(kv1, kv2)
    assert torch.isfinite(h1).all()


def test_one_row_and_a_qkv_bias(tmp_path: Path) -> None:
    """A Qwen2-shaped model: q/k/v biases, which only the QKV projection takes."""
    spec = RandomModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=256, architecture="qwen2", attention_bias=True)  # fmt: skip
    engine = _engine(create_model(spec, tmp_path / "qwen2"))
    assert engine.model.layers[0].qkv_bias is not None and engine.model.decode_step is not None
    h1, kv1, h2, kv2 = _forward_both(engine, _decode_batch(engine, [[7, 8, 9] * 11]))
    assert torch.equal(h1, h2) and torch.equal(kv1, kv2)


def test_an_engine_generates_the_same_tokens_with_and_without_it(tiny_model_dir: Path) -> None:
    on, off = _engine(tiny_model_dir), _engine(tiny_model_dir)
    assert on.model.decode_step is not None
    off.model.decode_step = None
    prompts = [[3, 50, 900, 7] * 30, [11, 12], [3, 50, 900, 7] * 30 + [5], list(range(4, 300))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert on.generate(prompts, params) == off.generate(prompts, params)
    assert torch.equal(on.pool.kv, off.pool.kv)


def test_it_is_used_only_where_its_kernels_are_the_models_own(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _engine(tiny_model_dir).model.decode_step is not None
    torch_backend = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128, num_pages=16,
                                 attention_backend="torch")  # fmt: skip
    assert Engine(torch_backend).model.decode_step is None  # no fused ops, no plan
    monkeypatch.setenv("BATON_CPU_LINEAR", "onednn")  # another matmul: the weights are not in panels
    assert _engine(tiny_model_dir).model.decode_step is None


def test_bad_input_is_refused_before_anything_is_written(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    out = _decode_batch(engine, [[3, 4, 5] * 10])
    runner, model = engine.runner, engine.model
    assert model.decode_step is not None
    decodes, keys = order_decodes(out.scheduled)
    input_ids, positions, slots = runner._flat_inputs(decodes)
    meta = runner._metadata([], decodes, slots, keys)
    before = engine.pool.kv.clone()
    with pytest.raises(ValueError, match="one contiguous int64 per row"):
        model.decode_step(input_ids, positions.to(torch.int32), meta, engine.pool)
    with pytest.raises(ValueError, match="decode rows only"):
        model.decode_step(torch.cat([input_ids, input_ids]), torch.cat([positions, positions]), meta, engine.pool)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.decode_step(input_ids + model.cfg.vocab_size, positions, meta, engine.pool)
    far = positions + engine.model.rope.max_len  # outside the RoPE tables: the kernel refuses it
    with pytest.raises(ValueError, match="outside the RoPE tables"):
        model.decode_step(input_ids, far, meta, engine.pool)
    assert torch.equal(engine.pool.kv, before)
