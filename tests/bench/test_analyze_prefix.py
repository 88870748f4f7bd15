"""`baton analyze-prefix`: shared prefixes, hit rates and the LRU bound on small traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.analyze_prefix import analyze, reading, summarize
from bench.trace import TraceEntry


def _e(length: int, ids: tuple[int, ...], tenant: str | None = None) -> TraceEntry:
    return TraceEntry(0.0, length, 8, ids, tenant)


def test_shared_prefix_is_block_chained_page_granular_and_keeps_the_last_token() -> None:
    entries = [
        _e(1200, (7, 3, 9)),  # first: nothing shared
        _e(1100, (7, 3, 4)),  # shares blocks 7, 3: 1,024 tokens
        _e(600, (7, 3)),  # block 3 cut to 88 tokens: shares 512 + 88 = 600, all but the last page
        _e(1024, (3, 7)),  # another order: nothing (chained, not a bag of blocks)
        _e(300, (7,)),  # a prefix of block 7: 300 shared, 288 reusable (whole pages, not the last token)
    ]
    got = analyze(entries, block_size=512, page_size=16, cache_tokens=10**9)
    assert [r.shared_same_tenant for r in got] == [0, 1024, 600, 0, 300]
    assert [r.reusable_unbounded for r in got] == [0, 1024, 592, 0, 288]
    assert [r.reusable_lru for r in got] == [r.reusable_unbounded for r in got]


def test_tenants_do_not_share_and_cross_tenant_overlap_is_reported() -> None:
    entries = [_e(1024, (1, 2), "a"), _e(1024, (1, 2), "b"), _e(1024, (1, 2), "b")]
    got = analyze(entries, 512, 16, 10**9)
    assert [(r.shared_any, r.shared_same_tenant) for r in got] == [(0, 0), (1024, 0), (1024, 1024)]
    summary = summarize(got, 10**9)
    assert summary["tenants"]["a"]["hit_rate"] == 0.0 and summary["tenants"]["b"]["hit_rate"] > 0.4
    assert 0.4 < summary["cross_tenant_share_of_overlap"] < 0.6
    assert any("between tenants" in line for line in reading(summary))


def test_a_small_lru_forgets_what_an_unbounded_cache_keeps() -> None:
    entries = [_e(512, (i,)) for i in range(10)] + [_e(512, (0,))]
    big = summarize(analyze(entries, 512, 16, 10**9), 10**9)
    small = summarize(analyze(entries, 512, 16, 2048), 2048)
    assert big["ideal_hit_rate"] > 0 and small["lru_hit_rate"] == 0.0
    assert small["ideal_hit_rate"] == big["ideal_hit_rate"]


def test_the_command_prints_a_summary_and_a_reading(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": i, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2 + i % 2]} for i in range(20)]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "analyze-prefix", str(trace)],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    summary = json.loads(out[: out.rindex("}") + 1])
    assert summary["requests"] == 20 and summary["ideal_hit_rate"] > 0.8
    assert "prefix cache" in out
