"""Fault 5 of issue 8: a client that goes away at every state of its request, streaming and
unary, on a real local Ray (one prefill actor, one decode actor):

    queued        its prompt waits in the prefill worker's queue (the worker's loop held by
                  the `stall` drill), no first token yet
    transferring  its first token is out, its pages are still moving to the decode worker
                  (the prefill worker's pushes held after their first chunk: `hold_pushes`)
    decoding      tokens are streaming from the decode worker (which takes no step after its
                  third until the client has left: `stall(after_steps=3)`)
    finishing     the last token is out, the stream's end not yet read

Each state is proven on the worker before the client leaves (the prefill worker holds the
prompt; a transfer is in flight; the decode worker runs it). Within 5 s of the client leaving,
every tier's pages are back at their baseline on both workers, nothing runs, and the gateway
counted exactly one more `cancelled` request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from cluster.disagg_config import DisaggConfig
from cluster.fleet.worker_msgs import DecodeStats, PrefillStats
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle
from tests.cluster.test_ray_serving import metric
from tests.faults.conftest import MODEL, disaggregated, front_of

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(120)

# A long prompt's pages move in 2-page chunks; a transfer stays in flight while the pushes are
# held (PrefillActor.hold_pushes), not for as long as a slowed push happens to last. Round
# robin: every long prompt goes through the prefill worker, whatever the cost model would make
# of this (loaded) machine's measured rates: these tests are about a client leaving.
SLOW = DisaggConfig(num_prefill=1, num_decode=1, pages_per_chunk=2, transport="grpc", transfer_deadline_s=4.0,
                    placement="round_robin")
STATES = ["queued", "transferring", "decoding", "finishing"]


@pytest.fixture(scope="module")
def slow1(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    yield from disaggregated(tiny_engine_config, SLOW)


def _prefill(handle: ServerHandle) -> PrefillStats:
    stats: PrefillStats = ray.get(front_of(handle).fleet.prefills[0].actor.stats.remote(), timeout=30)
    return stats


def _decode(handle: ServerHandle) -> DecodeStats:
    stats: DecodeStats = ray.get(front_of(handle).fleet.decodes[0].actor.stats.remote(), timeout=30)
    return stats


def _at_baseline(handle: ServerHandle) -> bool:
    p, d = _prefill(handle), _decode(handle)
    return (p.num_running == 0 and p.num_pinned_pages == 0 and p.num_inflight_transfers == 0
            and d.num_running == 0 and d.num_waiting == 0 and d.num_reserved_pages == 0
            and d.num_open_reservations == 0 and d.num_used_pages == d.num_cached_pages
            and d.num_free_pages_at_idle == d.num_pages)  # fmt: skip


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"never reached: {what}"
        await asyncio.sleep(0.02)


def _body(state: str, stream: bool) -> dict[str, Any]:
    # Long and unique (uncached anywhere): a prefill worker computes it and pushes its pages.
    prompt = f"# cancel {state} {'stream' if stream else 'unary'}\n" + "def fibonacci(n):\n    return n\n" * 18
    max_tokens = 6 if state == "finishing" else 200
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}


async def _leave_at(handle: ServerHandle, state: str, stream: bool) -> None:
    """Send the request, wait until it is in `state` (proven on the workers), then drop the
    connection (the client goes away)."""
    reached = asyncio.Event()
    prefill = front_of(handle).fleet.prefills[0]

    async def send(client: httpx.AsyncClient) -> None:
        if not stream:
            response = await client.post("/v1/completions", json=_body(state, stream))
            raise AssertionError(f"the unary request ended before its client left: {response.status_code}")
        async with client.stream("POST", "/v1/completions", json=_body(state, stream)) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if state == "finishing" and '"finish_reason":"length"' in line.replace(" ", ""):
                    reached.set()  # the last token is out; [DONE] is not read
                    await asyncio.sleep(3600)
                if state == "transferring" and line.startswith("data:"):
                    await asyncio.sleep(3600)  # hold the stream open at the first token
                if state == "decoding" and line.startswith("data:"):
                    continue
            raise AssertionError(f"the stream ended before its client left: {response.status_code}")

    conditions: dict[str, Callable[[], Awaitable[None]]] = {
        "queued": lambda: _until(lambda: _prefill(handle).num_running == 1, "the prompt waits at the prefill worker"),
        "transferring": lambda: _until(lambda: _prefill(handle).num_inflight_transfers == 1
                                       and _decode(handle).num_open_reservations == 1, "a transfer in flight"),
        "decoding": lambda: _until(lambda: _decode(handle).num_running == 1
                                   and _prefill(handle).num_inflight_transfers == 0, "decoding on the decode worker"),
        "finishing": reached.wait,
    }  # fmt: skip
    decode = front_of(handle).fleet.decodes[0]
    if state == "queued":
        await asyncio.to_thread(ray.get, prefill.actor.stall.remote(30), timeout=30)  # no prefill step for now
    if state == "decoding":  # a few tokens, then no decode step until the client has left: it cannot finish first
        await asyncio.to_thread(ray.get, decode.actor.stall.remote(30, after_steps=3), timeout=30)
    try:
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as client:
            task = asyncio.create_task(send(client))
            waiting = asyncio.create_task(conditions[state]())
            done, _ = await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # raises: the request ended before reaching its state
            await waiting
            task.cancel()  # the client goes away: its connection closes
            await asyncio.gather(task, return_exceptions=True)
            if state == "queued":  # stalled until the abort is there, so that the prompt is never computed
                await _until(lambda: _prefill(handle).num_running == 0, "the abort at the stalled prefill worker")
            if state == "decoding":  # stalled until the abort is there, so that the request never finishes
                await _until(lambda: _decode(handle).num_running == 0, "the abort at the stalled decode worker")
    finally:  # the worker as it was, also for the tests after a failed one
        if state == "queued":
            await asyncio.to_thread(ray.get, prefill.actor.stall.remote(0), timeout=30)
        if state == "decoding":
            await asyncio.to_thread(ray.get, decode.actor.stall.remote(0), timeout=30)


CASES = [(state, stream) for state in STATES for stream in (True, False)
         if not (state == "finishing" and not stream)]  # a unary answer is one write: nothing between


@pytest.mark.parametrize(("state", "stream"), CASES, ids=[f"{s}-{'stream' if t else 'unary'}" for s, t in CASES])
def test_a_client_leaving_at_any_state_frees_every_page(slow1: ServerHandle, state: str, stream: bool) -> None:
    assert _at_baseline(slow1)
    counts = {o: metric(slow1, "baton_requests_total", api="http", outcome=o) for o in OUTCOMES}
    prefill = front_of(slow1).fleet.prefills[0].actor
    held = state == "transferring"
    ended = _prefill(slow1).pushes_ended
    bad_tokens = _decode(slow1).refused_bad_token
    if held:  # the push stays open until the pages are back: only the client's leaving ends it
        ray.get(prefill.hold_pushes.remote(True), timeout=30)
    try:
        asyncio.run(_leave_at(slow1, state, stream))
        left = time.monotonic()
        while not _at_baseline(slow1):
            assert time.monotonic() - left < 5.0, f"pages not back at baseline 5 s after the client left ({state})"
            time.sleep(0.05)
    finally:  # the worker as it was, also for the tests after a failed one
        if held:
            ray.get(prefill.hold_pushes.remote(False), timeout=30)
    after = _prefill(slow1).pushes_ended
    moved_pushes = {k: n - ended.get(k, 0) for k, n in after.items() if n != ended.get(k, 0)}
    if state in ("transferring", "queued"):  # the abort ended the push (held, or not yet begun),
        assert moved_pushes == {"aborted": 1}, moved_pushes  # not its deadline (also inside the 5 s)
    else:  # the pages moved before the client left
        assert moved_pushes == {"ok": 1}, moved_pushes
    # whichever side heard of the abort first, no chunk was refused as a wrong token (kvtransfer.transport)
    assert _decode(slow1).refused_bad_token == bad_tokens
    # The request is counted once: cancelled, or (finishing: every token was out) ok.
    expected = {"cancelled"} if state != "finishing" else {"cancelled", "ok"}
    deadline = time.monotonic() + 5.0
    while True:
        now = {o: metric(slow1, "baton_requests_total", api="http", outcome=o) for o in OUTCOMES}
        moved = {o: now[o] - counts[o] for o in OUTCOMES if now[o] != counts[o]}
        if moved:
            break
        assert time.monotonic() < deadline, "the gateway did not count the request"
        time.sleep(0.05)
    assert len(moved) == 1 and set(moved) <= expected and sum(moved.values()) == 1, moved


OUTCOMES = ("ok", "error", "cancelled", "deadline", "rejected")


def test_decode_killed_with_handoffs_pending_frees_the_prefill_side(slow1: ServerHandle) -> None:
    """Fault 3 (runs last: it ends this module's decode worker): the decode actor dies while
    two pushes are in flight to it. The prefill worker's pinned pages return to baseline
    within the push lease (transfer deadline + grace) + 5 s, and the clients get an error,
    not a hang."""
    from prefill.pushes import LEASE_GRACE_S
    from tests.cluster.conftest import kill_actor

    front = front_of(slow1)
    assert _at_baseline(slow1)

    async def main() -> list[BaseException | list[str]]:
        async with httpx.AsyncClient(base_url=slow1.url, timeout=60) as client:
            async def one(i: int) -> list[str]:
                body = _body(f"handoff {i}", True)
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    return [line async for line in response.aiter_lines() if line]

            prefill = front.fleet.prefills[0].actor
            await asyncio.to_thread(ray.get, prefill.hold_pushes.remote(True), timeout=30)
            tasks = [asyncio.create_task(one(i)) for i in range(2)]
            await _until(lambda: _prefill(slow1).num_inflight_transfers == 2, "two pushes in flight")
            assert _prefill(slow1).num_pinned_pages > 0
            await asyncio.to_thread(kill_actor, front.fleet.decodes[0].actor)  # the fault happened: it is dead
            killed = time.monotonic()
            await asyncio.to_thread(ray.get, prefill.hold_pushes.remote(False), timeout=30)  # they go on, to no one
            await _until(lambda: _prefill(slow1).num_pinned_pages == 0 and _prefill(slow1).num_inflight_transfers == 0,
                         "the prefill side's pinned pages back at baseline",
                         SLOW.transfer_deadline_s + LEASE_GRACE_S + 5)  # fmt: skip
            assert time.monotonic() - killed < SLOW.transfer_deadline_s + LEASE_GRACE_S + 5
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            return list(done)

    ended = asyncio.run(main())  # both streams ended within 10 s, none hung
    for outcome in ended:  # and each as a failure the client can see: an error event, or a cut stream
        if isinstance(outcome, list):
            assert any('"error"' in line for line in outcome), outcome[-3:]
        else:
            assert isinstance(outcome, httpx.HTTPError), repr(outcome)
    assert not front.is_alive
