"""The cross-host transfer benchmark runs end to end (small) on two dev hosts: the KV push
delivers every page intact, and the shaped link is really slower than the unshaped one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.link import main
from cluster.devhosts import available

pytestmark = pytest.mark.timeout(90)

RATE_MBIT = 100
PAGES = 16  # 256 tokens of baton-tiny in 16-token pages: 1 MiB of KV


def test_link_benchmark_runs(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if (why := available()) is not None:
        pytest.skip(f"dev hosts unavailable here: {why}")
    argv = ["--model", str(tiny_model_dir), "--prompt-len", "256", "--rates", f"0,{RATE_MBIT}", "--repeats", "1",
            "--pages-per-chunk", "2"]
    assert main(argv) == 0
    head, *rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert head["prompt_len"] == 256 and head["prefill_s"] > 0 and head["kv_cache_dtype"] == "auto"
    assert head["pages"] == PAGES and head["bytes"] == PAGES * 4 * 2 * 16 * 2 * 64 * 4
    by = {(row["rate_mbit"], row["path"]): row for row in rows}
    assert set(by) == {(r, p) for r in (0, RATE_MBIT) for p in ("kv grpc", "raw grpc.aio")}
    for row in rows:
        assert row["gb_per_s"] > 0 and row["vs_prefill"] > 0
    for rate in (0, RATE_MBIT):  # the receiver matched every stored page against the sender's digest
        kv = by[(rate, "kv grpc")]
        assert kv["pages"] == kv["pages_verified"] == PAGES and kv["vs_raw"] > 0
    # tbf held the link to its rate (allowing for its burst) and the unshaped link was faster
    ceiling_gb_per_s = 1.5 * RATE_MBIT * 1e6 / 8 / 1e9
    unshaped, shaped = by[(0, "raw grpc.aio")], by[(RATE_MBIT, "raw grpc.aio")]
    assert shaped["gb_per_s"] <= ceiling_gb_per_s, shaped
    assert by[(RATE_MBIT, "kv grpc")]["gb_per_s"] <= ceiling_gb_per_s
    assert unshaped["gb_per_s"] > 2 * shaped["gb_per_s"], (unshaped, shaped)
