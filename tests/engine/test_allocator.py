"""A prefill step's activations stay in the heap (engine.allocator): counted in page faults.

Each case runs in a fresh interpreter, since malloc's settings are the whole process's: one
engine, warmed up, then the minor page faults of a few prefill steps on a thread of their own
(as the served step thread, in a malloc arena of its own) of 8 prompts × 256
tokens (their gate_up output alone is 16 MB, 4,096 pages). With glibc's own settings those
buffers are faulted in anew each step, which the second case shows (so the check can fail
here); with the engine's, almost nothing is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.allocator import glibc

PROBE = r"""
import json, resource, sys, threading
import numpy as np
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams

engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", max_num_batched_tokens=2048, max_prefill_chunk=512,
                             enable_prefix_cache=False))  # freed pages are reused: the pool is touched once
params = SamplingParams(max_tokens=1, temperature=0.0)
rng = np.random.default_rng(0)

def step():
    for i in range(8):
        engine.add_request(f"r{rng.integers(1 << 40)}", rng.integers(100, 1000, 256).tolist(), params)
    while engine.has_unfinished():
        engine.step()

def measure(out):
    for _ in range(2):  # first-call allocations, the heap grown to a step's peak
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    out["faults_per_step"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3

out = {}
thread = threading.Thread(target=measure, args=(out,))  # as served: a step thread, its own malloc arena
thread.start()
thread.join()
print(json.dumps(out))
"""

GATE_UP_PAGES = 2048 * 2048 * 4 // 4096  # baton-tiny's gate_up output at 2,048 tokens, in 4 KiB pages

pytestmark = pytest.mark.skipif(glibc() is None, reason="not glibc: the engine leaves malloc alone")


def _faults_per_step(model_dir: Path, policy: str) -> float:
    env = {**os.environ, "BATON_MALLOC": policy}
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], env=env, capture_output=True, text=True,
                         timeout=240, check=True)  # fmt: skip
    faults: float = json.loads(out.stdout.strip().splitlines()[-1])["faults_per_step"]
    return faults


def test_a_prefill_steps_activations_are_not_faulted_in_anew(tiny_model_dir: Path) -> None:
    system = _faults_per_step(tiny_model_dir, "system")
    engine = _faults_per_step(tiny_model_dir, "engine")
    print(f"[allocator] minor faults per prefill step: glibc's settings {system:.0f}, the engine's {engine:.0f}")
    assert system > GATE_UP_PAGES  # the check can fail: without the settings the buffers come back each step
    # 0-2 faults a step in a quiet process; up to ~850 in the full suite, and 170-850 in a
    # process that has just built the CPU kernels into a fresh cache dir (cause not found: a
    # plain child process leaves none). The gate_up buffer unmapped and mapped again each
    # step is 4,096 by itself, which is what this guards against.
    assert engine < GATE_UP_PAGES / 2
