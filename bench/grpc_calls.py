"""What one unary gRPC call costs over one channel, against what it asks the engine for: the
measurement issue 24 asks for before a batched or bidirectional-stream RPC is added.

    python -m bench.grpc_calls --target 127.0.0.1:50051 [--model baton-tiny] [--calls 400]
                               [--concurrency 1,32] [--api-key KEY]

For each concurrency c (calls in flight on one channel, one HTTP/2 connection), in turns:
    Tokenize   a short text: the RPC's own cost (parse, auth, one tokenizer call, reply)
    Complete   a 16-token prompt, max_tokens=1, greedy: one engine step's worth of work
and per method the calls/s and the p50 / p99 latency. If Tokenize's calls/s are far above
Complete's, the per-call overhead is not what bounds a high-volume client, and batching calls
into one RPC would not pay. Prints one JSON line per (method, c) on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from cluster.client import AsyncBatonClient, Sampling

PROMPT = list(range(1000, 1016))


async def _run(call: Callable[[], Awaitable[object]], calls: int, concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:  # bounded: `calls` calls in all
            left -= 1
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {"calls_per_s": len(latencies) / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    async with AsyncBatonClient(args.target, model=args.model, api_key=args.api_key, timeout_s=60) as client:
        methods: dict[str, Callable[[], Awaitable[object]]] = {
            "Tokenize": lambda: client.tokenize("the quick brown fox"),
            "Complete": lambda: client.complete(PROMPT, sampling=Sampling(max_tokens=1, temperature=0.0)),
        }
        for c in args.concurrency:
            for name, call in methods.items():
                await _run(call, min(args.calls, 4 * c), c)  # warm the channel and the caches
                row = {"method": name, "concurrency": c, **await _run(call, args.calls, c)}
                print(json.dumps(row), flush=True)
                print(f"{name:9} c={c:<3} {row['calls_per_s']:8.0f} calls/s  p50 {row['p50_ms']:6.2f} ms  "
                      f"p99 {row['p99_ms']:6.2f} ms", file=sys.stderr)  # fmt: skip


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--model", default="baton-tiny")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(_parse()))
