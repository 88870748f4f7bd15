"""The fused CUDA-path kernels against the torch path, on CPU under Triton's interpreter.

Same roundings as torch: float32 results must be equal, not merely close. bfloat16 is checked
to a few units in the last place only, because the interpreter emulates bf16 casts by truncation
where the GPU rounds to nearest even (on the device, bench/gpu_check.py reports bf16
agreement with the torch path's tokens). And a whole engine running the fused forward and the Triton decode kernel must produce the
plain engine's greedy tokens.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when triton and the kernels are first imported
pytest.importorskip("triton")

from engine.attention import write_kv  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.model import rms_norm  # noqa: E402
from engine.rope import apply_rotary  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def ops() -> Iterator[ModuleType]:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor  # see test_triton_attention.py

    def patch(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    import engine.triton_attention as attention_mod
    import engine.triton_ops as mod

    importlib.reload(attention_mod)
    yield importlib.reload(mod)
    interpreter._patch_lang_tensor = original


DTYPES = [torch.float32, torch.bfloat16]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5)  # a few truncated ulps


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_the_residual_add_then_rms_norm(ops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 96, generator=gen).to(dtype)
    delta = torch.randn(5, 96, generator=gen).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    want_h = h + delta
    want = rms_norm(want_h, w, 1e-5)
    got_h = h.clone()
    got = ops.add_rms_norm(got_h, delta, w, 1e-5)
    _same(got_h, want_h)
    if dtype == torch.float32:
        _same(got, want)
    else:  # built on the (truncated) sum: compare with the kernel's own residual
        torch.testing.assert_close(got, rms_norm(got_h, w, 1e-5), rtol=2**-6, atol=2**-6)
    _same(ops.add_rms_norm(h.clone(), None, w, 1e-5), rms_norm(h, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_equals_apply_rotary_and_write_kv(ops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, hd, tokens, pages, page = 6, 2, 16, 7, 10, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=gen).to(dtype)
    angles = torch.rand(64, hd // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(pages * page, generator=gen)[:tokens]
    k_cache = torch.zeros(pages, page, kv_heads, hd, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    want_q = apply_rotary(q.reshape(tokens, heads, hd), cos[positions], sin[positions])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, apply_rotary(k.reshape(tokens, kv_heads, hd), cos[positions], sin[positions]),
             v.reshape(tokens, kv_heads, hd), slots)  # fmt: skip
    got_q = ops.rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads)
    _same(got_q, want_q)
    _same(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_times_up(ops: ModuleType, dtype: torch.dtype) -> None:
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ops.silu_mul(gate_up), want, rtol=1e-6 if dtype == torch.float32 else 2**-5, atol=1e-6 if dtype == torch.float32 else 2**-5)


def test_engine_on_the_fused_path_matches_the_plain_engine(ops: ModuleType, tiny_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128, num_pages=32)
    plain, fused = Engine(cfg), Engine(cfg)
    fused.model.fused_ops = ops  # type: ignore[assignment]
    fused.runner.decode_backend = "triton"
    prompts = [[3, 50, 900, 7] * 5, [11, 12]]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert fused.generate(prompts, greedy) == plain.generate(prompts, greedy)
    torch.testing.assert_close(fused.pool.kv, plain.pool.kv, rtol=1e-5, atol=1e-5)
