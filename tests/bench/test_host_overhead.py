"""bench.host_overhead: the engine's host time per decode step, on a model too small to matter."""

from __future__ import annotations

import json

import pytest

from bench import host_overhead

pytestmark = pytest.mark.timeout(120)


def test_it_reports_each_batch_in_both_modes_with_the_parts_adding_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert host_overhead.main(["--batches", "1,3", "--steps", "4", "--context", "12"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["async_scheduling"]) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    for r in rows:
        assert r["step_ms"] > 0 and r["model_ms"] > 0 and r["sample_ms"] > 0
        parts = r["model_ms"] + r["sample_ms"] + r["host_ms"]
        assert parts == pytest.approx(r["step_ms"], abs=0.01)
        assert r["host_us_per_row"] == pytest.approx(r["host_ms"] * 1e3 / r["batch"], rel=0.01, abs=0.05)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        host_overhead.main(["--steps", "0"])
