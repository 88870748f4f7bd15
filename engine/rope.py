"""Rotary position embeddings, bit-for-bit equal to Hugging Face transformers' in float32.

The cos/sin tables are computed once per model with the same float32 operations, in the same
order, as `LlamaRotaryEmbedding.forward` (an outer product of positions and inverse
frequencies, duplicated along the last axis, then cos/sin), so a table lookup returns exactly
the values transformers computes for those positions. The inverse frequencies are computed on
the CPU, as transformers does at construction, and only then moved to the device.

    inv_freq  [head_dim/2]             freqs = pos * inv_freq        [L, head_dim/2]
    emb = cat(freqs, freqs)  [L, head_dim]        cos, sin = emb.cos(), emb.sin()
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32 on the CPU, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling.kind == "default":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unknown RoPE kind {scaling.kind!r}")  # ModelConfig refuses it first


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`, expression for expression.

    Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band
    between is interpolated. The operand order is copied exactly: float32 rounding depends on it.
    """
    factor, low_freq_factor, high_freq_factor = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding:
    """cos/sin tables [max_model_len, head_dim] float32, looked up by position."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        inv_freq = compute_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        positions = torch.arange(cfg.max_model_len, dtype=torch.int64, device=device)
        # an elementwise product is what transformers computes (its older matmul with inner
        # dimension 1 is the same exact product)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [L, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, head_dim]
        # attention_scaling is 1.0 for default, linear and llama3 RoPE
        self.cos = emb.cos()
        self.sin = emb.sin()
        self.max_len = cfg.max_model_len

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] (each < max_model_len) -> (cos, sin), each [T, head_dim] float32."""
        return self.cos[positions], self.sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1), transformers' half-split convention."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, num_heads, head_dim] rotated by cos/sin [T, head_dim], in x's dtype.

    transformers casts cos/sin to the activations' dtype and computes in that dtype; doing the
    same keeps bfloat16 results identical too.
    """
    cos = cos.to(x.dtype).unsqueeze(1)  # [T, 1, head_dim]
    sin = sin.to(x.dtype).unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)
