"""The fused CPU elementwise kernels (engine/cpu_ops.py, engine/csrc/fused_ops.c) against the
torch path, the reference: RoPE and the K/V write bit for bit (float32, bfloat16 and float16
pools), RMSNorm and SiLU x up to float32 rounding; bad input refused before anything is
written; a whole engine on the fused forward gives the torch forward's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention import write_kv
from engine.cpu_ops import CpuOps
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.model import rms_norm
from engine.rope import apply_rotary
from engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

ROWS = [1, 5, 300]  # a decode row, a few, a prefill chunk (past the kernels' threading threshold)


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    return CpuOps()  # the C compiler is part of the setup: it must build here


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_the_residual_add_then_rms_norm(ops: CpuOps, rows: int, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 256, generator=gen) * 3
    delta = torch.randn(rows, 256, generator=gen) if with_delta else None
    weight = torch.randn(256, generator=gen)
    summed = h + delta if delta is not None else h.clone()
    got = ops.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, summed)  # the residual stream, updated in place (an exact add)
    # the one difference from torch: the order the sum of squares is added in
    torch.testing.assert_close(got, rms_norm(summed, weight, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_is_silu_of_the_gate_times_up(ops: CpuOps, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1000, generator=gen) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])  # no overflow, no NaN
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.shape == (rows, 1000) and torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_and_cache_equals_rotary_then_write_kv_bit_for_bit(rows: int, kv_dtype: torch.dtype) -> None:
    heads, kv_heads, dim, pages, page = 4, 2, 64, 64, 16
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = torch.randn(500, dim, generator=gen), torch.randn(500, dim, generator=gen)
    positions = torch.randint(0, 500, (rows,), generator=gen)
    slots = torch.randperm(pages * page, generator=gen)[:rows]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_k, want_v = torch.zeros(pages, page, kv_heads, dim, dtype=kv_dtype), torch.zeros(pages, page, kv_heads, dim, dtype=kv_dtype)
    c, s = cos[positions], sin[positions]
    write_kv(want_k, want_v, apply_rotary(k.reshape(rows, kv_heads, dim), c, s), v.reshape(rows, kv_heads, dim), slots)
    k_cache, v_cache = torch.zeros_like(want_k), torch.zeros_like(want_v)
    got_q = CpuOps(kv_dtype).rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads)
    assert torch.equal(got_q, apply_rotary(q.reshape(rows, heads, dim), c, s))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # 16-bit: rounded as torch rounds


def test_rope_and_cache_reads_qkv_rows_with_a_stride(ops: CpuOps) -> None:
    """A view of wider rows (as a linear's output may be) is read where it lies."""
    wide = torch.randn(3, 512 + 32, generator=torch.Generator().manual_seed(4))
    qkv = wide[:, :512]
    cos, sin = torch.ones(10, 64), torch.zeros(10, 64)  # the identity rotation
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    q = ops.rope_and_cache(qkv, cos, sin, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]), k_cache, v_cache, 4)
    assert torch.equal(q, qkv[:, :256].reshape(3, 4, 64))
    assert torch.equal(k_cache.view(-1, 2, 64)[5:8], qkv[:, 256:384].reshape(3, 2, 64))


def test_bad_input_is_refused_before_anything_is_written(ops: CpuOps) -> None:
    qkv = torch.randn(2, 512)
    cos = sin = torch.randn(10, 64)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    pos, slots = torch.tensor([0, 1]), torch.tensor([0, 1])
    for bad_pos, bad_slots in ((torch.tensor([0, 10]), slots), (pos, torch.tensor([0, 64])), (pos, torch.tensor([-1, 0]))):
        with pytest.raises(ValueError, match="outside"):
            ops.rope_and_cache(qkv, cos, sin, bad_pos, bad_slots, k_cache, v_cache, 4)
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match="int64"):
        ops.rope_and_cache(qkv, cos, sin, pos.int(), slots, k_cache, v_cache, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.rope_and_cache(qkv, cos, sin, pos, slots, k_cache.bfloat16(), v_cache.bfloat16(), 4)
    with pytest.raises(ValueError, match="qkv"):
        ops.rope_and_cache(qkv[:, :500], cos, sin, pos, slots, k_cache, v_cache, 4)
    with pytest.raises(ValueError, match="float32"):
        ops.silu_mul(torch.randn(2, 8).double())
    with pytest.raises(ValueError, match="odd"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="shape"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)


def test_the_engine_runs_the_fused_forward_and_matches_the_torch_ops(tiny_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256, num_pages=48, attention_backend="cpu")
    fused, plain = Engine(cfg), Engine(cfg)
    assert isinstance(fused.model.fused_ops, CpuOps)
    plain.model.fused_ops = None
    plain.model.decode_step = None  # engine.cpu_decode drives the fused ops: off with them
    prompts = [[3, 50, 900, 7] * 30, [11, 12], [3, 50, 900, 7] * 30 + [5]]  # a prefix shared, a short one
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert fused.generate(prompts, greedy) == plain.generate(prompts, greedy)
    torch.testing.assert_close(fused.pool.kv, plain.pool.kv, rtol=1e-5, atol=1e-5)


def test_the_torch_backend_keeps_the_torch_ops(tiny_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128, num_pages=16, attention_backend="torch")
    assert Engine(cfg).model.fused_ops is None
