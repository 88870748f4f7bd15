"""bench.compare (issue 10): parsing the targets and the grid, the order the targets run in,
the ratios and their tables, the JSON document and the PNG; then one small comparison end to
end over real HTTP against a real baton server (two targets naming it, so the ratios are of a
server against itself)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.compare import (
    Cell,
    Target,
    absolute_table,
    best_table,
    main,
    parse_cells,
    parse_target,
    plot_ratios,
    ratio_table,
    ratios,
    report,
    tables_of,
    turn,
    versus_best,
)
from bench.report import RunSummary
from cluster.server import ServerConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, free_port, start_server

pytestmark = pytest.mark.timeout(120)


def summary(label: str = "random-c1", *, tok_s: float = 100.0, ttft: float | None = 50.0, itl: float | None = 10.0,
            ok: int = 12, sent: int = 12) -> RunSummary:  # fmt: skip
    return RunSummary(
        label=label, workload=label.split("-")[0], concurrency=1, rate=None, duration_s=10.0, num_sent=sent,
        num_ok=ok, num_failed=sent - ok, num_short=0, errors={}, ttft_p50_ms=ttft,
        ttft_p90_ms=None if ttft is None else ttft * 1.5, ttft_p99_ms=None if ttft is None else ttft * 2,
        itl_p50_ms=itl, itl_p99_ms=None if itl is None else itl * 3, tpot_p50_ms=itl, e2e_p50_ms=1000.0,
        output_tok_s=tok_s, request_s=1.2, goodput_req_s=1.2, goodput_share=1.0, slo_ttft_s=2.0, slo_itl_s=0.2,
        prompt_tokens=3000, output_tokens=1536, cached_tokens=None, prefix_hit_rate=None, ideal_hit_rate=None,
        hit_vs_ideal=None, by_tag={},
    )  # fmt: skip


def test_targets_and_the_grid_parse_or_say_what_is_wrong() -> None:
    assert parse_target("baton=http://127.0.0.1:8000/") == Target("baton", "http://127.0.0.1:8000")
    assert parse_target("vllm=http://127.0.0.1:8001,tiny") == Target("vllm", "http://127.0.0.1:8001", "tiny")
    for bad in ("http://127.0.0.1:8000", "=http://x", "llama=127.0.0.1:8002"):
        with pytest.raises(ValueError, match="NAME=http"):
            parse_target(bad)
    assert parse_cells(["random:1,8", "rag:32"]) == [Cell("random", 1), Cell("random", 8), Cell("rag", 32)]
    assert Cell("rag", 32).label == "rag-c32"
    assert parse_cells(["burst-agent:replay", "rag:8"]) == [Cell("burst-agent", None), Cell("rag", 8)]
    assert Cell("tenant-rag", None).label == "tenant-rag-replay"
    with pytest.raises(ValueError, match="no arrival times of its own"):
        parse_cells(["random:replay"])
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        parse_cells(["chat:1"])
    for bad in ("rag", "rag:", "rag:0", "rag:a,b"):
        with pytest.raises(ValueError, match="concurrency levels"):
            parse_cells([bad])


def test_every_target_leads_in_turn() -> None:
    targets = [Target(n, f"http://127.0.0.1:{p}") for n, p in (("baton", 1), ("vllm", 2), ("llama", 3))]
    orders = [[t.name for t in turn(targets, i)] for i in range(4)]
    assert orders == [["baton", "vllm", "llama"], ["vllm", "llama", "baton"], ["llama", "baton", "vllm"],
                      ["baton", "vllm", "llama"]]  # fmt: skip
    assert all(sorted(o) == sorted(orders[0]) for o in orders)  # each cell runs every target once


def test_ratios_are_baseline_over_peer_and_absent_without_a_figure() -> None:
    faster = summary(tok_s=300.0, ttft=20.0, itl=5.0)
    slower = summary(tok_s=100.0, ttft=80.0, itl=10.0)
    got = ratios(faster, slower)
    assert got == {"tok/s": 3.0, "TTFT p50": 0.25, "TTFT p99": 0.25, "ITL p50": 0.5, "ITL p99": 0.5, "TPOT p50": 0.5,
                   "goodput": 1.0}
    assert ratios(slower, faster)["tok/s"] == pytest.approx(1 / 3)
    nothing = summary(tok_s=0.0, ttft=None, itl=None, ok=0)  # a peer that finished no request
    assert set(ratios(faster, nothing).values()) == {None}
    assert set(ratios(nothing, faster).values()) == {None}
    assert ratios(faster, summary(itl=None))["ITL p50"] is None  # one-token outputs: no ITL
    # A peer that sends tokens in bursts has an ITL p50 of ~0: no ratio, where TPOT still has one.
    bursty = summary(itl=0.0)
    assert ratios(faster, bursty)["ITL p50"] is None and ratios(bursty, faster)["ITL p50"] is None
    assert ratios(faster, dataclasses.replace(summary(), itl_p50_ms=0.0))["TPOT p50"] == 0.5


def test_tables_and_the_document_carry_every_cell_and_peer(tmp_path: Path) -> None:
    cells = [Cell("random", 1), Cell("rag", 32)]
    targets = [Target("baton", "http://127.0.0.1:1"), Target("vllm", "http://127.0.0.1:2"),
               Target("llama", "http://127.0.0.1:3")]  # fmt: skip
    results = {
        ("random-c1", "baton"): summary(tok_s=200.0), ("random-c1", "vllm"): summary(tok_s=100.0),
        ("random-c1", "llama"): summary(tok_s=400.0), ("rag-c32", "baton"): summary("rag-c32", tok_s=50.0),
        ("rag-c32", "vllm"): summary("rag-c32", tok_s=25.0),  # llama never ran rag: its cell is absent
    }  # fmt: skip
    ratio_rows = ratio_table(cells, results, "baton", ["vllm", "llama"]).splitlines()
    assert ratio_rows[0] == "| cell | peer | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | goodput |"
    assert ratio_rows[2] == "| random-c1 | vllm | 2.00× | 1.00× | 1.00× | 1.00× | 1.00× | 1.00× | 1.00× |"
    assert ratio_rows[3].startswith("| random-c1 | llama | 0.50× |")
    assert ratio_rows[5] == "| rag-c32 | llama | – | – | – | – | – | – | – |"
    absolute = absolute_table(cells, results, ["baton", "vllm", "llama"]).splitlines()
    assert absolute[2] == "| random-c1 | baton | 12/12 | 200.0 | 50 | 100 | 10.0 | 30.0 | 10.0 | 1.20 | – |"
    assert len(absolute) == 2 + 5  # no row for the cell that did not run

    doc = report(cells, targets, results, {"baton": "baton-tiny", "vllm": "baton-tiny", "llama": "baton-tiny"})
    assert doc["baseline"] == "baton" and [t["name"] for t in doc["targets"]] == ["baton", "vllm", "llama"]
    assert len(doc["runs"]) == 5 and {r["target"] for r in doc["runs"]} == {"baton", "vllm", "llama"}
    assert [(r["cell"], r["peer"], r["tok/s"]) for r in doc["ratios"]] == [
        ("random-c1", "vllm", 2.0), ("random-c1", "llama", 0.5), ("rag-c32", "vllm", 2.0)]  # fmt: skip
    assert [(b["cell"], b["figure"], b["peer"], b["ratio"]) for b in doc["versus_best"] if b["figure"] == "tok/s"] == [
        ("random-c1", "tok/s", "llama", 0.5), ("rag-c32", "tok/s", "vllm", 2.0)]  # fmt: skip
    json.dumps(doc)  # the document is plain JSON
    png = tmp_path / "ratios.png"
    plot_ratios(doc, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def baton(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    engine_cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024)
    handle = start_server(ServerConfig(engine=engine_cfg, served_model_name="baton-tiny"), Engine(engine_cfg))
    yield handle
    handle.stop()


def test_a_small_comparison_end_to_end(baton: ServerHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    gone = f"http://127.0.0.1:{free_port()}"  # a peer that is not running: its cells fail, the rest go on
    code = main(["--target", f"baton={baton.url}", "--target", f"again={baton.url},baton-tiny",
                 "--target", f"gone={gone},baton-tiny", "--grid", "random:1,2", "--requests", "3",
                 "--cell-cap", "60", "--floor", "gone", "--out", str(out), "--plot", str(png),
                 "--quiet-idle", "0"])  # fmt: skip  (the test's own server is busy in this process)
    assert code == 1  # not every target finished its requests
    doc = json.loads(out.read_text())
    assert doc == json.loads(capsys.readouterr().out)
    assert doc["seed"].isdigit()  # a fresh seed, recorded
    assert main(["tables", str(out)]) == 0  # the saved document renders its tables again
    tables = capsys.readouterr().out.split("\n\n")
    assert len(tables) == 3 and "| random-c2 | again |" in tables[1]
    assert tables[2].splitlines()[2].startswith("| random-c1 |") and "(gone)" not in tables[2]
    runs = {(r["label"], r["target"]): r for r in doc["runs"]}
    assert set(runs) == {(c, t) for c in ("random-c1", "random-c2") for t in ("baton", "again", "gone")}
    ran = [r for (_, t), r in runs.items() if t != "gone"]
    assert all(r["num_ok"] == r["num_sent"] == 3 and r["output_tok_s"] > 0 for r in ran)
    assert all(runs[(c, "gone")]["num_ok"] == 0 for c in ("random-c1", "random-c2"))
    # the same prompts went to both targets of a cell
    for cell in ("random-c1", "random-c2"):
        assert runs[(cell, "baton")]["prompt_tokens"] == runs[(cell, "again")]["prompt_tokens"]
    by_peer = {(r["cell"], r["peer"]): r for r in doc["ratios"]}
    assert set(by_peer) == {(c, p) for c in ("random-c1", "random-c2") for p in ("again", "gone")}
    assert all(by_peer[(c, "again")]["tok/s"] > 0 for c in ("random-c1", "random-c2"))
    assert all(by_peer[(c, "gone")]["tok/s"] is None for c in ("random-c1", "random-c2"))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_baton_is_set_against_the_best_peer_on_each_figure() -> None:
    """P1 and P3 read: the most tok/s and the least time among the peers, whoever has them;
    a bursty peer's ~0 ITL does not count as the best ITL."""
    cells = [Cell("rag", 8)]
    results = {
        ("rag-c8", "baton"): summary("rag-c8", tok_s=300.0, ttft=40.0, itl=8.0),
        ("rag-c8", "vllm"): summary("rag-c8", tok_s=400.0, ttft=100.0, itl=0.0),
        ("rag-c8", "llama"): summary("rag-c8", tok_s=200.0, ttft=50.0, itl=4.0),
        ("rag-c8", "floor"): summary("rag-c8", tok_s=0.0, ttft=None, itl=None, ok=0),
    }  # fmt: skip
    best = {b["figure"]: (b["peer"], b["ratio"]) for b in versus_best(cells, results, "baton", ["vllm", "llama", "floor"])}
    assert best["tok/s"] == ("vllm", 0.75)
    assert best["TTFT p50"] == ("llama", 0.8) and best["TTFT p99"] == ("llama", 0.8)
    assert best["ITL p50"] == ("llama", 2.0)
    assert best["TPOT p50"] == ("llama", 2.0)
    targets = [Target(n, f"http://127.0.0.1:{i + 1}") for i, n in enumerate(("baton", "vllm", "llama", "floor"))]
    results[("rag-c8", "floor")] = summary("rag-c8", tok_s=50.0, ttft=9000.0, itl=1.0)  # one at a time
    doc = report(cells, targets, results, {}, floors=["floor"])
    assert doc["floors"] == ["floor"] and {b["peer"] for b in doc["versus_best"]} == {"vllm", "llama"}
    assert any(r["peer"] == "floor" for r in doc["ratios"])  # still in the ratio table
    table = best_table(doc["versus_best"]).splitlines()
    assert table[0] == "| cell | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | goodput |"
    assert table[2].startswith("| rag-c8 | 0.75× (vllm) | 0.80× (llama) | 0.80× (llama) | 2.00× (llama) |")


def test_a_replayed_cell_is_compared_on_goodput_and_its_tables_render_again() -> None:
    """A bursty workload runs open loop on its own times: its cell has no concurrency, its
    label says replay, and goodput (requests/s within the SLO) is one of its figures."""
    cells = [Cell("burst-agent", None)]
    targets = [Target("baton", "http://127.0.0.1:1"), Target("vllm", "http://127.0.0.1:2")]
    replayed = dataclasses.replace(summary("burst-agent-replay"), concurrency=None, workload="burst-agent")
    results = {
        ("burst-agent-replay", "baton"): dataclasses.replace(replayed, goodput_req_s=1.5),
        ("burst-agent-replay", "vllm"): dataclasses.replace(replayed, goodput_req_s=1.2),
    }
    doc = report(cells, targets, results, {})
    assert [(r["cell"], r["goodput"]) for r in doc["ratios"]] == [("burst-agent-replay", 1.25)]
    assert {"figure": "goodput", "cell": "burst-agent-replay", "peer": "vllm", "ratio": 1.25} in doc["versus_best"]
    doc["targets"] = [{"name": t.name} for t in targets]
    tables = tables_of(json.loads(json.dumps(doc))).split("\n\n")
    assert tables[0].splitlines()[2].startswith("| burst-agent-replay | baton | 12/12 |")
    assert tables[2].splitlines()[2].endswith("| 1.25× (vllm) |")
    doc["runs"][0]["label"] = "burst-agent"  # neither closed-loop nor a replay
    with pytest.raises(ValueError, match="neither closed-loop nor a replay"):
        tables_of(doc)


async def test_quiet_waits_for_idle_cpus_or_gives_up_at_its_bound() -> None:
    from bench.compare import quiet

    assert await quiet(0.0, 5.0) == 0.0  # asked for nothing: no wait
    assert await quiet(1.01, 0.3) == 0.3  # never that idle: it waits its bound, then says so
    burners = [subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\nwhile True: pass"],
                                stdout=subprocess.PIPE, text=True) for _ in range(os.cpu_count() or 1)]  # fmt: skip
    try:
        for b in burners:  # each is spinning before the wait starts, however slow its start was
            assert b.stdout is not None and b.stdout.readline().strip() == "up"
        assert await quiet(0.9, 0.6) == 0.6  # every CPU busy: not quiet within the bound
    finally:
        for b in burners:
            b.kill()
            b.wait()
