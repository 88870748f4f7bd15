"""load_state_dict: small random safetensors checkpoints load exactly; bad ones are refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.errors import CheckpointError, ConfigError
from engine.loader import expected_shapes, load_state_dict, parse_dtype

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}
TINY_QWEN2 = {**TINY, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True}


def tiny(raw: dict[str, object] = TINY) -> ModelConfig:
    return ModelConfig.from_hf_dict(raw)


def random_weights(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def write_sharded(model_dir: Path, weights: dict[str, torch.Tensor], num_shards: int = 2) -> None:
    names = sorted(weights)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::num_shards]}
        save_file(part, str(model_dir / shard))
        weight_map.update({n: shard for n in part})
    write_index(model_dir, weight_map)


def write_index(model_dir: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def assert_same(loaded: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name


def test_expected_shapes_follow_the_config() -> None:
    shapes = expected_shapes(tiny())
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (32, 32)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (16, 32)  # 2 kv heads x 8
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (32, 32)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (32, 48)
    assert shapes["lm_head.weight"] == (64, 32)
    assert len(shapes) == 1 + 2 * 9 + 2
    qwen = expected_shapes(tiny(TINY_QWEN2))
    assert qwen["model.layers.0.self_attn.v_proj.bias"] == (16,)
    assert len(qwen) == 1 + 2 * 12 + 2


def test_single_file(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = load_state_dict(tmp_path, cfg, torch.float32)
    assert set(loaded) == set(expected_shapes(cfg))
    assert_same(loaded, weights)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in loaded.values())


def test_sharded_with_index(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    write_sharded(tmp_path, weights, num_shards=3)
    loaded = load_state_dict(tmp_path, cfg, torch.float32)
    assert set(loaded) == set(weights)
    assert_same(loaded, weights)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    cfg = tiny({**TINY, "tie_word_embeddings": True})
    save_file(random_weights(cfg), str(tmp_path / "model.safetensors"))
    loaded = load_state_dict(tmp_path, cfg, torch.float32)
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]


def test_tied_checkpoint_with_saved_lm_head_uses_embedding(tmp_path: Path) -> None:
    cfg = tiny({**TINY, "tie_word_embeddings": True})
    weights = random_weights(cfg)
    weights["lm_head.weight"] = torch.zeros(64, 32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = load_state_dict(tmp_path, cfg, torch.float32)
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]


def test_qwen2_biases(tmp_path: Path) -> None:
    cfg = tiny(TINY_QWEN2)
    weights = random_weights(cfg)
    write_sharded(tmp_path, weights)
    loaded = load_state_dict(tmp_path, cfg, torch.float32)
    assert torch.equal(
        loaded["model.layers.1.self_attn.k_proj.bias"],
        weights["model.layers.1.self_attn.k_proj.bias"],
    )
    del weights["model.layers.1.self_attn.k_proj.bias"]
    for f in tmp_path.iterdir():
        f.unlink()
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_state_dict(tmp_path, cfg, torch.float32)


@pytest.mark.parametrize(
    ("stored", "wanted"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_dtype_conversion(tmp_path: Path, stored: torch.dtype, wanted: torch.dtype) -> None:
    cfg = tiny()
    weights = random_weights(cfg, stored)
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = load_state_dict(tmp_path, cfg, wanted, device=torch.device("cpu"))
    assert all(t.dtype == wanted for t in loaded.values())
    assert_same(loaded, weights)


def test_buffers_are_ignored_and_extra_parameters_refused(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    weights["model.layers.0.some_buffer"] = torch.ones(4)
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = load_state_dict(tmp_path, cfg, torch.float32)
    assert "model.layers.0.some_buffer" not in loaded
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.ones(32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"
    ):
        load_state_dict(tmp_path, cfg, torch.float32)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_state_dict(tmp_path, cfg, torch.float32)
    message = str(info.value)
    assert (
        "model.layers.1.mlp.up_proj.weight" in message
        and "[47, 32]" in message
        and "[48, 32]" in message
    )


def test_missing_tensor(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    del weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is missing.*\[32\]"):
        load_state_dict(tmp_path, cfg, torch.float32)


def test_quantized_tensor_refused(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    weights["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(48, 32, dtype=torch.int8)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight' is stored as I8"):
        load_state_dict(tmp_path, cfg, torch.float32)


def test_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_state_dict(tmp_path, tiny(), torch.float32)


_OPENED: list[tuple[str, str]] | None = None  # (event, path) seen while a test watches


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _OPENED is not None and event in ("open", "os.open", "pickle.find_class"):
        _OPENED.append((event, str(args[0]) if args else ""))


def test_pickle_only_dir_is_refused_without_opening_it(tmp_path: Path) -> None:
    global _OPENED
    if _audit not in getattr(sys, "_baton_hooks", ()):
        sys.addaudithook(_audit)  # audit hooks cannot be removed; _OPENED gates this one
        sys._baton_hooks = (*getattr(sys, "_baton_hooks", ()), _audit)  # type: ignore[attr-defined]
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 arbitrary bytes, never unpickled")
    (tmp_path / "extra.pt").write_bytes(b"\x80\x04")
    _OPENED = []
    try:
        (tmp_path / "config.json").read_text()  # proves the hook sees opens
        with pytest.raises(CheckpointError) as info:
            load_state_dict(tmp_path, tiny(), torch.float32)
        opened = list(_OPENED)
    finally:
        _OPENED = None
    assert any(path.endswith("config.json") for _, path in opened)
    assert not any(path.endswith((".bin", ".pt")) for _, path in opened)
    assert not any(event == "pickle.find_class" for event, _ in opened)
    message = str(info.value)
    assert "pytorch_model.bin" in message and "only safetensors" in message
    assert "save_pretrained" in message


def test_missing_shard(tmp_path: Path) -> None:
    cfg = tiny()
    write_sharded(tmp_path, random_weights(cfg))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_state_dict(tmp_path, cfg, torch.float32)


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors", ""],
)
def test_index_path_traversal_refused(tmp_path: Path, shard: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    cfg = tiny()
    weights = random_weights(cfg)
    save_file(weights, str(tmp_path / "outside.safetensors"))  # a real file, reachable by ".."
    write_index(model_dir, {name: shard for name in weights})
    with pytest.raises(CheckpointError, match="points outside"):
        load_state_dict(model_dir, cfg, torch.float32)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    cfg = tiny()
    weights = random_weights(cfg)
    save_file(weights, str(tmp_path / "a.safetensors"))
    write_index(
        tmp_path, {**{n: "a.safetensors" for n in weights}, "model.extra.weight": "a.safetensors"}
    )
    with pytest.raises(CheckpointError, match=r"'model\.extra\.weight'.*not there"):
        load_state_dict(tmp_path, cfg, torch.float32)


@pytest.mark.parametrize("text", ["{", "[]", '{"weight_map": {}}', '{"weight_map": {"a": 3}}'])
def test_malformed_index(tmp_path: Path, text: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_state_dict(tmp_path, tiny(), torch.float32)


def test_empty_and_missing_dirs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(CheckpointError, match="no weights found"):
        load_state_dict(tmp_path, tiny(), torch.float32)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_state_dict(tmp_path / "nope", tiny(), torch.float32)


def test_non_hf_safetensors_name_refused(tmp_path: Path) -> None:
    save_file(random_weights(tiny()), str(tmp_path / "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match="consolidated.safetensors"):
        load_state_dict(tmp_path, tiny(), torch.float32)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("torch.bfloat16", torch.bfloat16),
    ],
)
def test_parse_dtype(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) == dtype


@pytest.mark.parametrize("name", ["auto", "int8", "float64", ""])
def test_parse_dtype_unknown(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_dtype(name)
    assert info.value.field == "dtype" and "bfloat16" in str(info.value)
