"""Prefill actor -> gRPC push -> decode actor on a real local Ray: the tokens equal one
in-process engine's; a forged push is refused and counted; when the prefill actor dies, the
decode side's reservation expires on its own and its pages come back; a complete transfer
that is never admitted is released at its lease."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.fleet.actors import DecodeStats, spawn_decode, spawn_prefill
from cluster.fleet.worker_msgs import OutputBatch
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from tests.cluster.conftest import kill_actor

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
EPOCH = 3


@dataclass
class Decode:
    """A decode actor and this test's place in its output stream."""

    actor: Any
    after: int = 0

    def tokens(self, req_ids: set[str], timeout_s: float = 60.0) -> dict[str, list[int]]:
        """Every output token of `req_ids` until each finished, from the per-step batches."""
        got: dict[str, list[int]] = {r: [] for r in req_ids}
        pending, deadline = set(req_ids), time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            batch: OutputBatch = ray.get(self.actor.next_batch.remote(self.after, 1.0), timeout=30)
            assert batch.first_seq == self.after + 1  # nothing dropped
            self.after = max(self.after, batch.last_seq)
            for out in batch.outputs:
                got[out.req_id].extend(out.token_ids)
                if out.finished:
                    pending.discard(out.req_id)
        assert not pending, f"unfinished: {pending}"
        return got

    def stats(self) -> DecodeStats:
        stats: DecodeStats = ray.get(self.actor.stats.remote(), timeout=30)
        return stats


@pytest.fixture(scope="module")
def cfg(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=64)


@pytest.fixture(scope="module")
def single(cfg: EngineConfig) -> Engine:
    return Engine(cfg)


@pytest.fixture(scope="module")
def pair(ray_cluster: Any, cfg: EngineConfig) -> Iterator[tuple[Any, Decode]]:
    prefill = spawn_prefill(replace(cfg, max_prefill_chunk=64), epoch=EPOCH)
    decode = spawn_decode(cfg, admit_lease_s=0.5)
    address = ray.get(decode.start.remote(), timeout=60)
    assert address.startswith("127.0.0.1:")
    ray.get(prefill.ping.remote(), timeout=60)
    yield prefill, Decode(decode)
    ray.kill(prefill)
    ray.kill(decode)


def _pd(prefill: Any, decode: Decode, job: Job) -> list[int]:
    dest = ray.get(decode.actor.place.remote(job, EPOCH))
    if dest is None:  # short: prefilled on the decode side
        return decode.tokens({job.req_id})[job.req_id]
    result = ray.get(prefill.prefill.remote(job, dest))
    if result.output.finished:
        ray.get(decode.actor.cancel.remote(dest))
        return [result.first_token]
    assert ray.get(decode.actor.admit.remote(job, dest, result.output, 10.0))
    report = ray.get(prefill.push_result.remote(result.transfer_id))
    assert report.accepted and report.transport == "grpc" and report.num_bytes > 0, report
    return [result.first_token] + decode.tokens({job.req_id})[job.req_id]


def test_pd_across_actors_equals_one_engine(pair: tuple[Any, Decode], single: Engine) -> None:
    prefill, decode = pair
    rng = np.random.default_rng(8)
    seeded = SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)
    cases = [(10, GREEDY), (40, GREEDY), (200, GREEDY), (200, seeded), (300, GREEDY)]
    for i, (n, params) in enumerate(cases):
        job = Job(f"pd{i}", tuple(rng.integers(4, 16_384, size=n).tolist()), params)
        assert _pd(prefill, decode, job) == single.generate([list(job.prompt_ids)], params)[0], n

    stats = decode.stats()
    assert stats.num_open_reservations == 0 and stats.refused_bad_token == 0
    assert stats.num_reserved_pages == 0 and stats.num_free_pages_at_idle == stats.num_pages
    assert ray.get(prefill.stats.remote()).num_pinned_pages == 0


def test_forged_push_is_refused_and_counted(pair: tuple[Any, Decode], single: Engine) -> None:
    prefill, decode = pair
    before = decode.stats()
    job = Job("forge", tuple(range(100, 180)), GREEDY)
    dest = ray.get(decode.actor.place.remote(job, EPOCH))
    assert dest is not None
    reserved = decode.stats()

    forged = replace(dest, token=b"\x00" * len(dest.token))
    result = ray.get(prefill.prefill.remote(job, forged))
    report = ray.get(prefill.push_result.remote(result.transfer_id))
    assert not report.accepted and report.error == "refused"
    after = decode.stats()
    assert after.refused_bad_token == before.refused_bad_token + 1
    # the real reservation is untouched: still open, its pages still held
    assert after.num_open_reservations == 1 and after.num_used_pages == reserved.num_used_pages

    result = ray.get(prefill.prefill.remote(replace(job, req_id="forge"), dest))  # the true token works
    assert ray.get(decode.actor.admit.remote(job, dest, result.output, 10.0))
    tokens = [result.first_token] + decode.tokens({"forge"})["forge"]
    assert tokens == single.generate([list(job.prompt_ids)], GREEDY)[0]
    assert decode.stats().num_free_pages_at_idle == before.num_pages


def test_complete_transfer_never_admitted_is_released_at_its_lease(pair: tuple[Any, Decode]) -> None:
    prefill, decode = pair
    job = Job("unclaimed", tuple(range(300, 400)), GREEDY)
    dest = ray.get(decode.actor.place.remote(job, EPOCH))
    assert dest is not None
    result = ray.get(prefill.prefill.remote(job, dest))
    assert ray.get(prefill.push_result.remote(result.transfer_id)).accepted
    held = decode.stats()
    assert held.num_open_reservations == 0 and held.num_reserved_pages == len(dest.dest_page_ids)

    deadline = time.monotonic() + 10.0  # the admission lease (0.5 s) runs from completion
    while decode.stats().num_reserved_pages and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = decode.stats()
    assert stats.num_reserved_pages == 0 and stats.num_lease_expired == held.num_lease_expired + 1
    assert stats.num_free_pages_at_idle == stats.num_pages
    assert not ray.get(decode.actor.admit.remote(job, dest, result.output, 0.1))  # too late


def test_dead_prefill_actor_reservation_expires(ray_cluster: Any, cfg: EngineConfig, single: Engine) -> None:
    decode = Decode(spawn_decode(cfg, reservation_ttl_s=0.5))
    victim = spawn_prefill(cfg, epoch=EPOCH)
    ray.get([decode.actor.start.remote(), victim.ping.remote()], timeout=60)
    baseline = decode.stats()
    assert baseline.num_free_pages_at_idle == baseline.num_pages

    job = Job("orphan", tuple(range(1000, 1200)), GREEDY)
    dest = ray.get(decode.actor.place.remote(job, EPOCH))
    assert dest is not None and decode.stats().num_used_pages == len(dest.dest_page_ids)

    kill_actor(victim)  # the fault happened: it is dead (before it could push anything)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.prefill.remote(job, dest), timeout=30)

    deadline = time.monotonic() + 10.0  # bounded wait for the decode actor's own expiry
    while decode.stats().num_open_reservations and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = decode.stats()
    assert stats.num_open_reservations == 0 and stats.num_expired == 1
    assert stats.num_used_pages == 0 and stats.num_reserved_pages == 0
    assert stats.num_free_pages_at_idle == baseline.num_free_pages_at_idle

    # the decode actor still serves: with no prefill worker (epoch None) it prefills itself
    after = replace(job, req_id="after")
    assert ray.get(decode.actor.place.remote(after, None)) is None
    tokens = decode.tokens({"after"})["after"]
    assert tokens == single.generate([list(job.prompt_ids)], GREEDY)[0]
    ray.get(decode.actor.close.remote())
    ray.kill(decode.actor)


def test_a_push_past_its_deadline_frees_both_sides(pair: tuple[Any, Decode], cfg: EngineConfig) -> None:
    _, decode = pair
    slow = spawn_prefill(cfg, epoch=EPOCH, pages_per_chunk=1, chunk_pause_s=0.2, push_deadline_s=0.5)
    try:
        before = decode.stats()
        job = Job("late", tuple(range(500, 600)), GREEDY)  # 7 pages: 1.4 s of pauses
        dest = ray.get(decode.actor.place.remote(job, EPOCH), timeout=60)
        assert dest is not None
        result = ray.get(slow.prefill.remote(job, dest), timeout=60)
        admit = decode.actor.admit.remote(job, dest, result.output, 10.0)  # waits on decode
        assert ray.get(slow.stats.remote()).num_pinned_pages == len(dest.dest_page_ids)
        report = ray.get(slow.push_result.remote(result.transfer_id), timeout=30)
        assert not report.accepted and report.error == "deadline exceeded"
        assert ray.get(admit, timeout=5) is False  # the broken stream released the reservation
        stats = decode.stats()
        assert stats.num_reserved_pages == 0 and stats.num_open_reservations == 0
        # every page is reusable again; what had arrived verified stays cached (decode.worker)
        assert stats.num_free_pages_at_idle == before.num_free_pages_at_idle == stats.num_pages
        assert stats.num_kept_pages > before.num_kept_pages
        assert ray.get(slow.stats.remote()).num_pinned_pages == 0
    finally:
        ray.kill(slow)
