"""The placement benchmark (P10) runs end to end at a small scale and reports its figures."""

from __future__ import annotations

import json

import pytest

from bench.placement_bench import main


def test_placement_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "16", "--pages", "20000", "--requests", "300", "--tenants", "4"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)
    assert row["workers"] == 16 and row["indexed_pages"] == 20_000 >= row["pages_after"]  # at its cap
    assert 0 < row["place_us_p50"] <= row["place_us_p99"] and 0 < row["place_cpu_us_p50"]
    assert 49 < row["index_bytes_per_page"] < 200  # a 16-byte hash alone is a 49-byte object
    assert row["saturated"] == 0 and row["forgotten_pages"] > 0 and row["snapshot_pages"] > 0
    assert 0 < row["hit_share"] <= 1  # reused pages never exceed the best holder's
    assert "placement" in err and "B/page" in err
