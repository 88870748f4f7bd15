"""The engine's host work per decode step, apart from the model: what a GPU waits for.

    python -m bench.host_overhead [--batches 1,16,64] [--steps 100] [--context 128]

A one-layer, 64-wide Llama (baton's tokenizer, 16k vocabulary) makes the forward pass nearly
free, so a decode step's time is the host's: scheduling, input staging, the sampler's call,
detokenizing, stop checks and outputs. On the H200 (2026-11-29) about 1.5 ms of a 3.1 ms
batch-64 step was host time with the GPU idle; this measures that part on any machine, with
async scheduling off and on (on a CPU the two do the same work: nothing runs beside it).

Per batch and mode, one JSON line:

    step_ms     wall time of engine.step()
    model_ms    the model's forward and LM head (on a GPU: the device's, in a graph)
    sample_ms   the sampler's calls (its argmax over the vocabulary is compute; on a GPU, the device's)
    host_ms     step - model - sample: the Python around them, input staging included
    host_us_per_row

Numbers from a shared 2-core machine are noisy: compare runs of one invocation.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MICRO = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=128, seed=3)  # fmt: skip


class _Clock:
    """Adds up the time spent in the functions it wraps."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


class _TimedSampler:
    """The engine's sampler, both entry points on one clock."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self._call = clock.wrap(inner.__call__)
        self.sample_tokens = clock.wrap(inner.sample_tokens)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self._call(*args, **kw)


def measure(model_dir: Path, batch: int, steps: int, context: int, async_on: bool) -> dict[str, Any]:
    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=context + steps + 64, max_num_seqs=batch,
                                 kv_memory_bytes=256 << 20, enable_prefix_cache=False,
                                 async_scheduling=async_on))  # fmt: skip
    sample, model = _Clock(), _Clock()
    engine.runner.sampler = _TimedSampler(engine.runner.sampler, sample)  # type: ignore[assignment]
    engine.model.forward = model.wrap(engine.model.forward)  # type: ignore[method-assign]
    engine.model.compute_logits = model.wrap(engine.model.compute_logits)  # type: ignore[method-assign]
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"h{i}", rng.integers(4, 16_000, size=context).tolist(), params)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # warm: the first decode steps allocate
        engine.step()
    sample.seconds = model.seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
        assert engine.last_stats is not None and engine.last_stats.num_decode_tokens == batch
    step = (time.perf_counter() - t0) / steps
    host = step - (model.seconds + sample.seconds) / steps
    return {"batch": batch, "async_scheduling": async_on, "step_ms": round(step * 1e3, 3),
            "model_ms": round(model.seconds / steps * 1e3, 3), "sample_ms": round(sample.seconds / steps * 1e3, 3),
            "host_ms": round(host * 1e3, 3), "host_us_per_row": round(host * 1e6 / batch, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.host_overhead", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.context < 1:
        parser.error("--steps and --context must be positive")
    import torch

    from engine.builtin import RandomModelSpec, create_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host path is one thread; the micro forward needs no more
    try:
        with tempfile.TemporaryDirectory(prefix="baton-host-") as tmp:
            model_dir = create_model(RandomModelSpec(**MICRO), Path(tmp) / "micro")  # type: ignore[arg-type]
            for batch in (int(b) for b in args.batches.split(",")):
                for async_on in (False, True):
                    print(json.dumps(measure(model_dir, batch, args.steps, args.context, async_on)), flush=True)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
