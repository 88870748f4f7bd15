"""The command line: offline generation works, and bad checkpoints get one clear line, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _baton(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def test_generate_with_the_builtin_model(tiny_model_dir: Path, baton_cache_dir: Path) -> None:
    proc = _baton(
        "generate",
        "--model",
        "baton-tiny",
        "--prompt",
        "def main():",
        "--max-tokens",
        "8",
        cache=baton_cache_dir,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text was generated"
    assert "8 generated" in proc.stderr


def _refusal(model_dir: Path, cache: Path) -> str:
    proc = _baton("generate", "--model", str(model_dir), "--prompt", "x", cache=cache)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("baton: error: ")
    return lines[0]


def test_pickle_only_checkpoint_is_refused(
    tiny_model_dir: Path, tmp_path: Path, baton_cache_dir: Path
) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tiny_model_dir / name).read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    message = _refusal(tmp_path, baton_cache_dir)
    assert "pytorch_model.bin" in message and "safetensors" in message


def test_malformed_config_is_refused(
    tiny_model_dir: Path, tmp_path: Path, baton_cache_dir: Path
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["num_attention_heads"] = "four"
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = _refusal(tmp_path, baton_cache_dir)
    assert "num_attention_heads" in message


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MixtralForCausalLM"])
def test_unsupported_architecture_is_refused(
    arch: str, tiny_model_dir: Path, tmp_path: Path, baton_cache_dir: Path
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["architectures"] = [arch]
    config["model_type"] = arch.lower()
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = _refusal(tmp_path, baton_cache_dir)
    assert arch in message


def test_missing_directory_is_refused(tmp_path: Path, baton_cache_dir: Path) -> None:
    message = _refusal(tmp_path / "nope", baton_cache_dir)
    assert "nope" in message


def test_run_without_a_terminal_generates_a_demo_batch(tiny_model_dir: Path, baton_cache_dir: Path) -> None:
    env = {**os.environ, "BATON_CACHE_DIR": str(baton_cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "run"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--- ") == 4  # one block per demo prompt
    assert "4 requests, 192 tokens" in proc.stderr  # 48 tokens each: LM-head rows of EOS are zero
