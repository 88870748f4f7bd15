"""KV-preserving failover (issue 26): how long a stream stalls when its decode worker dies, and
what that costs a loaded cluster, with the lost context fetched (recovery.preserve_kv: true)
against recomputed (false).

    python -m bench.failover [--part resume|goodput|both] [--model baton-small] [--context 4000]
                             [--after 8] [--repeats 3] [--fault kill|drain]
                             [--workload burst-agent] [--duration 60]
                             [--ttft-slo 2] [--itl-slo 0.2] [--out failover.json] [--smoke]

Each (part, mode) gets its own `baton up --config cluster.yaml` child on 127.0.0.1 (1 prefill +
2 decode actors on a private Ray, each pinned to a core with one torch thread; recovery:
{preserve_kv: <mode>, max_restarts: 100}), started fresh and stopped by its PID (bench.server_proc).

resume   one stream at a time, a unique `--context`-token prompt per repeat (the same prompts in
         both modes), greedy, EOS ignored, `--output` tokens, streamed from /v1/completions:
             tokens 1..after | SIGKILL the decode worker running it (/status: role decode,
             running > 0, its pid, checked to be an actor process of our child) | stall | the
             survivor's tokens
         gap: from the kill to the survivor's first token (the one after the longest pause
         since the kill; a token already on the wire when the kill landed is not it). Then,
         once every node is ok again and no node reports the killed pid (Ray restarted it), the
         same prompt without a fault: is the faulted stream token-exact against it? From
         /metrics (before/after the stream): the migration's context tokens fetched and
         recomputed, and the gateway's own loss -> next token (baton_migration_resume_seconds,
         which starts when the gateway learns of the loss: gap - it = detect_s, how long that took).
         Summary per mode: median gap; the ratio recompute / preserve (target >= 5x).
         `--fault drain`: SIGTERM instead (a pod's termination: the worker drains, hands the
         stream off with its pages -- decode.handoff -- and leaves for good); once the stream
         ended, POST /admin/scale {"decode": 2} brings the pool back before the reference run.
goodput  `--workload` (bench.workloads; default `burst-agent`, issue 21's agent fan-out, replayed
         on its own arrival times; a closed-loop one such as `agent` runs at `--concurrency`) for
         `--duration` s (the run's time cap; requests still running then are "cut", not failed),
         one decode worker SIGKILLed at half time (the one running most, once one runs any). goodput = requests
         that finished with TTFT <= `--ttft-slo` and ITL p99 <= `--itl-slo` (issue 21's: 2 s,
         0.2 s) / duration; failed = requests that ended in an error before the cap.

Prints one JSON line per server, repeat, summary and goodput run on stdout, tables on stderr;
--out writes everything to one JSON file. `--smoke`: baton-tiny, 600-token context, 1 repeat,
30 s of goodput -- a quick check that the whole thing runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.client import ClientConfig, SSEDecoder, StreamClient, completion_payload
from bench.prompts import PromptMode, PromptRenderer, segment_ids
from bench.report import percentile
from bench.runner import RunPlan, execute
from bench.server_proc import BatonProcess, baton_command, free_port
from bench.soak_faults import actor_pids, is_gone, nodes
from bench.transport import CompletionRequest
from bench.transport import run as run_loop
from bench.workloads import make_workload
from engine.builtin import resolve_model_dir

MODES = {"preserve": True, "recompute": False}  # mode -> recovery.preserve_kv
TARGET = 5.0  # median resume gap, recompute / preserve
NUM_NODES = 3  # 1 prefill + 2 decode
POLL_S = 0.2
BUSY_WAIT_S = 20.0  # goodput: from half time, how long to wait for a decode worker with requests running


@dataclass(frozen=True, slots=True)
class Repeat:
    """One faulted stream (resume part)."""

    mode: str
    repeat: int
    fault: str  # kill (SIGKILL) or drain (SIGTERM)
    context_tokens: int
    killed_node: str | None  # None: no decode worker was found running the stream
    killed_pid: int | None
    killed_unix: float | None  # time.time() of the kill, to find it in the server's log
    killed_after: int  # tokens the client had when the kill landed
    took_effect: bool  # the process was gone within 10 s
    gap_s: float | None  # kill -> the survivor's first token, on the client (None: the stream failed)
    in_flight: int  # tokens that arrived between the kill and the survivor's first
    itl_p50_s: float | None  # between the chunks before the kill, for scale
    server_resume_s: float | None  # baton_migration_resume_seconds (mean over this stream's migrations)
    detect_s: float | None  # gap - server_resume_s: the kill until the gateway learned of it (one migration)
    migrations: int
    fetched_tokens: int  # baton_migration_context_tokens_total{outcome="fetched"}, this stream's
    recomputed_tokens: int
    output_tokens: int
    token_exact: bool | None  # against the same prompt without a fault (None: not compared)
    first_mismatch: int | None
    recovered_s: float | None  # the faulted stream's end -> every node ok, none under the killed pid
    error: str | None


@dataclass(frozen=True, slots=True)
class Summary:
    mode: str
    repeats: int
    gap_p50_s: float | None
    server_resume_p50_s: float | None
    fetched_tokens: int
    recomputed_tokens: int
    all_exact: bool


@dataclass(frozen=True, slots=True)
class Goodput:
    """One workload run with a decode worker killed at half time (goodput part)."""

    mode: str
    duration_s: float
    num_sent: int
    num_ok: int
    num_good: int  # ok, TTFT and ITL p99 within the SLOs
    num_failed: int  # ended in an error before the time cap
    num_cut: int  # still running at the time cap
    goodput_rps: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_max_s: float | None  # the longest pause in any stream that finished (the fault's stall)
    killed_node: str | None
    killed_at_s: float | None
    took_effect: bool
    recovered_s: float | None
    migrations: int
    fetched_tokens: int
    recomputed_tokens: int
    errors: tuple[str, ...]


class Migrations(NamedTuple):
    """The gateway's failover counters (/metrics), summed over their labels."""

    migrations: float = 0.0
    fetched: float = 0.0
    recomputed: float = 0.0
    resume_sum: float = 0.0
    resume_count: float = 0.0

    def minus(self, other: Migrations) -> Migrations:
        return Migrations(*(a - b for a, b in zip(self, other, strict=True)))


class Kill(NamedTuple):
    node: str
    pid: int
    at: float  # time.perf_counter() just after the signal
    unix: float  # time.time() then


# -- the server ------------------------------------------------------------------------------


def cluster_yaml(model: str, served: str, port: int, max_model_len: int, preserve: bool, pin: bool) -> str:
    return f"""cluster: failover
model: {{path: {model}, served_name: {served}, dtype: float32, max_model_len: {max_model_len}}}
workers: {{prefill: {{count: 1}}, decode: {{count: 2}}, pin_cores: {str(pin).lower()}}}
recovery: {{preserve_kv: {str(preserve).lower()}, max_restarts: 100}}
api: {{host: 127.0.0.1, port: {port}, grpc_port: 0, enable_admin: true}}
"""


def start(args: argparse.Namespace, label: str, preserve: bool, max_model_len: int, log_dir: Path) -> BatonProcess:
    """A fresh `baton up --config` child (entered: the caller's `with` stops it)."""
    port = free_port()
    config = log_dir / f"{label}.yaml"
    config.write_text(cluster_yaml(args.model, args.served, port, max_model_len, preserve, args.pin_cores))
    server = BatonProcess([], log_dir / f"{label}.log", port=port)
    server.argv = [*baton_command(), "up", "--config", str(config)]  # host and ports: in the file
    return server


async def all_ok(client: httpx.AsyncClient, timeout_s: float, gone_pid: int | None = None,
                 left: frozenset[str] = frozenset()) -> float | None:  # fmt: skip
    """Seconds until every node is ok (and none runs under `gone_pid`; those `left`, drained and
    gone for good, are not counted), None at the timeout."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < timeout_s:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            now = [n for n in await nodes(client) if n["name"] not in left]
            if (len(now) == NUM_NODES and all(n["health"] == "ok" for n in now)
                    and all(n.get("pid") != gone_pid for n in now)):  # fmt: skip
                return time.perf_counter() - begin
        await asyncio.sleep(POLL_S)
    return None


async def migrations(client: httpx.AsyncClient) -> Migrations:
    text = (await client.get("/metrics", timeout=10)).text
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = {"baton_request_migrations_total": "migrations",
                   "baton_migration_resume_seconds_sum": "resume_sum",
                   "baton_migration_resume_seconds_count": "resume_count"}.get(s.name)  # fmt: skip
            if s.name == "baton_migration_context_tokens_total":
                key = s.labels.get("outcome")
            if key in Migrations._fields:
                got[key] = got.get(key, 0.0) + s.value
    return Migrations(**got)


async def kill_decode(client: httpx.AsyncClient, root_pid: int, busy_only: bool, timeout_s: float = 5.0,
                      sig: signal.Signals = signal.SIGKILL) -> Kill | None:  # fmt: skip
    """SIGKILL (or `sig`) the decode worker /status shows running the most (with `busy_only`, at
    least one request), if its pid is an actor process of our baton child; None if none was found
    in time."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < timeout_s:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            decodes = [n for n in await nodes(client) if n["role"] == "decode" and n["health"] == "ok" and n["pid"]]
            ours = set(actor_pids(root_pid, "decode"))
            decodes = [n for n in decodes if n["pid"] in ours and (n["running"] > 0 or not busy_only)]
            if decodes:
                node = max(decodes, key=lambda n: n["running"])
                os.kill(node["pid"], sig)  # a decode actor of the baton this run started
                return Kill(node["name"], node["pid"], time.perf_counter(), time.time())
        await asyncio.sleep(0.02)
    return None


async def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.perf_counter() + timeout_s
    while not is_gone(pid) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    return is_gone(pid)


# -- resume: one stream, killed mid-way ----------------------------------------------------------


async def stream(client: httpx.AsyncClient, served: str, prompt: list[int], output_len: int, timeout_s: float,
                 arrivals: list[tuple[float, int]], reached: asyncio.Event, after: int) -> str | None:  # fmt: skip
    """Stream one greedy completion, appending (arrival time, token id) as they come and
    setting `reached` at `after` tokens (or at the end); the error, or None."""
    payload = completion_payload(served, CompletionRequest(prompt, output_len, want_token_ids=True))
    decoder, done = SSEDecoder(), False
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", "/v1/completions", json=payload,
                                                             timeout=httpx.Timeout(timeout_s, connect=10)) as resp:  # fmt: skip
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {(await resp.aread())[:500].decode(errors='replace')}"
            async for line in resp.aiter_lines():
                data = decoder.feed(line.rstrip("\r\n"))
                if data is None or done:
                    continue
                if data.strip() == "[DONE]":
                    done = True
                    continue
                obj, now = json.loads(data), time.perf_counter()
                if obj.get("error"):
                    return f"server error in stream: {json.dumps(obj['error'])[:300]}"
                for choice in obj.get("choices") or ():
                    arrivals.extend((now, int(i)) for i in choice.get("token_ids") or ())
                if len(arrivals) >= after:
                    reached.set()
                if len(arrivals) > output_len + 8:
                    return f"more than {output_len} tokens"
    except TimeoutError:
        return f"timeout after {timeout_s:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        reached.set()
    return None if done else "stream ended before [DONE]"


def resume_gap(times: Sequence[float], killed_at: float) -> tuple[float | None, int]:
    """(kill -> the survivor's first token, tokens that arrived before it but after the kill).

    The survivor's first token is the one after the longest pause since the kill; a token the
    dead worker had already sent arrives just after the kill and is passed over:

        tokens:  t  t  t  t   KILL t        ...stall...        t  t  t
                                   ^ in flight                 ^ survivor's first: gap = its time - KILL
    """
    post = [i for i, t in enumerate(times) if t >= killed_at]
    if not post:
        return None, 0
    resumed = max(post, key=lambda i: times[i] - max(times[i - 1] if i else killed_at, killed_at))
    return times[resumed] - killed_at, resumed - post[0]


async def resume_once(client: httpx.AsyncClient, server: BatonProcess, args: argparse.Namespace, mode: str,
                      repeat: int, prompt: list[int], left: set[str]) -> Repeat:  # fmt: skip
    """One faulted stream, then the same prompt without a fault (after the cluster recovered;
    `left`: the nodes drained so far, gone for good)."""
    before = await migrations(client)
    arrivals: list[tuple[float, int]] = []
    reached = asyncio.Event()
    task = asyncio.create_task(stream(client, args.served, prompt, args.output, args.request_timeout, arrivals,
                                      reached, args.after))  # fmt: skip
    await reached.wait()  # stream() sets it at the end whatever happens, so this is bounded
    sig = signal.SIGTERM if args.fault == "drain" else signal.SIGKILL
    kill = await kill_decode(client, server.pid, busy_only=True, sig=sig) if not task.done() else None
    killed_after = len(arrivals)
    error = await task
    took_effect = kill is not None and await wait_gone(kill.pid, 60.0 if args.fault == "drain" else 10.0)
    scaled = None
    if took_effect and args.fault == "drain":  # it left for good: the pool back to two decode workers
        got = await client.post("/admin/scale", json={"decode": 2}, timeout=args.recover_timeout)
        scaled = None if got.status_code == 200 else f"POST /admin/scale: HTTP {got.status_code} {got.text[:200]}"
    if kill and args.fault == "drain":
        left.add(kill.node)
    recovered = await all_ok(client, args.recover_timeout, kill.pid if kill else None, frozenset(left)) if took_effect else None
    delta = (await migrations(client)).minus(before)
    times, ids = [t for t, _ in arrivals], [i for _, i in arrivals]
    gap, in_flight = resume_gap(times, kill.at) if kill and error is None else (None, 0)
    chunks = sorted(set(times[:killed_after]))  # a chunk may carry several tokens
    pre = [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
    resume = delta.resume_sum / delta.resume_count if delta.resume_count else None
    detect = gap - resume if gap is not None and resume is not None and delta.migrations == 1 else None
    exact, mismatch = None, None
    if error is None and (kill is None or recovered is not None):
        reference: list[tuple[float, int]] = []
        ref_error = await stream(client, args.served, prompt, args.output, args.request_timeout, reference,
                                 asyncio.Event(), args.output)  # fmt: skip
        if ref_error is None:
            ref = [i for _, i in reference]
            exact = ids == ref
            mismatch = next((k for k, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
                            None if len(ids) == len(ref) else min(len(ids), len(ref)))  # fmt: skip
        else:
            error = f"reference run: {ref_error}"
    if kill is None and error is None:
        error = "no decode worker showed the stream running (or it finished first)"
    error = error or scaled
    return Repeat(
        mode, repeat, args.fault, len(prompt), kill.node if kill else None, kill.pid if kill else None,
        round(kill.unix, 3) if kill else None, killed_after,
        took_effect, _r(gap), in_flight, _r(percentile(pre, 50)), _r(resume), _r(detect), int(delta.migrations),
        int(delta.fetched), int(delta.recomputed), len(ids), exact, mismatch, _r(recovered), error,
    )  # fmt: skip


async def resume_mode(server: BatonProcess, args: argparse.Namespace, mode: str, vocab: int) -> list[Repeat]:
    out: list[Repeat] = []
    async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=30) as client:
        if await all_ok(client, args.start_timeout) is None:
            raise RuntimeError(f"not every node came up ok:\n{server.log_tail()}")
        warm = [segment_ids(f"{args.seed}/failover/warmup/{k}", 64, vocab) for k in range(2)]
        await asyncio.gather(*(stream(client, args.served, p, 8, args.request_timeout, [], asyncio.Event(), 8)
                               for p in warm))  # fmt: skip
        left: set[str] = set()
        for repeat in range(args.repeats):
            prompt = segment_ids(f"{args.seed}/failover/{repeat}", args.context, vocab)  # the same in both modes
            result = await resume_once(client, server, args, mode, repeat, prompt, left)
            print(json.dumps(asdict(result)), flush=True)
            out.append(result)
            if result.recovered_s is None and await all_ok(client, args.recover_timeout, None, frozenset(left)) is None:
                break  # the cluster did not come back: the next repeat would measure nothing
    return out


def summarize(repeats: list[Repeat]) -> list[Summary]:
    out = []
    for mode in dict.fromkeys(r.mode for r in repeats):
        rs = [r for r in repeats if r.mode == mode]
        gaps = [r.gap_s for r in rs if r.gap_s is not None and r.error is None]
        server = [r.server_resume_s for r in rs if r.server_resume_s is not None]
        out.append(Summary(mode, len(rs), _r(statistics.median(gaps)) if gaps else None,
                           _r(statistics.median(server)) if server else None, sum(r.fetched_tokens for r in rs),
                           sum(r.recomputed_tokens for r in rs), all(r.token_exact is True for r in rs)))  # fmt: skip
    return out


def gap_ratio(summaries: list[Summary]) -> float | None:
    by = {s.mode: s.gap_p50_s for s in summaries}
    slow, fast = by.get("recompute"), by.get("preserve")
    return None if slow is None or not fast else round(slow / fast, 2)


# -- goodput: agent traffic, a decode worker killed at half time --------------------------------


async def kill_at(client: httpx.AsyncClient, server: BatonProcess, at: float, begin: float,
                  recover_timeout: float) -> tuple[Kill | None, bool, float | None]:  # fmt: skip
    await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
    kill = await kill_decode(client, server.pid, busy_only=True, timeout_s=BUSY_WAIT_S)  # a worker with streams
    if kill is None:
        return None, False, None
    took_effect = await wait_gone(kill.pid)
    return kill, took_effect, await all_ok(client, recover_timeout, kill.pid) if took_effect else None


async def goodput_mode(server: BatonProcess, args: argparse.Namespace, mode: str, vocab: int) -> Goodput:
    workload = make_workload(args.workload, args.param)
    concurrency = None if workload.replayed else args.concurrency  # None: on the workload's own times
    plan = RunPlan(f"goodput-{mode}", f"{args.seed}/goodput", concurrency, None, 1 << 30,
                   time_cap_s=args.duration, request_timeout_s=args.duration, progress=False)  # fmt: skip
    renderer = PromptRenderer(PromptMode.TOKENS, vocab)
    async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=30) as control:
        if await all_ok(control, args.start_timeout) is None:
            raise RuntimeError(f"not every node came up ok:\n{server.log_tail()}")
        before = await migrations(control)
        async with StreamClient(ClientConfig(server.url, args.served)) as client:
            begin = time.perf_counter()
            run, (kill, took_effect, recovered) = await asyncio.gather(
                execute(plan, workload, client, renderer),
                kill_at(control, server, args.duration / 2, begin, args.recover_timeout))
        delta = (await migrations(control)).minus(before)
    results = [r.result for r in run.records]
    ok = [r for r in results if r.ok]
    cut = [r for r in results if not r.ok and (r.error or "").startswith("time cap")]
    failed = [r for r in results if not r.ok and not (r.error or "").startswith("time cap")]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= args.ttft_slo
            and (percentile(r.itl_s, 99) or 0.0) <= args.itl_slo]  # fmt: skip
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return Goodput(
        mode, round(run.duration_s, 2), len(results), len(ok), len(good), len(failed), len(cut),
        round(len(good) / run.duration_s, 4), _r(percentile(ttfts, 50)), _r(percentile(ttfts, 99)),
        _r(max((x for r in ok for x in r.itl_s), default=None)), kill.node if kill else None,
        _r(kill.at - begin) if kill else None, took_effect, _r(recovered), int(delta.migrations),
        int(delta.fetched), int(delta.recomputed), tuple(sorted({r.error or "" for r in failed}))[:3],
    )  # fmt: skip


def workload_len(args: argparse.Namespace) -> int:
    """The workload's longest request, as its first session's last turn: prompt and output."""
    workload = make_workload(args.workload, args.param)
    session = next(workload.timed("len"))[1] if workload.replayed else next(workload.sessions("len"))
    last = len(session.turns) - 1
    return session.nominal_prompt_len(last) + session.turns[last].output_len


# -- the report ----------------------------------------------------------------------------------


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def resume_table(repeats: list[Repeat], summaries: list[Summary]) -> str:
    lines = [f"{'mode':<10} {'rep':>3} {'killed':<9} {'after':>5} {'gap s':>7} {'in flight':>9} {'ITL p50 ms':>10} "
             f"{'server s':>8} {'detect s':>8} {'fetched':>8} {'recomp.':>8} {'exact':>5} {'recovered s':>11}"]  # fmt: skip
    for r in repeats:
        exact = "-" if r.token_exact is None else ("yes" if r.token_exact else f"@{r.first_mismatch}")
        lines.append(f"{r.mode:<10} {r.repeat:>3} {r.killed_node or '-':<9} {r.killed_after:>5} {_f(r.gap_s):>7} "
                     f"{r.in_flight:>9} {_f(r.itl_p50_s and r.itl_p50_s * 1000, '.1f'):>10} "
                     f"{_f(r.server_resume_s):>8} {_f(r.detect_s):>8} {r.fetched_tokens:>8} {r.recomputed_tokens:>8} {exact:>5} "
                     f"{_f(r.recovered_s, '.1f'):>11}")  # fmt: skip
        if r.error:
            lines.append(f"  error: {r.error[:120]}")
    lines += ["", f"{'mode':<10} {'repeats':>7} {'gap p50 s':>9} {'server p50 s':>12} {'fetched':>8} "
                  f"{'recomp.':>8} {'all exact':>9}"]  # fmt: skip
    lines += [f"{s.mode:<10} {s.repeats:>7} {_f(s.gap_p50_s):>9} {_f(s.server_resume_p50_s):>12} "
              f"{s.fetched_tokens:>8} {s.recomputed_tokens:>8} {'yes' if s.all_exact else 'no':>9}"
              for s in summaries]  # fmt: skip
    ratio = gap_ratio(summaries)
    verdict = "-" if ratio is None else ("met" if ratio >= TARGET else "missed")
    lines.append(f"resume gap p50, recompute / preserve: {_f(ratio)}x (target >= {TARGET:g}x: {verdict})")
    return "\n".join(lines)


def goodput_table(cells: list[Goodput], slo: float, itl_slo: float) -> str:
    lines = [f"{'mode':<10} {'sent':>5} {'ok':>4} {'good':>4} {'failed':>6} {'cut':>4} {'goodput/s':>9} "
             f"{'TTFT p50':>8} {'TTFT p99':>8} {'max ITL':>7} {'killed':<9} {'at s':>5} {'recov. s':>8} "
             f"{'migr.':>5} {'fetched':>8} {'recomp.':>8}"]  # fmt: skip
    for c in cells:
        lines.append(f"{c.mode:<10} {c.num_sent:>5} {c.num_ok:>4} {c.num_good:>4} {c.num_failed:>6} {c.num_cut:>4} "
                     f"{c.goodput_rps:>9.3f} {_f(c.ttft_p50_s):>8} {_f(c.ttft_p99_s):>8} {_f(c.itl_max_s):>7} "
                     f"{(c.killed_node or '-') + ('' if c.took_effect else '?'):<9} {_f(c.killed_at_s, '.0f'):>5} "
                     f"{_f(c.recovered_s, '.1f'):>8} {c.migrations:>5} {c.fetched_tokens:>8} "
                     f"{c.recomputed_tokens:>8}")  # fmt: skip
        lines.extend(f"  failed: {e[:120]}" for e in c.errors)
    by = {c.mode: c.goodput_rps for c in cells}
    if by.get("preserve") is not None and by.get("recompute"):
        lines.append(f"goodput (TTFT <= {slo:g} s, ITL p99 <= {itl_slo:g} s), preserve / recompute: "
                     f"{by['preserve'] / by['recompute']:.2f}x")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.failover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--part", choices=["resume", "goodput", "both"], default="both")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--model", default="baton-small")
    p.add_argument("--context", type=int, default=4000, help="resume: prompt tokens")
    p.add_argument("--output", type=int, default=64, help="resume: output tokens per stream")
    p.add_argument("--after", type=int, default=8, help="resume: streamed tokens before the kill")
    p.add_argument("--repeats", type=int, default=3, help="resume: faulted streams per mode")
    p.add_argument("--fault", choices=["kill", "drain"], default="kill",
                   help="resume: SIGKILL the decode worker, or SIGTERM it (a drain that hands the stream off)")
    p.add_argument("--workload", default="burst-agent", help="goodput: a bench.workloads name")
    p.add_argument("--concurrency", type=int, default=4, help="goodput: requests in flight (closed-loop workloads)")
    p.add_argument("--duration", type=float, default=60.0, help="goodput: seconds of load (the kill at half)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: seconds (issue 21's)")
    p.add_argument("--itl-slo", type=float, default=0.2, help="goodput: a request's ITL p99, seconds (issue 21's)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="goodput: workload field")
    p.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="each actor on its own core, one torch thread (workers.pin_cores)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="resume: seconds per stream")
    p.add_argument("--recover-timeout", type=float, default=180.0, help="seconds for the killed worker to rejoin")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for baton up to be ready")
    p.add_argument("--seed", default="failover")
    p.add_argument("--out", type=Path, help="write every figure to this JSON file")
    p.add_argument("--log-dir", type=Path, help="keep each server's cluster.yaml and log here (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="baton-tiny, 600-token context, 1 repeat, 30 s of goodput")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.context, args.repeats, args.duration = "baton-tiny", 600, 1, 30.0
    if not 1 <= args.after < args.output:
        p.error("--after must be at least 1 and below --output")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    args.served = Path(args.model).name
    return args


class Results(NamedTuple):
    servers: list[dict[str, Any]]
    repeats: list[Repeat]
    cells: list[Goodput]


def run_part(part: str, args: argparse.Namespace, vocab: int, log_dir: Path, out: Results) -> None:
    """Every mode of one part, each against its own fresh server."""
    length = args.context + args.output if part == "resume" else workload_len(args)
    max_model_len = -(-length // 256) * 256 + 256
    for mode in args.modes:
        with start(args, f"{part}-{mode}", MODES[mode], max_model_len, log_dir) as server:
            ready_s = server.wait_ready(args.start_timeout)
            info = {"part": part, "mode": mode, "argv": server.argv, "ready_s": round(ready_s, 1),
                    "max_model_len": max_model_len}  # fmt: skip
            print(json.dumps(info), flush=True)
            if part == "resume":
                out.repeats.extend(run_loop(resume_mode(server, args, mode, vocab)))
            else:
                cell = run_loop(goodput_mode(server, args, mode, vocab))
                print(json.dumps(asdict(cell)), flush=True)
                out.cells.append(cell)
        info["exit_code"] = server.returncode
        out.servers.append(info)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = json.loads((resolve_model_dir(args.model) / "config.json").read_text())  # created on first use
    vocab = int(config["vocab_size"])
    parts = ["resume", "goodput"] if args.part == "both" else [args.part]
    out = Results([], [], [])
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C: the server is stopped
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="baton-failover-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        for part in parts:
            run_part(part, args, vocab, log_dir, out)
    doc: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "servers": out.servers}  # fmt: skip
    if "resume" in parts:
        summaries = summarize(out.repeats)
        for s in summaries:
            print(json.dumps(asdict(s)), flush=True)
        doc["resume"] = {"repeats": [asdict(r) for r in out.repeats], "summary": [asdict(s) for s in summaries],
                         "ratio": gap_ratio(summaries), "target": TARGET}  # fmt: skip
        print(resume_table(out.repeats, summaries), file=sys.stderr)
    if "goodput" in parts:
        doc["goodput"] = {"runs": [asdict(c) for c in out.cells], "ttft_slo_s": args.ttft_slo, "itl_slo_s": args.itl_slo}
        print(goodput_table(out.cells, args.ttft_slo, args.itl_slo), file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    faulted = all(r.took_effect and r.error is None for r in out.repeats) and all(c.took_effect for c in out.cells)
    return 0 if faulted else 1


if __name__ == "__main__":
    sys.exit(main())
