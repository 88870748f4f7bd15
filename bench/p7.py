"""P7 (BENCHMARKS.md): cache-aware placement against round robin, 2 prefill + 2 decode workers
on a private local Ray, multi-tenant prefix traffic.

    python -m bench.p7 [--tenants 16] [--prefix 256] [--suffix 48] [--requests 128]
                       [--concurrency 4] [--num-pages 160] [--policies cache,round_robin]

Traffic: `tenants` tenants, each with its own system prompt of `prefix` tokens (its own cache
salt), requests = a tenant's prompt + `suffix` fresh tokens, tenants drawn uniformly, the
same seeded stream for every policy; `concurrency` requests in flight; greedy, 8 tokens out.
Each worker's KV pool has `num_pages` pages: too few for every tenant's prefix on one worker,
enough for half of them — the case where where a request goes decides whether it hits.

For each policy the actors are launched fresh (cold caches) on the one Ray and driven through
RayFront.generate in this process (no HTTP). Figures: hit rate = prompt tokens the workers'
prefix caches served / prompt tokens sent (from the workers' own counters), TTFT p50/p90 of
the second half of the stream (after the caches warmed), requests per second. One JSON line
per policy on stdout, the table and the ratios (target: >= 1.5x hit rate, <= 0.5x TTFT p90)
on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from bench.report import percentile
from cluster.disagg_config import DisaggConfig
from cluster.fleet import ray_runtime
from cluster.fleet.front import RayFront
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams

SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    req_per_s: float
    locality_given_up_pages: int


def traffic(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    rng = random.Random(7)
    prefixes = [[rng.randrange(100, 1000) for _ in range(args.prefix)] for _ in range(args.tenants)]
    out = []
    for _ in range(args.requests):
        t = rng.randrange(args.tenants)
        out.append((f"tenant-{t}", prefixes[t] + [rng.randrange(100, 1000) for _ in range(args.suffix)]))
    return out


async def hits(front: RayFront) -> int:
    stats = await asyncio.gather(*(h.actor.stats.remote() for h in (*front.fleet.prefills, *front.fleet.decodes)))
    return sum(s.num_hit_tokens for s in stats)


async def run_policy(policy: str, engine_cfg: EngineConfig, args: argparse.Namespace) -> Result:
    from cluster.fleet.launch import launch

    front = await launch(engine_cfg, DisaggConfig(num_prefill=2, num_decode=2, transport="grpc", placement=policy))
    front.start()
    try:
        stream = traffic(args)
        ttfts: list[float] = [0.0] * len(stream)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(stream)):
            queue.put_nowait(i)

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                tenant, prompt = stream[i]
                start = time.perf_counter()
                first = True
                async for _ in front.generate(Job(f"{policy}-{i}", tuple(prompt), SAMPLING, cache_salt=tenant)):
                    if first:
                        ttfts[i] = time.perf_counter() - start
                        first = False

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - start
        hit = await hits(front)
        sent = sum(len(p) for _, p in stream)
        warm = sorted(ttfts[len(ttfts) // 2 :])
        return Result(policy, len(stream), sent, hit, hit / sent, 1e3 * (percentile(warm, 50) or 0.0),
                      1e3 * (percentile(warm, 90) or 0.0), len(stream) / seconds, front.placer.stats.given_up_pages)
    finally:
        await front.stop()


async def main_async(args: argparse.Namespace) -> list[Result]:
    engine_cfg = EngineConfig(model="baton-tiny", dtype="float32", max_model_len=512, num_pages=args.num_pages)
    results = []
    for policy in args.policies.split(","):
        result = await run_policy(policy, engine_cfg, args)
        print(json.dumps(asdict(result)), flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--suffix", type=int, default=48)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-pages", type=int, default=160)
    ap.add_argument("--policies", default="cache,round_robin")
    args = ap.parse_args(argv)
    ray_runtime.start_local()
    try:
        results = asyncio.run(main_async(args))
    finally:
        ray_runtime.shutdown()
    print(f"{'policy':<12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>6} {'given up':>8}", file=sys.stderr)
    for r in results:
        print(f"{r.policy:<12} {r.hit_rate:>8.3f} {r.ttft_p50_ms:>7.1f}ms {r.ttft_p90_ms:>7.1f}ms "
              f"{r.req_per_s:>6.1f} {r.locality_given_up_pages:>8}", file=sys.stderr)  # fmt: skip
    by = {r.policy: r for r in results}
    if "cache" in by and "round_robin" in by:
        c, rr = by["cache"], by["round_robin"]
        print(f"hit rate {c.hit_rate / max(rr.hit_rate, 1e-9):.2f}x (target >= 1.5x); "
              f"TTFT p90 {c.ttft_p90_ms / rr.ttft_p90_ms:.2f}x (target <= 0.5x)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
