"""Faults in Ray-disaggregated serving (two prefill actors, one decode actor, pushes slowed so a
transfer can be caught in flight): a client that leaves mid-transfer frees the pages on both
sides; a prefill actor killed in the middle of a transfer sends the
request to the other one, and once no prefill worker is left, decode prefills itself. Each
request completes with the colocated server's greedy text, and the decode worker's pages return
to their baseline. A push damaged in flight (a flipped byte, a missing last chunk, a stall
past its deadline) is refused and the request goes down another path. When the only decode worker dies, its streams fail within 5 s with a clear
error (there is no other to move them to) and the gateway stops admitting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from cluster.disagg_config import DisaggConfig
from cluster.fleet.worker_msgs import PrefillStats
from cluster.fleet.workers import PrefillHandle
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, kill_actor, start_server
from tests.cluster.test_ray_serving import (
    LONG,
    MODEL,
    OTHER,
    decode_stats,
    front_of,
    metric,
    wait_decode_idle,
)
from tests.faults.conftest import wait_for

ray = pytest.importorskip("ray")

# 12 pages of LONG in chunks of 2, over gRPC; a transfer is caught in flight by holding the
# prefill workers' pushes after their first chunk (PrefillActor.hold_pushes), not by racing a
# slowed push. The drills below fail both pairs' pushes on purpose, one after another: with the
# default pair_failures (3) both pairs would turn unroutable (cluster.placement.pair_health, tested on its
# own and across hosts), and the tests after them would find no pair to kill a transfer on.
# round_robin: each uncached prompt goes to a prefill worker whatever the links measured (held
# and stalled pushes here; tests/cluster/test_ray_serving.py's pd says more).
SLOW_PUSH = DisaggConfig(num_prefill=2, num_decode=1, pages_per_chunk=2, transport="grpc", transfer_deadline_s=5.0,
                         pair_failures=1000, placement="round_robin")


@pytest.fixture(scope="module")
def slow(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    cfg = ServerConfig(engine=tiny_engine_config, grpc_port=None, served_model_name=MODEL,
                       prefill_workers=2, disagg=SLOW_PUSH)
    handle = start_server(cfg, None)
    yield handle
    handle.stop()


def _prefill_stats(p: PrefillHandle) -> PrefillStats:
    stats: PrefillStats = ray.get(p.actor.stats.remote(), timeout=30)
    return stats


def _kill(p: PrefillHandle) -> None:
    kill_actor(p.actor)  # the fault happened: it is dead


def _hold(prefills: list[PrefillHandle], hold: bool) -> None:
    """Every push of these workers stops after its first chunk (or goes on again)."""
    for p in prefills:
        try:
            ray.get(p.actor.hold_pushes.remote(hold), timeout=30)
        except ray.exceptions.RayActorError:  # killed: nothing of it left to hold
            pass


def _pushing(prefills: list[PrefillHandle]) -> PrefillHandle:
    """The one worker with a push in flight. The client's first token can reach it before the
    push task has begun, so this waits for it; with pushes held it then stays in flight."""
    def busy() -> list[PrefillHandle]:
        return [p for p in prefills if _prefill_stats(p).num_inflight_transfers == 1]

    wait_for(lambda: len(busy()) == 1, "one push in flight", 20)
    [pushing] = busy()  # held: it stays in flight
    return pushing


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The push end reasons counted between two PrefillStats."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def test_a_client_leaving_mid_transfer_frees_both_sides(slow: ServerHandle) -> None:
    front = front_of(slow)
    baseline = wait_decode_idle(front)
    _hold(front.fleet.prefills, True)
    try:
        with httpx.Client(base_url=slow.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": LONG + "# leave", "max_tokens": 12, "stream": True, "temperature": 0}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()  # held: dropping the iterator would close the stream
                assert next(line for line in lines if line.startswith("data:"))  # the first token
                pushing = _pushing(front.fleet.prefills)
                ended = _prefill_stats(pushing).pushes_ended
                assert decode_stats(front).num_open_reservations == 1  # its pages are still moving
        deadline = time.monotonic() + 10  # the aborts reach both actors (the push is still held)
        while (_prefill_stats(pushing).num_pinned_pages or decode_stats(front).num_reserved_pages) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        after = _prefill_stats(pushing)
        assert after.num_pinned_pages == 0
        # the abort ended the push, not its deadline (which would free the pages in this window too)
        assert _moved(ended, after.pushes_ended) == {"aborted": 1}
    finally:
        _hold(front.fleet.prefills, False)
    stats = wait_decode_idle(front)
    assert stats.num_reserved_pages == 0 and stats.num_running == 0
    assert stats.num_free_pages_at_idle == baseline.num_free_pages_at_idle == stats.num_pages
    assert metric(slow, "baton_redispatches_total", to="prefill") == 0  # a cancel is not a failure


@pytest.mark.parametrize("fault", ["transfer_corrupt", "transfer_truncate", "transfer_stall"])
def test_a_damaged_or_stalled_push_is_refused_and_the_request_completes(
    slow: ServerHandle, server: ServerHandle, fault: str
) -> None:
    """Fault 4: a push whose payload is corrupted in flight, cut before its last chunk, or
    stalled past its deadline fails at the decode side (checksum, completeness, deadline):
    the request is re-dispatched to the other prefill worker (corrupted: first sent again by
    the same one, whose copy is good) and completes with the no-fault tokens; no page stays
    reserved or pinned."""
    front = front_of(slow)
    want = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
        model=MODEL, prompt=f"# {fault}\n" + LONG, max_tokens=12, temperature=0).choices[0].text  # uncached anywhere
    baseline = wait_decode_idle(front)
    refused = decode_stats(front).refused_bad_page + decode_stats(front).refused_bad_token
    to = "same" if fault == "transfer_corrupt" else "prefill"
    redispatched = metric(slow, "baton_redispatches_total", to=to)
    for p in front.fleet.prefills:  # whichever the placement picks damages this push, and only it
        ray.get(p.actor.inject_fault.remote(fault), timeout=30)
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", timeout=60, max_retries=0)
    started = time.monotonic()
    got = client.completions.create(model=MODEL, prompt=f"# {fault}\n" + LONG, max_tokens=12, temperature=0)
    assert got.choices[0].text == want  # no wrong output: the damaged pages never served
    assert time.monotonic() - started < SLOW_PUSH.transfer_deadline_s + 10
    assert metric(slow, "baton_redispatches_total", to=to) > redispatched  # the fault happened
    failed = sum(_prefill_stats(p).num_failed_transfers for p in front.fleet.prefills)
    assert failed >= 1
    if fault == "transfer_corrupt":
        assert decode_stats(front).refused_bad_page + decode_stats(front).refused_bad_token == refused
    for p in front.fleet.prefills:  # disarm what the placement did not use
        ray.get(p.actor.clear_faults.remote(), timeout=30)
    stats = wait_decode_idle(front)
    assert stats.num_reserved_pages == 0 and stats.num_free_pages_at_idle == baseline.num_free_pages_at_idle
    assert all(_prefill_stats(p).num_pinned_pages == 0 for p in front.fleet.prefills if p.is_alive)


COUNTED = [("baton_redispatches_total", {"to": "prefill"}), ("baton_kv_transfer_failures_total", {"reason": "died"}),
           ("baton_kv_transfers_total", {"transport": "grpc", "outcome": "ok"})]


def test_prefill_killed_mid_transfer_then_all_gone(slow: ServerHandle, server: ServerHandle) -> None:
    front = front_of(slow)
    want = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    want_long = want.completions.create(model=MODEL, prompt=LONG, max_tokens=12, temperature=0).choices[0].text
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", timeout=60, max_retries=0)
    baseline = wait_decode_idle(front)
    before = {name: metric(slow, name, **labels) for name, labels in COUNTED}
    transfers = {p.name: _prefill_stats(p).num_transfers for p in front.fleet.prefills}

    chunks: list[str] = []
    first = threading.Event()

    def read() -> None:
        for c in client.completions.create(model=MODEL, prompt=LONG, max_tokens=12, temperature=0, stream=True):
            chunks.extend(x.text for x in c.choices)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    _hold(front.fleet.prefills, True)
    try:
        started = time.monotonic()
        reader.start()
        assert first.wait(30)
        # The first token is out while its pages are still moving: a transfer is in flight.
        victim = _pushing(front.fleet.prefills)
        assert _prefill_stats(victim).num_pinned_pages > 0
        assert decode_stats(front).num_open_reservations == 1
        _kill(victim)
    finally:
        _hold(front.fleet.prefills, False)  # the survivor's push (the re-dispatch) goes through

    reader.join(60)
    assert not reader.is_alive()
    assert "".join(chunks) == want_long  # re-dispatched: the other prefill worker, same tokens
    assert time.monotonic() - started < SLOW_PUSH.transfer_deadline_s + 10
    assert not victim.is_alive
    [survivor] = [p for p in front.fleet.prefills if p is not victim]
    after = {name: metric(slow, name, **labels) for name, labels in COUNTED}
    assert {name: after[name] - before[name] for name in after} == dict.fromkeys(after, 1)  # one each
    assert _prefill_stats(survivor).num_transfers == transfers[survivor.name] + 1  # the survivor moved the pages
    assert metric(slow, "baton_node_up", node=victim.name, role="prefill") == 0
    stats = wait_decode_idle(front)
    assert stats.num_reserved_pages == 0 and stats.num_open_reservations == 0
    assert stats.num_free_pages_at_idle == baseline.num_free_pages_at_idle == stats.num_pages
    assert _prefill_stats(survivor).num_pinned_pages == 0

    # No prefill worker left: decode prefills a long, uncached prompt itself.
    _kill(survivor)
    local = metric(slow, "baton_placements_total", route="local")
    got = client.completions.create(model=MODEL, prompt=OTHER, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.completions.create(
        model=MODEL, prompt=OTHER, max_tokens=8, temperature=0
    ).choices[0].text
    assert metric(slow, "baton_placements_total", route="local") == local + 1
    stats = wait_decode_idle(front)
    assert stats.num_reserved_pages == 0 and stats.num_free_pages_at_idle == stats.num_pages


def test_decode_killed_mid_stream_fails_fast_and_clearly(slow: ServerHandle) -> None:
    """Runs last in this module: it ends the cluster."""
    front = front_of(slow)
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", timeout=60, max_retries=0)
    stream = client.completions.create(model=MODEL, prompt=OTHER + "!", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = iter(stream)
    next(received)
    decode = front.fleet.decodes[0]
    kill_actor(decode.actor)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="decode worker"):  # lost, and no other to move to
        for _ in received:
            pass
    assert time.monotonic() - started < 5
    assert not front.is_alive
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt=OTHER, max_tokens=4, temperature=0)
    assert refused.value.status_code == 503
    # No decode worker is left: not ready, but live -- kubelet must not restart the gateway
    # (that would end every actor it owns, the healthy prefill worker too) while a decode pod
    # is down or still loading.
    assert httpx.get(slow.url + "/ready", timeout=10).status_code == 503
    assert httpx.get(slow.url + "/live", timeout=10).json() == {"status": "ok"}
