"""Soak (issue 8): baton disaggregated on a private Ray with etcd membership, under mixed
traffic and faults, checked for miscounts, leaked pages and growth.

    python -m bench.soak --minutes 30 [--prefill 1 --decode 2 --concurrency 6 --kill-every 180
                                       --etcd-restart-at 0.45 --out-dir out/soak]

    etcd (a child on loopback) ─ baton up --config cluster.yaml (a child: the gateway, a private
                                 Ray and its actors, etcd membership)
      load    bench.soak_load: `concurrency` bounded client loops of seeded requests (chat and
              completions, streamed or not, short and long prompts with shared prefixes), ~10%
              cancelled by the client, 1% invalid
      faults  bench.soak_faults: a worker SIGKILLed every `kill_every` s, etcd restarted once
      samples the gateway's RSS and open fds (/proc/<pid>) every `sample_every` s
      idle    counts settle; pages must return to their pre-load baseline

Checks (the exit status is 1 when one fails):
  - baton_requests_total (/metrics) == ok + error + cancelled + deadline + rejected, and it
    equals the requests sent (less unary calls abandoned before their request was written:
    `unsent`, known from httpx's trace of the connection); by outcome: server ok + cancelled == client ok + cancelled +
    timeouts, with server ok >= client ok (a hang-up that races the request's last token is
    ok on the server: it finished before the server could notice), server rejected + error +
    deadline == the client's rest;
  - every invalid request got a 400; every kill and the etcd restart took effect and the
    cluster recovered from it (every node ok again; etcd holds every worker's key);
  - at idle, on every node and tier: pages used == baseline, no reserved, pinned or retained pages,
    nothing running or waiting; the gateway has nothing waiting or in flight; etcd holds
    every worker's key;
  - runs of at least `slope_min_minutes`: the RSS and fd slopes (least squares over the samples
    after the first 20% of the run) within `max_rss_slope` MiB/min and `max_fd_slope` fds/min.
A table on stderr, one JSON line on stdout (also out_dir/soak.json); logs in out_dir. Also
reported, not checked: ERROR lines of baton's log and recovery counters. Checked after baton
stopped: no KV staging region (/dev/shm/baton-kv-*) new since the start is left by a dead owner
(a SIGKILLed decode worker's is removed by its restart, kvtransfer.shm.sweep_orphans).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.etcd_proc import EtcdServer
from bench.server_proc import BatonProcess, baton_command, free_port
from bench.soak_faults import FaultEvent, FaultPlan, inject, nodes, wait_rejoined
from bench.soak_load import MODEL, LoadConfig, load
from kvtransfer.shm import orphans

OUTCOMES = ("ok", "error", "cancelled", "deadline", "rejected")  # cluster.edge.frontend, cluster.edge.http_api
# unsent: a unary call abandoned before any of its request was written (the server never saw it);
# one that had begun is abandoned only once written whole (bench.soak_load._abandoned)
CLIENT_OUTCOMES = ("ok", "cancelled", "unsent", "timeout", "invalid", "not-400", "refused", "error")
IDLE_GAUGES = ("baton_inflight_requests", "baton_queue_waiting_requests", "baton_kv_transfers_inflight",
               "baton_kv_pinned_pages", "baton_kv_reserved_pages")  # fmt: skip
RECOVERY_COUNTERS = ("baton_request_migrations_total", "baton_redispatches_total", "baton_worker_restarts_total",
                     "baton_worker_stalls_total", "baton_kv_transfer_failures_total", "baton_membership_changes_total")  # fmt: skip
CLUSTER = "soak"
SHM = Path("/dev/shm")  # kvtransfer.shm's staging regions: baton-kv-<pid namespace>-<pid>-<random>
WARMUP_SHARE = 0.2


@dataclass(frozen=True, slots=True)
class SoakConfig:
    minutes: float = 30.0
    prefill: int = 1
    decode: int = 2
    concurrency: int = 6
    max_requests: int = 200_000
    abandon_min_s: float = 0.2  # a unary call the client abandons, after this long ...
    abandon_max_s: float = 0.8  # ... to this long
    kill_every_s: float = 180.0
    etcd_restart_at: float = 0.45  # share of the run
    etcd_down_s: float = 2.0
    sample_every_s: float = 10.0
    request_timeout_s: float = 120.0
    recover_timeout_s: float = 120.0
    idle_timeout_s: float = 45.0  # past the retained copies' lease: at idle they must be gone too
    retain_s: float = 30.0  # recovery.retain_s: a prefill worker holds each pushed prompt this long past its push
    max_rss_slope: float = 1.0  # MiB/min
    max_fd_slope: float = 0.2  # fds/min
    slope_min_minutes: float = 10.0
    seed: int = 0
    out_dir: Path = Path("out/soak")  # gitignored


@dataclass(frozen=True, slots=True)
class SoakReport:
    minutes: float
    client: dict[str, int]  # requests by outcome as the client saw them (+ sent, short)
    server: dict[str, int]  # baton_requests_total by outcome
    faults: list[FaultEvent]
    rss_mib: tuple[float, float]  # first and last sample
    fds: tuple[int, int]
    rss_slope_mib_min: float | None  # after warm-up
    fd_slope_min: float | None
    idle: list[dict[str, Any]]  # per node: health, pages per tier, reserved, pinned, running, waiting
    recovery: dict[str, float]  # RECOVERY_COUNTERS at the end, each summed over its labels
    log_errors: list[str]  # distinct ERROR / Traceback lines of baton's log (timestamps cut)
    phases_s: dict[str, float]  # start (baton up until every node is ok), load, idle (until checked)
    shm_left: list[str] = field(default_factory=list)  # KV staging regions new in /dev/shm, left by a dead owner
    problems: list[str] = field(default_factory=list)
    loop_lag: dict[str, float] = field(default_factory=dict)  # the gateway's, whole run: samples, over_<bound>s


def cluster_yaml(cfg: SoakConfig, etcd_port: int, http_port: int) -> str:
    disk = cfg.out_dir.resolve() / "disk"
    return f"""cluster: {CLUSTER}
model: {{path: {MODEL}, dtype: float32, max_model_len: 1024}}
workers: {{prefill: {{count: {cfg.prefill}}}, decode: {{count: {cfg.decode}}}}}
kv_cache: {{device_pages: 1024, host_pages: 256, disk_pages: 512, disk_dir: "{disk}"}}
recovery: {{max_restarts: 100, retain_s: {cfg.retain_s}}}
membership: {{backend: etcd, lease_ttl_s: 5, etcd: {{host: 127.0.0.1, port: {etcd_port}}}}}
api: {{host: 127.0.0.1, port: {http_port}, grpc_port: 0}}
"""


# -- what the gateway reports ----------------------------------------------------------------


def metric_sums(text: str) -> tuple[dict[str, int], dict[str, float]]:
    """baton_requests_total by outcome, and each of IDLE_GAUGES and RECOVERY_COUNTERS summed
    over its labels."""
    outcomes: dict[str, int] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "baton_requests_total":
                outcomes[s.labels["outcome"]] = outcomes.get(s.labels["outcome"], 0) + int(s.value)
            elif s.name in IDLE_GAUGES or s.name in RECOVERY_COUNTERS:
                gauges[s.name] = gauges.get(s.name, 0.0) + s.value
    return outcomes, gauges


LAG_BOUNDS = ("0.025", "0.1", "1.0")


def loop_lag(text: str) -> dict[str, float]:
    """The gateway's event-loop lag histogram: how many 0.1 s timer samples, and how many woke
    later than each of LAG_BOUNDS seconds."""
    buckets: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "baton_event_loop_lag_seconds_bucket":
                buckets[s.labels["le"]] = s.value
    total = buckets.get("+Inf", 0.0)
    return {"samples": total, **{f"over_{b}s": total - buckets.get(b, total) for b in LAG_BOUNDS}}


def count_problems(client: Counter[str], server: dict[str, int]) -> list[str]:
    c = {k: client[k] for k in CLIENT_OUTCOMES}
    total, known = sum(server.values()), sum(server.get(k, 0) for k in OUTCOMES)
    pairs = [
        ("requests_total vs ok + error + cancelled + deadline + rejected", total, known),
        ("requests_total vs requests sent", total, client["sent"] - client["unsent"]),
        ("server ok + cancelled vs client ok + cancelled + timeout",
         server.get("ok", 0) + server.get("cancelled", 0), c["ok"] + c["cancelled"] + c["timeout"]),
        ("server rejected + error + deadline vs client invalid + not-400 + refused + error",
         sum(server.get(k, 0) for k in ("rejected", "error", "deadline")),
         c["invalid"] + c["not-400"] + c["refused"] + c["error"]),
    ]  # fmt: skip
    problems = [f"{what}: {a} != {b}" for what, a, b in pairs if a != b]
    if server.get("ok", 0) < c["ok"]:  # more the other way is a hang-up that raced the last token
        problems.append(f"server ok {server.get('ok', 0)} < client ok {c['ok']}")
    if c["not-400"]:
        problems.append(f"{c['not-400']} invalid requests were not answered 400")
    return problems


def idle_problems(status: dict[str, Any], gauges: dict[str, float], baseline: dict[tuple[str, str], int]) -> list[str]:
    gw = status["gateway"]
    problems = [f"gateway: {k} {gw[k]}" for k in ("waiting", "inflight") if gw[k]]
    problems += [f"/metrics {k} = {v:g}" for k, v in gauges.items() if v and k in IDLE_GAUGES]
    for n in status["nodes"]:
        name = n["name"]
        if n["health"] != "ok":
            problems.append(f"{name}: health {n['health']}")
        problems += [f"{name}: {k} {n.get(k, 0)}" for k in ("running", "waiting", "reserved_pages", "pinned_pages",
                                                             "retained_pages") if n.get(k, 0)]  # fmt: skip
        for tier, t in n["cache"]["tiers"].items():
            base = baseline.get((name, tier), 0)
            if t["pages_used"] != base:
                problems.append(f"{name} {tier}: {t['pages_used']} pages used at idle, {base} at baseline")
    return problems


def idle_row(n: dict[str, Any]) -> dict[str, Any]:
    tiers = {tier: [t["pages_used"], t["pages_cached"], t["pages_total"]] for tier, t in n["cache"]["tiers"].items()}
    return {"node": n["name"], "role": n["role"], "health": n["health"], "epoch": n["epoch"],
            "pages_used_cached_total": tiers, "reserved": n["reserved_pages"], "pinned": n["pinned_pages"],
            "retained": n.get("retained_pages", 0), "running": n["running"], "waiting": n["waiting"]}  # fmt: skip


async def settle_counts(client: httpx.AsyncClient, num_sent: int, timeout_s: float = 20.0) -> None:
    """Wait until baton_requests_total reaches what was sent (the server counts a hang-up when
    it notices it) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcomes, _ = metric_sums((await client.get("/metrics")).text)
        if sum(outcomes.values()) >= num_sent:
            return
        await asyncio.sleep(0.5)


class Idle(NamedTuple):
    nodes: list[dict[str, Any]]
    problems: list[str]
    recovery: dict[str, float]


async def wait_idle(client: httpx.AsyncClient, baseline: dict[tuple[str, str], int], timeout_s: float) -> Idle:
    """The nodes at idle and what is not at baseline, polled until nothing is or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = (await client.get("/status")).json()
        _, sums = metric_sums((await client.get("/metrics")).text)
        problems = idle_problems(status, sums, baseline)
        if not problems or time.monotonic() > deadline:
            recovery = {k: sums.get(k, 0.0) for k in RECOVERY_COUNTERS}
            return Idle([idle_row(n) for n in status["nodes"]], [f"at idle: {p}" for p in problems], recovery)
        await asyncio.sleep(1.0)


def log_errors(log: Path, limit: int = 20) -> list[str]:
    """Distinct ERROR and Traceback lines of baton's log, without their timestamps."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    found = dict.fromkeys(line.split(" ", 2)[-1][:300] for line in lines if " ERROR " in line or "Traceback" in line)
    return list(found)[:limit]


# -- the run -----------------------------------------------------------------------------------


def read_proc(pid: int) -> tuple[float, int]:
    """RSS in MiB and open file descriptors of a process."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute; None under 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60.0 * sum((t - mx) * (v - my) for t, v in points) / var if var else None


async def sample(pid: int, every_s: float, start: float, stop_at: float, out: list[tuple[float, float, int]]) -> None:
    while True:
        out.append((time.monotonic() - start, *read_proc(pid)))
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(every_s, max(0.0, stop_at - time.monotonic())))


async def drive(cfg: SoakConfig, server: BatonProcess, etcd: EtcdServer, started: float) -> SoakReport:
    duration = cfg.minutes * 60
    plan = FaultPlan(duration, cfg.kill_every_s, cfg.etcd_restart_at, cfg.etcd_down_s, cfg.recover_timeout_s, cfg.seed,
                     f"/{CLUSTER}/workers/", cfg.prefill + cfg.decode)  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=30) as client:
        if await wait_rejoined(client, {}, cfg.recover_timeout_s) is None:
            raise RuntimeError(f"not every node came up ok:\n{server.log_tail()}")
        baseline = {(n["name"], tier): t["pages_used"] for n in await nodes(client)
                    for tier, t in n["cache"]["tiers"].items()}  # fmt: skip
        tally: Counter[str] = Counter()
        samples: list[tuple[float, float, int]] = []
        start = time.monotonic()
        stop_at = start + duration
        phases = {"start": start - started}
        faults = asyncio.create_task(inject(server.url, plan, server.pid, etcd, start))
        load_cfg = LoadConfig(cfg.concurrency, cfg.max_requests, cfg.request_timeout_s, cfg.seed,
                              (cfg.abandon_min_s, cfg.abandon_max_s))
        await asyncio.gather(load(server.url, load_cfg, stop_at, tally),
                             sample(server.pid, cfg.sample_every_s, start, stop_at, samples))  # fmt: skip
        events = await asyncio.wait_for(faults, cfg.recover_timeout_s * 2 + cfg.etcd_down_s + 60)
        phases["load"] = time.monotonic() - start
        await settle_counts(client, tally["sent"] - tally["unsent"])
        idle = await wait_idle(client, baseline, cfg.idle_timeout_s)
        final = (await client.get("/metrics")).text  # after the idle wait too
        server_counts, _ = metric_sums(final)
    phases["idle"] = time.monotonic() - start - phases["load"]
    members = etcd.count_keys(f"/{CLUSTER}/workers/")
    if members != cfg.prefill + cfg.decode:
        idle.problems.append(f"at idle: etcd holds {members} worker keys, not {cfg.prefill + cfg.decode}")
    result = report(cfg, tally, server_counts, events, samples, idle, log_errors(server.log_path), phases)
    return replace(result, loop_lag=loop_lag(final))


def report(cfg: SoakConfig, tally: Counter[str], server_counts: dict[str, int], events: list[FaultEvent],
           samples: list[tuple[float, float, int]], idle: Idle, errors: list[str],
           phases: dict[str, float]) -> SoakReport:  # fmt: skip
    warm = [s for s in samples if s[0] >= WARMUP_SHARE * cfg.minutes * 60]
    rss_slope = slope_per_min([(t, rss) for t, rss, _ in warm])
    fd_slope = slope_per_min([(t, float(fds)) for t, _, fds in warm])
    problems = count_problems(tally, server_counts)
    problems += [f"{e.kind} at {e.at_s:.0f} s: did not take effect" for e in events if not e.took_effect]
    problems += [f"{e.kind} at {e.at_s:.0f} s: no recovery within {cfg.recover_timeout_s:.0f} s"
                 for e in events if e.took_effect and e.recovered_s is None]  # fmt: skip
    problems += idle.problems
    if cfg.minutes >= cfg.slope_min_minutes:
        if rss_slope is None or rss_slope > cfg.max_rss_slope:
            problems.append(f"gateway RSS slope {rss_slope} MiB/min (limit {cfg.max_rss_slope})")
        if fd_slope is None or fd_slope > cfg.max_fd_slope:
            problems.append(f"gateway fd slope {fd_slope} fds/min (limit {cfg.max_fd_slope})")
    client = {k: tally[k] for k in ("sent", *CLIENT_OUTCOMES, "cancelled-stream", "cancelled-unary", "short")}
    return SoakReport(cfg.minutes, client, dict(sorted(server_counts.items())), events,
                      (samples[0][1], samples[-1][1]), (samples[0][2], samples[-1][2]),
                      rss_slope, fd_slope, idle.nodes, idle.recovery, errors, phases, problems=problems)  # fmt: skip


def run(cfg: SoakConfig) -> SoakReport:
    """Start etcd and baton, soak, stop both (baton by its PID, SIGINT), return the figures."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("etcd-data", "disk"):  # a fresh cluster each run
        shutil.rmtree(cfg.out_dir / stale, ignore_errors=True)
    etcd = EtcdServer.launch(cfg.out_dir, "soak")
    try:
        port = free_port()
        config = cfg.out_dir / "cluster.yaml"
        config.write_text(cluster_yaml(cfg, etcd.port, port))
        server = BatonProcess([], cfg.out_dir / "baton.log", port=port)
        server.argv = [*baton_command(), "up", "--config", str(config)]  # host, ports: in the file
        started, shm_before = time.monotonic(), {p.name for p in SHM.glob("baton-kv-*")}
        with server:
            server.wait_ready(timeout_s=300)
            result = asyncio.run(drive(cfg, server, etcd, started))
        # only those of dead owners: on a shared machine another baton's regions could be new too
        left = sorted(set(orphans(str(SHM))) - shm_before)
        problems = [f"/dev/shm: {name} outlived its owner" for name in left]
        return replace(result, shm_left=left, problems=result.problems + problems)
    finally:
        etcd.stop()


def print_table(r: SoakReport) -> None:
    def out(line: str) -> None:
        print(line, file=sys.stderr)

    out(f"soak: {r.minutes:g} min of load; " + ", ".join(f"{k} {v:.1f} s" for k, v in r.phases_s.items()))
    out("client  " + "  ".join(f"{k} {v}" for k, v in r.client.items()))
    out(f"server  requests_total {sum(r.server.values())}  " + "  ".join(f"{k} {v}" for k, v in r.server.items()))
    for e in r.faults:
        rec = f"recovered in {e.recovered_s:.1f} s" if e.recovered_s is not None else "NOT recovered"
        out(f"fault   {e.at_s:7.1f} s  {e.kind:<13} pid {e.pid}  took effect: {e.took_effect}  {rec}")
    def fmt(v: float | None, unit: str) -> str:
        return "n/a" if v is None else f"{v:+.3f} {unit}"

    out(f"gateway RSS {r.rss_mib[0]:.1f} -> {r.rss_mib[1]:.1f} MiB, slope {fmt(r.rss_slope_mib_min, 'MiB/min')}; "
        f"fds {r.fds[0]} -> {r.fds[1]}, slope {fmt(r.fd_slope_min, 'fds/min')} (after the first 20%)")
    for n in r.idle:
        tiers = "  ".join(f"{t} {u}/{c}/{tot}" for t, (u, c, tot) in n["pages_used_cached_total"].items())
        out(f"idle    {n['node']:<10} {n['health']:<6} pages used/cached/total: {tiers}  reserved {n['reserved']}  "
            f"pinned {n['pinned']}  retained {n.get('retained', 0)}  running {n['running']}  waiting {n['waiting']}")
    out("recovery " + "  ".join(f"{k.removeprefix('baton_').removesuffix('_total')} {v:g}" for k, v in r.recovery.items()))
    out("\n".join(f"log     {line}" for line in r.log_errors) or "log     no ERROR or Traceback lines")
    lag = r.loop_lag
    out(f"loop    {lag.get('samples', 0):g} lag samples of the gateway's event loop; late by over "
        + ", ".join(f"{b} s: {lag.get(f'over_{b}s', 0):g}" for b in LAG_BOUNDS))
    out(f"shm     {len(r.shm_left)} KV staging regions new in /dev/shm and left by a dead owner")
    out("\n".join(f"FAILED  {p}" for p in r.problems) if r.problems else "all invariants held")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakConfig()
    for f in fields(SoakConfig):
        flag = "--" + f.name.removesuffix("_s").replace("_", "-")
        ap.add_argument(flag, dest=f.name, type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    cfg = SoakConfig(**vars(ap.parse_args(argv)))
    if not 0 <= cfg.etcd_restart_at <= 0.9:
        ap.error("--etcd-restart-at is a share of the run, from 0 to 0.9")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C: etcd and baton are stopped
    result = run(cfg)
    print_table(result)
    line = json.dumps(asdict(result))
    (cfg.out_dir / "soak.json").write_text(line + "\n")
    print(line, flush=True)
    return 1 if result.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
