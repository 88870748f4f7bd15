"""The engine's prefill/decode hand-off hooks: a prompt prefilled by one engine and decoded by
another (its KV copied page by page) gives exactly a single engine's tokens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams


def _single(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0]


def _handoff(prefill: Engine, decode: Engine, req_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    prefill.add_request(req_id, prompt, replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
                        export_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    exported = prefill.take_exported(req_id)
    assert exported is not None and exported.num_tokens == len(prompt)
    pages = decode.reserve_pages(len(prompt))
    assert pages is not None and len(pages) == exported.kv.shape[0]
    decode.pool.kv[:, :, torch.tensor(pages)] = exported.kv.permute(1, 2, 0, 3, 4, 5)  # what a transport does
    decode.add_prefilled(Job(req_id, tuple(prompt), params), exported.first_token, pages)
    tokens = [exported.first_token]
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.token_ids)
        decode.check_integrity()
    return tokens


def test_prefill_here_decode_there_equals_one_engine(tiny_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32")
    single, prefill, decode = Engine(cfg), Engine(replace(cfg, max_prefill_chunk=64)), Engine(cfg)
    rng = np.random.default_rng(17)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    for i, n in enumerate((1, 15, 16, 17, 100, 333)):
        prompt = rng.integers(4, 16_384, size=n).tolist()
        for params in (greedy, seeded):
            assert _handoff(prefill, decode, f"h{i}-{params.seed}", prompt, params) == _single(single, prompt, params)
    # The prefill side kept nothing but its cache; the decode side freed its reservations.
    assert prefill.free_pages_at_idle() == prefill.pool.num_pages
    assert decode.free_pages_at_idle() == decode.pool.num_pages


def test_a_cached_prefix_on_the_prefill_side_still_hands_off_every_page(tiny_model_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32")
    single, prefill, decode = Engine(cfg), Engine(cfg), Engine(cfg)
    prompt = list(range(500, 600))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = _handoff(prefill, decode, "a", prompt, params)
    second = _handoff(prefill, decode, "b", prompt + [7, 8, 9], params)
    assert prefill.prefix_cache is not None and prefill.prefix_cache.stats.hit_tokens == 96
    assert first == _single(single, prompt, params)
    assert second == _single(single, prompt + [7, 8, 9], params)
