"""Client-supplied ids and routing hints never steer placement or cross tenant caches
(docs/architecture.md: One request, Rules).

Everything that decides where a request runs and which cached pages it may use is the
request id, the prompt, the sampling, the priority, the cache salt and the session key, as the
edge hands them to its engine side (EngineFront.generate: AsyncEngine colocated, PDFront
in-process, RayFront whose Placer places on them). Two of them take a client's word, scoped
to the key's tenant: `cache_salt` only narrows the tenant's own reuse (the salt is the
tenant's name and then the client's), and a session key (`prompt_cache_key`, gRPC
`session_id`) is the tenant's name and then the client's, so it prefers the worker that
tenant's session used and can never name a worker or another tenant's session. The tests record what crosses that boundary while clients send
every hint they could think of (request-id and worker headers, tenant claims, `user`,
`priority` without permission, vLLM-style transfer parameters), and check that:

- the request id is the server's, fresh per request, whatever the client called it;
- priority is the API key's tenant's, and the salt starts with its name, whatever the body or
  headers claim;
- tenants with the same prompt never share cached tokens (usage.cached_tokens stays 0);
- a client reusing another in-flight request's id (and then hanging up) leaves it running.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import random
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
import httpx
import pytest

from batonpb.baton.v1 import generation_pb2 as gen_pb
from cluster.edge.frontend import EngineFront
from cluster.placement.policy import Placer
from engine.async_engine import AsyncEngine
from engine.job import Job
from engine.sampling import SamplingParams
from kvcache.hashing import cache_salt, tenant_of
from tests.security.conftest import ALPHA_KEY, BETA_KEY, MODEL, OPS_KEY, Guarded, bearer

pytestmark = pytest.mark.timeout(120)

HEX_ID = re.compile(r"[0-9a-f]{32}")
HINT_HEADERS = {
    "x-request-id": "victim-request", "x-baton-request-id": "victim-request", "x-baton-worker": "decode-1",
    "x-baton-prefill": "prefill-0", "x-baton-tenant": "beta", "x-tenant": "beta", "openai-organization": "beta",
    "openai-project": "beta", "x-baton-priority": "-100", "priority": "-100", "x-session-affinity": "decode-1",
    "x-forwarded-for": "10.0.0.5", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}  # fmt: skip
HINT_FIELDS = {
    "user": "beta", "priority": -100, "request_id": "victim-request", "req_id": "victim-request",
    "id": "victim-request", "tenant": "beta", "cache_salt": "beta", "salt": "", "worker": "decode-1",
    "decode_worker": "decode-1", "prefill_worker": "prefill-0", "routing_key": "decode-1",
    "session_id": "victim", "kv_transfer_params": {"remote_host": "10.0.0.5", "remote_port": 1},
}  # fmt: skip


class Call(NamedTuple):
    req_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int
    cache_salt: str
    session: str


@pytest.fixture
def recorded(guarded: Guarded, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Call]]:
    """Every call the edge makes into its engine side, as it makes it."""
    front = guarded.server.running.frontend.engine
    assert isinstance(front, AsyncEngine)
    original = front.generate
    calls: list[Call] = []

    def generate(job: Job) -> Any:
        calls.append(Call(job.req_id, tuple(job.prompt_ids), job.sampling, job.priority, job.cache_salt, job.session))
        return original(job)

    monkeypatch.setattr(front, "generate", generate)
    yield calls


def _prompt(seed: int, n: int = 40) -> list[int]:
    return random.Random(seed).sample(range(1000, 16_000), n)


def _complete(guarded: Guarded, key: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    reply = httpx.post(guarded.url + "/v1/completions", json=body, headers={**bearer(key), **(headers or {})}, timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_hints_never_reach_the_engine_side(guarded: Guarded, recorded: list[Call]) -> None:
    body = {"model": MODEL, "prompt": _prompt(1, 20), "max_tokens": 2, "temperature": 0}
    plain = _complete(guarded, ALPHA_KEY, body)
    hinted = _complete(guarded, ALPHA_KEY, {**body, **HINT_FIELDS}, HINT_HEADERS)
    again = _complete(guarded, ALPHA_KEY, {**body, **HINT_FIELDS, "prompt_cache_key": "beta"}, HINT_HEADERS)
    assert len(recorded) == 3
    first, second, third = recorded
    # the same request, whatever the hints: prompt, sampling and priority are equal; the salt
    # is the key's tenant's, narrowed (never widened) by the client's cache_salt
    assert first._replace(req_id="") == second._replace(req_id="", cache_salt="alpha", session="")
    assert second._replace(req_id="") == third._replace(req_id="", session="")
    assert (first.priority, first.cache_salt, first.session) == (0, "alpha", "")  # the key's tenant, not "beta"
    assert second.cache_salt == cache_salt("alpha", "beta") and tenant_of(second.cache_salt) == "alpha"
    assert second.session == "" and third.session == cache_salt("alpha", "beta")  # alpha's session "beta"
    # ids are the server's: fresh, unique, never the client's
    ids = {c.req_id for c in recorded}
    assert len(ids) == 3 and all(HEX_ID.fullmatch(i) for i in ids)
    assert not ids & {"victim-request", "victim"}
    assert len({plain["id"], hinted["id"], again["id"]}) == 3 and "victim" not in hinted["id"]
    assert plain["choices"][0]["text"] == hinted["choices"][0]["text"]


def test_grpc_hints_never_reach_the_engine_side(guarded: Guarded, recorded: list[Call]) -> None:
    request = gen_pb.CompleteRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=_prompt(2, 20)),
                                     sampling=gen_pb.Sampling(max_tokens=2, temperature=0.0), priority=-100)  # fmt: skip
    metadata = [(k, v) for k, v in HINT_HEADERS.items()] + [("x-api-key", BETA_KEY)]
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        complete = channel.unary_unary("/baton.v1.GenerationService/Complete",
                                       request_serializer=gen_pb.CompleteRequest.SerializeToString,
                                       response_deserializer=gen_pb.CompleteResponse.FromString)  # fmt: skip
        replies = [complete(request, metadata=metadata, timeout=30) for _ in range(2)]
    # the tenant of the key (beta, priority 3), not the request's priority field (not allowed here)
    assert [(c.priority, c.cache_salt) for c in recorded] == [(3, "beta"), (3, "beta")]
    assert len({c.req_id for c in recorded}) == 2 and all(HEX_ID.fullmatch(c.req_id) for c in recorded)
    assert [r.request_id for r in replies] == [c.req_id for c in recorded]


def test_tenants_never_share_cached_pages_whatever_the_client_claims(guarded: Guarded) -> None:
    # 40 prompt tokens: 2 full pages (32 tokens) can be reused, by the same tenant only
    body = {"model": MODEL, "prompt": _prompt(3), "max_tokens": 2, "temperature": 0}

    def cached(key: str, extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> int:
        usage = _complete(guarded, key, {**body, **(extra or {})}, headers)["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    claims = {**HINT_FIELDS, "user": "alpha", "tenant": "alpha", "prompt_cache_key": "alpha"}
    del claims["cache_salt"]
    claim_headers = {**HINT_HEADERS, "x-baton-tenant": "alpha", "openai-organization": "alpha"}
    assert cached(ALPHA_KEY) == 0
    assert cached(ALPHA_KEY) == 32  # real reuse: the measurement can see a hit
    assert cached(BETA_KEY, claims, claim_headers) == 0  # beta claiming to be alpha: no hit
    assert cached(BETA_KEY, {"user": "beta"}) == 32  # beta's own pages, now cached
    # alpha claiming to be beta does not see beta's pages either (it sees its own)
    assert cached(ALPHA_KEY, {**claims, "user": "beta", "tenant": "beta"}) == 32
    # a salt only narrows: beta naming alpha's "salt" is still beta's, and apart from both
    assert cached(BETA_KEY, {"cache_salt": "alpha"}) == 0
    assert cached(BETA_KEY, {"cache_salt": "alpha"}) == 32
    # and over gRPC the same: the key decides
    request = gen_pb.CompleteRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=_prompt(4)),
                                     sampling=gen_pb.Sampling(max_tokens=2, temperature=0.0))  # fmt: skip
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        complete = channel.unary_unary("/baton.v1.GenerationService/Complete",
                                       request_serializer=gen_pb.CompleteRequest.SerializeToString,
                                       response_deserializer=gen_pb.CompleteResponse.FromString)  # fmt: skip
        hits = [complete(request, metadata=[("x-api-key", key), ("x-baton-tenant", "alpha")], timeout=30).usage.cached_tokens
                for key in (ALPHA_KEY, BETA_KEY, BETA_KEY)]  # fmt: skip
    assert hits == [0, 0, 32]


def test_a_colliding_client_request_id_does_not_disturb_the_request_in_flight(
    guarded: Guarded, recorded: list[Call]
) -> None:
    same = {"x-request-id": "same-id"}
    long = {"model": MODEL, "prompt": _prompt(5, 8), "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "request_id": "same-id", "user": "u"}  # fmt: skip
    first_chunk, chunks = threading.Event(), []

    def stream_a() -> None:
        with httpx.stream("POST", guarded.url + "/v1/completions", json=long, headers={**bearer(ALPHA_KEY), **same},
                          timeout=60) as reply:  # fmt: skip
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first_chunk.set()

    a = threading.Thread(target=stream_a)
    a.start()
    assert first_chunk.wait(30), "the first request never started"
    # B: the same client id, run to its end; C: the same id again, then the client hangs up
    b = _complete(guarded, BETA_KEY, {**long, "stream": False, "max_tokens": 4}, same)
    assert b["usage"]["completion_tokens"] == 4
    cancelled = _cancelled(guarded)
    with httpx.stream("POST", guarded.url + "/v1/completions", json=long, headers={**bearer(BETA_KEY), **same},
                      timeout=60) as reply:  # fmt: skip
        next(line for line in reply.iter_lines() if line.startswith("data: {"))
    assert a.is_alive() and len(chunks) < 400  # all of this happened while A was in flight
    a.join(60)
    assert not a.is_alive()
    assert _cancelled(guarded, cancelled + 1) == cancelled + 1  # C's hang-up did abort a request: its own
    usage = chunks[-1]["usage"]
    tokens = sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"])
    assert usage["completion_tokens"] == 400 and tokens == 400, (usage, tokens)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    ids = [c.req_id for c in recorded]
    assert len(ids) == 3 and len(set(ids)) == 3 and "same-id" not in ids
    assert guarded.server.wait_idle(5.0)


def _cancelled(guarded: Guarded, expected: float | None = None) -> float:
    """baton_requests_total{api="http",outcome="cancelled"}; with `expected`, once it got
    there (bounded wait: the abort lands after the client has gone)."""
    pattern = re.compile(r'^baton_requests_total\{api="http",outcome="cancelled"\} (\S+)$', re.M)
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(guarded.url + "/metrics", headers=bearer(OPS_KEY), timeout=10).text
        match = pattern.search(text)
        value = float(match.group(1)) if match else 0.0
        if expected is None or value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


# session: the tenant-scoped session key; num_resumed: set by the gateway when a request
# moves off a lost decode worker (cluster.fleet.front), never from a client's field; slo: a
# class the client chooses only within what the server allows (the edge refuses LATENCY unless
# the operator lets callers set scheduling, as for priority; BATCH only gives ground);
# reuse_cache: off only for a moved request when the operator turned recovery.preserve_kv off
# (cluster.fleet.front), never from a client's field -- and it only ever gives reuse up
ALLOWED_FIELDS = ["req_id", "prompt_ids", "sampling", "priority", "cache_salt", "session", "num_resumed", "slo",
                  "reuse_cache"]  # fmt: skip


def test_the_engine_side_and_the_placer_take_no_hint() -> None:
    # Everything placement may use crosses this signature, one Job whole; a hint would need a
    # new parameter or a new field of the Job
    from cluster.fleet.front import RayFront
    from cluster.fleet.pd import PDFront

    assert [f.name for f in dataclasses.fields(Job)] == ALLOWED_FIELDS
    for front in (EngineFront, AsyncEngine, PDFront, RayFront):
        params = inspect.signature(front.generate).parameters
        assert [(name, p.annotation) for name, p in params.items()] == [("self", inspect.Parameter.empty), ("job", "Job")], front
    # slo: the Job's class, as the edge allowed it (ALLOWED_FIELDS)
    assert list(inspect.signature(Placer.place).parameters) == [
        "self", "req_id", "hashes", "num_tokens", "tenant", "session", "slo"]
