"""The one prepared device check (issue 9): run from the source tree with the image's packages.

    PYTHONPATH=. python3 bench/gpu_check.py OUT_DIR            # on a CUDA machine (~3 min, H200)
    PYTHONPATH=. python3 bench/gpu_check.py OUT_DIR --cpu      # same code paths, small shapes

Stages, each timed and written to OUT_DIR/gpu_check.json as soon as it ends (a run cut off
still reports what it finished); a stage that fails records its error and the next one runs:

    env       device, versions; measured device-copy GB/s and bf16 matmul TFLOP/s (the ceilings)
    parity    (a) greedy tokens vs transformers in float32 (STYLE.md's parity contract) for
              baton-tiny and a ~1 B-parameter random Llama, through the CUDA path (Triton decode
              kernel, CUDA graphs); plus bf16 agreement, reported only
    decode    (b) decode tokens/s at batch 1/16/64/128 on the ~1 B model in bf16, engine steps
              (async scheduling, and each step read back before the next) and graph replay
              alone, against the HBM roofline (weights + KV read per step)
    prefill   (c) prefill TFLOP/s at 2k and 8k tokens
    nccl      (d) the NCCL transport end to end: send-to-self on one GPU through the same header
              checks, digests and reservation book as between two; GB/s vs a device copy
    host      (e) host-tier (pinned, side stream) copy GB/s each way, per page and in bulk
    graphs    (f) CUDA-graph replay vs eager decode step, and Triton vs torch decode attention
    kernels   each kernel of a decode layer timed alone at batch 64: where the step's time goes
              (and the Triton decode kernel at each split-KV partition, batch 1/16/64)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.builtin import BUILTIN_SPECS, RandomModelSpec, create_model
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MARGIN_EPS = 1e-3  # the parity contract's near-tie threshold (tests/engine/test_parity.py)
VENDOR_HBM_GBS = 4800.0  # H200 datasheet; the measured copy rate is reported beside it

ONE_B = RandomModelSpec(  # TinyLlama's shape with baton's vocabulary: ~1.04 B parameters
    hidden_size=2048,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=5632,
    max_position_embeddings=16_384,
    seed=11,
)
ONE_B_CPU = RandomModelSpec(  # the same code paths on CPU, small
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=4096,
    seed=11,
)


@dataclass
class Plan:
    device: str
    cpu: bool
    big: RandomModelSpec
    batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    prefill_lens: tuple[int, ...]
    parity_prompts: int
    parity_tokens: int
    transfer_pages: int


def plan_for(cpu: bool) -> Plan:
    if cpu:
        return Plan("cpu", True, ONE_B_CPU, (1, 4), 64, 4, (128, 256), 4, 8, 16)
    return Plan("cuda", False, ONE_B, (1, 16, 64, 128), 512, 32, (2048, 8192), 8, 32, 1024)


class Report:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "gpu_check.json"
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.start = time.perf_counter()

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            result = fn()
            result["ok"] = True
        except Exception as err:  # noqa: BLE001 - a failed stage is reported, the next runs
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        result["stage_s"] = round(time.perf_counter() - t0, 2)
        self.data[name] = result
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 2)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        short = {k: v for k, v in result.items() if k != "trace"}
        print(f"[gpu_check] {name}: {json.dumps(short, default=str)[:1500]}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


# -- env ----------------------------------------------------------------------------------


def stage_env(plan: Plan) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cpu_mode": plan.cpu}
    for name in ("triton", "cupy", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001
            info[name] = f"unavailable: {err}"
    if plan.cpu:
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), 10)
    info["copy_gbs_read_plus_write"] = round(2 * n / s / 1e9, 1)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    s = timed(lambda: a @ b, 10)
    info["bf16_matmul_tflops"] = round(2 * 8192**3 / s / 1e12, 1)
    return info  # the buffers go with this frame


# -- (a) parity -----------------------------------------------------------------------------


def _reference(model: Any, prompt: list[int], new_tokens: int, device: str) -> tuple[list[int], list[float]]:
    tokens, margins = [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        logits = out.logits[0, -1].float()
        for _ in range(new_tokens):
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            tokens.append(token)
            out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[0, -1].float()
    return tokens, margins


def _compare(refs: list[tuple[list[int], list[float]]], outputs: list[list[int]]) -> dict[str, Any]:
    early = mismatches = compared = 0
    for (want, margins), got in zip(refs, outputs, strict=True):
        for pos, (w, m) in enumerate(zip(want, margins, strict=True)):
            if m < MARGIN_EPS:
                early += 1
                break
            compared += 1
            if pos >= len(got) or got[pos] != w:
                mismatches += 1
                break
    return {"sequences": len(refs), "stopped_at_near_tie": early, "mismatched_sequences": mismatches,
            "tokens_compared": compared, "pass": mismatches == 0 and early <= max(1, len(refs) // 10)}  # fmt: skip


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each sequence's tokens before the first difference."""
    shares = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        shares.append(same / max(1, len(x)))
    return round(float(np.mean(shares)), 3)


def stage_parity(plan: Plan, models: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    result: dict[str, Any] = {}
    rng = np.random.default_rng(1234)
    lens = (1, 7, 16, 33, 100, 255, 640, 1500)[: plan.parity_prompts] if not plan.cpu else (1, 7, 33, 100)
    for name, model_dir in models.items():
        prompts = [rng.integers(4, 16_384, size=n).tolist() for n in lens]
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(plan.device).eval()
        t0 = time.perf_counter()
        refs = [_reference(hf, p, plan.parity_tokens, plan.device) for p in prompts]
        ref_s = time.perf_counter() - t0
        del hf
        if not plan.cpu:
            torch.cuda.empty_cache()
        greedy = SamplingParams(max_tokens=plan.parity_tokens, temperature=0.0, ignore_eos=True)
        engine = Engine(EngineConfig(model=str(model_dir), device=plan.device, dtype="float32", max_model_len=2048,
                                     kv_memory_bytes=2 << 30, max_num_seqs=16))  # fmt: skip
        out32 = engine.generate(prompts, greedy)
        entry = _compare(refs, out32)
        entry.update(backend=engine.runner.decode_backend, graphs=engine.runner.graphs is not None,
                     graph_replays=engine.runner.graphs.num_replays if engine.runner.graphs else 0,
                     reference_s=round(ref_s, 1))  # fmt: skip
        entry["pages_back_at_idle"] = engine.free_pages_at_idle() == engine.pool.num_pages
        del engine
        bf16 = Engine(EngineConfig(model=str(model_dir), device=plan.device, dtype="bfloat16", max_model_len=2048,
                                   kv_memory_bytes=2 << 30, max_num_seqs=16))  # fmt: skip
        entry["bf16_agreement_with_fp32"] = _agreement(out32, bf16.generate(prompts, greedy))
        del bf16
        if not plan.cpu:
            torch.cuda.empty_cache()
        result[name] = entry
    result["pass"] = all(v["pass"] for v in result.values() if isinstance(v, dict))
    return result


# -- (b) decode and (f) graphs ---------------------------------------------------------------


def _param_bytes(engine: Engine) -> int:
    model = engine.model
    tensors = [model.lm_head, model.final_norm]
    for layer in model.layers:
        tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
    return sum(t.numel() * t.element_size() for t in tensors)  # embeddings: only B rows are read


def _kv_bytes_per_token(engine: Engine) -> int:
    lay = engine.pool.layout
    return lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * engine.pool.kv.element_size()


def _fill_batch(engine: Engine, batch: int, context: int, steps: int, tag: str) -> None:
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", rng.integers(4, 16_000, size=context).tolist(), params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()


def _drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def stage_decode(plan: Plan, engine: Engine, ceilings: dict[str, Any]) -> dict[str, Any]:
    weights = _param_bytes(engine)
    per_token_kv = _kv_bytes_per_token(engine)
    # a copy's traffic (read + write) is what HBM moves per second; a decode step's is its reads
    measured_bw = float(ceilings.get("copy_gbs_read_plus_write") or VENDOR_HBM_GBS)
    result: dict[str, Any] = {"weight_bytes": weights, "kv_bytes_per_token": per_token_kv,
                              "context": plan.decode_context, "hbm_gbs_measured": measured_bw}  # fmt: skip
    for batch in plan.batches:
        _fill_batch(engine, batch, plan.decode_context, plan.decode_steps, f"d{batch}")
        sync()
        t0 = time.perf_counter()
        for _ in range(plan.decode_steps):
            engine.step()
        sync()
        step_s = (time.perf_counter() - t0) / plan.decode_steps
        ctx = plan.decode_context + plan.decode_steps // 2
        bytes_per_step = weights + batch * ctx * per_token_kv
        row: dict[str, Any] = {"engine_step_ms": round(step_s * 1e3, 3), "engine_tok_s": round(batch / step_s, 1),
                               "async_scheduling": engine.async_scheduling}  # fmt: skip
        if engine.async_scheduling:  # the same steps read back before the next is launched
            engine.async_scheduling = False
            sync()
            t0 = time.perf_counter()
            for _ in range(plan.decode_steps // 2):
                engine.step()
            sync()
            row["engine_step_ms_sync"] = round((time.perf_counter() - t0) / (plan.decode_steps // 2) * 1e3, 3)
            engine.async_scheduling = True
        graphs = engine.runner.graphs
        if graphs is not None:
            from engine.cuda_graphs import bucket_for

            bucket = bucket_for(batch, graphs.sizes)
            graph = graphs._graphs.get(bucket) if bucket else None
            if graph is not None:
                replay_s = timed(graph.replay, 50)
                row["graph_replay_ms"] = round(replay_s * 1e3, 3)
                row["forward_tok_s"] = round(batch / replay_s, 1)
        for label, bw in (("measured", measured_bw), ("vendor", VENDOR_HBM_GBS)):
            roof = batch / (bytes_per_step / (bw * 1e9))
            row[f"roofline_tok_s_{label}"] = round(roof, 1)
            row[f"engine_fraction_of_roofline_{label}"] = round(batch / step_s / roof, 3)
            if "forward_tok_s" in row:
                row[f"forward_fraction_of_roofline_{label}"] = round(row["forward_tok_s"] / roof, 3)
        if batch == 64 or (plan.cpu and batch == plan.batches[-1]):
            row["host_profile"] = _profile_steps(engine, 8)
            row.update(_count_syncs(engine, 8))
        result[f"batch_{batch}"] = row
        _drain(engine)
    return result


def _profile_steps(engine: Engine, steps: int) -> list[str]:
    """Where a step's host time goes: the top functions by own time over `steps` steps."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]  # type: ignore[attr-defined]
    return [f"{fn[2]} ({Path(fn[0]).name}:{fn[1]}) tottime={v[2] * 1e3 / steps:.3f}ms/step calls={v[1] // steps}"
            for fn, v in rows]  # fmt: skip


def _count_syncs(engine: Engine, steps: int) -> dict[str, Any]:
    """How often a step makes the host wait for the device (CUDA's sync debug mode warns at
    each), and from where. With async scheduling one a step is the read-back of the step before;
    any other is overlap lost."""
    if not torch.cuda.is_available():
        return {}
    import collections
    import warnings

    sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))  # fmt: skip
    return {"syncs_per_step": round(sum(where.values()) / steps, 2),
            "sync_sites": [f"{site} x{n / steps:.2f}/step" for site, n in where.most_common(8)]}  # fmt: skip


def stage_graphs(plan: Plan, engine: Engine) -> dict[str, Any]:
    """(f) one decode step: graph replay vs eager, and the Triton kernel vs the torch reference."""
    result: dict[str, Any] = {}
    runner = engine.runner
    graphs, backend = runner.graphs, runner.decode_backend
    for batch in plan.batches[:3]:
        _fill_batch(engine, batch, plan.decode_context, 64, f"g{batch}")
        row: dict[str, Any] = {}
        variants = [("graph", graphs, backend), ("eager", None, backend), ("eager_torch_attention", None, "torch")]
        for label, g, b in variants:
            if label == "graph" and g is None:
                continue
            runner.graphs, runner.decode_backend = g, b
            row[f"{label}_step_ms"] = round(timed(engine.step, 8) * 1e3, 3)
        runner.graphs, runner.decode_backend = graphs, backend
        if "graph_step_ms" in row:
            row["graph_speedup"] = round(row["eager_step_ms"] / row["graph_step_ms"], 2)
        result[f"batch_{batch}"] = row
        for r in list(engine.scheduler.running):
            engine.abort(r.req_id)
        _drain(engine)
    return result


def stage_kernels(plan: Plan, engine: Engine) -> dict[str, Any]:
    """Where one decode step's GPU time goes: each kernel of a layer timed alone at the step's
    shapes (batch 64 or the CPU plan's largest), with the bytes it must move per second."""

    from engine.attention import AttnMetadata, paged_attention

    model, pool = engine.model, engine.pool
    cfg, lay = model.cfg, pool.layout
    batch = 64 if not plan.cpu else plan.batches[-1]
    ctx = plan.decode_context + plan.decode_steps // 2
    dev, dtype = model.device, model.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(batch, cfg.hidden_size, device=dev, generator=gen).to(dtype)
    layer = model.layers[0]
    result: dict[str, Any] = {"batch": batch, "context": ctx}
    reps = 50 if not plan.cpu else 3

    def row(name: str, fn: Callable[[], Any], nbytes: int) -> float:
        s = timed(fn, reps)
        result[name] = {"us": round(s * 1e6, 1), "gbs": round(nbytes / s / 1e9, 1)}
        return s

    per_layer = 0.0
    # in-features from the config: a prepared weight's shape is its linear's layout (flat panels on the CPU)
    for name, w, width in (("qkv", layer.qkv, cfg.hidden_size), ("o", layer.o, model.q_size),
                           ("gate_up", layer.gate_up, cfg.hidden_size), ("down", layer.down, cfg.intermediate_size)):
        xin = torch.randn(batch, width, device=dev, generator=gen).to(dtype)
        per_layer += row(f"gemm_{name}", lambda xin=xin, w=w: model.linear(xin, w), w.numel() * w.element_size())
    pages_per_seq = -(-ctx // lay.page_size)
    table = torch.randint(0, pool.num_pages, (batch, pages_per_seq), device=dev, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device=dev, generator=gen).to(dtype)
    k_cache, v_cache = pool.layer(0)
    kv_bytes = batch * ctx * lay.num_kv_heads * lay.head_dim * 2 * pool.kv.element_size()
    for backend in dict.fromkeys((engine.runner.decode_backend, "torch")):
        cpu_plan = None
        if backend == "cpu":  # the compiled CPU kernel reads the step's plan, not the table
            from engine.cpu_kernels import DecodePlan

            rows = [(ids, ctx) for ids in table.tolist()]
            cpu_plan = DecodePlan.build(rows, [-1] * batch, lay.page_size, cfg.num_heads, cfg.head_dim)
        meta = AttnMetadata(torch.zeros(batch, dtype=torch.int64, device=dev), (), 0, table, lens, model.scale, backend,
                            cpu_plan=cpu_plan)  # fmt: skip
        s = row(f"attention_{backend}", lambda meta=meta: paged_attention(q, k_cache, v_cache, meta), kv_bytes)
        if backend == engine.runner.decode_backend:
            per_layer += s
    if engine.runner.decode_backend == "triton":
        result["attention_partitions"] = _time_partitions(plan, engine, ctx, reps)
    if model.fused_ops is not None:  # the model's own: Triton's on CUDA, the compiled CPU ones on CPU
        ops = model.fused_ops
        add_rms_norm, rope_and_cache, silu_mul = ops.add_rms_norm, ops.rope_and_cache, ops.silu_mul
        h = x.clone()
        act = x.numel() * x.element_size()
        per_layer += 2 * row("add_rms_norm", lambda: add_rms_norm(h, x, layer.input_norm, 1e-5), 3 * act)
        qkv = model.linear(x, layer.qkv)
        pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
        slots = torch.arange(batch, device=dev) * lay.page_size
        per_layer += row("rope_and_cache", lambda: rope_and_cache(qkv, model.rope.cos, model.rope.sin, pos, slots,
                                                                  k_cache, v_cache, cfg.num_heads), 2 * qkv.numel() * 2)  # fmt: skip
        gu = model.linear(x, layer.gate_up)
        per_layer += row("silu_mul", lambda: silu_mul(gu), gu.numel() * gu.element_size() * 3 // 2)
    head = row("lm_head", lambda: model.linear(x, model.lm_head), model.lm_head.numel() * model.lm_head.element_size())
    result["sum_of_kernels_per_step_ms"] = round((per_layer * cfg.num_layers + head) * 1e3, 3)
    result["sampler_top_p"] = _time_top_p(engine, batch, reps)
    return result


def _time_top_p(engine: Engine, batch: int, reps: int) -> dict[str, Any]:
    """A step's sampling for `batch` rows at temperature 0.8, top_p 0.9, over the model's
    vocabulary: top_p by the race (reads a test back each round) and by the sort (no read-back;
    what CUDA uses, so that async scheduling keeps the forward in flight), host wall time."""
    from engine import sampler as sampler_mod

    vocab = engine.runner.sampler.vocab_size
    gen = torch.Generator(device=engine.device).manual_seed(1)
    logits = (torch.randn(batch, vocab, device=engine.device, generator=gen) * 3).to(engine.model.dtype)
    rows = [sampler_mod.SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), 10, [], [], ())] * batch
    sampler = sampler_mod.Sampler(vocab, seed=0)
    chosen = sampler_mod._SORTED_NUCLEUS_DEVICES
    out: dict[str, Any] = {"vocab": vocab, "batch": batch, "in_use": "sort" if engine.device.type in chosen else "race"}
    try:
        for label, devices in (("race", frozenset()), ("sort", frozenset({engine.device.type}))):
            sampler_mod._SORTED_NUCLEUS_DEVICES = devices
            out[f"{label}_ms"] = round(timed(lambda: sampler.sample_tokens(logits, rows), reps) * 1e3, 3)
    finally:
        sampler_mod._SORTED_NUCLEUS_DEVICES = chosen
    return out


def _time_partitions(plan: Plan, engine: Engine, ctx: int, reps: int) -> dict[str, Any]:
    """The Triton decode kernel per split-KV partition (0: no split) at a few batch sizes, in
    a table as wide as the graphs' (the model's context), with decode_partition's choice
    marked: the figures that set its rule (engine.triton_attention)."""
    from engine.triton_attention import decode_partition, paged_decode

    model, pool = engine.model, engine.pool
    cfg, lay = model.cfg, pool.layout
    dev, dtype = model.device, model.dtype
    gen = torch.Generator(device=dev).manual_seed(1)
    k_cache, v_cache = pool.layer(0)
    width = -(-engine.max_model_len // lay.page_size)
    out: dict[str, Any] = {"context": ctx, "table_keys": width * lay.page_size}
    for batch in plan.batches[:3]:
        table = torch.randint(0, pool.num_pages, (batch, width), device=dev, generator=gen)
        lens = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device=dev, generator=gen).to(dtype)
        kv_bytes = batch * ctx * lay.num_kv_heads * lay.head_dim * 2 * pool.kv.element_size()
        cells: dict[str, Any] = {"chosen": decode_partition(batch, lay.num_kv_heads, width * lay.page_size)}
        for part in (0, 64, 128, 256, 512):
            call = functools.partial(paged_decode, q, k_cache, v_cache, table, lens, model.scale, partition=part)
            s = timed(call, reps)
            cells[str(part)] = {"us": round(s * 1e6, 1), "gbs": round(kv_bytes / s / 1e9, 1)}
        out[f"batch_{batch}"] = cells
    return out


# -- (c) prefill ----------------------------------------------------------------------------


def stage_prefill(plan: Plan, model_dir: Path, spec: RandomModelSpec) -> dict[str, Any]:
    longest = max(plan.prefill_lens)
    engine = Engine(EngineConfig(model=str(model_dir), device=plan.device, max_model_len=longest + 64,
                                 max_num_batched_tokens=longest, max_prefill_chunk=longest, max_num_seqs=4,
                                 kv_memory_bytes=4 << 30, enable_prefix_cache=False, cuda_graph_max_batch=0))  # fmt: skip
    params = _param_bytes(engine) // engine.pool.kv.element_size() - spec.vocab_size * spec.hidden_size
    hd = spec.resolved_head_dim
    result: dict[str, Any] = {}
    rng = np.random.default_rng(5)
    for n in plan.prefill_lens:
        times = []
        for rep in range(3):
            engine.add_request(f"p{n}-{rep}", rng.integers(4, 16_000, size=n).tolist(), SamplingParams(max_tokens=1))
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            times.append(time.perf_counter() - t0)
            _drain(engine)
        best = min(times[1:])
        # matmuls (the LM head for one row only) + causal attention (QK^T and PV, half the square)
        flops = 2 * params * n + 2 * 2 * spec.num_hidden_layers * spec.num_attention_heads * hd * n * n / 2
        result[f"tokens_{n}"] = {"seconds": round(best, 4), "tflops": round(flops / best / 1e12, 1)}
    return result


# -- (d) NCCL ---------------------------------------------------------------------------------


def stage_nccl(plan: Plan, engine: Engine) -> dict[str, Any]:
    from kvcache.pool import DevicePool
    from kvtransfer.nccl import (
        LoopbackFabric,
        NcclChannel,
        NcclReceiver,
        nccl_chunks,
        transfer_to_self,
    )
    from kvtransfer.nccl_comm import CupyComm, unique_id
    from kvtransfer.transport import PoolReceiver, ReservationBook

    device = torch.device(plan.device)
    layout, dtype = engine.pool.layout, engine.pool.kv.dtype
    n = plan.transfer_pages
    dst_pool = DevicePool(layout, n + 8, dtype, device)
    book = ReservationBook(layout.num_layers, lambda res: dst_pool.pages.free(res.page_ids))
    receiver = NcclReceiver(PoolReceiver(dst_pool, book), device)
    shape = (n, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
    kv = torch.randn(shape, device=device).to(dtype)
    nbytes = kv.numel() * kv.element_size()
    if plan.cpu:
        fabric = LoopbackFabric()
        channel = NcclChannel(lambda: fabric.comm(0), peer=0)
    else:
        uid = unique_id()
        channel = NcclChannel(lambda: CupyComm(1, uid, 0, device), peer=0)
    channel.open(deadline_s=30.0)
    result: dict[str, Any] = {"bytes": nbytes, "pages": n, "mode": "loopback-fabric" if plan.cpu else "nccl send-to-self"}
    # raw: the whole block in one send/recv group, then a plain device copy of the same bytes
    flat = kv.view(-1)
    out = torch.empty_like(flat)
    raw_s = timed(lambda: channel.run([flat], [out], 30.0), 5)
    assert torch.equal(out, flat), "NCCL delivered different bytes"
    copy_s = timed(lambda: out.copy_(flat), 5)
    result.update(raw_gbs=round(nbytes / raw_s / 1e9, 1), device_copy_gbs=round(nbytes / copy_s / 1e9, 1),
                  raw_fraction_of_copy=round(copy_s / raw_s, 3))  # fmt: skip
    # the transport path: reserve, headers with device digests, checks, store into the pool
    times = []
    for rep in range(3):
        pages = dst_pool.pages.allocate(n)
        assert pages is not None
        dest = book.reserve("self", f"req-{rep}", pages, 1, 30.0)
        sync()
        t0 = time.perf_counter()
        error = transfer_to_self(channel, receiver, nccl_chunks(dest, kv, 1, pages_per_chunk=64), 30.0)
        sync()
        times.append(time.perf_counter() - t0)
        if error:
            raise RuntimeError(f"transfer failed: {error}")
        landed = dst_pool.kv[:, :, torch.tensor(pages, device=device)].permute(2, 0, 1, 3, 4, 5)
        assert torch.equal(landed, kv), "pages landed wrong"
        book.completed.pop(dest.transfer_id)
        dst_pool.pages.free(pages)
    best = min(times)
    # where a 64-page chunk's time goes besides NCCL: its digest (each side computes one) and
    # the store into the reserved pages
    from kvtransfer.nccl import device_digest

    chunk = kv[:64].contiguous()
    result["chunk_digest_ms"] = round(timed(lambda: device_digest(chunk), 5) * 1e3, 3)
    pages = dst_pool.pages.allocate(chunk.shape[0])
    assert pages is not None
    dest = book.reserve("self", "req-parts", pages, 1, 30.0)
    header = next(nccl_chunks(dest, chunk, 1, pages_per_chunk=64))[0]
    store = receiver.receiver.store
    book.mark = lambda header: 0  # type: ignore[method-assign]  # the store alone, repeatedly
    result["chunk_store_ms"] = round(timed(lambda: store(header, chunk), 5) * 1e3, 3)
    result.update(transport_gbs=round(nbytes / best / 1e9, 1), transport_fraction_of_copy=round(copy_s / best, 3),
                  note="one GPU: a functional check; the 80% bandwidth target applies between two GPUs")  # fmt: skip
    channel.close()
    return result


# -- (e) host tier ----------------------------------------------------------------------------


def stage_host(plan: Plan, engine: Engine) -> dict[str, Any]:
    from kvcache.host import HostTier

    layout, dtype, pool = engine.pool.layout, engine.pool.kv.dtype, engine.pool
    n = min(plan.transfer_pages, pool.num_pages)
    host = HostTier(layout, n, dtype, pin=not plan.cpu)
    page_bytes = layout.page_bytes(dtype)
    pool.kv[:, :, :n].normal_()
    sync()
    t0 = time.perf_counter()
    slots = [host.store(pool.read_page(p)) for p in range(n)]
    host.load(0)  # waits for the side stream
    d2h = time.perf_counter() - t0
    assert all(s is not None for s in slots)
    assert torch.equal(host.slab[n - 1].to(pool.kv.device), pool.read_page(n - 1))
    expect = pool.kv[:, :, :n].clone()
    pool.kv[:, :, :n].zero_()
    sync()
    t0 = time.perf_counter()
    for p, slot in enumerate(slots):
        assert slot is not None
        host.load_into(slot, pool.kv[:, :, p])
    host.fence()
    sync()
    h2d = time.perf_counter() - t0
    assert torch.equal(pool.kv[:, :, :n], expect), "host tier round trip changed the pages"
    # load_many: the prefix cache's promotions of a whole prefix (runs of slots, staged, one
    # indexed copy), into every other page so the destinations are scattered
    pool.kv[:, :, :n].zero_()
    targets = list(range(0, n, 2)) + list(range(1, n, 2))
    sync()
    t0 = time.perf_counter()
    host.load_many([s for s in slots if s is not None], pool.kv, targets)
    host.fence()
    sync()
    h2d_many = time.perf_counter() - t0
    assert torch.equal(pool.kv[:, :, targets], expect), "load_many put the pages in the wrong places"
    # store_many: an eviction batch to the host (one indexed copy, a copy per run of slots)
    for slot in slots:
        if slot is not None:
            host.free(slot)
    sync()
    t0 = time.perf_counter()
    many = host.store_many(pool.kv, targets)
    host.load(many[-1])  # waits for the side stream
    d2h_many = time.perf_counter() - t0
    assert len(many) == n and torch.equal(host.slab[many[0]].to(pool.kv.device), pool.read_page(targets[0]))
    bulk_dev = pool.kv[:, :, :n].permute(2, 0, 1, 3, 4, 5).contiguous()
    bulk_host = torch.empty(bulk_dev.shape, dtype=dtype, pin_memory=not plan.cpu)
    d2h_bulk = timed(lambda: bulk_host.copy_(bulk_dev, non_blocking=True), 3)
    h2d_bulk = timed(lambda: bulk_dev.copy_(bulk_host, non_blocking=True), 3)
    total = n * page_bytes
    return {"pages": n, "page_bytes": page_bytes, "pinned": bool(host.slab.is_pinned()),
            "d2h_per_page_gbs": round(total / d2h / 1e9, 1), "h2d_per_page_gbs": round(total / h2d / 1e9, 1),
            "h2d_load_many_gbs": round(total / h2d_many / 1e9, 1), "d2h_store_many_gbs": round(total / d2h_many / 1e9, 1),
            "d2h_bulk_gbs": round(total / d2h_bulk / 1e9, 1), "h2d_bulk_gbs": round(total / h2d_bulk / 1e9, 1)}  # fmt: skip


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--cpu", action="store_true", help="run every stage on CPU with small shapes")
    parser.add_argument("--skip", default="", help="comma-separated stages to skip")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the CPU dry run", file=sys.stderr)
        return 2
    plan = plan_for(args.cpu)
    skip = set(filter(None, args.skip.split(",")))
    report = Report(args.out_dir)
    report.stage("env", lambda: stage_env(plan))
    work = Path(tempfile.mkdtemp(prefix="baton-gpu-check-"))
    t0 = time.perf_counter()
    tiny = create_model(BUILTIN_SPECS["baton-tiny"], work / "baton-tiny")
    big = create_model(plan.big, work / "one-b")
    report.data["models_created_s"] = round(time.perf_counter() - t0, 1)
    if "parity" not in skip:
        report.stage("parity", lambda: stage_parity(plan, {"baton-tiny": tiny, "one-b": big}))
    engine: Engine | None = None
    try:
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=str(big), device=plan.device, max_model_len=plan.decode_context + 160,
                                     max_num_seqs=max(plan.batches), max_num_batched_tokens=8192,
                                     max_prefill_chunk=8192, kv_memory_bytes=(24 << 30) if not plan.cpu else (256 << 20),
                                     enable_prefix_cache=False,
                                     # on with CUDA graphs; on CPU too, so the dry run runs it
                                     async_scheduling=True if plan.cpu else None))  # fmt: skip
        report.data["decode_engine_ready_s"] = round(time.perf_counter() - t0, 1)
    except Exception as err:  # noqa: BLE001
        report.data["decode_engine_error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}"
    ceilings = report.data.get("env", {})
    if engine is not None:
        if "decode" not in skip:
            report.stage("decode", lambda: stage_decode(plan, engine, ceilings))
        if "graphs" not in skip:
            report.stage("graphs", lambda: stage_graphs(plan, engine))
        if "kernels" not in skip:
            report.stage("kernels", lambda: stage_kernels(plan, engine))
        if "nccl" not in skip:
            report.stage("nccl", lambda: stage_nccl(plan, engine))
        if "host" not in skip:
            report.stage("host", lambda: stage_host(plan, engine))
        del engine
        if not plan.cpu:
            torch.cuda.empty_cache()
    if "prefill" not in skip:
        report.stage("prefill", lambda: stage_prefill(plan, big, plan.big))
    print(f"[gpu_check] done in {report.data['elapsed_s']} s -> {report.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
