"""The transfer benchmark runs end to end (small) and prints one JSON line per path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.transfer import main


def test_transfer_benchmark_runs(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_model_dir), "--prompt-len", "64", "--pages-per-chunk", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["prompt_len"] == 64 and lines[0]["prefill_s"] > 0
    paths = {row["transport"]: row for row in lines[1:]}
    assert set(paths) == {"local", "grpc", "shm", "nccl", "raw grpc.aio (ceiling)", "raw shm memcpy (ceiling)"}
    for row in paths.values():  # 4 pages x 64 KiB of KV went through each path
        assert row["bytes"] == 4 * 4 * 2 * 16 * 2 * 64 * 4 and row["gb_per_s"] > 0
