"""Cache-aware placement on a real local Ray, 2 prefill + 2 decode workers (issue 6, acceptance
item 2): the gateway's GlobalIndex follows the workers' KV events, and its Placer sends the
follow-up turns of a conversation to the prefill worker holding its prefix (asserted from the
workers' own prefix-hit counters); when that worker is overloaded (stalled, with a burst of
the conversation's requests queued on it) a new request with the same prefix goes elsewhere
and is served while the hot worker is still stuck."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from bench.server_proc import free_port
from cluster.client import BatonClient, Options, Sampling
from cluster.disagg_config import DisaggConfig
from cluster.fleet.front import RayFront
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from kvcache.hashing import page_hashes
from tests.cluster.conftest import ServerHandle, start_server

ray = pytest.importorskip("ray")

T = TypeVar("T")
TENANT = "tenant-a"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
STALL_S = 6.0


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def pd2(ray_cluster: Any, tiny_engine_config: EngineConfig, grpc_port: int) -> Iterator[ServerHandle]:
    cfg = ServerConfig(engine=tiny_engine_config, grpc_port=grpc_port, served_model_name="baton-tiny",
                       disagg=DisaggConfig(num_prefill=2, num_decode=2, transport="grpc"))
    handle = start_server(cfg, None)
    yield handle
    handle.stop()


def on_loop(handle: ServerHandle, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    return asyncio.run_coroutine_threadsafe(coro, handle.loop).result(timeout_s)


async def generate(front: RayFront, req_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in front.generate(Job(req_id, tuple(prompt), GREEDY, cache_salt=TENANT)):
        tokens.extend(out.token_ids)
    return tokens


def hit_tokens(front: RayFront) -> dict[str, int]:
    """Each prefill worker's prefix-cache hits, from its own stats."""
    stats = ray.get([p.actor.stats.remote() for p in front.fleet.prefills], timeout=30)
    return {p.name: s.num_hit_tokens for p, s in zip(front.fleet.prefills, stats, strict=True)}


def wait_indexed(front: RayFront, prompt: list[int], timeout_s: float = 10.0) -> str:
    """The prefill worker the index says holds the prompt's full pages (once its events came)."""
    ps = front.page_size
    hashes = page_hashes(prompt[: len(prompt) // ps * ps], ps, TENANT.encode(), front.fingerprint)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = front.index.match(hashes)
        for p in front.fleet.prefills:
            if match.hit(p.name).num_pages == len(hashes):
                return p.name
        time.sleep(0.02)
    raise AssertionError("the index never learned the prompt's pages from a prefill worker")


def test_follow_ups_land_on_the_holder_and_a_hot_holder_sheds(pd2: ServerHandle) -> None:
    front = pd2.running.front
    assert isinstance(front, RayFront) and len(front.fleet.prefills) == 2 and len(front.fleet.decodes) == 2
    rng = random.Random(6)
    words = lambda n: [rng.randrange(100, 1000) for _ in range(n)]  # noqa: E731

    # Turn 1 is computed by some prefill worker; each follow-up (the whole conversation so far
    # plus a new message too long for decode-local prefill) goes back to that one.
    prompt = words(160)
    answer = on_loop(pd2, generate(front, "turn-1", prompt))
    holder = wait_indexed(front, prompt)
    other = next(p.name for p in front.fleet.prefills if p.name != holder)
    for turn in (2, 3):
        prompt = prompt + answer + words(48)
        before = hit_tokens(front)
        answer = on_loop(pd2, generate(front, f"turn-{turn}", prompt))
        after = hit_tokens(front)
        assert after[holder] - before[holder] >= len(prompt) - 48 - 2 * front.page_size, (turn, before, after)
        assert after[other] == before[other] == 0, (turn, before, after)
        wait_indexed(front, prompt)

    rates = ray.get([p.actor.stats.remote() for p in front.fleet.prefills], timeout=30)
    assert any(r.prefill_s_per_token > 0 for r in rates)  # the holder's measured prefill cost

    # Overload the holder: it stalls, and a burst of the conversation's next messages queues on
    # it until its queue outweighs what its cache saves; the rest, and a new request with the
    # same prefix, go elsewhere and finish while the holder is still stuck.
    holder_actor = next(p.actor for p in front.fleet.prefills if p.name == holder)
    ray.get(holder_actor.stall.remote(STALL_S), timeout=30)
    stalled_at = time.monotonic()

    async def burst() -> list[asyncio.Task[list[int]]]:
        return [asyncio.create_task(generate(front, f"burst-{i}", prompt + words(96))) for i in range(8)]

    tasks = on_loop(pd2, burst())
    deadline = time.monotonic() + 5
    while front.placer.inflight(holder) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert front.placer.inflight(holder) >= 2, "the burst did not queue on the cache-hot worker"
    time.sleep(1.0)  # the burst has waited on the holder far longer than its queue should take
    probe_start = time.monotonic()
    assert on_loop(pd2, generate(front, "probe", prompt + words(96)), STALL_S)
    probe_s = time.monotonic() - probe_start
    assert time.monotonic() - stalled_at < STALL_S, "the probe waited for the stalled worker"
    assert front.placer.stats.given_up_pages > 0  # locality given up, recorded per decision
    assert hit_tokens(front)[holder] == after[holder]  # the stalled holder computed nothing meanwhile

    async def gather() -> list[list[int]]:
        return await asyncio.gather(*tasks)

    outs = on_loop(pd2, gather(), STALL_S + 20)  # the burst queued on the holder finishes after the stall
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert hit_tokens(front)[holder] > after[holder]
    text = httpx.get(pd2.url + "/metrics", timeout=10).text  # per-worker hits, locality given up
    assert "baton_placement_locality_given_up_pages_total" in text
    assert f'baton_node_prefix_hit_tokens_total{{node="{holder}",role="prefill",tier="device"}}' in text
    status = httpx.get(pd2.url + "/status", timeout=10).json()  # what `baton status` and /dashboard show
    nodes = {n["name"]: n for n in status["nodes"]}
    assert sorted(nodes) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert all(n["health"] == "ok" for n in nodes.values())
    assert nodes[holder]["cache"]["tiers"]["device"]["hit_tokens"] > 0
    print(f"probe served in {probe_s:.2f} s while {holder} was stalled")


def wait_for(check: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_gateway_follows_membership(pd2: ServerHandle, tiny_engine_config: EngineConfig) -> None:
    """Workers register themselves (the `ray` backend here; etcd is the same interface): one
    that leaves gets no new work but stays up, comes back with a new epoch that its KV events
    and pushes carry, and a worker the gateway never launched is adopted when it joins."""
    from cluster.fleet.actors import spawn_prefill

    front = pd2.running.front
    assert isinstance(front, RayFront) and front.fleet.membership is not None
    members = front.fleet.membership.members()
    assert sorted(members) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    rng = random.Random(7)
    left, stays = front.fleet.prefills[0], front.fleet.prefills[1]
    old_epoch = left.epoch
    assert members[left.name].epoch == old_epoch > 0

    ray.get(left.actor.leave.remote(), timeout=30)
    wait_for(lambda: not left.is_member, "the gateway did not see the worker leave")
    assert left.is_alive and next(n for n in front.nodes() if n.name == left.name).health == "left"
    before = ray.get(left.actor.stats.remote(), timeout=30).num_query_tokens
    for i in range(4):  # prompts too long for decode-local prefill: a prefill worker computes them
        on_loop(pd2, generate(front, f"after-leave-{i}", [rng.randrange(100, 1000) for _ in range(120)]))
    assert ray.get(left.actor.stats.remote(), timeout=30).num_query_tokens == before, "work went to a left worker"

    cfg = front.cfg.membership
    new_epoch = ray.get(left.actor.join.remote(cfg, front.fleet.registry_name, left.name), timeout=30)
    assert new_epoch > old_epoch
    wait_for(lambda: left.is_member and left.epoch == new_epoch, "the gateway did not follow the new epoch")
    assert ray.get(left.actor.stats.remote(), timeout=30).epoch == new_epoch  # its pushes carry it
    wait_for(lambda: (st := front.index.sync_state(left.name)) is not None and st.epoch == new_epoch,
             "the index was not rebuilt for the new epoch")  # fmt: skip
    on_loop(pd2, generate(front, "after-rejoin", [rng.randrange(100, 1000) for _ in range(120)]))

    # A worker someone else started (the planner, an operator) joins: the gateway adopts it.
    extra = spawn_prefill(tiny_engine_config, name="baton-test-prefill-9", epoch=1)
    try:
        ray.get(extra.join.remote(cfg, front.fleet.registry_name, "prefill-9"), timeout=120)
        wait_for(lambda: "prefill-9" in front.fleet.prefill_of, "the gateway did not adopt the new worker", 30)
        wait_for(lambda: any(n.name == "prefill-9" and n.health == "ok" for n in front.nodes()),
                 "the adopted worker never reported", 30)  # fmt: skip
        status = httpx.get(pd2.url + "/status", timeout=10).json()
        assert "prefill-9" in {n["name"] for n in status["nodes"]}
        assert front.fleet.num_member_events["join"] >= 2 and front.fleet.num_member_events["leave"] >= 1
    finally:
        ray.get(extra.close.remote(), timeout=30)  # leaves membership first
        wait_for(lambda: not front.fleet.prefill_of["prefill-9"].is_member, "the adopted worker's leave was missed")
        ray.kill(extra)
    assert stays.is_routable



def test_a_session_stays_on_its_decode_worker_and_reuses_its_pages(pd2: ServerHandle, grpc_port: int) -> None:
    """gRPC `session_id`: each turn of a conversation (the whole conversation so far plus a short
    new message) goes back to the decode worker that served the turn before, which prefills
    the new part from its own cache -- whether or not the index has heard of those pages
    yet. A conversation of the same shape without a session hits at best as often."""
    front = pd2.running.front
    assert isinstance(front, RayFront) and len(front.fleet.decodes) == 2
    rng = random.Random(11)
    greedy = Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)

    def conversation(options: Options) -> list[tuple[int, int, int]]:
        """(tokens of the turn before, cached tokens, of them from another worker) per follow-up."""
        prompt = [rng.randrange(100, 1000) for _ in range(100)]
        turns = []
        with BatonClient(f"127.0.0.1:{grpc_port}", model="baton-tiny", timeout_s=60) as client:
            answer = list(client.complete(prompt, sampling=greedy, options=options).token_ids)
            for _ in range(3):
                before, prompt = len(prompt), prompt + answer + [rng.randrange(100, 1000) for _ in range(8)]
                done = client.complete(prompt, sampling=greedy, options=options)
                assert done.usage is not None
                turns.append((before, done.usage.cached_tokens, done.usage.cached.remote))
                answer = list(done.token_ids)
        return turns

    kept, moved = front.placer.stats.num_session_kept, front.placer.stats.num_session_moved
    with_session = conversation(Options(session_id="conv-1"))
    assert front.placer.stats.num_session_kept == kept + 3 and front.placer.stats.num_session_moved == moved
    page = front.page_size
    for before, cached, remote in with_session:  # the decode worker's own pages, every turn
        assert cached >= before // page * page and remote == 0, with_session
    without = conversation(Options())
    rate = [sum(t[1] for t in turns) / sum(t[0] for t in turns) for turns in (with_session, without)]
    assert rate[0] >= rate[1], rate
    print(f"hit rate of the follow-ups: {rate[0]:.2f} with a session, {rate[1]:.2f} without")


def test_a_pin_reaches_every_worker_of_its_role(pd2: ServerHandle, grpc_port: int) -> None:
    """gRPC PinPrefix on the Ray fleet: every prefill worker (the default role) computes and
    holds the prefix, or every decode worker when asked; /status lists it; unpin releases it."""
    prefix = [random.Random(5).randrange(100, 1000) for _ in range(40)]  # 2 whole pages
    with BatonClient(f"127.0.0.1:{grpc_port}", model="baton-tiny", timeout_s=120) as client:
        pin = client.pin_prefix(prefix, pin_id="sys", ttl_s=600)
        assert (pin.tenant, pin.num_pages, pin.workers) == ("default", 2, {"prefill-0": "held", "prefill-1": "held"})
        on_decode = client.pin_prefix(prefix, pin_id="sys-d", ttl_s=600, role="decode")
        assert on_decode.workers == {"decode-0": "held", "decode-1": "held"}
        status = httpx.get(pd2.url + "/status", timeout=10).json()
        assert sorted(p["pin_id"] for p in status["pins"]) == ["sys", "sys-d"]
        assert client.unpin_prefix("sys") and client.unpin_prefix("sys-d")
        assert not client.unpin_prefix("sys")
    assert httpx.get(pd2.url + "/status", timeout=10).json()["pins"] == []
