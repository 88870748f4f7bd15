"""A mixed, multi-tenant workload routed by a gateway, against the same traffic sent to each pool
alone: goodput and TTFT p90 per target and per part.

    python -m bench.routed_mix --target gateway=http://127.0.0.1:8100 \\
        --target vllm=http://127.0.0.1:8101 --target llama=http://127.0.0.1:8103 \\
        --model baton-tiny --rate 2 --requests 48 --mix rag=1,random=1,agent=1 --out mix.json
    python -m bench.routed_mix --dry-run ...     # the schedule and each part's overlap, nothing sent

The mix is three single-turn parts, each its own tenant, so a gateway's per-tenant overlap
measure sees two of them share long prefixes and one share nothing:

    part     workload      prompt (tokens)                                       overlap
    rag      rag           [system 2,000, shared by all][question 50]             high
    agent    burst-agent   [system 1,500][tools 1,000][task 300, per burst][own 50]  high
    random   random        [256, unique]                                          ~0

`agent` is issue 21's agent fan-out: a burst of `fanout` sub-agents within `spread_s` of each
other, sharing the fleet's system prompt and tool schema (its task here is shortened so a prompt
fits one slot of llama-server's 3,072-token context at 32 slots). A request carries its tenant
(the part's name) in the body's `user` field (baton's HTTP edge and vLLM accept it; off with
--no-user) and, with `--key PART=KEY`, in `Authorization: Bearer KEY` (the tenant baton's API
key file names): a gateway routes on either.

Arrivals are open loop and bounded: `--requests` in all, split between the parts by `--mix`
weights; each part arrives as its own Poisson process at its share of `--rate` (the agent part
in bursts at share/fanout, not burst-agent's bursts_per_s), or with `--arrivals bursty` at
`--burst-factor` times that rate for `--burst-s` of every `--period-s`. Every target gets the same schedule from `--seed`: the same
parts in the same order at the same times, one target at a time (after the CPUs settle, as in
bench.compare). Its prompts are the same shape but fresh tokens per target, since a gateway and
its pools share the engines behind them and a target run after another would find the prompts
in their prefix caches; `--same-prompts` sends identical token ids to every target instead.

Per target and part: requests done/failed, TTFT p50/p90, ITL p50/p99, output tok/s, goodput
(requests per second of the run that met TTFT <= --slo-ttft-s and their own ITL p99 <=
--slo-itl-p99-s, as bench.report and issue 21 define it), hit rate. The last line sets the
first target's goodput against the best of the others. --out writes it all as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench import analyze_prefix
from bench.client import ClientConfig, StreamClient, list_models
from bench.compare import Target, parse_target, quiet
from bench.prompts import PromptMode, PromptRenderer
from bench.report import SLO, RunSummary, summarize, to_json
from bench.runner import RunPlan, RunResult, execute
from bench.trace import TraceEntry
from bench.transport import CompletionRequest, StreamResult
from bench.transport import run as run_loop
from bench.workloads import BurstAgentWorkload, Session, Workload, make_workload

logger = logging.getLogger(__name__)

PARTS: dict[str, str] = {"rag": "rag", "random": "random", "agent": "burst-agent"}  # part -> workload
# The mix's own defaults, before --param: agent prompts of 2,850 tokens (2,500 fleet-wide).
DEFAULT_PARAMS: dict[str, tuple[str, ...]] = {"agent": ("task_len=300", "own_len=50", "output_len=32")}
MAX_REQUESTS = 100_000
ALL = "all"  # the row of a target's whole run


@dataclass(frozen=True, slots=True)
class Schedule:
    bursty: bool = False
    burst_factor: float = 4.0  # the rate is multiplied by this for burst_s of every period_s
    burst_s: float = 4.0
    period_s: float = 20.0


@dataclass(frozen=True, slots=True)
class MixSpec:
    rate: float  # requests per second, all parts together
    num_requests: int
    shares: tuple[tuple[str, float], ...]  # (part, weight), in the order given
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (part, workload field overrides)
    schedule: Schedule = Schedule()


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float  # from the run's start
    part: str
    session: Session  # tag and tenant: the part


@dataclass(frozen=True, slots=True)
class MixWorkload(Workload):
    """A fixed schedule, replayed on its own times (the runner's replay mode)."""

    name: ClassVar[str] = "routed-mix"
    replayed: ClassVar[bool] = True
    arrivals: tuple[Arrival, ...]

    def sessions(self, seed: str) -> Iterator[Session]:
        return iter(())

    def timed(self, seed: str) -> Iterator[tuple[float, Session]]:
        return ((a.offset_s, a.session) for a in self.arrivals)


def part_counts(num_requests: int, shares: Sequence[tuple[str, float]]) -> dict[str, int]:
    """`num_requests` split by weight, largest remainder first (ties: the order given)."""
    total = sum(w for _, w in shares)
    if total <= 0 or any(w < 0 for _, w in shares):
        raise ValueError("--mix weights must be >= 0 and not all 0")
    exact = [(part, num_requests * w / total) for part, w in shares]
    counts = {part: int(x) for part, x in exact}
    by_remainder = sorted(range(len(exact)), key=lambda i: -(exact[i][1] - int(exact[i][1])))
    for i in by_remainder[: num_requests - sum(counts.values())]:
        counts[exact[i][0]] += 1
    return counts


def arrival_times(rng: random.Random, n: int, rate: float, schedule: Schedule, fanout: int = 1,
                  spread_s: float = 0.0) -> list[float]:  # fmt: skip
    """`n` offsets: groups of `fanout` requests within `spread_s` of the group's start, groups
    starting at Poisson times of rate `rate / fanout` (times `burst_factor` inside a burst)."""
    if rate <= 0 or fanout < 1:
        raise ValueError("a part's rate must be > 0 and its fanout >= 1")
    times: list[float] = []
    t = 0.0
    for _ in range(-(-n // fanout)):  # one group per pass: bounded by n
        bursting = schedule.bursty and schedule.period_s > 0 and t % schedule.period_s < schedule.burst_s
        t += rng.expovariate(rate / fanout * (schedule.burst_factor if bursting else 1.0))
        size = min(fanout, n - len(times))
        times.extend(t + x for x in sorted(rng.uniform(0.0, spread_s) for _ in range(size)))
    return times


def part_workload(part: str, params: Sequence[str] = ()) -> Workload:
    return make_workload(PARTS[part], [*DEFAULT_PARAMS.get(part, ()), *params])


def build_mix(spec: MixSpec, seed: str, prompt_seed: str) -> tuple[Arrival, ...]:
    """The schedule: times from `seed` alone, prompts from `prompt_seed`, in order of time."""
    if not 1 <= spec.num_requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be 1..{MAX_REQUESTS}")
    counts = part_counts(spec.num_requests, spec.shares)
    weights, params = dict(spec.shares), dict(spec.params)
    total = sum(weights.values())
    arrivals: list[Arrival] = []
    for part, n in counts.items():
        if n == 0:
            continue
        workload = part_workload(part, params.get(part, ()))
        fanout, spread = (workload.fanout, workload.spread_s) if isinstance(workload, BurstAgentWorkload) else (1, 0.0)
        rng = random.Random(f"{seed}/routed-mix/{part}/times")  # str seeds hash with SHA-512: stable
        times = arrival_times(rng, n, spec.rate * weights[part] / total, spec.schedule, fanout, spread)
        sessions = itertools.islice(workload.sessions(f"{prompt_seed}/{part}"), n)
        for offset, s in zip(times, sessions, strict=True):
            session = dataclasses.replace(s, session_id=f"{part}/{s.session_id}", tag=part, tenant=part)
            arrivals.append(Arrival(offset, part, session))
    return tuple(sorted(arrivals, key=lambda a: (a.offset_s, a.part, a.session.session_id)))


def overlap_by_part(arrivals: Sequence[Arrival], renderer: PromptRenderer, page_size: int = 16) -> dict[str, float]:
    """Each part's token-weighted prefix overlap (bench.analyze_prefix's ideal hit rate per
    tenant, unbounded cache): every prompt becomes a trace entry whose blocks are its pages, a
    block's id the hash of its token ids, so shared ids are shared tokens."""
    entries = []
    for a in arrivals:
        ids = renderer.render(a.session.prompt_parts(0, ()))
        if not isinstance(ids, list):
            raise ValueError("the overlap is measured on token ids: render in token mode")
        pages = tuple(hash(tuple(ids[i : i + page_size])) for i in range(0, len(ids), page_size))
        entries.append(TraceEntry(a.offset_s * 1000, len(ids), a.session.turns[0].output_len, pages, a.part))
    results = analyze_prefix.analyze(entries, page_size, page_size, cache_tokens=1 << 62)
    tenants = analyze_prefix.summarize(results, 1 << 62)["tenants"]
    return {part: float(t["hit_rate"]) for part, t in tenants.items()}


@dataclass
class TenantTransport:
    """One target's clients, one per API key: a request goes out with its tenant's key (none
    for a tenant without one), and with the `user` field only when `send_user`."""

    clients: dict[str | None, StreamClient]
    keys: dict[str, str]  # tenant -> API key
    send_user: bool = True

    async def complete(self, req: CompletionRequest, timeout_s: float) -> StreamResult:
        client = self.clients[self.keys.get(req.user or "")]
        if not self.send_user:
            req = dataclasses.replace(req, user=None)
        return await client.complete(req, timeout_s)

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


def open_target(url: str, model: str, keys: dict[str, str], send_user: bool, new_connection: bool) -> TenantTransport:
    clients = {key: StreamClient(ClientConfig(url, model, key, new_connection)) for key in {None, *keys.values()}}
    return TenantTransport(clients, dict(keys), send_user)


def part_summaries(run: RunResult, slo: SLO, parts: Sequence[str]) -> dict[str, RunSummary]:
    """The whole run ("all") and each part over the same duration, so per-part goodputs add up."""
    out = {ALL: summarize(run, slo)}
    for part in parts:
        records = tuple(r for r in run.records if r.tag == part)
        out[part] = summarize(dataclasses.replace(run, plan=dataclasses.replace(run.plan, label=part),
                                                  records=records), slo)  # fmt: skip
    return out


def verdict(goodputs: Sequence[tuple[str, float]]) -> dict[str, Any] | None:
    """The first target's goodput against the best of the others (None with one target)."""
    if len(goodputs) < 2:
        return None
    (first, mine), others = goodputs[0], goodputs[1:]
    best, theirs = max(others, key=lambda t: t[1])
    ratio = mine / theirs if theirs > 0 else None
    return {"target": first, "goodput_req_s": mine, "best_other": best, "best_other_goodput_req_s": theirs,
            "ratio": ratio, "beats": mine > theirs}  # fmt: skip


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def table(results: Sequence[tuple[str, dict[str, RunSummary]]]) -> str:
    head = (f"{'target':<12} {'part':<7} {'ok/sent':>9} {'failed':>6} {'TTFT p50':>9} {'p90':>7} {'ITL p50':>8} "
            f"{'p99':>7} {'out tok/s':>9} {'goodput':>7} {'hit':>6}")  # fmt: skip
    lines = [head, "(TTFT and ITL in ms, goodput in req/s)"]
    for name, parts in results:
        for part, s in parts.items():
            lines.append(
                f"{name[:12]:<12} {part[:7]:<7} {f'{s.num_ok}/{s.num_sent}':>9} {s.num_failed:>6} "
                f"{_fmt(s.ttft_p50_ms):>9} {_fmt(s.ttft_p90_ms):>7} {_fmt(s.itl_p50_ms, '.1f'):>8} "
                f"{_fmt(s.itl_p99_ms, '.1f'):>7} {s.output_tok_s:>9.1f} {s.goodput_req_s:>7.2f} "
                f"{_fmt(s.prefix_hit_rate, '.1%'):>6}"
            )
            errors = s.errors.items() if part == ALL else ()  # the whole run's, once
            lines.extend(f"  {count} x {error[:100]}" for error, count in errors)
    return "\n".join(lines)


def verdict_line(v: dict[str, Any] | None) -> str:
    if v is None:
        return "goodput: one target, nothing to compare"
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}x"
    return (f"goodput: {v['target']} {v['goodput_req_s']:.2f} req/s vs best other ({v['best_other']}) "
            f"{v['best_other_goodput_req_s']:.2f} req/s = {ratio}: {'beats' if v['beats'] else 'does not beat'} it")  # fmt: skip


async def _model(target: Target, model: str | None) -> str:
    if target.model or model:
        return str(target.model or model)
    models = await list_models(target.url)
    if not models:
        raise RuntimeError(f"{target.name}: {target.url}/v1/models lists no model; pass --model")
    return models[0]


async def run_all(args: argparse.Namespace, spec: MixSpec) -> dict[str, Any]:
    renderer = PromptRenderer(PromptMode.TOKENS, args.vocab_size)
    slo = SLO(args.slo_ttft_s, args.slo_itl_p99_s)
    parts = [p for p, n in part_counts(spec.num_requests, spec.shares).items() if n]
    results: list[tuple[str, dict[str, RunSummary]]] = []
    targets: list[dict[str, Any]] = []
    for target in args.target:
        model = await _model(target, args.model)
        prompt_seed = args.seed if args.same_prompts else f"{args.seed}/{target.name}"
        workload = MixWorkload(build_mix(spec, args.seed, prompt_seed))
        plan = RunPlan(label=target.name, seed=prompt_seed, concurrency=None, rate=None,
                       num_requests=len(workload.arrivals), time_cap_s=args.time_cap,
                       request_timeout_s=args.request_timeout, progress=False)  # fmt: skip
        if await quiet(args.quiet_idle, args.quiet_max) >= args.quiet_max > 0:
            logger.warning("%s: the CPUs did not settle within %.0f s; measuring anyway", target.name, args.quiet_max)
        transport = open_target(target.url, model, args.keys, args.user, not args.keep_alive)
        async with contextlib.aclosing(transport):
            run = await execute(plan, workload, transport, renderer)
        summaries = part_summaries(run, slo, parts)
        results.append((target.name, summaries))
        targets.append({"name": target.name, "url": target.url, "model": model, "prompt_seed": prompt_seed,
                        "runs": {part: to_json(s) for part, s in summaries.items()}})  # fmt: skip
        logger.info("%s: %d/%d ok in %.1f s", target.name, summaries[ALL].num_ok, summaries[ALL].num_sent,
                    run.duration_s)  # fmt: skip
    v = verdict([(name, s[ALL].goodput_req_s) for name, s in results])
    print(table(results))
    print(verdict_line(v), flush=True)
    return {"seed": args.seed, "same_prompts": args.same_prompts, "mix": _mix_doc(spec), "slo": dataclasses.asdict(slo),
            "keys_for": sorted(args.keys), "send_user": args.user, "targets": targets, "verdict": v}  # fmt: skip


def _mix_doc(spec: MixSpec) -> dict[str, Any]:
    return {"rate": spec.rate, "requests": spec.num_requests, "shares": dict(spec.shares),
            "params": {p: list(v) for p, v in spec.params}, "schedule": dataclasses.asdict(spec.schedule)}  # fmt: skip


def dry_run(spec: MixSpec, seed: str, vocab_size: int) -> str:
    """The schedule's shape: per part the requests, prompt tokens, time span and overlap."""
    arrivals = build_mix(spec, seed, seed)
    overlap = overlap_by_part(arrivals, PromptRenderer(PromptMode.TOKENS, vocab_size))
    lines = [f"{'part':<7} {'requests':>8} {'prompt tokens':>13} {'output':>6} {'first s':>7} {'last s':>7} {'overlap':>7}"]
    for part in dict.fromkeys(a.part for a in arrivals):
        mine = [a for a in arrivals if a.part == part]
        lengths = sorted({a.session.nominal_prompt_len(0) for a in mine})
        outputs = sorted({a.session.turns[0].output_len for a in mine})
        lines.append(f"{part:<7} {len(mine):>8} {'/'.join(map(str, lengths)):>13} {'/'.join(map(str, outputs)):>6} "
                     f"{mine[0].offset_s:>7.2f} {mine[-1].offset_s:>7.2f} {overlap[part]:>7.1%}")  # fmt: skip
    return "\n".join(lines)


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        for piece in item.split(","):
            key, sep, value = piece.partition("=")
            if not sep or not key or not value:
                raise ValueError(f"{flag} {piece!r}: expected NAME=VALUE")
            out.append((key.strip(), value.strip()))
    return out


def mix_spec(args: argparse.Namespace) -> MixSpec:
    shares = [(part, float(w)) for part, w in _pairs([args.mix], "--mix")]
    params: dict[str, list[str]] = {part: [] for part, _ in shares}
    for key, value in _pairs(args.max_tokens, "--max-tokens"):
        params.setdefault(key, []).append(f"output_len={value}")
    for item in args.param:
        part, dot, field = item.partition(".")
        if not dot:
            raise ValueError(f"--param {item!r}: expected PART.FIELD=VALUE")
        params.setdefault(part, []).append(field)
    unknown = sorted({*dict(shares), *params} - PARTS.keys())
    if unknown or len(dict(shares)) != len(shares):
        raise ValueError(f"parts are {', '.join(PARTS)}, each once: not {', '.join(unknown) or 'a repeated one'}")
    for part, fields in params.items():
        part_workload(part, fields)  # a bad field fails now, not mid-run
    schedule = Schedule(args.arrivals == "bursty", args.burst_factor, args.burst_s, args.period_s)
    return MixSpec(args.rate, args.requests, tuple(shares), tuple((p, tuple(f)) for p, f in params.items()), schedule)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench.routed_mix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--target", action="append", type=parse_target, default=[],
                    help="NAME=URL[,MODEL], in the order run; the first (the gateway) is set against the others")  # fmt: skip
    ap.add_argument("--model", help="the model name sent (default: each target's first of /v1/models)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second, all parts together")
    ap.add_argument("--requests", type=int, default=48, help="requests in all (the schedule's bound)")
    ap.add_argument("--mix", default="rag=1,random=1,agent=1", help="PART=WEIGHT,...: shares of the requests")
    ap.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson")
    ap.add_argument("--burst-factor", type=float, default=4.0, help="bursty: the rate multiplier inside a burst")
    ap.add_argument("--burst-s", type=float, default=4.0, help="bursty: seconds of burst in every period")
    ap.add_argument("--period-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", action="append", default=[], metavar="PART=N", help="a part's output length")
    ap.add_argument("--param", action="append", default=[], metavar="PART.FIELD=VALUE",
                    help="a part's workload field, e.g. agent.fanout=4, rag.system_len=1000")  # fmt: skip
    ap.add_argument("--key", action="append", default=[], metavar="PART=KEY", help="send the part as Bearer KEY")
    ap.add_argument("--user", action=argparse.BooleanOptionalAction, default=True,
                    help="send the part's name as the body's `user` field")  # fmt: skip
    ap.add_argument("--seed", help="schedule and prompt seed (default: a new one per run, recorded in --out)")
    ap.add_argument("--same-prompts", action="store_true", help="identical token ids for every target")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-itl-p99-s", type=float, default=0.2)
    ap.add_argument("--time-cap", type=float, default=300.0, help="seconds per target")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--vocab-size", type=int, default=16384, help="prompt token ids are drawn from [100, N)")
    ap.add_argument("--keep-alive", action="store_true", help="reuse connections (default: one per request)")
    ap.add_argument("--quiet-idle", type=float, default=0.9, help="idle share of the CPUs a target waits for")
    ap.add_argument("--quiet-max", type=float, default=10.0, help="seconds a target waits for it at most")
    ap.add_argument("--dry-run", action="store_true", help="print the schedule's shape and send nothing")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = str(int(time.time()))
    try:
        spec = mix_spec(args)
        args.keys = dict(_pairs(args.key, "--key"))
        if unknown := sorted(args.keys.keys() - PARTS.keys()):
            raise ValueError(f"--key {unknown[0]}: not a part ({', '.join(PARTS)})")
        build_mix(spec, args.seed, args.seed)  # refuses a bad rate or count before any target runs
    except ValueError as exc:
        ap.error(str(exc))
    if args.dry_run:
        print(dry_run(spec, args.seed, args.vocab_size))
        return 0
    if not args.target:
        ap.error("give at least one --target NAME=URL")
    if len({t.name for t in args.target}) != len(args.target):
        ap.error("--target names must differ")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    doc = run_loop(run_all(args, spec))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        logger.info("wrote %s", args.out)
    return 0 if all(t["runs"][ALL]["num_ok"] for t in doc["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
