"""The nccl transport between Ray actors (`--kv-transport nccl`) on a real local Ray, on CPU: the
pages cross a real gloo communicator, which is what CPU pools use (CuPy's NCCL calls are the one
part not here: bench/gpu_check.py runs them on a GPU). Routing opens one channel per (prefill,
decode) pair; greedy outputs equal the colocated server's through the official openai client;
transfer metrics say nccl; a chunk corrupted after its digest is refused, the request completes
with the right tokens, and the channel carries the next transfer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.disagg_config import DisaggConfig
from cluster.fleet.worker_msgs import PrefillStats
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, start_server
from tests.cluster.test_ray_serving import LONG, MODEL, OTHER, front_of, metric, wait_decode_idle

ray = pytest.importorskip("ray")

# round_robin: a known route for every uncached prompt (test_ray_serving.py's pd says why)
NCCL = DisaggConfig(num_prefill=1, num_decode=1, transport="nccl", pages_per_chunk=2, placement="round_robin")


@pytest.fixture(scope="module")
def pd(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    handle = start_server(ServerConfig(engine=tiny_engine_config, grpc_port=None, served_model_name=MODEL,
                                       disagg=NCCL), None)  # fmt: skip
    yield handle
    handle.stop()


def _prefill_stats(handle: ServerHandle) -> PrefillStats:
    stats: PrefillStats = ray.get(front_of(handle).fleet.prefills[0].actor.stats.remote(), timeout=30)
    return stats


def test_pages_move_over_the_pairs_channel_and_outputs_match_one_engine(pd: ServerHandle, server: ServerHandle) -> None:
    colocated = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    disaggregated = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", timeout=60, max_retries=0)
    for prompt in (LONG, OTHER):
        want = colocated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        got = disaggregated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.choices[0].text
    assert metric(pd, "baton_placements_total", route="disaggregated") == 2
    assert metric(pd, "baton_kv_transfers_total", transport="nccl", outcome="ok") == 2
    assert metric(pd, "baton_kv_transfer_bytes_total", transport="nccl") > 0
    assert metric(pd, "baton_kv_transfers_total", transport="grpc", outcome="ok") == 0
    stats = wait_decode_idle(front_of(pd))
    assert stats.num_free_pages_at_idle == stats.num_pages and stats.num_open_reservations == 0


def test_a_corrupted_chunk_is_refused_and_the_channel_carries_the_next_transfer(
    pd: ServerHandle, server: ServerHandle
) -> None:
    front = front_of(pd)
    colocated = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", timeout=60, max_retries=0)
    baseline = wait_decode_idle(front)
    failed = _prefill_stats(pd).num_failed_transfers
    ok = metric(pd, "baton_kv_transfers_total", transport="nccl", outcome="ok")

    ray.get(front.fleet.prefills[0].actor.inject_fault.remote("transfer_corrupt"), timeout=30)
    prompt = "# corrupt\n" + LONG  # uncached anywhere: its pages move
    want = colocated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want  # the damaged pages never served
    assert _prefill_stats(pd).num_failed_transfers == failed + 1

    prompt = "# after\n" + OTHER
    want = colocated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text == want
    deadline = time.monotonic() + 5
    while metric(pd, "baton_kv_transfers_total", transport="nccl", outcome="ok") <= ok and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(pd, "baton_kv_transfers_total", transport="nccl", outcome="ok") > ok  # still by nccl
    stats = wait_decode_idle(front)
    assert stats.num_reserved_pages == 0 and stats.num_free_pages_at_idle == baseline.num_free_pages_at_idle
    assert _prefill_stats(pd).num_pinned_pages == 0
