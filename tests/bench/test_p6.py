"""bench.p6's figures and report, on synthetic runs (the benchmark itself is run by hand), and
the child-process handling it starts baton with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.p6 import Cell, cell_of, itl_by_phase, pinning, ratios, table
from bench.runner import RequestRecord, RunPlan, RunResult
from bench.server_proc import BatonProcess
from bench.transport import StreamResult


def _record(tag: str, ttft_s: float, itl_s: tuple[float, ...], error: str | None = None,
            start_s: float = 0.0) -> RequestRecord:  # fmt: skip
    result = StreamResult(error is None, error, ttft_s, ttft_s + sum(itl_s), itl_s, len(itl_s) + 1,
                          len(itl_s) + 1, 64, 0, "length", "", None)  # fmt: skip
    return RequestRecord(f"{tag}-0", 0, tag, None, start_s, len(itl_s) + 1, 64, None, result)


def _run(*records: RequestRecord) -> RunResult:
    return RunResult(RunPlan("x", "s", 8, None, len(records)), "mixed", 12.345, records)


def test_a_cell_counts_the_short_stream_only() -> None:
    run = _run(
        _record("short", 0.1, (0.010,) * 50),
        _record("short", 0.3, (0.030,) * 49 + (0.500,)),
        _record("long", 2.0, (5.0,)),  # its intervals are not the decode stream's
        _record("short", 0.0, (), error="time cap (90 s)"),
    )
    cell = cell_of("disagg", True, run)
    assert (cell.num_sent, cell.num_short_ok, cell.num_long_ok, cell.num_failed) == (4, 2, 1, 1)
    assert cell.itl_p50_ms == 20.0  # 50 x 10 ms, 49 x 30 ms, one 500 ms (the long's 5 s left out)
    assert cell.itl_p99_ms == 34.7 and cell.itl_max_ms == 500.0
    assert (cell.ttft_p50_ms, cell.ttft_p99_ms, cell.long_ttft_p50_ms) == (200.0, 298.0, 2000.0)
    assert cell.errors == ("time cap (90 s)",) and cell.duration_s == 12.35


def test_intervals_are_told_apart_by_what_a_long_prompt_was_doing() -> None:
    # long: sent at 1.0, first token at 2.0, last at 3.0
    # short: first token at 0.5, then tokens at 0.9 | 1.5 | 2.5 | 3.5 | 3.6
    records = (_record("long", 1.0, (1.0,), start_s=1.0), _record("short", 0.5, (0.4, 0.6, 1.0, 1.0, 0.1)))
    phases = itl_by_phase(records)
    assert phases == {"long prefill": [0.6, 1.0], "long decode": [1.0], "neither": [0.4, 0.1]}
    assert itl_by_phase(records[1:]) == {"long prefill": [], "long decode": [], "neither": [0.4, 0.6, 1.0, 1.0, 0.1]}


def _cell(config: str, with_long: bool, p50: float | None, p99: float | None) -> Cell:
    return Cell(config, with_long, 10, 10, 0, 0, 1.0, p50, p99, p99, p99, None, None, p99, 100.0, 200.0, None, ())


def test_ratios_and_the_table() -> None:
    cells = [
        _cell("disagg", False, 10.0, 20.0), _cell("disagg", True, 11.0, 25.0),
        _cell("colocated-unchunked", False, 10.0, 20.0), _cell("colocated-unchunked", True, 12.0, 400.0),
        _cell("colocated-chunked", False, 10.0, None),  # no run with the long prompts: no ratio
    ]  # fmt: skip
    got = {r.config: r for r in ratios(cells)}
    assert set(got) == {"disagg", "colocated-unchunked"}
    assert (got["disagg"].itl_p50, got["disagg"].itl_p99, got["disagg"].meets_target) == (1.1, 1.25, True)
    assert got["colocated-unchunked"].itl_p99 == 20.0 and got["colocated-unchunked"].meets_target is False
    text = table(cells)
    assert "1.25x" in text and "met" in text and "20.00x" in text and "(contrast)" in text
    assert table([_cell("disagg", False, 10.0, 20.0), _cell("disagg", True, 10.0, 40.0)]).rstrip().endswith("missed")


def test_pinning_reads_the_cpu_lists_of_a_process() -> None:
    got = pinning(os.getpid())
    assert list(got) == [f"baton up [{os.getpid()}]"]
    assert got[f"baton up [{os.getpid()}]"]  # e.g. ["0-1"]


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    with BatonProcess(["--no-such-flag"], tmp_path / "up.log") as server:
        with pytest.raises(RuntimeError, match="no-such-flag"):
            server.wait_ready(timeout_s=60)
    assert server.returncode == 2  # argparse's; stop() after exit just collects it
