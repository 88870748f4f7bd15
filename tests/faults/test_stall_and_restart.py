"""Faults 6 and 9 of issue 8 on a real local Ray, and issue 24's constrained migration.

6. A decode worker stopped (SIGSTOP) for longer than the watchdog: its streams move to the
   other decode worker and complete with the no-fault tokens; it is marked stalled and gets
   no new work; after SIGCONT it answers again and is re-admitted, its pages back at baseline.
9. An exception injected in a worker's forward pass (engine.faults): the actor exits on
   purpose, its requests move (decode) or are re-dispatched (prefill) and complete, Ray
   restarts it, and it rejoins membership under a new epoch and serves again.
24. A JSON-schema request whose decode worker fails after a fixed number of its steps moves
   with the tokens it emitted; its grammar resumes after them on the new workers, and the
   output parses and equals the no-fault one.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from cluster.fleet.worker_msgs import DecodeStats
from cluster.fleet.workers import DecodeHandle
from tests.cluster.conftest import ServerHandle
from tests.faults.conftest import (
    MODEL,
    WATCHDOG_S,
    Streams,
    alive,
    counter,
    decode_pid,
    front_of,
    node,
    on_loop,
    proc_state,
    prompts,
    reference,
    wait_for,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 48


def _stats(d: DecodeHandle) -> DecodeStats:
    stats: DecodeStats = ray.get(d.actor.stats.remote(), timeout=30)
    return stats


def _at_baseline(d: DecodeHandle) -> bool:
    s = _stats(d)
    return s.num_running == 0 and s.num_waiting == 0 and s.num_reserved_pages == 0 and (
        s.num_used_pages == s.num_cached_pages)


def test_a_stopped_decode_worker_is_passed_over_then_readmitted(recovering: ServerHandle, server: ServerHandle) -> None:
    front = front_of(recovering)
    texts = prompts(6, "stall")
    want = reference(server, texts, MAX_TOKENS)
    stalls_before = counter(front, "stalls", "decode")
    streams = Streams(recovering, texts, MAX_TOKENS)
    streams.wait_started()
    victim = max(front.fleet.decodes, key=lambda d: d.num_active)
    on_victim, pid = victim.num_active, decode_pid(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: proc_state(pid) == "T", "the decode process is stopped", 5)  # the fault happened
        stopped_at = time.monotonic()
        wait_for(lambda: victim.is_stalled, "the watchdog marks it stalled", WATCHDOG_S + 5)
        assert time.monotonic() - stopped_at < WATCHDOG_S + 2.0
        assert not victim.is_routable and node(front, victim.name).health == "stalled"
        streams.join()
        assert streams.errors == [], streams.errors[:2]
        assert streams.got == want  # moved with prompt + emitted tokens: no gap, no repeat
        assert on_victim > 0 and counter(front, "stalls", "decode") >= stalls_before + 1
        assert proc_state(pid) == "T"  # all of that while it was still stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: victim.is_routable, "re-admitted once it answers again (and rejoined membership)", 30)
    wait_for(lambda: _at_baseline(victim), "its pages are back at baseline: the moved requests were aborted", 15)
    again = Streams(recovering, prompts(2, "after"), 8)
    again.wait_started()
    again.join()
    assert again.errors == []


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_failed_forward_pass_restarts_the_worker_and_it_rejoins(
    recovering: ServerHandle, server: ServerHandle, role: str
) -> None:
    front = front_of(recovering)
    texts = prompts(4, f"boom-{role}", scale=4)  # long: a prefill worker computes them
    want = reference(server, texts, MAX_TOKENS)
    restarts = counter(front, "restarts", role)
    if role == "decode":
        streams = Streams(recovering, texts, MAX_TOKENS)
        streams.wait_started()
        handle: Any = max(front.fleet.decodes, key=lambda d: d.num_active)
        assert handle.num_active > 0
        epoch, pid = handle.epoch, decode_pid(handle)
        _inject(handle.actor)  # its next step raises
    else:
        handle = front.fleet.prefills[0]
        epoch, pid = handle.epoch, ray.get(handle.actor.ping.remote(), timeout=30)
        ray.get(handle.actor.inject_fault.remote("forward"), timeout=30)  # the next prompt's step raises
        streams = Streams(recovering, texts, MAX_TOKENS)
        streams.wait_started()
    failed_at = time.monotonic()
    wait_for(lambda: not alive(pid), "the worker's process exited", 15)  # the fault took effect
    streams.join()
    assert streams.errors == [], streams.errors[:2]
    assert streams.got == want
    assert max(streams.finished_at) - failed_at < 30
    wait_for(lambda: counter(front, "restarts", role) == restarts + 1, "Ray restarted it and it rejoined", 90)
    assert handle.is_routable and handle.epoch > epoch and node(front, handle.name).health in ("ok", "starting")
    new_pid = decode_pid(handle) if role == "decode" else ray.get(handle.actor.ping.remote(), timeout=30)
    assert new_pid != pid
    again = Streams(recovering, prompts(3, f"after-{role}"), 8)  # it serves again
    again.wait_started()
    again.join()
    assert again.errors == []


def _inject(actor: Any) -> None:
    """Arm the forward pass to fail; the actor may die before its answer leaves (the loop steps
    between the call's return and the reply), which is the fault taking effect."""
    try:
        ray.get(actor.inject_fault.remote("forward"), timeout=30)
    except ray.exceptions.ActorUnavailableError:
        pass


def test_fault_injection_is_refused_without_permission(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.env import FAULT_INJECTION_ENV as ENV
    from engine.faults import FaultPoints

    monkeypatch.delenv(ENV)
    with pytest.raises(PermissionError, match=ENV):
        FaultPoints().arm("forward")


def test_a_prefill_worker_killed_before_the_handoff_is_restarted(recovering: ServerHandle, server: ServerHandle) -> None:
    """Fault 2, before the handoff: SIGKILL the prefill worker's process while it holds a
    prompt (its loop held by the `stall` drill, so no first token and no page has moved):
    the request completes by decode-local prefill with the no-fault tokens, the reservation's
    pages return, and Ray restarts the worker, which rejoins and holds again the prefix pinned
    before it died (cluster.fleet.pins)."""
    front = front_of(recovering)
    prefill = front.fleet.prefills[0]
    texts = prompts(1, "killed-before", scale=4)
    want = reference(server, texts, MAX_TOKENS)
    restarts = counter(front, "restarts", "prefill")
    pin = ("", "acme:sys", tuple(range(100, 140)), "acme", 600.0, 30.0)  # 2 whole pages, on the prefill workers
    assert [a.state for _, a in on_loop(recovering, front.pin_prefix(*pin))] == ["held"]  # type: ignore[union-attr]
    reapplied = front.metrics.pins_reapplied.labels("prefill", "held")._value.get()  # noqa: SLF001
    pid = ray.get(prefill.actor.ping.remote(), timeout=30)
    ray.get(prefill.actor.stall.remote(30), timeout=30)
    streams = Streams(recovering, texts, MAX_TOKENS)
    wait_for(lambda: ray.get(prefill.actor.stats.remote(), timeout=30).num_running == 1, "the prompt is held there")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), "the prefill process is gone", 10)  # the fault happened
    streams.wait_started()
    streams.join()
    assert streams.errors == [] and streams.got == want
    wait_for(lambda: counter(front, "restarts", "prefill") == restarts + 1, "Ray restarted it and it rejoined", 90)
    assert prefill.is_routable and ray.get(prefill.actor.ping.remote(), timeout=30) != pid
    wait_for(lambda: front.metrics.pins_reapplied.labels("prefill", "held")._value.get() == reapplied + 1,  # noqa: SLF001
             "the restarted worker holds the pin again", 30)  # its own answer: the pin's pages are held there
    assert on_loop(recovering, front.unpin_prefix("acme:sys")) == 1
    for d in front.fleet.decodes:
        wait_for(lambda d=d: _at_baseline(d), f"{d.name}'s pages back at baseline", 15)


SETTINGS = {
    "type": "object",
    "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "name": {"type": "string", "pattern": "^[a-z]{6,10}$"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 2, "maxItems": 3},
    },
    "required": ["level", "name", "tags"],
    "additionalProperties": False,
}


def test_a_constrained_request_moves_and_its_output_still_parses(recovering: ServerHandle, server: ServerHandle) -> None:
    """Issue 24: the request is held at its prefill (the `stall` drill) until its decode worker
    is known; that worker is armed to fail on its (n+1)-th step, so the request loses it after
    exactly n decode steps, mid-JSON. It moves with the tokens it emitted, the new prefill and
    decode workers advance the grammar over them, and it completes with the no-fault output."""
    front = front_of(recovering)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "settings", "schema": SETTINGS}}
    messages: Any = [{"role": "user", "content": prompts(1, "constrained-move", scale=4)[0]}]  # long: disaggregated

    def ask(url: str) -> Any:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=90, max_retries=0)
        return client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=120,
                                              temperature=0)  # fmt: skip

    reference = ask(server.url)
    want = reference.choices[0]
    assert want.finish_reason == "stop" and reference.usage is not None
    steps = reference.usage.completion_tokens // 2  # the victim's steps: it emits that many after the first token
    assert steps >= 3
    prefill = front.fleet.prefills[0]
    restarts, moved = counter(front, "restarts", "decode"), front.metrics.migrations._value.get()  # noqa: SLF001
    ray.get(prefill.actor.stall.remote(30), timeout=30)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(ask, recovering.url)
        wait_for(lambda: ray.get(prefill.actor.stats.remote(), timeout=30).num_running == 1, "held at its prefill")
        [victim] = [d for d in front.fleet.decodes if _stats(d).num_open_reservations == 1]  # its pages go there
        pid = decode_pid(victim)
        ray.get(victim.actor.inject_fault.remote("forward", 1, steps), timeout=30)
        ray.get(prefill.actor.stall.remote(0), timeout=30)
        wait_for(lambda: not alive(pid), "the decode worker failed mid-stream and exited", 30)  # the fault happened
        got = call.result(90).choices[0]
    assert front.metrics.migrations._value.get() > moved  # noqa: SLF001  (it moved, not failed)
    assert got.finish_reason == "stop" and got.message.content == want.message.content
    jsonschema.validate(json.loads(got.message.content or ""), SETTINGS)
    wait_for(lambda: counter(front, "restarts", "decode") == restarts + 1, "Ray restarted it and it rejoined", 90)
    for d in front.fleet.decodes:
        wait_for(lambda d=d: _at_baseline(d), f"{d.name}'s pages back at baseline", 15)
