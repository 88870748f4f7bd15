"""P6 (BENCHMARKS.md): decode ITL under prefill interference, `mixed` with and without its long
prompts, disaggregated against colocated.

    python -m bench.p6 [--configs disagg,colocated-chunked,colocated-unchunked] [--requests 32]
                       [--concurrency 8] [--time-cap 90] [--out p6.json]

For each configuration: start `baton up` on 127.0.0.1 as a child process (bench.server_proc),
wait for /ready, warm it up, then run the `mixed` stream twice — without the long prompts
(long_interval_s=0) and with them — and stop the server by its PID. Each run draws its own
prompts (no run starts warm from another's cache). The figures are the short requests' (the
steady decode stream's): ITL p50/p99 and TTFT, plus the long prompts' TTFT; the ratio with /
without is P6's figure (target for the disaggregated setup: ITL p99 <= 1.3x).

Budget: the run without long prompts sends --requests short requests; the run with them gets
as many more requests as long prompts arrive in the first run's duration, so both runs send
about the same short stream. A run ends at its time cap whatever happens (bench.runner).

Configurations (every engine on one core with one torch thread, `--pin-cores`):
    disagg               --prefill 1 --decode 1: prefill actor on core 0, decode actor on core 1
    colocated-chunked    one engine, chunked prefill (512 tokens of a prompt per step)
    colocated-unchunked  one engine, a whole prompt per step (the interference, for contrast)
Prints one JSON line per run on stdout and the tables on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.client import ClientConfig, StreamClient
from bench.prompts import PromptMode, PromptRenderer
from bench.report import percentile
from bench.runner import RequestRecord, RunPlan, RunResult, execute
from bench.server_proc import BatonProcess
from bench.transport import run as run_loop
from bench.workloads import MixedWorkload, make_workload

P6_TARGET = 1.3  # ITL p99 with / without the long prompts, disaggregated
UNCHUNKED = 16384  # chunk and step budget above any prompt: a prompt is prefilled in one step

CONFIGS: dict[str, tuple[str, ...]] = {
    "disagg": ("--prefill", "1", "--decode", "1", "--pin-cores", "--threads", "1"),
    "colocated-chunked": ("--prefill", "0", "--pin-cores", "--threads", "1"),
    "colocated-unchunked": ("--prefill", "0", "--pin-cores", "--threads", "1",
                            "--max-prefill-chunk", str(UNCHUNKED), "--max-batched-tokens", str(UNCHUNKED)),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Cell:
    """One run: a configuration, with or without the long prompts."""

    config: str
    with_long: bool
    num_sent: int
    num_short_ok: int
    num_long_ok: int
    num_failed: int
    duration_s: float
    itl_p50_ms: float | None  # the short requests' inter-token intervals
    itl_p99_ms: float | None
    itl_p999_ms: float | None
    itl_max_ms: float | None
    # ITL p99 of the short stream's intervals that overlap a long prompt's prefill (sent ->
    # first token), else its decode (first token -> last), else neither: where a tail comes from
    itl_p99_long_prefill_ms: float | None
    itl_p99_long_decode_ms: float | None
    itl_p99_neither_ms: float | None
    ttft_p50_ms: float | None  # the short requests'
    ttft_p99_ms: float | None
    long_ttft_p50_ms: float | None
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ratio:
    config: str
    itl_p50: float | None  # with / without
    itl_p99: float | None

    @property
    def meets_target(self) -> bool | None:
        return None if self.itl_p99 is None else self.itl_p99 <= P6_TARGET


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def itl_by_phase(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The short stream's intervals by what a long prompt was doing meanwhile (seconds from
    the run's start; an interval overlapping a long prefill counts there first):

        long:   sent |-- prefill --| first token |-- decode --| last token
        short:           |--|  "long prefill"         |--|  "long decode"     |--| "neither"
    """
    windows = [(r.start_s, r.start_s + r.result.ttft_s, r.start_s + r.result.e2e_s)
               for r in records if r.tag == "long" and r.result.ok and r.result.ttft_s is not None]  # fmt: skip
    phases: dict[str, list[float]] = {"long prefill": [], "long decode": [], "neither": []}
    for r in records:
        if r.tag != "short" or not r.result.ok or r.result.ttft_s is None:
            continue
        end = r.start_s + r.result.ttft_s
        for itl in r.result.itl_s:
            begin, end = end, end + itl
            if any(begin < first and end > sent for sent, first, _ in windows):
                phases["long prefill"].append(itl)
            elif any(begin < last and end > first for _, first, last in windows):
                phases["long decode"].append(itl)
            else:
                phases["neither"].append(itl)
    return phases


def cell_of(config: str, with_long: bool, run: RunResult) -> Cell:
    """The P6 figures of one run: decode ITL and TTFT of the short (tag "short") requests."""
    short = [r.result for r in run.records if r.tag == "short" and r.result.ok]
    long = [r.result for r in run.records if r.tag == "long" and r.result.ok]
    failed = [r.result.error or "" for r in run.records if not r.result.ok]
    itls = [x for r in short for x in r.itl_s]
    ttfts = [r.ttft_s for r in short if r.ttft_s is not None]
    phases = itl_by_phase(run.records)
    return Cell(
        config, with_long, len(run.records), len(short), len(long), len(failed), round(run.duration_s, 2),
        itl_p50_ms=_ms(percentile(itls, 50)), itl_p99_ms=_ms(percentile(itls, 99)),
        itl_p999_ms=_ms(percentile(itls, 99.9)), itl_max_ms=_ms(max(itls, default=None)),
        itl_p99_long_prefill_ms=_ms(percentile(phases["long prefill"], 99)),
        itl_p99_long_decode_ms=_ms(percentile(phases["long decode"], 99)),
        itl_p99_neither_ms=_ms(percentile(phases["neither"], 99)),
        ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p99_ms=_ms(percentile(ttfts, 99)),
        long_ttft_p50_ms=_ms(percentile([r.ttft_s for r in long if r.ttft_s is not None], 50)),
        errors=tuple(sorted(set(failed)))[:3],
    )  # fmt: skip


def ratios(cells: list[Cell]) -> list[Ratio]:
    """With / without for every configuration that has both runs, in the cells' order."""
    out: list[Ratio] = []
    for config in dict.fromkeys(c.config for c in cells):
        pair = {c.with_long: c for c in cells if c.config == config}
        if set(pair) == {False, True}:
            out.append(Ratio(config, _div(pair[True].itl_p50_ms, pair[False].itl_p50_ms),
                             _div(pair[True].itl_p99_ms, pair[False].itl_p99_ms)))  # fmt: skip
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(cells: list[Cell]) -> str:
    """Runs (ms), where the tails fall, then config x ratio with/without."""
    lines = [f"{'config':<20} {'long':>4} {'short ok/sent':>13} {'ITL p50':>8} {'ITL p99':>8} {'p99.9':>7} "
             f"{'max':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'long TTFT p50':>13}"]  # fmt: skip
    for c in cells:
        lines.append(
            f"{c.config:<20} {'yes' if c.with_long else 'no':>4} {f'{c.num_short_ok}/{c.num_sent}':>13} "
            f"{_fmt(c.itl_p50_ms):>8} {_fmt(c.itl_p99_ms):>8} {_fmt(c.itl_p999_ms, '.0f'):>7} "
            f"{_fmt(c.itl_max_ms, '.0f'):>6} {_fmt(c.ttft_p50_ms, '.0f'):>9} "
            f"{_fmt(c.ttft_p99_ms, '.0f'):>9} {_fmt(c.long_ttft_p50_ms, '.0f'):>13}"
        )
        lines.extend(f"  {c.num_failed} failed: {e[:100]}" for e in c.errors[:1])
    lines += ["", f"{'ITL p99 (ms) while a long prompt is':<30} {'prefilled':>10} {'decoded':>10} {'neither':>10}"]
    for c in cells:
        if c.with_long:
            lines.append(f"{c.config:<30} {_fmt(c.itl_p99_long_prefill_ms):>10} "
                         f"{_fmt(c.itl_p99_long_decode_ms):>10} {_fmt(c.itl_p99_neither_ms):>10}")  # fmt: skip
    lines += ["", f"{'config':<20} {'ITL p50 with/without':>21} {'ITL p99 with/without':>21}  P6 (p99 <= {P6_TARGET}x)"]
    for r in ratios(cells):
        verdict = "-" if r.meets_target is None else ("met" if r.meets_target else "missed")
        verdict = verdict if r.config == "disagg" else "(contrast)"
        lines.append(f"{r.config:<20} {_fmt(r.itl_p50, '.2f') + 'x':>21} {_fmt(r.itl_p99, '.2f') + 'x':>21}  {verdict}")
    return "\n".join(lines)


def pinning(root_pid: int) -> dict[str, list[str]]:
    """The CPU lists of the server's engine processes' threads, from /proc: the server itself
    and its Ray actors (`ray::PrefillActor`, `ray::DecodeActor`), e.g. {"ray::DecodeActor": ["1"]}."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    out: dict[str, list[str]] = {}
    for pid in sorted(tree):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().split(".")[0]
            if pid != root_pid and not name.startswith(("ray::PrefillActor", "ray::DecodeActor")):
                continue
            lists = {_cpus(task) for task in Path(f"/proc/{pid}/task").iterdir()}
        except OSError:
            continue
        out[f"{name if pid != root_pid else 'baton up'} [{pid}]"] = sorted(lists)
    return out


def _cpus(task: Path) -> str:
    for line in (task / "status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


async def _run(url: str, model: str, plan: RunPlan, workload: MixedWorkload) -> RunResult:
    renderer = PromptRenderer(PromptMode.TOKENS, 16384)
    async with StreamClient(ClientConfig(url, model)) as client:
        return await execute(plan, workload, client, renderer)


def measure(config: str, args: argparse.Namespace, log_dir: Path) -> tuple[list[Cell], dict[str, Any]]:
    """Both runs of one configuration against a fresh server."""
    mixed = make_workload("mixed", args.param)
    assert isinstance(mixed, MixedWorkload)
    without = MixedWorkload(mixed.short_len, mixed.short_output_len, mixed.long_len, mixed.long_output_len, 0.0)
    name = Path(args.model).name
    up_args = [*CONFIGS[config], "--model", args.model, "--dtype", "float32", "--served-model-name", name]
    with BatonProcess(up_args, log_dir / f"{config}.log") as server:
        ready_s = server.wait_ready(args.start_timeout)
        info = {"config": config, "argv": server.argv, "ready_s": round(ready_s, 1), "pinning": pinning(server.pid)}
        print(json.dumps(info), flush=True)

        def plan(label: str, n: int, concurrency: int) -> RunPlan:
            return RunPlan(label, f"{args.seed}/{config}/{label}", concurrency, None, n, args.time_cap,
                           args.time_cap, progress=False)  # fmt: skip

        warm = MixedWorkload(mixed.short_len, 8, mixed.long_len, 2, 0.01)
        run_loop(_run(server.url, name, plan("warmup", 3, 1), warm))
        base = run_loop(_run(server.url, name, plan("without-long", args.requests, args.concurrency), without))
        num_long = int(base.duration_s // mixed.long_interval_s) if mixed.long_interval_s > 0 else 0
        loaded = run_loop(_run(server.url, name, plan("with-long", args.requests + num_long, args.concurrency), mixed))
    info["exit_code"] = server.returncode
    cells = [cell_of(config, False, base), cell_of(config, True, loaded)]
    for cell in cells:
        print(json.dumps(asdict(cell)), flush=True)
    return cells, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.p6", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--model", default="baton-tiny")
    parser.add_argument("--requests", type=int, default=32, help="short requests per run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--time-cap", type=float, default=90.0, help="seconds per run")
    parser.add_argument("--start-timeout", type=float, default=180.0, help="seconds for baton up to be ready")
    parser.add_argument("--seed", default="p6")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="mixed workload field")
    parser.add_argument("--out", type=Path, help="write every run's figures to this JSON file")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    cells: list[Cell] = []
    servers: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="baton-p6-") as tmp:
        for config in configs:
            got, info = measure(config, args, Path(tmp))
            cells += got
            servers.append(info)
    print(table(cells), file=sys.stderr)
    if args.out:
        doc = {"servers": servers, "cells": [asdict(c) for c in cells], "ratios": [asdict(r) for r in ratios(cells)]}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(c.num_short_ok for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
