"""RotaryEmbedding / apply_rotary are bit-identical to transformers' Llama rotary embedding."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.rope import RotaryEmbedding, apply_rotary, compute_inv_freq

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
}
ROPES: dict[str, dict[str, Any]] = {
    "default": {"max_position_embeddings": 4096, "rope_theta": 10000.0},
    "linear": {
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    },
    "llama3": {
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
POSITIONS = torch.arange(4096, dtype=torch.int64)


def _configs(kind: str) -> tuple[ModelConfig, torch.nn.Module]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {**BASE, **ROPES[kind]}
    return ModelConfig.from_hf_dict(raw), LlamaRotaryEmbedding(LlamaConfig(**raw))


def _hf_cos_sin(
    hf: torch.nn.Module, positions: torch.Tensor, dtype: torch.dtype, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, 1, positions.numel(), head_dim, dtype=dtype)
    cos, sin = hf(x, positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("kind", list(ROPES))
def test_inv_freq_matches_transformers(kind: str) -> None:
    cfg, hf = _configs(kind)
    ours = compute_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours, hf.get_buffer("inv_freq"))


@pytest.mark.parametrize("kind", list(ROPES))
def test_cos_sin_table_is_bit_exact(kind: str) -> None:
    cfg, hf = _configs(kind)
    rope = RotaryEmbedding(cfg)
    assert rope.cos.shape == (cfg.max_model_len, cfg.head_dim) and rope.cos.dtype == torch.float32
    far = torch.randint(0, cfg.max_model_len, (64,), generator=torch.Generator().manual_seed(0))
    for positions in (POSITIONS, far, POSITIONS.flip(0)[:100]):
        cos, sin = rope.cos_sin(positions)
        hf_cos, hf_sin = _hf_cos_sin(hf, positions, torch.float32, cfg.head_dim)
        assert cos.shape == (positions.numel(), cfg.head_dim)
        assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_scaling_changes_the_table() -> None:
    default = RotaryEmbedding(_configs("default")[0]).cos_sin(POSITIONS)[0]
    linear = RotaryEmbedding(_configs("linear")[0]).cos_sin(POSITIONS)[0]
    assert not torch.equal(default, linear)


@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_is_bit_exact(kind: str, dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg, hf = _configs(kind)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(POSITIONS), cfg.num_heads, cfg.head_dim, generator=gen).to(dtype)
    k = torch.randn(len(POSITIONS), cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    cos, sin = RotaryEmbedding(cfg).cos_sin(POSITIONS)
    hf_cos, hf_sin = _hf_cos_sin(hf, POSITIONS, dtype, cfg.head_dim)
    # transformers' layout is [batch, heads, T, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos[None], hf_sin[None]
    )
    ours_q, ours_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert ours_q.dtype == dtype
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))
    assert not torch.equal(ours_q, q)
