"""The engine on CUDA (bf16): runs where a GPU is present, skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_bf16_engine_tracks_the_cpu_float32_engine(tiny_model_dir: Path) -> None:
    cpu = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024))
    gpu = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", max_model_len=1024))
    assert gpu.dtype == torch.bfloat16
    prompt = list(range(100, 700))
    ref = cpu.prompt_logits(prompt)
    got = gpu.prompt_logits(prompt).cpu()
    assert torch.nn.functional.cosine_similarity(ref, got, dim=0).item() > 0.99
    outputs = gpu.generate([prompt, prompt[:50], [7]], SamplingParams(max_tokens=16, temperature=0.0))
    assert [len(o) for o in outputs] == [16, 16, 16]
    assert gpu.free_pages_at_idle() == gpu.pool.num_pages


def test_cuda_engine_decodes_through_triton_and_cuda_graphs(tiny_model_dir: Path) -> None:
    gpu = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", max_model_len=512, max_num_seqs=8))
    assert gpu.runner.decode_backend == "triton" and gpu.model.fused_ops is not None
    assert gpu.runner.graphs is not None and gpu.runner.graphs.num_graphs == len(gpu.runner.graphs.sizes)
    assert gpu.async_scheduling  # on by default with graphs
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 17]
    got = gpu.generate(prompts, params)
    assert gpu.runner.graphs.num_replays > 0 and gpu.runner.graphs.num_carried_steps > 0
    sync = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", max_model_len=512, max_num_seqs=8,
                               async_scheduling=False))  # fmt: skip
    assert sync.generate(prompts, params) == got
    assert gpu.free_pages_at_idle() == gpu.pool.num_pages


def test_split_kv_decode_matches_the_whole_context_kernel_in_bf16() -> None:
    from engine.triton_attention import paged_decode

    gen = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(64, 16, 4, 64, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(64, 16, 4, 64, device="cuda", generator=gen).to(torch.bfloat16)
    table = torch.randint(0, 64, (5, 40), device="cuda", generator=gen)
    lens = torch.tensor([1, 64, 65, 300, 640], device="cuda")
    q = torch.randn(5, 32, 64, device="cuda", generator=gen).to(torch.bfloat16)
    whole = paged_decode(q, k, v, table, lens, 0.125, partition=0)
    for part in (64, 128, 256):
        split = paged_decode(q, k, v, table, lens, 0.125, partition=part)
        torch.testing.assert_close(split, whole, rtol=2e-2, atol=2e-2)


def test_host_tier_load_many_stages_runs_of_slots_on_the_side_stream() -> None:
    from kvcache.host import HostTier
    from kvcache.pool import DevicePool, KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    host = HostTier(layout, 8, torch.bfloat16, pin=True)
    assert host.slab.is_pinned()
    host.slab.copy_(torch.randn(host.slab.shape).to(torch.bfloat16))
    pool = DevicePool(layout, 10, torch.bfloat16, torch.device("cuda"))
    slots, pages = [2, 3, 4, 0, 6, 7], [9, 1, 5, 3, 0, 8]
    host.load_many(slots, pool.kv, pages)
    host.fence()
    torch.cuda.synchronize()
    for slot, page in zip(slots, pages, strict=True):
        assert torch.equal(pool.read_page(page).cpu(), host.slab[slot])
    assert all(not pool.read_page(p).any() for p in range(10) if p not in pages)


def test_host_tier_store_many_stages_an_eviction_batch_on_the_side_stream() -> None:
    from kvcache.host import HostTier
    from kvcache.pool import DevicePool, KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    host = HostTier(layout, 4, torch.bfloat16, pin=True)
    pool = DevicePool(layout, 10, torch.bfloat16, torch.device("cuda"))
    pool.kv.normal_()
    pages = [7, 2, 9, 4, 5]
    slots = host.store_many(pool.kv, pages)
    assert len(slots) == 4 and host.num_free == 0  # as many as there were slots
    torch.cuda.synchronize()
    for slot, page in zip(slots, pages, strict=False):
        assert torch.equal(host.load(slot), pool.read_page(page).cpu())


def test_deferred_sampling_queues_without_waiting_for_the_device() -> None:
    """sample_tokens with greedy, temperature, top_k, min_p, top_p (sorted on CUDA), seeded and
    logit_bias rows makes no call that synchronises (CUDA's sync debug mode raises on one):
    with async scheduling, the sampler runs while the forward is in flight. Its tokens equal
    __call__'s."""
    from engine.sampler import Sampler, SamplingRow

    vocab = 512
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(9, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0, min_p=0.05),
              SamplingParams(temperature=0.9, top_k=5, seed=11), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=40, top_p=0.7, seed=2),
              SamplingParams(temperature=0.0, logit_bias={17: 100.0}),
              SamplingParams(temperature=0.8, seed=6, logit_bias={3: -100.0, 9: 5.0})]  # fmt: skip
    rows = [SamplingRow(p, 40 + i, [], [], ()) for i, p in enumerate(params)]
    sampler = Sampler(vocab, seed=3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.sample_tokens(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    again = Sampler(vocab, seed=3)(logits, rows)
    assert tokens.tolist() == again.token_ids
    assert tokens[7].item() == 17 and tokens[8].item() != 3
