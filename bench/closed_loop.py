"""The engine alone in a closed loop, per scheduler policy: where a step's prompt work lands.

    python -m bench.closed_loop [--model baton-small] [--policies least-uncached,fcfs]
                                [--concurrency 8] [--requests 40] [--prompt-len 256] [--output-len 128]

C streams, each a fresh random prompt of `prompt_len` tokens generating exactly `output_len`
(ignore_eos, greedy, no prefix cache); a stream that finishes is replaced by a new one at once,
as bench.compare's closed-loop cells do over HTTP. Reported per policy, from the engine's own
step stats (no server, no client on the cores): output tokens/s, TTFT p50 and TPOT p50 (first
token to last over the tokens after the first), and the steps by kind -- decode-only, mixed
(prompt work beside decode rows), prompt-only -- with their median time, rows and prompt tokens.

What it answers: whether a policy's TPOT comes from slower steps or from where the prompt work
falls. In arrival order (fcfs) a closed loop settles into waves (a wave's prompts in one step,
then decode steps with no prompt beside them); least-uncached computes each prompt within a few
steps, beside the streams already decoding (README, "Side by side with the peers").

Prints one JSON line per policy and a table on stderr; the policies run one after the other
in this process (a shared machine drifts: compare within one invocation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

KINDS = ("decode", "mixed", "prompt")


@dataclass(frozen=True, slots=True)
class StepKind:
    steps: int
    median_ms: float
    total_s: float
    mean_rows: float  # decode rows a step
    mean_prompt_tokens: float
    prompt_tokens: int  # computed in all steps of this kind


@dataclass(frozen=True, slots=True)
class LoopResult:
    policy: str
    concurrency: int
    requests: int
    elapsed_s: float
    output_tok_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    steps: dict[str, StepKind]


def run_loop(engine: object, concurrency: int, requests: int, prompt_len: int, output_len: int,
             seed: int = 0) -> LoopResult:  # fmt: skip
    """`concurrency` streams through `engine` (reported under its scheduler's policy) until
    `requests` have finished; the ones then still running are aborted (the loop never drains:
    every figure is from the steady state)."""
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    assert isinstance(engine, Engine) and output_len > 1 and requests >= concurrency > 0 and not engine.has_unfinished()
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    ttft: list[float] = []
    tpot: list[float] = []
    finished: set[str] = set()
    steps: dict[str, list[tuple[float, int, int]]] = defaultdict(list)  # kind -> (seconds, rows, prompt tokens)

    def send() -> None:
        req_id = f"loop-{seed}-{len(sent)}"
        engine.add_request(req_id, rng.integers(4, vocab, size=prompt_len).tolist(), params)
        sent[req_id] = time.perf_counter()

    for _ in range(concurrency):
        send()
    done = 0
    start = time.perf_counter()
    while done < requests:
        outputs = engine.step()
        stats = engine.last_stats
        now = time.perf_counter()
        if stats is not None:
            kind = "decode" if not stats.num_prefill_tokens else "prompt" if not stats.num_decode_tokens else "mixed"
            steps[kind].append((stats.step_s, stats.num_decode_tokens, stats.num_prefill_tokens))
        for out in outputs:
            if out.req_id not in first:
                first[out.req_id] = now
                ttft.append(now - sent[out.req_id])
            if out.finished:
                done += 1
                finished.add(out.req_id)
                tpot.append((now - first[out.req_id]) / (output_len - 1))
                send()
    elapsed = time.perf_counter() - start
    for req_id in sent.keys() - finished:
        engine.abort(req_id)
    by_kind = {
        kind: StepKind(len(v), round(1e3 * statistics.median(s for s, _, _ in v), 2), round(sum(s for s, _, _ in v), 3),
                       round(statistics.mean(r for _, r, _ in v), 2), round(statistics.mean(p for _, _, p in v), 1),
                       sum(p for _, _, p in v))
        for kind, v in steps.items()
    }  # fmt: skip
    return LoopResult(engine.cfg.scheduler_policy, concurrency, done, round(elapsed, 3), round(done * output_len / elapsed, 2),
                      round(1e3 * statistics.median(ttft), 2), round(1e3 * statistics.median(tpot), 2), by_kind)  # fmt: skip


def measure(model: str, policies: list[str], concurrency: int, requests: int, prompt_len: int,
            output_len: int) -> list[LoopResult]:  # fmt: skip
    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from engine.sampling import SamplingParams

    results = []
    for policy in policies:
        engine = Engine(EngineConfig(model=model, scheduler_policy=policy, enable_prefix_cache=False))
        engine.generate([[5] * 64], SamplingParams(max_tokens=4))  # warm-up: kernels built, pools touched
        results.append(run_loop(engine, concurrency, requests, prompt_len, output_len))
        engine.close()
    return results


def _print_table(results: list[LoopResult]) -> None:
    for r in results:
        print(f"{r.policy} c={r.concurrency}: {r.requests} requests in {r.elapsed_s:.1f} s, {r.output_tok_s:.1f} tok/s, "
              f"TTFT p50 {r.ttft_p50_ms:.0f} ms, TPOT p50 {r.tpot_p50_ms:.1f} ms", file=sys.stderr)  # fmt: skip
        for kind in KINDS:
            k = r.steps.get(kind)
            if k is not None:
                print(f"    {kind:<7} {k.steps:5} steps  median {k.median_ms:8.1f} ms  total {k.total_s:7.1f} s  "
                      f"rows {k.mean_rows:5.1f}  prompt tokens {k.mean_prompt_tokens:7.1f}", file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from engine.scheduler import POLICIES

    ap = argparse.ArgumentParser(prog="bench.closed_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="baton-small")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        ap.error(f"--policies: each of {', '.join(POLICIES)}")
    if not 0 < args.concurrency <= args.requests or args.prompt_len < 1 or args.output_len < 2:
        ap.error("need 0 < --concurrency <= --requests, --prompt-len >= 1 and --output-len >= 2")
    results = measure(args.model, policies, args.concurrency, args.requests, args.prompt_len, args.output_len)
    for r in results:
        print(json.dumps(asdict(r)), flush=True)
    _print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
