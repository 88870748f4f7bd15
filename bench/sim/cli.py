"""`baton sim`: the capacity planner's cluster simulator (BENCHMARKS.md P11). baton's real
scheduler (cluster.placement.policy.Placer) and index (cluster.placement.global_index.GlobalIndex) place
requests on simulated prefill and decode workers, next to round-robin, least-loaded and
prefix-only routing, on the same traffic, in virtual time.

    baton sim --prefill 64 --decode 64 --workload agent:2+multiturn+rag --tenants 32 --rate 160
    baton sim --trace trace.jsonl --calibration my-gpu.json --policies baton,prefix-only

Workers cost what measured runs say (bench.sim.calibration: baton-small by default, or
--calibration FILE.json); their caches evict least recently used pages and tell the index by
real KV events (--event-delay / --event-loss exercise its snapshots). Per policy: goodput
under the TTFT / ITL SLOs, throughput, TTFT p50/p99, ITL p99, token-weighted prefix hit
rate, locality given up, and load imbalance (bench.sim.report). The table goes to stdout,
with the calibration and its source; --json FILE writes every figure.

The pieces (bench/sim/): calibration (costs), cache (tiered LRU + event bus), workers
(prefill queue, decode batch), traffic (sessions and page hashes), policies, simulation (the
event loop), report (figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench.sim.calibration import BUILTIN, Calibration, load_calibration
from bench.sim.policies import POLICIES
from bench.sim.report import SimResult, ratios, table
from bench.sim.simulation import FleetConfig, Simulation
from bench.sim.traffic import Mix, Traffic, load_trace_traffic, parse_mix
from engine.errors import BatonError

DEFAULT_WORKLOAD = "agent:2+multiturn+rag"
RATE_PER_PREFILL = 2.5  # requests / s per prefill worker when --rate is not given
_FLEET = FleetConfig()


def simulate(cal: Calibration, fleet: FleetConfig, policies: Sequence[str], traffic: Traffic,
             slo: tuple[float, float], seed: int = 0, jobs: int = 1) -> list[tuple[SimResult, float]]:
    """Each policy on the same traffic: (its result, wall seconds its run took). `jobs` > 1
    runs policies in that many processes (each run is itself one sequential simulation)."""
    runs = [(cal, fleet, name, traffic, slo, seed) for name in policies]
    if jobs <= 1 or len(runs) <= 1:
        return [_simulate_one(*run) for run in runs]
    with ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=get_context("fork")) as pool:
        return list(pool.map(_simulate_one, *zip(*runs, strict=True)))


def _simulate_one(cal: Calibration, fleet: FleetConfig, policy: str, traffic: Traffic,
                  slo: tuple[float, float], seed: int) -> tuple[SimResult, float]:
    start = time.perf_counter()
    result = Simulation(cal, fleet, policy, traffic, slo, seed).run()
    return result, time.perf_counter() - start


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "sim", help="cluster simulator: placement policies on simulated workers (real scheduler and index)"
    )
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--prefill", type=int, default=64, help="simulated prefill workers")
    p.add_argument("--decode", type=int, default=64, help="simulated decode workers")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD,
                   help="BENCHMARKS.md workloads with weights, e.g. agent:2+multiturn+rag")
    p.add_argument("--param", action="append", default=[], metavar="[NAME.]FIELD=VALUE",
                   help="override a workload field (all workloads of the mix that have it, or NAME's)")
    p.add_argument("--tenants", type=int, default=32, help="tenants, each with its own prompts and salt")
    p.add_argument("--tenant-skew", type=float, default=1.0, help="Zipf exponent of tenant popularity")
    p.add_argument("--rate", type=float, default=None,
                   help=f"requests / s (default {RATE_PER_PREFILL} x prefill workers)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals, virtual (default 60, shortened past 64 prefill workers so the "
                        "offered requests, and the run's time, stay about the same: 60 x 64 / prefill, >= 10)")
    p.add_argument("--think", type=float, default=1.0, help="mean seconds between a turn's end and the next")
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL instead of --workload")
    p.add_argument("--block-size", type=int, default=512, help="trace: tokens per hash id")
    p.add_argument("--speed", type=float, default=1.0, help="trace: replay speed-up")
    p.add_argument("--limit", type=int, default=None, help="trace: first N requests")
    p.add_argument("--calibration", default="baton-small",
                   help=f"{' or '.join(BUILTIN)}, or a JSON file of bench.sim.calibration.Calibration fields")
    p.add_argument("--transport", default="grpc", help="prefill -> decode path (a calibration transport)")
    p.add_argument("--prefill-pages", type=int, default=_FLEET.prefill_pages, help="device pages per prefill worker")
    p.add_argument("--host-pages", type=int, default=_FLEET.host_pages, help="per prefill worker")
    p.add_argument("--decode-pages", type=int, default=_FLEET.decode_pages,
                   help="pages per decode worker: reservations (prompt + output), the rest caches")
    p.add_argument("--max-running", type=int, default=_FLEET.max_running, help="decode batch limit")
    p.add_argument("--stats-interval", type=float, default=_FLEET.stats_interval_s,
                   help="seconds between workers' stats reports (what baton's placer sees of load)")
    p.add_argument("--event-delay", type=float, default=0.0, help="seconds KV events take to the index")
    p.add_argument("--event-loss", type=float, default=0.0, help="share of KV events lost")
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds (default: the calibration's model's)")
    p.add_argument("--slo-itl", type=float, default=None, help="seconds, per request's ITL p99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="policies simulated at once, in processes (default: the cores, up to 4)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        cal = load_calibration(args.calibration)
        policies = [name.strip() for name in args.policies.split(",") if name.strip()]
        unknown = [name for name in policies if name not in POLICIES]
        if unknown or not policies:
            raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
        fleet = FleetConfig(args.prefill, args.decode, args.prefill_pages, args.host_pages, args.decode_pages,
                            max_running=args.max_running, transport=args.transport,
                            stats_interval_s=args.stats_interval, event_delay_s=args.event_delay,
                            event_loss=args.event_loss)  # fmt: skip
        slo = (args.slo_ttft or cal.slo_ttft_s, args.slo_itl or cal.slo_itl_s)
        traffic, described = _traffic(args)
        if fleet.transport not in cal.transfer_bytes_per_s:
            raise ValueError(f"--transport {fleet.transport!r}: {cal.name} has {', '.join(cal.transfer_bytes_per_s)}")
    except (ValueError, OSError) as exc:
        raise BatonError(f"sim: {exc}") from None
    print(f"calibration: {cal.name} ({'built-in' if args.calibration in BUILTIN else args.calibration})")
    print(f"  {cal.source}")
    print(f"fleet: {fleet.num_prefill} prefill + {fleet.num_decode} decode simulated workers, transport "
          f"{fleet.transport}; pages per prefill worker {fleet.prefill_pages} device + {fleet.host_pages} host, "
          f"per decode worker {fleet.decode_pages}; SLO TTFT <= {slo[0]:g} s, ITL p99 <= {slo[1] * 1e3:g} ms")
    print(f"traffic: {described}")
    results = simulate(cal, fleet, policies, traffic, slo, args.seed, args.jobs)
    print()
    for line in table([r for r, _ in results]):
        print(line)
    print()
    for line in ratios([r for r, _ in results]):
        print(line)
    print("requests: " + ", ".join(f"{r.policy} {r.num_finished}/{r.num_requests} in {wall:.1f} s wall"
                                   for r, wall in results))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({
            "calibration": {"name": cal.name, "source": cal.source}, "fleet": _asdict(fleet), "traffic": described,
            "slo": {"ttft_s": slo[0], "itl_s": slo[1]},
            "results": [dict(r.to_dict(), wall_s=round(wall, 2)) for r, wall in results],
        }, indent=2) + "\n", encoding="utf-8")  # fmt: skip
    return 0


def _traffic(args: argparse.Namespace) -> tuple[Traffic, str]:
    if args.trace:
        trace = load_trace_traffic(args.trace, str(args.seed), args.block_size, args.speed, args.limit)
        if not trace.workload.entries:
            raise ValueError(f"trace {args.trace} has no requests")
        return trace, f"trace {args.trace}: {len(trace.workload.entries)} requests over {trace.end_s:.1f} s"
    rate = args.rate if args.rate is not None else RATE_PER_PREFILL * args.prefill
    duration = args.duration if args.duration is not None else max(10.0, 60.0 * min(1.0, 64 / max(1, args.prefill)))
    mix = Mix(parse_mix(args.workload, args.param), args.tenants, args.tenant_skew, rate, duration,
              args.think, str(args.seed))
    return mix, (f"{args.workload} over {args.tenants} tenants (Zipf {args.tenant_skew:g}), "
                 f"{rate:g} requests/s for {duration:g} s, think {args.think:g} s")


def _asdict(fleet: FleetConfig) -> dict[str, Any]:
    return dataclasses.asdict(fleet)
