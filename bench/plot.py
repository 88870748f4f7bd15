"""One PNG per benchmark invocation: TTFT and ITL distributions (empirical CDFs) per run, and
output tokens/s against concurrency per workload.

Built on `matplotlib.figure.Figure`, not pyplot: a bare Figure saves through the Agg canvas,
so no display, no global backend switch and no figure registry to leak from a long process."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.report import RunSummary
from bench.runner import RunResult


def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=np.float64)) * 1000
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot(runs: Sequence[RunResult], summaries: Sequence[RunSummary], path: str | Path) -> None:
    fig = Figure(figsize=(16, 4.8))
    ax_ttft, ax_itl, ax_tput = fig.subplots(1, 3)
    for run in runs:
        ok = [r.result for r in run.records if r.result.ok]
        _cdf(ax_ttft, [r.ttft_s for r in ok if r.ttft_s is not None], run.plan.label)
        _cdf(ax_itl, [x for r in ok for x in r.itl_s], run.plan.label)
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log)")
        ax.set_ylabel("share of requests" if ax is ax_ttft else "share of intervals")
        ax.set_title(f"{name} distribution")
        ax.grid(True, which="both", alpha=0.3)
    by_workload: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in summaries:
        if s.concurrency is not None:
            by_workload[s.workload].append((s.concurrency, s.output_tok_s))
    for workload, points in sorted(by_workload.items()):
        points.sort()
        ax_tput.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=workload)
    ax_tput.set_xscale("log", base=2)
    levels = sorted({c for points in by_workload.values() for c, _ in points})
    if levels:
        ax_tput.set_xticks(levels, labels=[f"{c:g}" for c in levels])
        ax_tput.minorticks_off()
    ax_tput.set_xlabel("concurrency")
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_title("throughput vs concurrency")
    ax_tput.grid(True, alpha=0.3)
    for ax in (ax_ttft, ax_itl, ax_tput):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
