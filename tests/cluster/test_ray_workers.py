"""Prefill actor -> gRPC push -> decode actor on a real local Ray (one per module): the tokens
equal one in-process engine's; a forged push is refused and counted; when the prefill actor
dies, the decode side's reservation expires on its own and its pages come back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster import ray_runtime  # sets Ray's environment before anything imports `ray`
from cluster.ray_actors import DecodeStats, spawn_decode, spawn_prefill
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from prefill.worker import PrefillJob

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
EPOCH = 3


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[ray_runtime.RayInfo]:
    info = ray_runtime.start_local()
    assert info.node_ip == ray_runtime.LOOPBACK
    yield info
    ray_runtime.shutdown()


@pytest.fixture(scope="module")
def cfg(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=64)


@pytest.fixture(scope="module")
def single(cfg: EngineConfig) -> Engine:
    return Engine(cfg)


@pytest.fixture(scope="module")
def pair(ray_cluster: ray_runtime.RayInfo, cfg: EngineConfig) -> tuple[Any, Any]:
    prefill = spawn_prefill(replace(cfg, max_prefill_chunk=64), epoch=EPOCH)
    decode = spawn_decode(cfg)
    address = ray.get(decode.start.remote(), timeout=60)
    assert address.startswith("127.0.0.1:")
    ray.get(prefill.ping.remote(), timeout=60)
    return prefill, decode


def _stats(decode: Any) -> DecodeStats:
    stats: DecodeStats = ray.get(decode.stats.remote(), timeout=30)
    return stats


def _pd(prefill: Any, decode: Any, job: PrefillJob) -> list[int]:
    dest = ray.get(decode.reserve.remote(job, EPOCH))
    assert dest is not None
    result = ray.get(prefill.prefill.remote(job, dest))
    assert result.accepted, result.error
    if result.finish_reason is not None:
        ray.get(decode.cancel.remote(dest))
        return [result.first_token]
    ray.get(decode.start_prefilled.remote(job, dest, result.first_token))
    tokens: list[int] = ray.get(decode.run_until_idle.remote())[job.req_id]
    return tokens


def test_pd_across_actors_equals_one_engine(pair: tuple[Any, Any], single: Engine) -> None:
    prefill, decode = pair
    rng = np.random.default_rng(8)
    seeded = SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)
    cases = [(10, GREEDY), (40, GREEDY), (200, GREEDY), (200, seeded), (300, GREEDY)]
    for i, (n, params) in enumerate(cases):
        job = PrefillJob(f"pd{i}", tuple(rng.integers(4, 16_384, size=n).tolist()), params)
        assert _pd(prefill, decode, job) == single.generate([list(job.prompt_ids)], params)[0], n

    local = PrefillJob("local", tuple(range(200, 212)), GREEDY)  # conditional disaggregation
    ray.get(decode.start_local.remote(local))
    tokens = ray.get(decode.run_until_idle.remote())
    assert tokens == {"local": single.generate([list(local.prompt_ids)], GREEDY)[0]}

    stats = _stats(decode)
    assert stats.num_open_reservations == 0 and stats.refused_bad_token == 0
    assert stats.num_free_pages_at_idle == stats.num_pages


def test_forged_push_is_refused_and_counted(pair: tuple[Any, Any], single: Engine) -> None:
    prefill, decode = pair
    before = _stats(decode)
    job = PrefillJob("forge", tuple(range(100, 180)), GREEDY)
    dest = ray.get(decode.reserve.remote(job, EPOCH))
    assert dest is not None
    reserved = _stats(decode)

    forged = replace(dest, token=b"\x00" * len(dest.token))
    result = ray.get(prefill.prefill.remote(job, forged))
    assert not result.accepted and result.pages_received == 0
    after = _stats(decode)
    assert after.refused_bad_token == before.refused_bad_token + 1
    # the real reservation is untouched: still open, its pages still held
    assert after.num_open_reservations == 1 and after.num_used_pages == reserved.num_used_pages

    result = ray.get(prefill.prefill.remote(job, dest))  # the true token still works
    assert result.accepted, result.error
    ray.get(decode.start_prefilled.remote(job, dest, result.first_token))
    tokens = ray.get(decode.run_until_idle.remote())["forge"]
    assert tokens == single.generate([list(job.prompt_ids)], GREEDY)[0]
    assert _stats(decode).num_free_pages_at_idle == before.num_pages


def test_dead_prefill_actor_reservation_expires(
    ray_cluster: ray_runtime.RayInfo, cfg: EngineConfig, single: Engine
) -> None:
    decode = spawn_decode(cfg, reservation_ttl_s=0.5)
    victim = spawn_prefill(cfg, epoch=EPOCH)
    ray.get([decode.start.remote(), victim.ping.remote()], timeout=60)
    baseline = _stats(decode)
    assert baseline.num_free_pages_at_idle == baseline.num_pages

    job = PrefillJob("orphan", tuple(range(1000, 1200)), GREEDY)
    dest = ray.get(decode.reserve.remote(job, EPOCH))
    assert dest is not None and _stats(decode).num_used_pages == len(dest.dest_page_ids)

    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayActorError):  # the fault happened: it is dead
        ray.get(victim.prefill.remote(job, dest), timeout=30)

    deadline = time.monotonic() + 10.0  # bounded wait for the decode actor's own expiry
    while _stats(decode).num_open_reservations and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = _stats(decode)
    assert stats.num_open_reservations == 0 and stats.num_expired == 1
    assert stats.num_used_pages == 0
    assert stats.num_free_pages_at_idle == baseline.num_free_pages_at_idle

    # the decode actor still serves
    ray.get(decode.start_local.remote(replace(job, req_id="after")))
    tokens = ray.get(decode.run_until_idle.remote())["after"]
    assert tokens == single.generate([list(job.prompt_ids)], GREEDY)[0]
    ray.get(decode.stop.remote())
    ray.kill(decode)
