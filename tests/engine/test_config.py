"""ModelConfig: real config.json files of each family parse; every malformed field is refused by name."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from engine.config import ModelConfig, RopeScaling
from engine.errors import ConfigError, UnsupportedModelError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Verbatim (minus cosmetic keys) from the published checkpoints.
LLAMA31_8B_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
# The same model as transformers 5.x writes it.
LLAMA31_8B_V5 = {
    **{
        k: v
        for k, v in LLAMA31_8B_V4.items()
        if k not in ("rope_scaling", "rope_theta", "torch_dtype")
    },
    "rope_parameters": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "dtype": "bfloat16",
    "head_dim": 128,
    "transformers_version": "5.23.0",
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 32000,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}
MISTRAL_7B_V02 = {**MISTRAL_7B_V01, "rope_theta": 1000000.0, "sliding_window": None}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DROP = object()  # marks a key to delete in `changed`


def changed(base: dict[str, object], **changes: object) -> dict[str, object]:
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        if value is DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    "raw", [LLAMA31_8B_V4, LLAMA31_8B_V5], ids=["rope_scaling", "rope_parameters"]
)
def test_llama31_both_layouts_give_the_same_config(raw: dict[str, object]) -> None:
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg == ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        max_model_len=131072,
        rms_norm_eps=1e-05,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        torch_dtype="bfloat16",
    )


def test_llama2_plain_rope() -> None:
    cfg = ModelConfig.from_hf_dict(LLAMA2_7B)
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads) == ("llama", 128, 32)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0  # transformers' default
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.max_model_len == 4096 and cfg.torch_dtype == "float16"


def test_linear_scaling_in_legacy_type_key() -> None:
    cfg = ModelConfig.from_hf_dict(
        changed(LLAMA2_7B, rope_scaling={"type": "linear", "factor": 4.0})
    )
    assert cfg.rope_scaling == RopeScaling(kind="linear", factor=4.0)


def test_mistral_window_caps_max_model_len(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.config"):
        cfg = ModelConfig.from_hf_dict(MISTRAL_7B_V01)
    assert cfg.architecture == "mistral" and cfg.max_position_embeddings == 32768
    assert cfg.max_model_len == 4096
    assert any("sliding_window=4096" in r.getMessage() for r in caplog.records)


def test_mistral_null_window_is_full_attention() -> None:
    cfg = ModelConfig.from_hf_dict(MISTRAL_7B_V02)
    assert cfg.max_model_len == 32768 and cfg.rope_theta == 1e6


def test_mistral_absent_window_uses_transformers_default() -> None:
    assert (
        ModelConfig.from_hf_dict(changed(MISTRAL_7B_V02, sliding_window=DROP)).max_model_len == 4096
    )


def test_qwen2_has_bias_and_ties() -> None:
    cfg = ModelConfig.from_hf_dict(QWEN25_05B)
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (14, 2, 64)
    assert cfg.max_model_len == 32768  # use_sliding_window: false
    assert cfg.eos_token_ids == (151645,) and cfg.rms_norm_eps == 1e-06


@pytest.mark.parametrize(
    ("changes", "max_model_len"),
    [
        ({"use_sliding_window": True, "sliding_window": 4096}, 4096),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 24}, 32768),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4096,
                "layer_types": ["full_attention"] * 23 + ["sliding_attention"],
            },
            4096,
        ),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4096,
                "layer_types": ["full_attention"] * 24,
            },
            32768,
        ),
        ({"use_sliding_window": True, "sliding_window": 65536}, 32768),
    ],
)
def test_qwen2_sliding_window(changes: dict[str, object], max_model_len: int) -> None:
    assert ModelConfig.from_hf_dict(changed(QWEN25_05B, **changes)).max_model_len == max_model_len


def test_model_type_alone_is_enough() -> None:
    cfg = ModelConfig.from_hf_dict(changed(LLAMA2_7B, architectures=DROP))
    assert cfg.architecture == "llama"


def test_explicit_head_dim_need_not_divide_hidden() -> None:
    cfg = ModelConfig.from_hf_dict(changed(MISTRAL_7B_V02, hidden_size=5120, head_dim=128))
    assert cfg.head_dim == 128 and cfg.hidden_size == 5120


def test_agrees_with_transformers_config_classes() -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    for raw, cls in (
        (LLAMA31_8B_V4, LlamaConfig),
        (MISTRAL_7B_V01, MistralConfig),
        (QWEN25_05B, Qwen2Config),
    ):
        kwargs: dict[str, Any] = dict(raw)
        ours = ModelConfig.from_hf_dict(raw)
        theirs = ModelConfig.from_hf_dict(cls(**kwargs).to_dict())  # the 5.x layout
        assert ours == theirs


CONFIG_ERRORS = [
    (changed(LLAMA2_7B, hidden_size=DROP), "hidden_size"),
    (changed(LLAMA2_7B, vocab_size=DROP), "vocab_size"),
    (changed(LLAMA2_7B, num_hidden_layers=DROP), "num_hidden_layers"),
    (changed(LLAMA2_7B, rms_norm_eps=DROP), "rms_norm_eps"),
    (changed(LLAMA2_7B, max_position_embeddings=DROP), "max_position_embeddings"),
    (changed(LLAMA2_7B, hidden_size="4096"), "hidden_size"),
    (changed(LLAMA2_7B, hidden_size=4096.0), "hidden_size"),
    (changed(LLAMA2_7B, num_hidden_layers=True), "num_hidden_layers"),
    (changed(LLAMA2_7B, intermediate_size=-11008), "intermediate_size"),
    (changed(LLAMA2_7B, vocab_size=0), "vocab_size"),
    (changed(LLAMA2_7B, num_key_value_heads=-8), "num_key_value_heads"),
    (changed(LLAMA2_7B, num_key_value_heads=12), "num_key_value_heads"),
    (changed(LLAMA2_7B, hidden_size=4100), "hidden_size"),
    (changed(LLAMA2_7B, head_dim=63), "head_dim"),
    (changed(LLAMA2_7B, rms_norm_eps=0), "rms_norm_eps"),
    (changed(LLAMA2_7B, rms_norm_eps="1e-5"), "rms_norm_eps"),
    (changed(LLAMA2_7B, rope_theta=float("nan")), "rope_theta"),
    (changed(LLAMA2_7B, rope_theta=False), "rope_theta"),
    (changed(LLAMA2_7B, tie_word_embeddings="false"), "tie_word_embeddings"),
    (changed(LLAMA2_7B, eos_token_id="</s>"), "eos_token_id"),
    (changed(LLAMA2_7B, eos_token_id=[2, -1]), "eos_token_id"),
    (changed(LLAMA2_7B, eos_token_id=True), "eos_token_id"),
    (changed(LLAMA2_7B, bos_token_id=1.5), "bos_token_id"),
    (changed(LLAMA2_7B, torch_dtype=16), "torch_dtype"),
    (changed(LLAMA2_7B, hidden_act=DROP, hidden_activation=3), "hidden_activation"),
    (changed(LLAMA2_7B, architectures="LlamaForCausalLM"), "architectures"),
    (changed(LLAMA2_7B, architectures=DROP, model_type=DROP), "architectures"),
    (changed(LLAMA2_7B, model_type="mistral"), "model_type"),
    (changed(LLAMA2_7B, rope_scaling=[8.0]), "rope_scaling"),
    (changed(LLAMA2_7B, rope_scaling={"type": "linear"}), "rope_scaling.factor"),
    (changed(LLAMA2_7B, rope_scaling={"type": "linear", "factor": "4"}), "rope_scaling.factor"),
    (
        changed(
            LLAMA31_8B_V5,
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
        ),
        "rope_parameters.low_freq_factor",
    ),
    (
        changed(
            LLAMA31_8B_V5,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
            },
        ),
        "rope_parameters.high_freq_factor",
    ),
    (
        changed(LLAMA31_8B_V5, rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
        "rope_parameters.rope_theta",
    ),
    (changed(MISTRAL_7B_V01, sliding_window=0), "sliding_window"),
    (changed(QWEN25_05B, use_sliding_window="yes"), "use_sliding_window"),
    (changed(QWEN25_05B, use_sliding_window=True, layer_types="sliding"), "layer_types"),
]


@pytest.mark.parametrize(("raw", "field"), CONFIG_ERRORS)
def test_malformed_field_is_named(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(raw)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


UNSUPPORTED = [
    (
        changed(LLAMA2_7B, architectures=["GPT2LMHeadModel"]),
        ["GPT2LMHeadModel", "LlamaForCausalLM"],
    ),
    (changed(LLAMA2_7B, architectures=DROP, model_type="qwen3"), ["qwen3", "Qwen2ForCausalLM"]),
    (
        changed(LLAMA2_7B, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        ["rope_scaling.rope_type", "yarn"],
    ),
    (
        changed(LLAMA2_7B, rope_scaling={"type": "dynamic", "factor": 2.0}),
        ["rope_scaling.type", "dynamic"],
    ),
    (
        changed(LLAMA31_8B_V5, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
        ["rope_parameters.rope_type", "longrope"],
    ),
    (changed(LLAMA2_7B, hidden_act="gelu"), ["hidden_act", "gelu", "silu"]),
    (
        changed(LLAMA2_7B, hidden_act=DROP, hidden_activation="gelu_pytorch_tanh"),
        ["hidden_activation"],
    ),
    (changed(LLAMA2_7B, mlp_bias=True), ["mlp_bias"]),
    (changed(LLAMA2_7B, attention_bias=True), ["attention_bias"]),
    (
        changed(LLAMA2_7B, quantization_config={"quant_method": "gptq", "bits": 4}),
        ["quantization_config", "gptq"],
    ),
    (changed(LLAMA2_7B, partial_rotary_factor=0.5), ["partial_rotary_factor"]),
]


@pytest.mark.parametrize(("raw", "words"), UNSUPPORTED)
def test_unsupported_model_is_refused_by_name(raw: dict[str, object], words: list[str]) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf_dict(raw)
    for word in words:
        assert word in str(info.value)


def test_from_dir_reads_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_hf_dict(QWEN25_05B)


def test_from_dir_malformed_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 4096,,}')
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    assert info.value.field == "config.json"
    assert "not valid JSON" in str(info.value) and "line 1" in str(info.value)


@pytest.mark.parametrize("text", ["[1, 2]", "\xff\xfe", ""])
def test_from_dir_not_an_object(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    assert info.value.field == "config.json"


def test_from_dir_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path / "nope")


def test_from_dir_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(changed(LLAMA2_7B, hidden_size=-1)))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    assert info.value.field == "hidden_size" and str(tmp_path / "config.json") in str(info.value)
    assert "found -1" in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps(changed(LLAMA2_7B, hidden_act="relu")))
    with pytest.raises(UnsupportedModelError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_attention_backend_resolves_by_device_and_is_validated() -> None:
    import torch

    from engine.engine_config import EngineConfig

    assert EngineConfig().resolve_attention_backend(torch.float32) == "cpu"  # the kernel builds here
    assert EngineConfig().resolve_attention_backend(torch.bfloat16) == "torch"
    assert EngineConfig(attention_backend="torch").resolve_attention_backend() == "torch"
    assert EngineConfig(attention_backend="triton").resolve_attention_backend() == "triton"
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="cpu", device="cuda")
    with pytest.raises(ConfigError, match="bfloat16"):
        EngineConfig(attention_backend="cpu").resolve_attention_backend(torch.bfloat16)
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=-1)


def test_the_kv_dtype_defaults_to_the_models_and_a_narrower_one_is_widened_as_read() -> None:
    import torch

    from engine.engine_config import EngineConfig

    assert EngineConfig().resolve_kv_dtype(torch.float32) == torch.float32
    half = EngineConfig(kv_cache_dtype="bfloat16")
    assert half.resolve_kv_dtype(torch.float32) == torch.bfloat16
    assert half.resolve_attention_backend(torch.float32, torch.bfloat16) == "cpu"  # its own build of the kernel
    assert EngineConfig(kv_cache_dtype="float16", attention_backend="torch").resolve_attention_backend(
        torch.float32, torch.float16
    ) == "torch"
    with pytest.raises(ConfigError, match="kv_cache_dtype float16 attends on the torch or cpu path"):
        EngineConfig(kv_cache_dtype="float16", attention_backend="triton").resolve_attention_backend(
            torch.float32, torch.float16
        )
    with pytest.raises(ConfigError, match="cpu kernel computes in float32"):
        EngineConfig(kv_cache_dtype="float32", attention_backend="cpu").resolve_attention_backend(
            torch.bfloat16, torch.float32
        )
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
