"""Built-in random models: byte-identical creation, loadable by transformers, LM-head rows of
unemittable tokens zeroed, and the cache/path resolution."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from engine.builtin import (
    BUILTIN_SPECS,
    GENERATOR_VERSION,
    RandomModelSpec,
    create_model,
    resolve_model_dir,
    unemittable_token_ids,
)
from engine.errors import CheckpointError, ConfigError
from engine.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_QWEN2 = RandomModelSpec(
    architecture="qwen2",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    attention_bias=True,
    tie_word_embeddings=True,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    seed=7,
)


def digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


def test_creation_is_byte_identical(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = create_model(BUILTIN_SPECS["baton-tiny"], tmp_path / "again")
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert set(digests(tiny_model_dir)) == expected
    assert digests(again) == digests(tiny_model_dir)
    other_seed = create_model(replace(BUILTIN_SPECS["baton-tiny"], seed=1), tmp_path / "seed1")
    assert digests(other_seed)["model.safetensors"] != digests(again)["model.safetensors"]


def test_tensor_names_and_shapes(tiny_model_dir: Path) -> None:
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    assert len(tensors) == 1 + 4 * 9 + 2
    assert tensors["model.embed_tokens.weight"].shape == (16_384, 256)
    assert tensors["model.layers.3.self_attn.k_proj.weight"].shape == (128, 256)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (256, 1024)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert (tensors["model.norm.weight"] == 1.0).all()
    assert 0.015 < tensors["model.layers.1.mlp.up_proj.weight"].std() < 0.025


def test_unemittable_lm_head_rows_are_zero(tiny_model_dir: Path) -> None:
    lm_head = load_file(str(tiny_model_dir / "model.safetensors"))["lm_head.weight"]
    banned = unemittable_token_ids(16_384)
    assert banned[:4] == [0, 1, 2, 3]
    tok = Tokenizer.from_dir(tiny_model_dir)
    # a lone lead byte and a lone continuation byte are banned; whole characters are not
    assert tok.decode([banned[4]]) == "\ufffd"
    assert all("\ufffd" in tok.decode([i]) for i in banned[4:])
    assert (lm_head[banned] == 0.0).all()
    allowed = np.setdiff1d(np.arange(16_384), banned)
    assert (np.abs(lm_head[allowed]).max(axis=1) > 0).all()
    assert "\ufffd" not in tok.decode(allowed.tolist())


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    return model.eval()


def test_tiny_loads_in_transformers(hf_tiny: torch.nn.Module, tiny_model_dir: Path) -> None:
    assert type(hf_tiny).__name__ == "LlamaForCausalLM"
    config = hf_tiny.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (256, 4, 2)
    assert config.tie_word_embeddings is False
    assert sum(p.numel() for p in hf_tiny.parameters()) == 12_323_072  # ~12 M, as documented
    banned = set(unemittable_token_ids(16_384))
    prompt = torch.tensor([Tokenizer.from_dir(tiny_model_dir).encode("def main():\n")])
    with torch.no_grad():
        out = hf_tiny.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    new_ids = out[0, prompt.shape[1] :].tolist()
    assert len(new_ids) == 24 and not banned.intersection(new_ids)


def test_transformers_tokenizer_agrees(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = Tokenizer.from_dir(tiny_model_dir)
    for text in ["hello world", "def f(x):\n\treturn x", "日本語 🙂 e\u0301", "  a  b  ", ""]:
        assert hf_tok(text).input_ids == ours.encode(text)
        assert hf_tok(text, add_special_tokens=False).input_ids == ours.encode(text, False)
        assert hf_tok.decode(ours.encode(text), skip_special_tokens=True) == text
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(messages)
    # The tool section (cluster.edge.tool_calls' format) renders the same in transformers' Jinja.
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": {"x": i}}} for i in (1, 2)]
    messages += [{"role": "assistant", "content": "", "tool_calls": calls},
                 {"role": "tool", "content": "ok", "tool_call_id": "c1"}]  # fmt: skip
    rendered = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(messages, tools=tools)
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>\n<|tool|>\nok\n' in rendered
    assert hf_tok.eos_token_id == 2 and hf_tok.pad_token_id == 3


def test_qwen2_tied_biased_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    directory = create_model(TINY_QWEN2, tmp_path / "qwen2")
    names = set(load_file(str(directory / "model.safetensors")))
    assert "lm_head.weight" not in names
    assert "model.layers.1.self_attn.v_proj.bias" in names
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.rope_parameters["rope_type"] == "linear"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 500, 900, 1200]])).logits
    assert logits.shape == (1, 4, 16_384) and torch.isfinite(logits).all()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_llama3_rope_scaling_is_written_as_hf_does(tmp_path: Path) -> None:
    from transformers import AutoConfig

    scaling: dict[str, float | int | str] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    spec = replace(TINY_QWEN2, architecture="llama", attention_bias=True, rope_scaling=scaling)
    directory = create_model(spec, tmp_path / "llama3")
    assert json.loads((directory / "config.json").read_text())["rope_scaling"] == scaling
    config = AutoConfig.from_pretrained(directory)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 8.0
    assert config.attention_bias is True


def test_invalid_specs_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="attention_bias"):
        create_model(replace(TINY_QWEN2, attention_bias=False), tmp_path / "a")
    with pytest.raises(ConfigError, match="architecture"):
        create_model(replace(TINY_QWEN2, architecture="gpt2"), tmp_path / "b")
    with pytest.raises(ConfigError, match="vocab_size"):
        create_model(replace(TINY_QWEN2, vocab_size=1000), tmp_path / "c")
    assert not (tmp_path / "a").exists()


def test_resolve_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert tiny_model_dir.name == f"baton-tiny-v{GENERATOR_VERSION}"
    assert resolve_model_dir("baton-tiny") == tiny_model_dir
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(CheckpointError, match="neither a built-in model"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="baton-small, baton-tiny"):
        resolve_model_dir("baton-huge")


def test_racing_creators_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_dir("baton-tiny")))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    models = tmp_path / "models"
    assert len(set(results)) == 1 and len(results) == 3
    # one finished model, no temp directories left behind (only the lock file beside it)
    assert sorted(p.name for p in models.iterdir()) == [
        f".baton-tiny-v{GENERATOR_VERSION}.lock",
        f"baton-tiny-v{GENERATOR_VERSION}",
    ]
    assert len(digests(results[0])) == 5
