"""Side by side with the peers (issue 10): one workload x concurrency grid against baton and
every running peer, in one run, as ratios.

    python -m bench.compare --target baton=http://127.0.0.1:8000 \\
        --target vllm=http://127.0.0.1:8001 --target llama=http://127.0.0.1:8002 \\
        --grid random:1,8,32 --grid rag:1,8,32 --grid multiturn:1,8,32 \\
        --grid burst-agent:replay --grid tenant-rag:replay --replay-requests 96 \\
        --cell-cap 300 --out compare.json --plot compare.png
    python -m bench.compare tables compare.json     # the tables again from a saved document

Each cell (a workload at one concurrency) is run against every target before the next cell
starts, and the order of the targets turns by one from cell to cell: drift of the machine
(thermal, a noisy neighbour) falls on every target alike rather than on whoever runs last.
A cell that fails on one target (a refusal, a server gone) is reported under "failures" and
the comparison goes on. Every target of a cell gets the same prompts (the seed is the cell's, not the target's), over
its own fresh connections (one per request: llama-server's HTTP library races keep-alive
reuse), with BENCHMARKS.md's request counts and at most --cell-cap seconds. The prompts are
new to every server on every run (a fresh --seed unless one is given, recorded in the
document): a rerun with the seed of an earlier run against servers that stayed up is served
from their prefix caches, and a server restarted in between is not.

Before each target's run the machine is let settle: the run starts once the CPUs have been
--quiet-idle idle (from /proc/stat) for a quarter of a second, or after --quiet-max seconds. A
server keeps working after its last response (vLLM-CPU's worker spun a core for 1-2 s after a
`random` c=16 run here): without this the target after it was measured on a machine still
busy with the one before, and a short cell's TTFT said so (baton's c=16 TTFT p50 575 ms in a
compare run against ~200 ms run alone).

A replayed cell (WORKLOAD:replay) sends the workload's requests on its own arrival times (the
bursty agent fan-out and multi-tenant RAG of issue 21), open loop, the same times for every
target.

The first target is the baseline (baton). The ratio table gives, per cell and peer,
baseline / peer for output tokens/s and goodput (requests/s within the model's SLO; above 1:
baton is better) and for TTFT and ITL at p50 and p99 and TPOT p50 (below 1: baton is faster); a third table sets baton against the best
peer on each figure (BENCHMARKS.md's P1 and P3 are read there). On stderr: the absolute
figures, the ratios, the best-peer table; on stdout one JSON object; --out writes it to a file,
--plot a PNG of the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import ClientConfig, StreamClient, list_models
from bench.prompts import PromptMode, PromptRenderer, load_tokenizer
from bench.report import SLO, RunSummary, summarize, to_json
from bench.runner import RunPlan, default_num_requests, execute
from bench.serving import SLO_BY_MODEL
from bench.transport import run as run_loop
from bench.workloads import WORKLOADS, make_workload

logger = logging.getLogger(__name__)

# (field of RunSummary, column, higher is better)
FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("output_tok_s", "tok/s", True),
    ("ttft_p50_ms", "TTFT p50", False),
    ("ttft_p99_ms", "TTFT p99", False),
    ("itl_p50_ms", "ITL p50", False),
    ("itl_p99_ms", "ITL p99", False),
    ("tpot_p50_ms", "TPOT p50", False),
    ("goodput_req_s", "goodput", True),
)
# A time figure below this (ms) is no measurement: an ITL p50 of ~0 means the server sends
# tokens in bursts (several SSE events arrive in one read, as vLLM does under load), so its
# ratio is left out ("–") and TPOT p50 ((e2e - TTFT) / (tokens - 1), burst-proof) speaks for it.
MIN_TIME_MS = 0.05


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str
    model: str | None = None  # None: the first the server lists


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    concurrency: int | None  # None: a replayed workload (bursty arrivals on its own times)

    @property
    def label(self) -> str:
        return f"{self.workload}-replay" if self.concurrency is None else f"{self.workload}-c{self.concurrency}"


def parse_target(text: str) -> Target:
    """NAME=URL or NAME=URL,MODEL."""
    name, sep, rest = text.partition("=")
    url, _, model = rest.partition(",")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--target {text!r}: expected NAME=http://HOST:PORT[,MODEL]")
    return Target(name, url.rstrip("/"), model or None)


def parse_cells(specs: Sequence[str]) -> list[Cell]:
    """WORKLOAD:C1,C2,... each, in the order given; WORKLOAD:replay for a workload with its own
    arrival times (burst-agent, tenant-rag): one open-loop cell, every target on the same times."""
    cells = []
    for spec in specs:
        workload, sep, levels = spec.partition(":")
        if workload not in WORKLOADS:
            raise ValueError(f"--grid {spec!r}: unknown workload {workload!r} (one of {', '.join(sorted(WORKLOADS))})")
        if levels == "replay":
            if not WORKLOADS[workload].replayed:
                raise ValueError(f"--grid {spec!r}: {workload} has no arrival times of its own; give concurrency levels")
            cells.append(Cell(workload, None))
            continue
        try:
            concurrencies = [int(c) for c in levels.split(",")] if sep else []
        except ValueError:
            concurrencies = []
        if not concurrencies or min(concurrencies) < 1:
            raise ValueError(f"--grid {spec!r}: expected {workload}:1,8,32 (concurrency levels >= 1) or {workload}:replay")
        cells += [Cell(workload, c) for c in concurrencies]
    return cells


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs since boot; None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)  # idle + iowait


async def quiet(idle_share: float, max_s: float, period_s: float = 0.25) -> float:
    """Wait until the CPUs were at least `idle_share` idle over one period, at most `max_s`;
    returns the seconds waited (max_s when it never got that quiet, or /proc/stat is absent)."""
    if idle_share <= 0:
        return 0.0
    start = time.monotonic()
    before = _cpu_times()
    while before is not None and time.monotonic() - start < max_s:
        await asyncio.sleep(period_s)
        after = _cpu_times()
        if after is None:
            break
        idle, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and idle / total >= idle_share:
            return time.monotonic() - start
        before = after
    await asyncio.sleep(max(0.0, max_s - (time.monotonic() - start)))
    return max_s


def turn(targets: Sequence[Target], index: int) -> list[Target]:
    """The targets in the order cell `index` runs them: each target leads in turn."""
    k = index % len(targets) if targets else 0
    return [*targets[k:], *targets[:k]]


def ratio(base: float | None, peer: float | None) -> float | None:
    if base is None or peer is None or peer <= 0 or base < 0:
        return None
    return base / peer


def _figure(summary: RunSummary, field_name: str, higher_better: bool) -> float | None:
    """A run's figure, or None where it is no measurement (nothing finished, a ~0 time)."""
    value: float | None = getattr(summary, field_name)
    if not summary.num_ok or value is None or (not higher_better and value < MIN_TIME_MS):
        return None
    return value


def ratios(base: RunSummary, peer: RunSummary) -> dict[str, float | None]:
    """baseline / peer for each of FIGURES; None where either side has no figure (nothing
    finished, or a time below MIN_TIME_MS)."""
    return {
        column: ratio(_figure(base, field_name, higher), _figure(peer, field_name, higher))
        for field_name, column, higher in FIGURES
    }


def versus_best(cells: Sequence[Cell], results: dict[tuple[str, str], RunSummary], baseline: str,
                peers: Sequence[str]) -> list[dict[str, Any]]:  # fmt: skip
    """Per cell and figure, the baseline against the best peer on that figure (the most tok/s,
    the least time): BENCHMARKS.md's P1 and P3 are read here. {cell, figure, peer, ratio}."""
    out: list[dict[str, Any]] = []
    for cell in cells:
        base = results.get((cell.label, baseline))
        if base is None:
            continue
        for field_name, column, higher in FIGURES:
            found = [(v, p) for p in peers if (r := results.get((cell.label, p))) is not None
                     and (v := _figure(r, field_name, higher)) is not None]  # fmt: skip
            if not found:
                continue
            value, peer = max(found) if higher else min(found)
            out.append({"cell": cell.label, "figure": column, "peer": peer,
                        "ratio": ratio(_figure(base, field_name, higher), value)})  # fmt: skip
    return out


def best_table(best: Sequence[dict[str, Any]]) -> str:
    """Markdown: a row per cell, baseline / best peer on each figure, naming that peer."""
    head = ["cell", *(column for _, column, _ in FIGURES)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_cell: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in best:
        by_cell.setdefault(entry["cell"], {})[entry["figure"]] = entry
    for cell, figures in by_cell.items():
        values = []
        for _, column, _ in FIGURES:
            e = figures.get(column)
            values.append("–" if e is None else f"{_fmt_ratio(e['ratio'])} ({e['peer']})")
        rows.append("| " + " | ".join([cell, *values]) + " |")
    return "\n".join(rows)


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def ratio_table(cells: Sequence[Cell], results: dict[tuple[str, str], RunSummary], baseline: str,
                peers: Sequence[str]) -> str:  # fmt: skip
    """Markdown: a row per cell and peer, baseline / peer for each figure."""
    head = ["cell", "peer", *(column for _, column, _ in FIGURES)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        base = results.get((cell.label, baseline))
        for peer in peers:
            other = results.get((cell.label, peer))
            found = ratios(base, other) if base is not None and other is not None else {}
            values = [_fmt_ratio(found.get(column)) for _, column, _ in FIGURES]
            rows.append("| " + " | ".join([cell.label, peer, *values]) + " |")
    return "\n".join(rows)


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def absolute_table(cells: Sequence[Cell], results: dict[tuple[str, str], RunSummary], names: Sequence[str]) -> str:
    """Markdown: each target's own figures per cell (ok/sent, tok/s, TTFT and ITL in ms)."""
    head = ["cell", "target", "ok/sent", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
            "goodput", "hit"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        for name in names:
            s = results.get((cell.label, name))
            if s is None:
                continue
            rows.append("| " + " | ".join([
                cell.label, name, f"{s.num_ok}/{s.num_sent}", _fmt(s.output_tok_s, ".1f"),
                _fmt(s.ttft_p50_ms, ".0f"), _fmt(s.ttft_p99_ms, ".0f"), _fmt(s.itl_p50_ms, ".1f"),
                _fmt(s.itl_p99_ms, ".1f"), _fmt(s.tpot_p50_ms, ".1f"), _fmt(s.goodput_req_s, ".2f"),
                _fmt(s.prefix_hit_rate, ".2f"),
            ]) + " |")  # fmt: skip
    return "\n".join(rows)


def report(cells: Sequence[Cell], targets: Sequence[Target], results: dict[tuple[str, str], RunSummary],
           models: dict[str, str], floors: Sequence[str] = ()) -> dict[str, Any]:  # fmt: skip
    """The JSON document: targets, every run's summary, the ratios against the baseline, and
    the baseline against the best peer that is not a floor (a one-request-at-a-time server's
    single stream has the least ITL and is nobody's pick for serving)."""
    baseline, peers = targets[0].name, [t.name for t in targets[1:]]
    contenders = [p for p in peers if p not in floors]
    doc_ratios = []
    for cell in cells:
        base = results.get((cell.label, baseline))
        for peer in peers:
            other = results.get((cell.label, peer))
            if base is not None and other is not None:
                doc_ratios.append({"cell": cell.label, "peer": peer, **ratios(base, other)})
    return {
        "baseline": baseline,
        "targets": [{"name": t.name, "url": t.url, "model": models.get(t.name)} for t in targets],
        "runs": [{"target": name, **to_json(s)} for (_, name), s in results.items()],
        "ratios": doc_ratios,
        "floors": list(floors),
        "versus_best": versus_best(cells, results, baseline, contenders),
    }


def plot_ratios(doc: dict[str, Any], path: str | Path) -> None:
    """Bars of baseline / peer per cell: throughput (higher is better for the baseline) and
    TTFT/ITL p50 (lower is better), one bar per peer."""
    import numpy as np
    from matplotlib.figure import Figure

    cells = list(dict.fromkeys(r["cell"] for r in doc["ratios"]))
    peers = list(dict.fromkeys(r["peer"] for r in doc["ratios"]))
    fig = Figure(figsize=(max(8.0, 1.2 * len(cells) + 4), 9))
    axes = fig.subplots(3, 1, sharex=True)
    x = np.arange(len(cells))
    width = 0.8 / max(1, len(peers))
    by_key = {(r["cell"], r["peer"]): r for r in doc["ratios"]}
    for ax, column, better in zip(axes, ("tok/s", "TTFT p50", "ITL p50"), ("higher", "lower", "lower"), strict=True):
        for i, peer in enumerate(peers):
            values = [by_key.get((c, peer), {}).get(column) for c in cells]
            ax.bar(x + i * width, [v if v is not None else 0.0 for v in values], width, label=peer)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"{doc['baseline']} / peer")
        ax.set_title(f"{column}: {doc['baseline']} / peer ({better} is better for {doc['baseline']})")
        ax.legend(fontsize="small")
    axes[-1].set_xticks(x + width * (len(peers) - 1) / 2, cells, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def _model_of(target: Target) -> str:
    if target.model:
        return target.model
    models = await list_models(target.url)
    if not models:
        raise RuntimeError(f"{target.name}: {target.url}/v1/models lists no model; give NAME=URL,MODEL")
    return models[0]


async def run_comparison(args: argparse.Namespace) -> dict[str, Any]:
    targets: list[Target] = args.target
    cells: list[Cell] = args.cells
    models = {t.name: await _model_of(t) for t in targets}
    renderer = PromptRenderer(PromptMode.TOKENS, args.vocab_size, load_tokenizer(args.tokenizer) if args.tokenizer else None)
    results: dict[tuple[str, str], RunSummary] = {}
    failures: list[dict[str, str]] = []
    for index, cell in enumerate(cells):
        workload = make_workload(cell.workload, [])
        if cell.concurrency is None:
            n = args.replay_requests or default_num_requests(workload, None, None)
        else:
            n = args.requests or default_num_requests(workload, cell.concurrency, None)
        plan = RunPlan(label=cell.label, seed=f"{args.seed}/{cell.label}", concurrency=cell.concurrency, rate=None,
                       num_requests=n, time_cap_s=args.cell_cap, request_timeout_s=args.request_timeout,
                       progress=False)  # fmt: skip
        for target in turn(targets, index):
            waited = await quiet(args.quiet_idle, args.quiet_max)
            if waited >= args.quiet_max:
                logger.warning("%s on %s: the machine was not %.0f%% idle within %.0f s; measuring anyway", cell.label,
                               target.name, 100 * args.quiet_idle, args.quiet_max)  # fmt: skip
            model = models[target.name]
            client = StreamClient(ClientConfig(target.url, model, None, True))
            try:
                async with contextlib.aclosing(client):
                    run = await execute(plan, workload, client, renderer)
            except Exception as exc:  # this cell of this target is lost, not the comparison
                logger.error("%s on %s failed: %s", cell.label, target.name, exc)
                failures.append({"cell": cell.label, "target": target.name, "error": str(exc)})
                continue
            summary = summarize(run, SLO_BY_MODEL.get(model, SLO()))
            results[(cell.label, target.name)] = summary
            logger.info("%s on %s: %d/%d ok, %.1f tok/s", cell.label, target.name, summary.num_ok, summary.num_sent,
                        summary.output_tok_s)  # fmt: skip
    doc = {**report(cells, targets, results, models, floors=args.floor or ()), "seed": args.seed,
           "failures": failures}  # fmt: skip
    names = [t.name for t in targets]
    print(absolute_table(cells, results, names), file=sys.stderr)
    print(file=sys.stderr)
    print(ratio_table(cells, results, names[0], names[1:]), file=sys.stderr)
    print(file=sys.stderr)
    print(best_table(doc["versus_best"]), file=sys.stderr)
    return doc


def tables_of(doc: dict[str, Any]) -> str:
    """The three tables again from a saved document (--out), e.g. after a change to them."""
    names = [t["name"] for t in doc["targets"]]
    results: dict[tuple[str, str], RunSummary] = {}
    for run in doc["runs"]:
        fields = {k: v for k, v in run.items() if k != "target"}
        summary = RunSummary(**fields)
        results[(summary.label, run["target"])] = summary
    cells: list[Cell] = []
    for summary in results.values():
        if summary.concurrency is None and not summary.label.endswith("-replay"):
            raise ValueError(f"run {summary.label} is neither closed-loop nor a replay: not a bench.compare document")
        if (cell := Cell(summary.workload, summary.concurrency)) not in cells:
            cells.append(cell)
    best = versus_best(cells, results, names[0], [n for n in names[1:] if n not in doc.get("floors", ())])
    return "\n\n".join([absolute_table(cells, results, names), ratio_table(cells, results, names[0], names[1:]),
                        best_table(best)])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["tables"]:  # python -m bench.compare tables DOC.json
        if len(argv) != 2:
            print("usage: python -m bench.compare tables DOC.json", file=sys.stderr)
            return 2
        print(tables_of(json.loads(Path(argv[1]).read_text())))
        return 0
    ap = argparse.ArgumentParser(prog="bench.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--target", action="append", required=True, type=parse_target,
                    help="NAME=URL[,MODEL]; the first is the baseline (baton)")  # fmt: skip
    ap.add_argument("--grid", action="append", required=True, help="WORKLOAD:C1,C2,... (repeat for more workloads)")
    ap.add_argument("--floor", action="append", help="a target that is a floor (the transformers server): "
                    "in the ratio tables, but not a contender for the best-peer table")  # fmt: skip
    ap.add_argument("--cell-cap", type=float, default=300.0, help="seconds per target per cell")
    ap.add_argument("--requests", type=int, help="requests per cell (default: BENCHMARKS.md's 12/32/64 at c=1/8/32)")
    ap.add_argument("--replay-requests", type=int, help="requests per replayed cell (WORKLOAD:replay; default 64)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", help="prompt seed (default: a new one per run, recorded in the document): a server "
                    "that saw the same prompts before serves them from its prefix cache")  # fmt: skip
    ap.add_argument("--vocab-size", type=int, default=16384, help="prompt token ids are drawn from [100, N)")
    ap.add_argument("--tokenizer", help="the model's tokenizer.json (or its directory): re-encodes the outputs of "
                    "servers that return no token ids (llama-server, vLLM) for multi-turn histories")  # fmt: skip
    ap.add_argument("--quiet-idle", type=float, default=0.9, help="idle share of the CPUs a run waits for (0: none)")
    ap.add_argument("--quiet-max", type=float, default=10.0, help="seconds a run waits for the machine at most")
    ap.add_argument("--out", type=Path, help="write the JSON document here too")
    ap.add_argument("--plot", type=Path, help="write a PNG of the ratios")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = f"{int(time.time())}"
    try:
        args.cells = parse_cells(args.grid)
    except ValueError as exc:
        ap.error(str(exc))
    if len({t.name for t in args.target}) != len(args.target):
        ap.error("--target names must differ")
    unknown = set(args.floor or ()) - {t.name for t in args.target[1:]}
    if unknown:
        ap.error(f"--floor {', '.join(sorted(unknown))}: not a peer's --target name")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # bench.server_proc polls readiness with httpx
    doc = run_loop(run_comparison(args))
    line = json.dumps(doc)
    if args.out:
        args.out.write_text(line + "\n")
    if args.plot and doc["ratios"]:
        plot_ratios(doc, args.plot)
    print(line, flush=True)
    return 0 if all(r["num_ok"] for r in doc["runs"]) and not doc["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
