"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Plain tensors and one linear (engine.linear: oneDNN's on CPU float32, else `F.linear`), no
framework: the weights are a dict loaded from safetensors, with q/k/v and gate/up fused at load
time so each layer runs four matmuls. Numerics follow
Hugging Face's modeling code (RMSNorm in float32, RoPE tables in float32) so greedy tokens
match `transformers` under the parity contract.

    forward(input_ids [T], positions [T], attn_meta) -> hidden [T, hidden]
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] (float32)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.attention import AttnMetadata, paged_attention, write_kv
from engine.config import ModelConfig
from engine.linear import prepare, select_linear
from engine.rope import RotaryEmbedding, apply_rotary
from kvcache.pool import DevicePool


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class FusedOps(Protocol):
    """A layer's elementwise work in three fused calls: engine.triton_ops (CUDA) or
    engine.cpu_ops.CpuOps (CPU), same signatures and roundings."""

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, /) -> torch.Tensor: ...
    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, /) -> torch.Tensor: ...  # fmt: skip
    def silu_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor: ...


class DecodeStep(Protocol):
    """A decode-only step's layers in one call (engine.cpu_decode): CausalLM.forward's result."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, pool: DevicePool, /) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class CausalLM:
    """One model's weights and its forward pass; the KV pool is owned by the caller."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.layers = [self._fuse_layer(weights, i) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg, device)
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.linear = select_linear(device, self.embed.dtype)  # baton's panel kernel on CPU float32 (engine.linear)
        # Each projection in the layout the linear reads fastest (column panels on CPU float32,
        # flat: those tensors are for self.linear only, their shape is not [out, in]). A tied LM
        # head gets its own copy; the embedding stays as it is for the lookup.
        self.lm_head = prepare(self.linear, self.lm_head)
        self.layers = [
            dataclasses.replace(layer, qkv=prepare(self.linear, layer.qkv), o=prepare(self.linear, layer.o),
                                gate_up=prepare(self.linear, layer.gate_up), down=prepare(self.linear, layer.down))
            for layer in self.layers
        ]  # fmt: skip
        # The elementwise work in fused kernels (FusedOps): engine.triton_ops on CUDA with the
        # triton attention backend, engine.cpu_ops on CPU float32 with the cpu one; the engine
        # sets it. None: the torch ops below.
        self.fused_ops: FusedOps | None = None
        # A decode-only step's layers in one compiled call (engine.cpu_decode), where the engine
        # found every kernel it drives to be the model's own; None: the layers from Python.
        self.decode_step: DecodeStep | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def _fuse_layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
        bias = None
        if self.cfg.attention_bias:
            bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"], dim=0)
        gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], dim=0)
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=qkv.contiguous(),
            qkv_bias=bias,
            o=w[p + "self_attn.o_proj.weight"],
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=gate_up.contiguous(),
            down=w[p + "mlp.down_proj.weight"],
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        pool: DevicePool,
    ) -> torch.Tensor:
        if self.decode_step is not None and meta.cpu_plan is not None and not meta.num_prefill_tokens:
            return self.decode_step(input_ids, positions, meta, pool)
        if self.fused_ops is not None:
            return self._forward_fused(self.fused_ops, input_ids, positions, meta, pool)
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        cos, sin = self.rope.cos_sin(positions)  # [T, head_dim] each
        for idx, layer in enumerate(self.layers):
            residual = h
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = self.linear(x, layer.qkv, layer.qkv_bias)  # [T, q + 2 kv]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = pool.layer(idx)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k_cache, v_cache, meta)  # [T, heads, head_dim]
            h = residual + self.linear(attn.reshape(-1, self.q_size), layer.o)
            residual = h
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = self.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = residual + self.linear(F.silu(gate).mul_(up), layer.down)  # the product in SiLU's own buffer: one activation fewer
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def _forward_fused(
        self,
        ops: FusedOps,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        pool: DevicePool,
    ) -> torch.Tensor:
        """The same layers with nine calls each: the residual add fused into the next
        RMSNorm, RoPE fused with the KV write, SiLU fused with the up product."""
        add_rms_norm, rope_and_cache, silu_mul = ops.add_rms_norm, ops.rope_and_cache, ops.silu_mul
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = F.embedding(input_ids, self.embed)  # [T, hidden]: the residual stream, updated in place
        delta: torch.Tensor | None = None
        for idx, layer in enumerate(self.layers):
            x = add_rms_norm(h, delta, layer.input_norm, eps)
            qkv = self.linear(x, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = pool.layer(idx)
            q = rope_and_cache(
                qkv, self.rope.cos, self.rope.sin, positions, meta.slot_mapping, k_cache, v_cache, cfg.num_heads
            )
            attn = paged_attention(q, k_cache, v_cache, meta)
            x = add_rms_norm(h, self.linear(attn.reshape(-1, self.q_size), layer.o), layer.post_norm, eps)
            delta = self.linear(silu_mul(self.linear(x, layer.gate_up)), layer.down)
        return add_rms_norm(h, delta, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.lm_head).float()  # [N, vocab]


def fused_ops_for(backend: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> FusedOps | None:
    """The model's fused elementwise kernels for this attention backend: Triton's on CUDA, the
    compiled CPU ones for a float32 model on the cpu backend (its library is already built:
    the backend was resolved by loading it); else None, the torch ops."""
    if backend == "triton" and device.type == "cuda":
        from engine import triton_ops

        return triton_ops
    if backend == "cpu" and device.type == "cpu" and dtype == torch.float32:
        from engine.cpu_ops import CpuOps

        return CpuOps(kv_dtype)
    return None
