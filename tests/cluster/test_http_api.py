"""The OpenAI-compatible HTTP API over real HTTP, against a real engine."""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from cluster.edge.http_api import HttpConfig
from engine.job import Job
from engine.request import SloClass
from tests.cluster.conftest import ServerHandle

MODEL = "baton-tiny"


def _post(server: ServerHandle, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    with server.client() as client:
        if isinstance(body, (bytes, str)):
            headers = {"content-type": "application/json", **(headers or {})}
            return client.post(path, content=body, headers=headers)
        return client.post(path, json=body, headers=headers)


# -- the official client, unmodified -----------------------------------------------------------


def test_openai_client_completions_and_chat(server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    done = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 8
    streamed = client.completions.create(
        model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.wait_idle()


def test_n_choices_logprobs_and_seed(server: ServerHandle) -> None:
    body = {"model": MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 5, "n": 3, "temperature": 0.9,
            "seed": 7, "logprobs": 2}
    first = _post(server, "/v1/completions", body).json()
    again = _post(server, "/v1/completions", body).json()
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert len(first["choices"]) == 3 and first["usage"]["prompt_tokens"] == 4
    lp = first["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(len(top) <= 2 for top in lp["top_logprobs"])
    chat = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
        "logprobs": True, "top_logprobs": 3, "temperature": 0,
    }).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) == 3


def test_absent_max_tokens_is_16_on_completions_and_the_rest_of_the_context_on_chat(server: ServerHandle) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "ignore_eos": True, "temperature": 0}
    assert _post(server, "/v1/completions", body).json()["usage"]["completion_tokens"] == 16  # OpenAI's, vLLM's
    body = {"model": MODEL, "prompt": list(range(100, 600)), "ignore_eos": True, "temperature": 0}
    reply = _post(server, "/v1/completions", body).json()
    assert reply["usage"]["completion_tokens"] == 12  # fewer left: context 512 - 500 prompt tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0}
    usage = _post(server, "/v1/chat/completions", chat).json()["usage"]
    assert usage["completion_tokens"] == 512 - usage["prompt_tokens"]


def test_logit_bias_bans_and_forces_tokens(server: ServerHandle) -> None:
    """OpenAI's logit_bias on both endpoints: +100 all but forces a token, -100 bans it."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    free = _post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    forced = _post(server, "/v1/completions", {**body, "logit_bias": {"4242": 100}}).json()["choices"][0]["token_ids"]
    assert forced == [4242] * 6 and free != forced
    banned = {str(t): -100 for t in set(free)}
    sampled = _post(server, "/v1/completions", {**body, "temperature": 1.0, "seed": 3, "n": 4, "logit_bias": banned}).json()
    assert all(not set(c["token_ids"]) & set(free) for c in sampled["choices"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "logit_bias": {"4242": 100}, "return_token_ids": True}  # fmt: skip
    assert _post(server, "/v1/chat/completions", chat).json()["choices"][0]["token_ids"] == [4242] * 3


# -- validation: every case a 4xx with an OpenAI-shaped body, and the server stays healthy --------

PROMPT = [5, 6, 7]
CASES: list[tuple[str, str, Any, int, str]] = [
    ("malformed json", "/v1/completions", b'{"model": "baton-tiny", "prompt": ', 400, "not valid JSON"),
    ("invalid utf-8", "/v1/completions", b'{"model": "baton-tiny", "prompt": "\xff\xfe"}', 400, "JSON"),
    ("lone surrogate", "/v1/completions", '{"model": "baton-tiny", "prompt": "a\\ud800b"}', 400, "UTF-8"),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("empty token prompt", "/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("prompt fills context", "/v1/completions", {"model": MODEL, "prompt": [9] * 512}, 400, "512 tokens"),
    ("prompt + max_tokens", "/v1/completions", {"model": MODEL, "prompt": [9] * 500, "max_tokens": 20},
     400, "prompt (500 tokens) + max_tokens (20)"),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": -4}, 400, "max_tokens"),
    ("min_tokens > max_tokens", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "min_tokens": 5},
     400, "min_tokens"),
    ("n 0", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 0}, 400, "n"),
    ("n 17", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 17}, 400, "n"),
    ("logprobs 21", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs 21", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
     "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("temperature < 0", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("top_k invalid", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_k": -7}, 400, "top_k"),
    ("presence penalty", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency penalty", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition penalty", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("too many stops", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stop": ["x"] * 17}, 400, "stop"),
    ("stop too long", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stop": "y" * 300}, 400, "stop"),
    ("token id >= vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 16384]}, 400, "prompt"),
    ("token id negative", "/v1/completions", {"model": MODEL, "prompt": [1, -1]}, 400, "prompt"),
    ("seed > int64", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "seed": 2**63}, 400, "seed"),
    ("seed negative", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "seed": -1}, 400, "seed"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": PROMPT}, 404, "gpt-9"),
    ("code-running field", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "logits_processors": ["x.y"]},
     400, "logits_processors"),
    ("echo unsupported", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True}, 400, "echo"),
    ("suffix unsupported", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "suffix": "end"}, 400, "suffix"),
    ("best_of over n", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "best_of": 3}, 400, "best_of"),
    ("logit_bias > 100", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "logit_bias": {"5": 101}},
     400, "logit_bias"),
    ("logit_bias id >= vocab", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
     "logit_bias": {"16384": 1}}, 400, "logit_bias"),
    ("logit_bias id not a number", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "logit_bias": {"a": 1}},
     400, "logit_bias"),
    ("logit_bias 301 entries", "/v1/completions",
     {"model": MODEL, "prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("bad timeout header", "/v1/completions", {"model": MODEL, "prompt": PROMPT}, 400, "x-request-timeout"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error_and_loses_nothing(
    server: ServerHandle, name: str, path: str, body: Any, status: int, needle: str
) -> None:
    headers = {"x-request-timeout": "soon"} if name == "bad timeout header" else {}
    reply = _post(server, path, body, headers=headers)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] or needle == error.get("param"), error
    assert set(error) == {"message", "type", "param", "code"}
    assert server.wait_idle()
    ok = _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200


def test_body_over_the_limit_is_refused_before_parsing(server: ServerHandle) -> None:
    big = json.dumps({"model": MODEL, "prompt": "a" * (9 << 20)})
    reply = _post(server, "/v1/completions", big)
    assert reply.status_code == 413 and "bytes" in reply.json()["error"]["message"]


def _outcomes(server: ServerHandle) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(r'^baton_requests_total\{api="http",outcome="(\w+)"\} (\S+)$', text, re.M)
    return {outcome: float(value) for outcome, value in found}


def _moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def test_a_call_whose_body_never_arrives_whole_is_counted_once(server: ServerHandle) -> None:
    """requests_total == ok + error + cancelled + deadline + rejected holds for every call a
    client starts: one whose client leaves mid-body counts cancelled, one whose body does not
    decode counts rejected (and gets an OpenAI-shaped 400)."""
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 50}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    before = _outcomes(server)
    for cut in (0, len(body) // 2, len(body) - 1):
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:cut])
    deadline = time.monotonic() + 10
    while _moved(before, _outcomes(server)) != {"cancelled": 3.0}:
        assert time.monotonic() < deadline, _moved(before, _outcomes(server))
        time.sleep(0.05)

    before = _outcomes(server)
    reply = _post(server, "/v1/completions", b'{"model": "\xff\xfe"}')
    assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert _moved(before, _outcomes(server)) == {"rejected": 1.0}
    assert server.wait_idle()


# -- health, metrics, auth -------------------------------------------------------------------------


def test_health_and_metrics(server: ServerHandle) -> None:
    with server.client() as client:
        assert client.get("/live").json() == {"status": "ok"}
        assert client.get("/ready").status_code == 200
        _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        text = client.get("/metrics").text
        assert 'baton_requests_total{api="http",outcome="ok"}' in text
        assert "baton_ttft_seconds_bucket" in text and 'baton_kv_pages{tier="device"}' in text
        spec = client.get("/openapi.json").json()
        assert "/v1/completions" in spec["paths"] and "/v1/chat/completions" in spec["paths"]


def test_a_blocked_event_loop_shows_in_the_loop_lag_histogram(server: ServerHandle) -> None:
    def slow_and_count() -> tuple[float, float]:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        slow = re.search(r'^baton_event_loop_lag_seconds_bucket\{le="0.25"\} (\S+)$', text, re.M)
        count = re.search(r"^baton_event_loop_lag_seconds_count (\S+)$", text, re.M)
        assert slow is not None and count is not None, "no loop lag histogram on /metrics"
        return float(count.group(1)) - float(slow.group(1)), float(count.group(1))

    late, count = slow_and_count()
    time.sleep(0.3)
    assert slow_and_count()[1] > count  # sampled while the loop is free
    server.loop.call_soon_threadsafe(time.sleep, 0.4)  # a blocking call on the gateway's loop
    deadline = time.monotonic() + 5
    while slow_and_count()[0] == late:
        assert time.monotonic() < deadline, "the 0.4 s block was not observed"
        time.sleep(0.05)


def test_api_keys_guard_every_route_but_health(make_server: Any, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k" * 24 + " acme priority=1 rps=1000\n" + "o" * 24 + " ops role=operator\n")
    guarded = make_server(api_keys_file=keys)
    with guarded.client() as client:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 401
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer " + "x" * 24})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models").status_code == 401
        assert client.get("/metrics").status_code == 401
        assert client.get("/live").status_code == 200 and client.get("/ready").status_code == 200
        assert client.get("/health").json() == {"status": "ready"}  # open, as routers probe it
        good = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer " + "k" * 24})
        assert good.status_code == 200
        assert client.get("/metrics", headers={"x-api-key": "k" * 24}).status_code == 403  # a tenant's key
        metrics = client.get("/metrics", headers={"x-api-key": "o" * 24}).text
        assert 'baton_tenant_tokens_total{kind="generated",tenant="acme"} 2.0' in metrics


def test_tenant_request_rate_limit(make_server: Any, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("r" * 24 + " limited rps=0.5\n")
    limited = make_server(api_keys_file=keys)
    with limited.client(headers={"Authorization": "Bearer " + "r" * 24}) as client:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        first = client.post("/v1/completions", json=body)
        second = client.post("/v1/completions", json=body)
    assert first.status_code == 200
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    assert "limited" in second.json()["error"]["message"]
    assert limited.running.frontend.admission.num_inflight == 0


def test_live_reports_a_dead_step_loop(make_server: Any) -> None:
    import asyncio

    doomed = make_server()
    with doomed.client() as client:
        assert client.get("/live").status_code == 200
        asyncio.run_coroutine_threadsafe(doomed.running.front.stop(), doomed.loop).result(10)
        assert client.get("/live").status_code == 503
        assert client.get("/ready").status_code == 503
        refused = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"


def test_return_token_ids_extension(server: ServerHandle) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    assert len(whole["token_ids"]) == 4
    with server.client() as client:
        lines = client.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]


def test_cached_tokens_are_real_and_per_tenant(make_server: Any, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("a" * 24 + " alpha\n" + "b" * 24 + " beta\n" + "o" * 24 + " ops role=operator\n")
    srv = make_server(api_keys_file=keys)
    body = {"model": MODEL, "prompt": list(range(300, 340)), "max_tokens": 2, "temperature": 0}

    def cached(key: str) -> int:
        with srv.client(headers={"Authorization": "Bearer " + key * 24}) as client:
            reply = client.post("/v1/completions", json=body).json()
        details = reply["usage"]["prompt_tokens_details"]
        # one engine, no lower tiers: every cached page was on the device, none from another worker
        hit = details["cached_tokens"]
        assert details["cached_tokens_by_tier"] == {"device": hit, "host": 0, "disk": 0}
        assert details["cached_tokens_remote"] == 0
        return int(hit)

    # 40 prompt tokens = 2 full pages + 8: the second alpha request reuses 32 tokens; beta's
    # first request, with the same prompt, reuses nothing of alpha's.
    assert [cached("a"), cached("a"), cached("b"), cached("b")] == [0, 32, 0, 32]
    with srv.client(headers={"x-api-key": "o" * 24}) as client:
        metrics = client.get("/metrics").text
    assert 'baton_tenant_tokens_total{kind="cached",tenant="alpha"} 32.0' in metrics


def test_cache_salt_keeps_requests_of_one_tenant_apart(server: ServerHandle) -> None:
    body = {"model": MODEL, "prompt": list(range(400, 440)), "max_tokens": 2, "temperature": 0}

    def cached(**extra: str) -> int:
        reply = _post(server, "/v1/completions", {**body, **extra})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    # 40 tokens = 2 full pages + 8. One salt's pages are reused only under that salt; without
    # a salt, or with another, the prompt is computed again.
    assert [cached(cache_salt="x"), cached(cache_salt="x"), cached(cache_salt="y"), cached()] == [0, 32, 0, 0]
    assert cached() == 32 and cached(cache_salt="y") == 32
    # A session key routes; it does not change what is reused.
    assert cached(prompt_cache_key="conv-1") == 32
    reply = _post(server, "/v1/completions", {**body, "cache_salt": "s" * 257})
    assert reply.status_code == 400 and "cache_salt" in reply.json()["error"]["message"]


def test_slo_class_batch_is_anyones_and_latency_the_operators_to_allow(
    server: ServerHandle, make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, call in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        refused = _post(server, path, {**call, "slo_class": "latency"})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["param"]) == ("permission_error", "slo_class") and "latency" in error["message"]
        assert _post(server, path, {**call, "slo_class": "batch"}).status_code == 200
        assert _post(server, path, {**call, "slo_class": "standard"}).status_code == 200
        assert _post(server, path, {**call, "slo_class": "urgent"}).status_code == 400
    adm = server.running.frontend.admission
    assert adm.num_inflight == 0 and adm.num_waiting == 0  # the refused calls took no ticket

    allowed: ServerHandle = make_server(http=HttpConfig(allow_priority_field=True))
    front = allowed.running.frontend.engine
    classes: list[SloClass] = []

    def generate(job: Job) -> Any:
        classes.append(job.slo)
        return original(job)

    original = front.generate
    monkeypatch.setattr(front, "generate", generate)
    for slo_class in ("latency", "batch", None):
        extra = {"slo_class": slo_class} if slo_class else {}
        reply = _post(allowed, "/v1/completions", {**body, **extra, "n": 2})
        assert reply.status_code == 200, reply.text
    assert classes == [SloClass.LATENCY] * 2 + [SloClass.BATCH] * 2 + [SloClass.STANDARD] * 2
    assert allowed.wait_idle()
