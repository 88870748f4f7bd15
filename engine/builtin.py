"""The built-in random-weight models, written as Hugging Face checkpoints.

`baton-tiny` and `baton-small` (BENCHMARKS.md "Models") are generated on first use into the
cache directory, byte-identical on every machine: the tokenizer is the committed asset and the
weights come from PCG64's raw 64-bit stream (stable across numpy versions, unlike the
distribution methods of `numpy.random.Generator`), turned into floats with exact IEEE
operations only. Tests use `RandomModelSpec` + `create_model` to make other shapes (Qwen2,
tied embeddings, RoPE scaling).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from engine import env
from engine.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

# Bump whenever the bytes a spec produces change (generator, asset, layout): the cache
# directory name carries it, so a stale cached model is never reused.
GENERATOR_VERSION = 2  # 2: the chat template's tool section

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_ASSET = ASSETS_DIR / "tokenizer.json"
CHAT_TEMPLATE_ASSET = ASSETS_DIR / "chat_template.jinja"

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, fixed by train_tokenizer.py
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

_LINEAR_STD = 0.02
_NORM_VALUE = 1.0
_BIAS_STD = 0.02
_SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    """Shape and seed of a random-weight checkpoint. `rope_scaling` is written to config.json
    as Hugging Face spells it (e.g. {"rope_type": "linear", "factor": 2.0}); being a mapping,
    it makes the spec unhashable when set."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    architecture: str = "llama"
    vocab_size: int = 16_384
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 8_192
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: Mapping[str, float | int | str] | None = None
    seed: int = 0
    # Std of the LM head (or of the embeddings when tied): large, so that the top-1/top-2
    # logit margins are wide and parity tests rarely meet a near-tie.
    lm_head_std: float = 0.5
    # Std of the layers' projections (and of untied embeddings). With tied embeddings, large
    # projections keep the layers' sum from being drowned by the token's own embedding (which
    # makes a model that echoes its input whatever attention computes).
    linear_std: float = _LINEAR_STD

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


BUILTIN_SPECS: dict[str, RandomModelSpec] = {
    "baton-tiny": RandomModelSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
    ),
    "baton-small": RandomModelSpec(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
    ),
}


def validate_spec(spec: RandomModelSpec) -> None:
    if spec.architecture not in _SUPPORTED_ARCHITECTURES:
        raise ConfigError("architecture", f"{spec.architecture!r} is not one of llama, qwen2")
    if spec.architecture == "qwen2" and not spec.attention_bias:
        # transformers' Qwen2 always has q/k/v biases; without them it would invent weights.
        raise ConfigError("attention_bias", "qwen2 always has q/k/v biases; set it to True")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ConfigError("num_key_value_heads", "must divide num_attention_heads")
    vocab = json.loads(TOKENIZER_ASSET.read_text(encoding="utf-8"))["model"]["vocab"]
    if spec.vocab_size < len(vocab):
        raise ConfigError("vocab_size", f"must be at least the tokenizer's {len(vocab)}")


def config_dict(spec: RandomModelSpec) -> dict[str, object]:
    """config.json as transformers writes it for LlamaForCausalLM / Qwen2ForCausalLM."""
    config: dict[str, object] = {
        "architectures": [_SUPPORTED_ARCHITECTURES[spec.architecture]],
        "model_type": spec.architecture,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": _LINEAR_STD,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling is not None else None,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if spec.architecture == "llama":
        config.update(attention_bias=spec.attention_bias, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
    return config


class _WeightStream:
    """Floats from PCG64's raw stream, using only exact IEEE float32 arithmetic.

    Each value is uniform on [-a, a) with a = std·√3 (the variance of N(0, std²)): 24 random
    bits → an exact float32 in [0, 1), then one multiply and one subtract — the same bits on
    every CPU and numpy version.
    """

    def __init__(self, seed: int) -> None:
        self._bits = np.random.PCG64(seed)

    def uniform(self, shape: tuple[int, ...], std: float) -> Float32Array:
        count = math.prod(shape)
        raw = self._bits.random_raw(count)
        unit = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
        half_width = np.float32(std * math.sqrt(3.0))
        values = (unit * np.float32(2.0) - np.float32(1.0)) * half_width
        return values.reshape(shape).astype(np.float32, copy=False)


def _layer_tensors(
    spec: RandomModelSpec, stream: _WeightStream, layer: int
) -> Iterator[tuple[str, Float32Array]]:
    """One decoder layer's tensors, in the fixed order that the generator draws them."""
    hidden, head_dim = spec.hidden_size, spec.resolved_head_dim
    q_out, kv_out = spec.num_attention_heads * head_dim, spec.num_key_value_heads * head_dim
    prefix = f"model.layers.{layer}"
    for proj, out_features in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        yield (
            f"{prefix}.self_attn.{proj}.weight",
            stream.uniform((out_features, hidden), spec.linear_std),
        )
        if spec.attention_bias:
            yield f"{prefix}.self_attn.{proj}.bias", stream.uniform((out_features,), _BIAS_STD)
    yield f"{prefix}.self_attn.o_proj.weight", stream.uniform((hidden, q_out), spec.linear_std)
    inter = spec.intermediate_size
    yield f"{prefix}.mlp.gate_proj.weight", stream.uniform((inter, hidden), spec.linear_std)
    yield f"{prefix}.mlp.up_proj.weight", stream.uniform((inter, hidden), spec.linear_std)
    yield f"{prefix}.mlp.down_proj.weight", stream.uniform((hidden, inter), spec.linear_std)
    norm = np.full((hidden,), _NORM_VALUE, dtype=np.float32)
    yield f"{prefix}.input_layernorm.weight", norm
    yield f"{prefix}.post_attention_layernorm.weight", norm.copy()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character → byte map (the inverse of `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def unemittable_token_ids(vocab_size: int) -> list[int]:
    """Ids greedy decoding must never pick: the special tokens, every byte-level token whose
    bytes are not complete UTF-8 (it would merge with its neighbour into one stream chunk),
    and padding rows past the tokenizer's vocabulary."""
    vocab: dict[str, int] = json.loads(TOKENIZER_ASSET.read_text(encoding="utf-8"))["model"][
        "vocab"
    ]
    byte_of = _byte_decoder()
    ids = set(range(len(SPECIAL_TOKENS))) | set(range(len(vocab), vocab_size))
    for token, token_id in vocab.items():
        if token in SPECIAL_TOKENS:
            continue
        try:
            bytes(byte_of[ch] for ch in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            ids.add(token_id)
    return sorted(ids)


def generate_weights(spec: RandomModelSpec) -> dict[str, Float32Array]:
    """All tensors, Hugging Face names, drawn in a fixed order from the spec's seed."""
    stream = _WeightStream(spec.seed)
    hidden = spec.hidden_size
    embed_std = spec.lm_head_std if spec.tie_word_embeddings else spec.linear_std
    tensors = {"model.embed_tokens.weight": stream.uniform((spec.vocab_size, hidden), embed_std)}
    for layer in range(spec.num_hidden_layers):
        tensors.update(_layer_tensors(spec, stream, layer))
    tensors["model.norm.weight"] = np.full((hidden,), _NORM_VALUE, dtype=np.float32)
    if not spec.tie_word_embeddings:
        # Tied heads keep every row: zeroing one would also zero that token's embedding.
        lm_head = stream.uniform((spec.vocab_size, hidden), spec.lm_head_std)
        lm_head[unemittable_token_ids(spec.vocab_size)] = 0.0
        tensors["lm_head.weight"] = lm_head
    return tensors


def _tokenizer_config(spec: RandomModelSpec) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE_ASSET.read_text(encoding="utf-8"),
    }


def _write_json(path: Path, value: Mapping[str, object]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def create_model(spec: RandomModelSpec, out_dir: Path) -> Path:
    """Write a complete Hugging Face checkpoint for `spec` into `out_dir` (created if needed)."""
    from safetensors.numpy import save_file

    validate_spec(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config_dict(spec))
    weights_path = out_dir / "model.safetensors"
    save_file(generate_weights(spec), str(weights_path), metadata={"format": "pt"})
    # safetensors creates the file private (0600); give it the umask's mode like the others.
    shutil.copymode(out_dir / "config.json", weights_path)
    shutil.copyfile(TOKENIZER_ASSET, out_dir / "tokenizer.json")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(spec))
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    _write_json(out_dir / "generation_config.json", generation)
    return out_dir


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as file:
            os.fsync(file.fileno())


def _create_cached(name: str, final: Path) -> None:
    """Create a built-in model exactly once, even with several processes racing: whoever
    holds the lock builds into a temp dir beside the target and renames it into place, so the
    target directory exists only when complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            if final.is_dir():
                return  # another process finished while we waited
            for stale in final.parent.glob(f".{final.name}.*.*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed creator
            # Not tempfile.mkdtemp: its 0700 mode would stick to the shared cache entry.
            tmp = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}"
            tmp.mkdir()
            try:
                logger.info("creating built-in model %s in %s", name, final)
                create_model(BUILTIN_SPECS[name], tmp)
                _fsync_files(tmp)  # a crash must not leave a complete-looking, torn model
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def resolve_model_dir(name_or_path: str) -> Path:
    """A built-in model name → its cached checkpoint (created on first use); anything else is
    a checkpoint directory that must already exist."""
    if name_or_path in BUILTIN_SPECS:
        final = env.cache_dir() / "models" / f"{name_or_path}-v{GENERATOR_VERSION}"
        if not final.is_dir():
            _create_cached(name_or_path, final)
        return final
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        builtins = ", ".join(sorted(BUILTIN_SPECS))
        raise CheckpointError(
            f"model {name_or_path!r} is neither a built-in model ({builtins}) "
            "nor an existing checkpoint directory"
        )
    return path
