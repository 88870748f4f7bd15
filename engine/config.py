"""A Hugging Face `config.json`, read into the one frozen value the engine builds a model from.

Every field is checked here, once, so that the model, the loader and the rotary tables can
trust the numbers. Anything baton does not run (another architecture, an activation other
than SiLU, an MLP bias, a RoPE variant beyond default/linear/llama3, quantized weights) is
refused by name instead of being run approximately.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError, UnsupportedModelError

logger = logging.getLogger(__name__)

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_SUPPORTED = ", ".join(sorted(_ARCHITECTURES))
_ROPE_KINDS = ("default", "linear", "llama3")
# transformers' own defaults for keys a config.json may omit (LlamaConfig, MistralConfig,
# Qwen2Config); using them keeps baton's reading of a file identical to transformers'.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_MISTRAL_WINDOW = 4096
_DEFAULT_QWEN2_WINDOW = 4096
_DEFAULT_QWEN2_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One decoder-only model (Llama, Mistral or Qwen2), validated.

    `rope_scaling` is None for plain RoPE. `max_model_len` is the longest sequence baton serves
    with this model: `max_position_embeddings`, except for sliding-window attention (Mistral's
    `sliding_window`, Qwen2's `use_sliding_window`). baton runs full causal attention, which is
    exactly sliding-window attention for sequences no longer than the window, so a model with
    an active window smaller than `max_position_embeddings` is served up to the window only
    (logged at info level) rather than silently computed as full attention beyond it.
    """

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    max_model_len: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    attention_bias: bool  # q/k/v projection bias (Qwen2: always True)
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # as declared by the checkpoint, e.g. "bfloat16"

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, object]) -> ModelConfig:
        """Validate a parsed config.json (transformers 4.x or 5.x layout)."""
        r = _Reader(raw)
        arch = _architecture(raw)
        _refuse_unsupported(r, arch)
        hidden_size = r.req_int("hidden_size")
        num_heads = r.req_int("num_attention_heads")
        num_kv_heads = r.opt_int("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads != 0:
            raise ConfigError(
                "num_key_value_heads",
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})",
            )
        num_layers = r.req_int("num_hidden_layers")
        max_pos = r.req_int("max_position_embeddings")
        rope_theta, rope_scaling = _rope(r, max_pos)
        window = _sliding_window(r, arch, num_layers)
        max_model_len = max_pos
        if window is not None and window < max_pos:
            logger.info(
                "sliding_window=%d < max_position_embeddings=%d: serving sequences of at most "
                "%d tokens, where sliding-window attention equals full attention",
                window,
                max_pos,
                window,
            )
            max_model_len = window
        return cls(
            architecture=arch,
            vocab_size=r.req_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=r.req_int("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_head_dim(r, hidden_size, num_heads),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            rms_norm_eps=r.req_float("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=arch == "qwen2",
            tie_word_embeddings=r.opt_bool("tie_word_embeddings", False),
            bos_token_id=r.opt_int("bos_token_id", minimum=0),
            eos_token_ids=_eos_ids(r),
            # transformers 5.x writes "dtype", 4.x "torch_dtype"; absent means float32 there too
            torch_dtype=r.opt_str("dtype") or r.opt_str("torch_dtype") or "float32",
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Read and validate `model_dir/config.json`; every error names the file."""
        path = Path(model_dir) / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                "config.json", f"not found in {model_dir}: expected a Hugging Face model directory"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("config.json", f"cannot read {path}: {exc}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                "config.json",
                f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError("config.json", f"{path} must hold a JSON object, found {_show(raw)}")
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as exc:
            message = str(exc).removeprefix(f"{exc.field}: ")
            raise ConfigError(exc.field, f"{message} (in {path})") from None
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{exc} (in {path})") from None


def _show(value: object) -> str:
    """A value as the user wrote it in JSON (true, null, "4096"), kept short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Typed reads from one JSON object; errors name the dotted key (e.g. rope_scaling.factor)."""

    def __init__(self, raw: Mapping[str, object], prefix: str = "") -> None:
        self.raw = raw
        self.prefix = prefix

    def has(self, key: str) -> bool:
        return key in self.raw

    def _required(self, key: str) -> object:
        if key not in self.raw:
            raise ConfigError(self.prefix + key, "required field is missing")
        return self.raw[key]

    def check_int(self, key: str, value: object, minimum: int) -> int:
        # bool is an int subclass in Python; `true` is never a size
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError(self.prefix + key, f"expected {kind}, found {_show(value)}")
        return value

    def check_float(self, key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(
                self.prefix + key, f"expected a positive number, found {_show(value)}"
            )
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(
                self.prefix + key, f"expected a positive number, found {_show(value)}"
            )
        return float(value)

    def req_int(self, key: str, minimum: int = 1) -> int:
        return self.check_int(key, self._required(key), minimum)

    def opt_int(self, key: str, minimum: int = 1) -> int | None:
        """Absent or null: None."""
        value = self.raw.get(key)
        return None if value is None else self.check_int(key, value, minimum)

    def req_float(self, key: str) -> float:
        return self.check_float(key, self._required(key))

    def opt_float(self, key: str) -> float | None:
        value = self.raw.get(key)
        return None if value is None else self.check_float(key, value)

    def opt_bool(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(self.prefix + key, f"expected true or false, found {_show(value)}")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(self.prefix + key, f"expected a string, found {_show(value)}")
        return value


def _architecture(raw: Mapping[str, object]) -> str:
    """ "llama" | "mistral" | "qwen2", from `architectures`, cross-checked with `model_type`."""
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError("model_type", f"expected a string, found {_show(model_type)}")
    archs = raw.get("architectures")
    if archs is None:
        if model_type is None:
            raise ConfigError(
                "architectures",
                f'required field is missing; expected e.g. ["LlamaForCausalLM"] '
                f"(baton runs {_SUPPORTED})",
            )
        if model_type not in _ARCHITECTURES.values():
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; baton runs {_SUPPORTED}"
            )
        return model_type
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConfigError(
            "architectures", f"expected a non-empty list of class names, found {_show(archs)}"
        )
    kinds = set()
    for name in archs:
        if name not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"architectures: {name!r} is not supported; baton runs {_SUPPORTED}"
            )
        kinds.add(_ARCHITECTURES[name])
    if len(kinds) > 1:
        raise ConfigError("architectures", f"names different model families: {_show(archs)}")
    arch = kinds.pop()
    if model_type is not None and model_type != arch:
        raise ConfigError(
            "model_type",
            f"{model_type!r} contradicts architectures {_show(archs)} (expected {arch!r})",
        )
    return arch


def _refuse_unsupported(r: _Reader, arch: str) -> None:
    """Refuse, by name, the features that would change the math of the forward pass."""
    act_key = "hidden_act" if r.has("hidden_act") else "hidden_activation"
    act = r.opt_str(act_key)
    act = "silu" if act is None else act
    if act != "silu":
        raise UnsupportedModelError(
            f"{act_key} = {act!r} is not supported; baton runs only 'silu' (SwiGLU) MLPs"
        )
    if r.opt_bool("mlp_bias", False):
        raise UnsupportedModelError("mlp_bias = true is not supported; baton runs bias-free MLPs")
    # Qwen2 always has q/k/v biases and ignores the key; in Llama it would also add an o_proj
    # bias, which baton's attention does not have.
    if r.opt_bool("attention_bias", False) and arch != "qwen2":
        raise UnsupportedModelError(
            f"attention_bias = true is not supported for {arch} models "
            "(only Qwen2's q/k/v biases are)"
        )
    quant = r.raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else "unknown"
        raise UnsupportedModelError(
            f"quantization_config: quantized checkpoints ({_show(method)}) are not supported; "
            "use the unquantized float16/bfloat16 weights"
        )
    partial = r.opt_float("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor = {partial} is not supported; baton rotates the whole head"
        )


def _head_dim(r: _Reader, hidden_size: int, num_heads: int) -> int:
    head_dim = r.opt_int("head_dim")
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ConfigError(
                "hidden_size",
                f"{hidden_size} is not a multiple of num_attention_heads ({num_heads}) and no "
                "head_dim is given",
            )
        head_dim = hidden_size // num_heads
    if head_dim % 2 != 0:
        raise ConfigError("head_dim", f"rotary embeddings need an even head size, found {head_dim}")
    return head_dim


def _rope(r: _Reader, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from 4.x `rope_theta` + `rope_scaling` or 5.x `rope_parameters`."""
    # transformers 5.x lets a non-empty rope_scaling win over rope_parameters
    source = "rope_scaling" if r.raw.get("rope_scaling") else "rope_parameters"
    params = r.raw.get(source)
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(source, f"expected an object, found {_show(params)}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type RoPE parameters are not supported")
    p = _Reader(params, prefix=source + ".")
    theta = p.opt_float("rope_theta") or r.opt_float("rope_theta") or _DEFAULT_ROPE_THETA
    kind_key = "rope_type" if p.has("rope_type") else "type"
    kind = p.opt_str(kind_key) or "default"
    if kind not in _ROPE_KINDS:
        raise UnsupportedModelError(
            f"{source}.{kind_key} = {kind!r} is not supported; baton supports "
            f"{', '.join(_ROPE_KINDS)}"
        )
    partial = p.opt_float("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise UnsupportedModelError(
            f"{source}.partial_rotary_factor = {partial} is not supported; baton rotates the "
            "whole head"
        )
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=p.req_float("factor"))
    low, high = p.req_float("low_freq_factor"), p.req_float("high_freq_factor")
    if high <= low:
        raise ConfigError(
            source + ".high_freq_factor",
            f"must be greater than low_freq_factor ({low}), found {high}",
        )
    # transformers gives a top-level original_max_position_embeddings priority (Phi-3 style)
    original = r.opt_int("original_max_position_embeddings")
    if original is None:
        original = p.opt_int("original_max_position_embeddings") or max_pos
    return theta, RopeScaling(
        kind="llama3",
        factor=p.req_float("factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _sliding_window(r: _Reader, arch: str, num_layers: int) -> int | None:
    """The attention window in effect on any layer, or None for full attention everywhere."""
    if arch == "mistral":
        # MistralConfig defaults an absent key to 4096; null means full attention
        return r.opt_int("sliding_window") if r.has("sliding_window") else _DEFAULT_MISTRAL_WINDOW
    if arch != "qwen2" or not r.opt_bool("use_sliding_window", False):
        return None
    window = r.opt_int("sliding_window") if r.has("sliding_window") else _DEFAULT_QWEN2_WINDOW
    if window is None:
        return None
    layer_types = r.raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(
                "layer_types", f"expected a list of strings, found {_show(layer_types)}"
            )
        return window if "sliding_attention" in layer_types else None
    # Qwen2 windows only the layers from max_window_layers on
    max_window_layers = r.opt_int("max_window_layers", minimum=0)
    if max_window_layers is None:
        max_window_layers = _DEFAULT_QWEN2_MAX_WINDOW_LAYERS
    return window if max_window_layers < num_layers else None


def _eos_ids(r: _Reader) -> tuple[int, ...]:
    value = r.raw.get("eos_token_id")
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(r.check_int("eos_token_id", v, minimum=0) for v in value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            "eos_token_id", f"expected a token id or a list of token ids, found {_show(value)}"
        )
    return (r.check_int("eos_token_id", value, minimum=0),)
