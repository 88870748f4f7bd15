"""Weights from a Hugging Face checkpoint directory: safetensors only, checked tensor by tensor.

baton never unpickles anything (docs/architecture.md, Rules): a directory holding only pickle weights
(`pytorch_model.bin`, `*.pt`, ...) is refused with instructions to convert it, without opening
those files. Every tensor is checked against the shape the config implies before its data is
read, so a checkpoint that does not match its config.json fails with the tensor's name instead
of a shape error deep inside the forward pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig
from engine.engine_config import dtype_name
from engine.errors import CheckpointError

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# stored dtypes we convert from; anything else (int8, fp8, ...) is a quantized checkpoint
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_CONVERT_HINT = (
    'convert it once, in an environment you trust, with `python -c "from transformers import '
    "AutoModelForCausalLM as M; M.from_pretrained('{src}').save_pretrained('{src}-safetensors')\"` "
    "and point baton at the new directory"
)


def parse_dtype(name: str) -> torch.dtype:
    """ "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"/"half" -> torch dtype
    (engine_config.dtype_name: ConfigError("dtype") for any other name).

    "auto" is not a dtype: the caller resolves it (e.g. from the checkpoint's torch_dtype).
    """
    dtype: torch.dtype = getattr(torch, dtype_name(name))
    return dtype


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `load_state_dict` returns, by Hugging Face name, with its shape.

    `lm_head.weight` is always listed; when embeddings are tied it is not read from the
    checkpoint but is the embedding tensor itself.
    """
    q_size = cfg.num_heads * cfg.head_dim
    kv_size = cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_size)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def load_state_dict(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read, check and convert every weight of `model_dir` to `dtype` on `device`."""
    model_dir = Path(model_dir)
    expected = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    weights: dict[str, torch.Tensor] = {}
    for file, names in _weight_files(model_dir).items():
        _read_file(file, names, expected, weights, dtype, device)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{model_dir}: tensor {missing[0]!r}{more} is missing; expected shape "
            f"{list(expected[missing[0]])} for this config.json"
        )
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    logger.info("loaded %d tensors from %s as %s", len(weights), model_dir, dtype)
    return weights


def _weight_files(model_dir: Path) -> Mapping[Path, set[str] | None]:
    """The safetensors files to read, each with the tensor names the index puts there
    (None: whatever the file holds)."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory; expected a Hugging Face model dir")
    single = model_dir / SINGLE_FILE
    if single.is_file():  # transformers also prefers the single file when both exist
        return {single: None}
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _read_index(model_dir, index)
    others = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if others:
        raise CheckpointError(
            f"{model_dir}: found {', '.join(others)} but neither {SINGLE_FILE} nor {INDEX_FILE}; "
            "baton reads the Hugging Face layout"
        )
    # names only: a pickle file is never opened, not even to look at it
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir}: holds only pickle weights ({', '.join(pickles)}); baton loads only "
            "safetensors, because unpickling can run arbitrary code; "
            + _CONVERT_HINT.format(src=model_dir)
        )
    raise CheckpointError(
        f"{model_dir}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE} with its shards"
    )


def _read_index(model_dir: Path, index: Path) -> Mapping[Path, set[str] | None]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: cannot be read as JSON: {exc}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f'{index}: expected a non-empty "weight_map" object')
    files: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: weight_map[{name!r}] must be a file name")
        files.setdefault(_shard_path(model_dir, index, shard), set()).add(name)
    for path in files:
        if not path.is_file():
            raise CheckpointError(
                f"{index}: names shard {path.name!r}, which is missing from {model_dir}"
            )
    return files


def _shard_path(model_dir: Path, index: Path, shard: str) -> Path:
    """A shard name from the index, refused unless it stays inside model_dir.

    The check is on the name, not the resolved path: Hugging Face cache snapshots are
    symlinks into a blobs directory, which must keep working.
    """
    rel = PurePosixPath(shard)
    if not shard or rel.is_absolute() or ".." in rel.parts or "\\" in shard:
        raise CheckpointError(
            f"{index}: shard name {shard!r} points outside {model_dir}; expected a file name "
            "like model-00001-of-00002.safetensors"
        )
    return model_dir.joinpath(*rel.parts)


def _read_file(
    file: Path,
    names: set[str] | None,
    expected: dict[str, tuple[int, ...]],
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Check and load the expected tensors of one safetensors file into `weights`."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            if names is not None:
                absent = sorted(names - set(keys))
                if absent:
                    raise CheckpointError(
                        f"{file}: the index places tensor {absent[0]!r} in this file, "
                        "but it is not there"
                    )
                keys = [k for k in keys if k in names]
            for name in keys:
                if not _is_wanted(file, name, expected, weights):
                    continue
                header = f.get_slice(name)
                found = list(header.get_shape())
                _check_header(file, name, found, str(header.get_dtype()), expected[name])
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file: {exc}") from None


def _is_wanted(
    file: Path, name: str, expected: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor]
) -> bool:
    if name in weights:
        raise CheckpointError(f"{file}: tensor {name!r} appears in more than one file")
    if name in expected:
        return True
    if name.endswith(".rotary_emb.inv_freq"):
        return False  # a buffer old checkpoints saved; recomputed by engine.rope
    if name == "lm_head.weight":
        # tied: transformers also uses the embedding and ignores a saved copy
        logger.warning("%s: ignoring lm_head.weight, tied to the embedding by config.json", file)
        return False
    if name.endswith((".weight", ".bias")):
        # a parameter the model does not have (an o_proj bias, an extra layer) would change
        # the output: refuse rather than ignore it
        raise CheckpointError(
            f"{file}: unexpected tensor {name!r}; config.json does not describe it "
            "(wrong config, or an architecture variant baton does not run)"
        )
    logger.warning("%s: ignoring unknown tensor %r", file, name)
    return False


def _check_header(
    file: Path, name: str, found: list[int], stored: str, shape: tuple[int, ...]
) -> None:
    """Shape and dtype from the file's header, checked before any data is read."""
    if found != list(shape):
        raise CheckpointError(
            f"{file}: tensor {name!r} has shape {found}, expected {list(shape)} from config.json"
        )
    if stored not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name!r} is stored as {stored}; baton loads float32/float16/"
            "bfloat16 weights only (quantized checkpoints are not supported)"
        )


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A cheap identity of a checkpoint's weights and config, for KV page hashes.

    Pages computed by different weights must never be shared (least of all from a disk tier
    that outlives a restart), so the fingerprint covers config.json and, per safetensors file,
    its size and a digest of its first and last MiB (reading every byte would slow start-up).
    """
    h = hashlib.blake2b(digest_size=16)
    config = model_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()
