"""What constrained decoding costs the batch: inter-token latency with and without it.

    python -m bench.structured [--model baton-tiny] [--concurrency 32] [--requests 192]

One in-process engine, a closed loop of `concurrency` requests (a new one starts whenever one
finishes), each with a random `prompt_len`-token prompt and exactly `output_len` output tokens.
Scenarios, run back to back on the same engine:

- none:         no request is constrained;
- half:         (masks filled on a thread beside the forward pass) every other request follows a JSON schema (four nested objects with strings,
                patterns, enums, integers and decimals: longer than `output_len`, so every
                request runs its full length and the two scenarios do the same work);
- half, serial: the same, with the masks filled before the forward pass instead of beside it
                (a second engine with `StructuredConfig(overlap=False)`; the default, overlap
                None, picks this one where the forward's threads already take every core).

ITL is the wall time between two consecutive tokens of one request (its first token
excluded), over every request of the scenario. Each scenario runs `repeats` times, interleaved
with the others, and each figure is the median of its runs. Prints a table and one JSON line
per scenario. A shared 2-core machine is noisy: compare scenarios of one invocation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01},
    },
    "required": ["name", "email", "role", "age", "score"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 4, "maxItems": 4}


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    concurrency: int
    num_requests: int
    num_constrained: int
    itl_p50_ms: float
    itl_p99_ms: float
    output_tok_s: float
    num_incomplete: int  # constrained requests whose grammar ended before output_len
    mask_wait_ms: float  # mean wait for the masks after the forward, over steps with any


def run_scenario(
    engine: object, name: str, args: argparse.Namespace, constrained_every: int
) -> ScenarioResult:
    from engine.constraint import Constraint
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    assert isinstance(engine, Engine)
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    free = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, seed=args.seed)
    constrained = SamplingParams(
        max_tokens=args.output_len, temperature=1.0, seed=args.seed, constraint=Constraint("json_schema", json.dumps(SCHEMA))
    )
    engine.prepare(constrained)
    last_token: dict[str, float] = {}
    counts: dict[str, int] = {}
    itls: list[float] = []
    started = num_constrained = incomplete = 0

    def start_one() -> None:
        nonlocal started, num_constrained
        is_constrained = constrained_every > 0 and started % constrained_every == 0
        req_id = f"{name}-{started}{'-c' if is_constrained else ''}"
        prompt = rng.integers(4, vocab, size=args.prompt_len).tolist()
        engine.add_request(req_id, prompt, constrained if is_constrained else free)
        started += 1
        num_constrained += is_constrained

    for _ in range(min(args.concurrency, args.requests)):
        start_one()
    begin = time.perf_counter()
    total_tokens = 0
    waits: list[float] = []
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        if engine.last_stats is not None and engine.last_stats.num_constrained:
            waits.append(engine.last_stats.mask_wait_s)
        for out in outputs:
            total_tokens += len(out.token_ids)
            if out.req_id in last_token:
                itls.append(now - last_token[out.req_id])
            last_token[out.req_id] = now
            counts[out.req_id] = out.num_output_tokens
            if out.finished:
                del last_token[out.req_id]
                incomplete += out.num_output_tokens < args.output_len
                if started < args.requests:
                    start_one()
    elapsed = time.perf_counter() - begin
    ms = np.array(itls) * 1e3
    return ScenarioResult(
        name, args.concurrency, started, num_constrained, float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
        total_tokens / elapsed, incomplete, float(np.mean(waits) * 1e3) if waits else 0.0,
    )  # fmt: skip


def _median(runs: list[ScenarioResult]) -> ScenarioResult:
    """Each metric's median over the runs of one scenario."""
    first = runs[0]
    med = {f: float(np.median([getattr(r, f) for r in runs])) for f in ("itl_p50_ms", "itl_p99_ms", "output_tok_s", "mask_wait_ms")}
    return replace(first, num_incomplete=sum(r.num_incomplete for r in runs), **med)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.structured", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="baton-tiny")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=192, help="requests per scenario")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each scenario; the median is reported")
    args = parser.parse_args(argv)

    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from engine.structured_config import StructuredConfig

    cfg = EngineConfig(model=args.model, max_num_seqs=max(64, args.concurrency), num_threads=args.threads)
    engine = Engine(replace(cfg, structured=StructuredConfig(overlap=True)))
    serial = Engine(replace(cfg, structured=StructuredConfig(overlap=False)))
    warmup = argparse.Namespace(**{**vars(args), "requests": args.concurrency, "output_len": 8})
    run_scenario(engine, "warmup", warmup, 2)
    run_scenario(serial, "warmup", warmup, 2)
    runs: dict[str, list[ScenarioResult]] = {"none": [], "half": [], "half, serial": []}
    for _ in range(args.repeats):  # interleaved, so that a noisy minute hits every scenario
        runs["none"].append(run_scenario(engine, "none", args, 0))
        runs["half"].append(run_scenario(engine, "half", args, 2))
        runs["half, serial"].append(run_scenario(serial, "half, serial", args, 2))
    engine.close()
    serial.close()
    results = [_median(rs) for rs in runs.values()]

    base = results[0].itl_p50_ms
    print(f"{'scenario':14s} {'constrained':>11s} {'ITL p50 ms':>10s} {'ITL p99 ms':>10s} {'tok/s':>8s} {'p50 vs none':>11s} {'mask wait ms':>12s}",
          file=sys.stderr)  # fmt: skip
    for r in results:
        print(
            f"{r.scenario:14s} {r.num_constrained:>5d}/{r.num_requests:<5d} {r.itl_p50_ms:10.2f} {r.itl_p99_ms:10.2f} "
            f"{r.output_tok_s:8.0f} {100 * (r.itl_p50_ms / base - 1):+10.1f}% {r.mask_wait_ms:12.3f}",
            file=sys.stderr,
        )
    for r in results:
        print(json.dumps(asdict(r)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
