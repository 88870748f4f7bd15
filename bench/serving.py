"""`baton bench --url URL --workload NAME ...`: the serving benchmark over a grid of runs.

    baton bench --url http://127.0.0.1:8000 --workload rag --concurrency 1,8,32 \\
        --out results.json --plot results.png
    baton bench --grpc 127.0.0.1:50051 --workload rag --concurrency 1,8,32

Drives any OpenAI-compatible server (baton, vLLM, llama-server) through streaming
`/v1/completions`, so peers are measured by the same client; with --grpc it drives baton's
gRPC `Generate` instead, timed the same way (bench.transport), so the two edges compare.
Each run of the grid (one per concurrency level, or per request rate with --rate, or one trace
replay) draws a fresh prompt set from (--seed, run label): the same invocation sends the same
prompts to every server, and no run starts warm from the one before. Prints one JSON object
per run on stdout and a table on stderr; --out writes all runs to one file, --plot a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import ClientConfig, StreamClient, list_models
from bench.prompts import MissingTokenIds, PromptMode, PromptRenderer, load_tokenizer
from bench.report import SLO, RunSummary, summarize, table, to_json
from bench.runner import RunPlan, RunResult, default_num_requests, execute
from bench.trace import TraceWorkload, load_trace
from bench.transport import Transport
from bench.transport import run as run_loop
from bench.workloads import WORKLOADS, Workload, make_workload
from engine.errors import BatonError

logger = logging.getLogger(__name__)

# BENCHMARKS.md: TTFT <= 2 s and ITL p99 <= 200 ms on baton-tiny, 10 s and 1 s on baton-small.
SLO_BY_MODEL = {"baton-small": SLO(ttft_s=10.0, itl_s=1.0)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving benchmark (without --offline)")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of an OpenAI-compatible server")
    g.add_argument("--grpc", metavar="HOST:PORT", help="drive baton's gRPC Generate here instead of --url")
    g.add_argument("--grpc-tls", action="store_true", help="--grpc over TLS (the system's root certificates)")
    g.add_argument("--workload", default="random", choices=sorted(WORKLOADS), help="ignored with --trace")
    g.add_argument("--trace", help="replay a Mooncake-format JSONL trace")
    g.add_argument("--block-size", type=int, default=512, help="tokens per trace hash id")
    g.add_argument("--trace-speed", type=float, default=1.0, help="replay N times faster")
    g.add_argument("--concurrency", help="closed-loop levels, e.g. 1,8,32 (the default without --rate/--trace)")
    g.add_argument("--rate", help="open-loop Poisson request rates per second, e.g. 1,2,4")
    g.add_argument("--requests", type=int, help="requests per run (default: 12/32/64 at c=1/8/32)")
    g.add_argument("--seed", default="0")
    g.add_argument("--model", help="model name (default: the first of GET --url/v1/models, also with --grpc)")
    g.add_argument("--api-key", help="sent as Authorization: Bearer (a header, or gRPC metadata)")
    g.add_argument("--out", type=Path, help="write every run's figures to this JSON file")
    g.add_argument("--plot", type=Path, help="write TTFT/ITL distributions and throughput to this PNG")
    g.add_argument("--slo-ttft", type=float, help="seconds (default 2; 10 on baton-small)")
    g.add_argument("--slo-itl", type=float, help="ITL p99 seconds (default 0.2; 1 on baton-small)")
    g.add_argument("--time-cap", type=float, default=120.0, help="seconds per run")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--prompt-mode", choices=[m.value for m in PromptMode], default="tokens")
    g.add_argument("--vocab-size", type=int, default=16384, help="token-mode ids are drawn from [100, N)")
    g.add_argument("--tokenizer", help="tokenizer.json to re-encode outputs when a server returns no ids")
    g.add_argument("--new-connection", action="store_true", help="a fresh connection (gRPC channel) per request")
    g.add_argument("--page-size", type=int, default=16, help="page size of the ideal prefix-hit count")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="workload field override")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar on stderr")


@dataclass(frozen=True, slots=True)
class Grid:
    workload: Workload
    plans: tuple[RunPlan, ...]
    slo: SLO


def _levels(text: str | None, kind: type[int] | type[float], flag: str) -> list[Any]:
    if not text:
        return []
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BatonError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise BatonError(f"{flag}: values must be positive")
    return values


def build_workload(args: argparse.Namespace) -> Workload:
    try:
        if args.trace:
            replay = not (args.concurrency or args.rate)
            entries = tuple(load_trace(args.trace))
            return TraceWorkload(entries, block_size=args.block_size, replay=replay, speed=args.trace_speed)
        return make_workload(args.workload, args.param)
    except (OSError, ValueError) as exc:
        raise BatonError(str(exc)) from None


def build_grid(args: argparse.Namespace, model: str) -> Grid:
    workload = build_workload(args)
    default_slo = SLO_BY_MODEL.get(model, SLO())
    slo = SLO(args.slo_ttft or default_slo.ttft_s, args.slo_itl or default_slo.itl_s)
    concurrencies: list[int] = _levels(args.concurrency, int, "--concurrency")
    rates: list[float] = _levels(args.rate, float, "--rate")
    modes: list[tuple[str, int | None, float | None]] = [(f"c{c}", c, None) for c in concurrencies]
    modes += [(f"r{r:g}", None, r) for r in rates]
    if not modes:
        if isinstance(workload, TraceWorkload) or workload.replayed:
            modes = [("replay", None, None)]
        else:
            modes = [(f"c{c}", c, None) for c in (1, 8, 32)]
    plans = []
    for suffix, c, r in modes:
        label = f"{workload.name}-{suffix}"
        if args.requests:
            n = args.requests
        elif isinstance(workload, TraceWorkload):
            n = len(workload.entries)
        else:
            n = default_num_requests(workload, c, r)
        plans.append(
            RunPlan(
                label=label, seed=f"{args.seed}/{label}", concurrency=c, rate=r, num_requests=n,
                time_cap_s=args.time_cap, request_timeout_s=args.request_timeout,
                page_size=args.page_size, progress=args.progress,
            )
        )
    return Grid(workload, tuple(plans), slo)


async def _model(args: argparse.Namespace) -> str:
    """--model, else the first model the HTTP side lists (gRPC has no model listing; `baton up`
    serves both edges, so --url names the same server)."""
    if args.model:
        return str(args.model)
    try:
        models = await list_models(args.url, args.api_key)
    except (aiohttp.ClientError, OSError, ValueError, TypeError) as exc:
        raise BatonError(f"cannot list models at {args.url}/v1/models ({exc}); pass --model") from None
    if not models:
        raise BatonError(f"{args.url}/v1/models lists no model; pass --model")
    return models[0]


async def run_grid(args: argparse.Namespace) -> tuple[list[RunResult], list[RunSummary], str]:
    model = await _model(args)
    grid = build_grid(args, model)
    renderer = PromptRenderer(
        PromptMode(args.prompt_mode), args.vocab_size, load_tokenizer(args.tokenizer) if args.tokenizer else None
    )
    runs: list[RunResult] = []
    summaries: list[RunSummary] = []
    for plan in grid.plans:
        async with contextlib.aclosing(open_transport(args, model)) as client:
            try:
                run = await execute(plan, grid.workload, client, renderer)
            except MissingTokenIds as exc:
                raise BatonError(str(exc)) from None
        summary = summarize(run, grid.slo)
        _emit(summary)
        runs.append(run)
        summaries.append(summary)
    return runs, summaries, model


def open_transport(args: argparse.Namespace, model: str) -> Transport:
    """A fresh connection (pool) per run, so no run inherits another's connections."""
    if args.grpc:
        try:
            from bench.grpc_client import GrpcClient, GrpcConfig  # grpcio only when asked for
        except ImportError as exc:
            raise BatonError(f"--grpc needs grpcio (the serve extra): {exc}") from None
        return GrpcClient(GrpcConfig(args.grpc, model, args.api_key, args.new_connection, args.grpc_tls))
    return StreamClient(ClientConfig(args.url, model, args.api_key, args.new_connection))


def run(args: argparse.Namespace) -> int:
    """The `baton bench` entry point (without --offline)."""
    runs, summaries, model = run_loop(run_grid(args))
    _finish(summaries)
    if args.out:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
        transport, endpoint = ("grpc", args.grpc) if args.grpc else ("http", args.url)
        doc = {"model": model, "transport": transport, "endpoint": endpoint, "config": config,
               "runs": [to_json(s) for s in summaries]}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        logger.info("wrote %s", args.out)
    if args.plot:
        from bench.plot import plot

        plot(runs, summaries, args.plot)
        logger.info("wrote %s", args.plot)
    return 0 if all(s.num_ok for s in summaries) else 1


def _emit(summary: RunSummary) -> None:
    print(json.dumps(to_json(summary)), flush=True)


def _finish(summaries: list[RunSummary]) -> None:
    print(table(summaries), file=sys.stderr)
