"""Offline engine throughput: output tokens/s at several batch sizes, and where step time goes.

    python -m bench.offline            (or: baton bench --offline)

For each model and batch size B: B random prompts of `prompt_len` tokens, each generating
exactly `output_len` tokens (ignore_eos), all submitted at once. Reported per run:

- output tokens/s over the whole run (prefill included) and over decode steps only;
- the share of decode-step time spent outside the model forward (scheduling, input
  preparation, sampling, detokenization, bookkeeping): BENCHMARKS.md's P9 asks <= 15% at B=32.

Prints a table and one JSON line per run. Numbers from a shared 2-core machine are noisy:
compare runs from the same invocation, not across days.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class OfflineResult:
    model: str
    batch: int
    prompt_len: int
    output_len: int
    elapsed_s: float
    output_tok_s: float
    decode_tok_s: float
    decode_steps: int
    decode_step_ms: float
    outside_forward_share: float


def run_one(engine: object, model: str, batch: int, prompt_len: int, output_len: int, seed: int) -> OfflineResult:
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    assert isinstance(engine, Engine)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = rng.integers(4, vocab, size=prompt_len).tolist()
        engine.add_request(f"bench-{seed}-{i}", prompt, params)
    decode_s = forward_s = 0.0
    decode_tokens = decode_steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        stats = engine.last_stats
        if stats is not None and stats.num_prefill_tokens == 0:
            decode_s += stats.step_s
            forward_s += stats.forward_s
            decode_tokens += stats.num_decode_tokens
            decode_steps += 1
    elapsed = time.perf_counter() - start
    return OfflineResult(
        model=model,
        batch=batch,
        prompt_len=prompt_len,
        output_len=output_len,
        elapsed_s=round(elapsed, 3),
        output_tok_s=round(batch * output_len / elapsed, 1),
        decode_tok_s=round(decode_tokens / decode_s, 1) if decode_s else 0.0,
        decode_steps=decode_steps,
        decode_step_ms=round(1000 * decode_s / max(decode_steps, 1), 2),
        outside_forward_share=round(1 - forward_s / decode_s, 3) if decode_s else 0.0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.offline", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="baton-tiny,baton-small")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from engine.engine_config import EngineConfig

    results = []
    for model in args.models.split(","):
        cfg = EngineConfig(
            model=model, device=args.device, dtype=args.dtype, num_threads=args.threads,
            kv_memory_bytes=2 << 30, max_num_seqs=256, max_num_batched_tokens=4096,
        )
        engine = Engine(cfg)
        run_one(engine, model, 2, 16, 8, seed=99)  # warm-up: first-call allocations
        for seed, batch in enumerate(int(b) for b in args.batch_sizes.split(",")):
            result = run_one(engine, model, batch, args.prompt_len, args.output_len, seed)
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    _table(results)
    return 0


def _table(results: list[OfflineResult]) -> None:
    head = f"{'model':<12} {'batch':>5} {'out tok/s':>10} {'decode tok/s':>12} {'step ms':>8} {'outside fwd':>11}"
    print(head, file=sys.stderr)
    for r in results:
        print(
            f"{r.model:<12} {r.batch:>5} {r.output_tok_s:>10.1f} {r.decode_tok_s:>12.1f} "
            f"{r.decode_step_ms:>8.2f} {r.outside_forward_share:>10.1%}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
