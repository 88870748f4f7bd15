"""API keys on every route but the probes, no way around them, and errors that leak nothing.

The routes are read from the running FastAPI app itself and the gRPC methods from the
service descriptors, so a route or method added later is covered without touching this file.
Bypass attempts go out as raw bytes on a socket (an HTTP client would normalise them first):
path spellings, absolute-form targets, Host and X-Forwarded-* headers, HTTP/1.0 without a
Host, other methods, a websocket upgrade. Every error body and gRPC status detail, across
404, 405, 401, 400, 413, 404-model and forced internal errors, is checked for tracebacks,
source paths and exception class names (conftest.leaks).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Route

from batonpb.baton.v1 import generation_pb2 as gen_pb
from cluster.edge.frontend import Frontend
from cluster.edge.http_api import HttpConfig
from engine.outputs import StepOutput
from tests.cluster.conftest import ServerHandle
from tests.security.conftest import (
    ALPHA_KEY,
    BETA_KEY,
    MAX_BODY_BYTES,
    METRICS_KEY,
    MODEL,
    OPEN_PATHS,
    OPERATOR_PATHS,
    OPS_KEY,
    ROOT,
    Guarded,
    bearer,
    leaks,
)
from tests.security.test_canary import raw_call

pytestmark = pytest.mark.timeout(120)

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
# What a guarded route would give away: if a refused reply contains any of these, it leaked.
GUARDED_MARKERS = (b"baton_requests_total", b'"nodes"', b'"owned_by"', b'"openapi"', b'"draining"')


def routes(guarded: Guarded) -> list[tuple[str, str]]:
    app = guarded.server.running.http.config.app
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute | Route) and route.methods:
            path = route.path.replace("{", "").replace("}", "")  # a path parameter, filled in
            out += [(method, path) for method in sorted(route.methods)]
    return out


def raw_http(port: int, request: bytes, timeout_s: float = 10.0) -> tuple[int | None, bytes]:
    """Send `request` as it is; the status (None: the server closed without answering) and
    the whole reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    if not data.startswith(b"HTTP/"):
        return None, data
    return int(data.split(b" ", 2)[1]), data


def get(path: str, headers: dict[str, str] | None = None, version: str = "1.1", method: str = "GET") -> bytes:
    head = {"Host": "127.0.0.1", "Connection": "close", **(headers or {})}
    lines = [f"{method} {path} HTTP/{version}"] + [f"{k}: {v}" for k, v in head.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- every route ---------------------------------------------------------------------------------


def test_every_route_but_the_probes_needs_a_key(guarded: Guarded) -> None:
    found = routes(guarded)
    assert {p for _, p in found} >= {"/v1/completions", "/v1/models", "/metrics", "/status", "/openapi.json",
                                     "/admin/drain", "/live", "/ready", "/dashboard"}  # fmt: skip
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        for method, path in found:
            for headers in ({}, bearer("x" * 26), bearer(ALPHA_KEY[:-1]), bearer(ALPHA_KEY + "x"),
                            {"Authorization": f"Basic {ALPHA_KEY}"}, {"Authorization": "Bearer"},
                            {"x-api-key": ""}, {"api-key": ALPHA_KEY}, {"Cookie": f"key={ALPHA_KEY}"}):  # fmt: skip
                reply = client.request(method, path, headers=headers, json=GOOD if method == "POST" else None)
                if path in OPEN_PATHS:
                    assert reply.status_code == 200, (method, path, reply.status_code)
                else:
                    assert reply.status_code == 401, (method, path, headers, reply.status_code)
                    assert reply.headers["www-authenticate"] == "Bearer"
                    if method != "HEAD":
                        assert reply.json()["error"]["type"] == "authentication_error"
            if path.startswith("/admin/"):
                continue  # with a key it would act (drain the shared server): its own test below
            key = OPS_KEY if path.startswith(OPERATOR_PATHS) else ALPHA_KEY
            if key == OPS_KEY:  # a tenant's key is not enough there
                reply = client.request(method, path, headers=bearer(ALPHA_KEY))
                assert reply.status_code == 403, (method, path, reply.status_code)
            for headers in (bearer(key), {"authorization": f"bearer  {key}"}, {"X-API-Key": key}):
                reply = client.request(method, path, headers=headers, json=GOOD if method == "POST" else None)
                assert reply.status_code not in (401, 403) and reply.status_code < 500, (method, path, reply.status_code)


def test_the_open_dashboard_is_a_static_page_with_no_data(guarded: Guarded) -> None:
    page = httpx.get(guarded.url + "/dashboard", timeout=10)
    static = (ROOT / "cluster" / "ops" / "static" / "dashboard.html").read_bytes()
    assert page.status_code == 200 and page.content == static  # the file, nothing filled in
    assert MODEL.encode() not in page.content and b"alpha" not in page.content
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    # what it shows comes from /status, which needs the key
    assert httpx.get(guarded.url + "/status", timeout=10).status_code == 401


# -- bypass attempts -----------------------------------------------------------------------------

PATH_VARIANTS = [
    "//v1/models", "/v1/models/", "/V1/models", "/v1//models", "/v1/./models", "/v1/../v1/models",
    "/v1%2Fmodels", "/v1%2fmodels", "/%76%31/models", "/v1/models%00", "/v1/models;", "/v1/models;/../../live",
    "/metrics?x=/live", "/metrics#/live", "/live/../metrics", "/live/%2e%2e/metrics", "/live%2F..%2Fmetrics",
    "/live/..%2Fmetrics", "/ready/../status", "/dashboard/../status", "/dashboard/../../metrics", "/./metrics",
    "/metrics/.", "/status/", "/STATUS", "/openapi.json/", "/%2Fmetrics", "/live/../openapi.json", "/admin/drain/",
]  # fmt: skip


def _refused(status: int | None, reply: bytes, what: object) -> None:
    assert status in (None, 400, 401, 404, 405, 421), (what, status, reply[:200])
    assert not any(m in reply for m in GUARDED_MARKERS), (what, reply[:300])


def test_path_variants_do_not_get_around_the_key(guarded: Guarded) -> None:
    # the raw path works at all: the open probe answers, a guarded route with its key too
    assert raw_http(guarded.port, get("/live"))[0] == 200
    assert raw_http(guarded.port, get("/metrics", bearer(OPS_KEY)))[0] == 200
    for path in PATH_VARIANTS:
        for method in ("GET", "POST"):
            status, reply = raw_http(guarded.port, get(path, method=method))
            _refused(status, reply, (method, path))


def test_absolute_targets_host_and_forwarding_headers_do_not_get_around_the_key(guarded: Guarded) -> None:
    here = f"127.0.0.1:{guarded.port}"
    attempts: list[tuple[str, dict[str, str | None], str]] = [
        (f"http://{here}/metrics", {}, "1.1"),
        ("http://localhost/metrics", {"Host": "localhost"}, "1.1"),
        ("http://evil.example/live/../metrics", {}, "1.1"),
        ("/metrics", {"Host": "localhost"}, "1.1"),
        ("/metrics", {"Host": "evil.example"}, "1.1"),
        ("/metrics", {"Host": ""}, "1.1"),
        ("/metrics", {"Host": f"{here}/live"}, "1.1"),
        ("/metrics", {"Host": None}, "1.0"),  # HTTP/1.0 without a Host
        ("/metrics", {"Host": None}, "1.1"),
        ("/metrics", {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1", "Forwarded": "for=127.0.0.1"}, "1.1"),
        ("/metrics", {"X-Forwarded-Host": "localhost", "X-Forwarded-Proto": "https", "X-Forwarded-Prefix": "/live"}, "1.1"),
        ("/metrics", {"X-Original-URL": "/live", "X-Rewrite-URL": "/live", "X-Forwarded-Uri": "/live"}, "1.1"),
        ("/live", {"X-Original-URL": "/metrics", "X-Rewrite-URL": "/metrics"}, "1.1"),  # stays /live
        ("/metrics", {"X-HTTP-Method-Override": "HEAD", "X-Api-Key": ""}, "1.1"),
        ("/status", {"Authorization": "Bearer", "X-Baton-Tenant": "alpha", "X-Tenant": "alpha"}, "1.1"),
    ]  # fmt: skip
    for target, headers, version in attempts:
        status, reply = raw_http(guarded.port, get(target, headers, version))
        if target == "/live":
            assert status == 200 and b"baton_" not in reply
            continue
        _refused(status, reply, (target, headers, version))
    for method in ("HEAD", "OPTIONS", "TRACE", "PUT", "DELETE", "PATCH", "CONNECT"):
        status, reply = raw_http(guarded.port, get("/metrics", method=method))
        _refused(status, reply, method)


def test_a_websocket_upgrade_gets_nothing(guarded: Guarded) -> None:
    # the guard lets non-HTTP scopes through to the router: a websocket route added one day
    # would be unguarded; today no route takes one, and the handshake is refused
    for path in ("/metrics", "/status", "/v1/models", "/live"):
        upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
        status, reply = raw_http(guarded.port, get(path, upgrade), timeout_s=5)
        assert status != 101, (path, reply[:200])
        assert not any(m in reply for m in GUARDED_MARKERS), (path, reply[:300])


# -- gRPC ----------------------------------------------------------------------------------------


def _generation_methods() -> list[tuple[str, str, bytes]]:
    """(path, kind, a valid request) for every method of baton.v1.GenerationService, under its
    name and under the deprecated one it is also served by (baton.v1.Generation)."""
    good = {
        "GenerateRequest": gen_pb.GenerateRequest(model=MODEL, text="hi", sampling=gen_pb.Sampling(max_tokens=1)),
        "CompleteRequest": gen_pb.CompleteRequest(model=MODEL, text="hi", sampling=gen_pb.Sampling(max_tokens=1)),
        "TokenizeRequest": gen_pb.TokenizeRequest(model=MODEL, text="hi"),
        "DetokenizeRequest": gen_pb.DetokenizeRequest(model=MODEL, token_ids=[5, 6]),
        "PinPrefixRequest": gen_pb.PinPrefixRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=range(100, 132)),
                                                    pin_id="auth", tenant="alpha", ttl_seconds=60),
        "UnpinPrefixRequest": gen_pb.UnpinPrefixRequest(model=MODEL, pin_id="auth", tenant="alpha"),
    }
    out = []
    for name in ("baton.v1.GenerationService", "baton.v1.Generation"):
        for m in gen_pb.DESCRIPTOR.services_by_name["GenerationService"].methods:
            kind = "unary_stream" if m.server_streaming else "unary_unary"
            out.append((f"/{name}/{m.name}", kind, good[m.input_type.name].SerializeToString()))
    assert len(out) == 12
    return out


PIN_METHODS = ("PinPrefix", "UnpinPrefix")  # operator keys only


def test_every_grpc_method_needs_a_key(guarded: Guarded) -> None:
    wrong: list[tuple[tuple[str, str], ...]] = [
        (), (("authorization", "Bearer " + "x" * 26),), (("authorization", f"Basic {ALPHA_KEY}"),),
        (("x-api-key", ALPHA_KEY[:-1]),), (("authorization", "Bearer"),), (("api-key", ALPHA_KEY),),
        (("x-baton-tenant", "alpha"),), (("authorization", f"Bearer {ALPHA_KEY}x"),),
    ]  # fmt: skip
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        for path, kind, request in _generation_methods():
            for metadata in wrong:
                code, details = raw_call(channel, path, kind, request, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (path, metadata, code)
                assert details == "a valid API key is required" and not leaks(details)
            key = OPS_KEY if path.endswith(PIN_METHODS) else ALPHA_KEY
            for metadata in ((("authorization", f"Bearer {key}"),), (("x-api-key", key),)):
                code, _ = raw_call(channel, path, kind, request, metadata)
                assert code == grpc.StatusCode.OK, (path, metadata, code)
            if path.endswith(PIN_METHODS):  # a tenant's own key may not pin
                code, details = raw_call(channel, path, kind, request, (("x-api-key", ALPHA_KEY),))
                assert code == grpc.StatusCode.PERMISSION_DENIED and "role=operator" in details, (path, code)


def test_a_metrics_key_reads_metrics_and_status_and_nothing_else(guarded: Guarded) -> None:
    """A scraper's key (role=metrics) can read what every tenant and node did, and can neither
    generate nor drain (k8s/monitoring/podmonitor.yaml scrapes with one)."""
    with httpx.Client(base_url=guarded.url, headers=bearer(METRICS_KEY), timeout=30) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/status").status_code == 200
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("POST", "/admin/drain")):  # fmt: skip
            reply = client.request(method, path, json=GOOD)
            _assert_clean_error(reply, 403)
            assert "role=" in reply.json()["error"]["message"]
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        for path, kind, request in _generation_methods():
            code, details = raw_call(channel, path, kind, request, (("authorization", f"Bearer {METRICS_KEY}"),))
            assert code == grpc.StatusCode.PERMISSION_DENIED, (path, code)
            assert "role=metrics" in details and not leaks(details)


# -- error bodies --------------------------------------------------------------------------------


def _assert_clean_error(reply: httpx.Response, status: int) -> None:
    assert reply.status_code == status, (reply.request.method, reply.request.url, reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
    assert not leaks(reply.text), (reply.request.url, leaks(reply.text), reply.text[:300])


def test_error_bodies_leak_no_internals(guarded: Guarded) -> None:
    key = bearer(ALPHA_KEY)
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        _assert_clean_error(client.get("/v1/models"), 401)
        _assert_clean_error(client.get("/nope", headers=key), 404)
        _assert_clean_error(client.get("/v1/completions", headers=key), 405)
        _assert_clean_error(client.put("/v1/models", headers=key), 405)
        _assert_clean_error(client.post("/v1/completions", headers=key, content=b"{not json"), 400)
        _assert_clean_error(client.post("/v1/completions", headers=key, content=b"\xff\xfe\x00"), 400)
        for bad in ({**GOOD, "prompt": {"x": 1}}, {**GOOD, "temperature": 5}, {**GOOD, "max_tokens": "2"},
                    {**GOOD, "logits_processors": ["os.system"]}, {**GOOD, "prompt": [2**40]}, [1, 2],
                    {**GOOD, "prompt": "hello " * 600}, {**GOOD, "n": 17}):  # fmt: skip
            _assert_clean_error(client.post("/v1/completions", headers=key, json=bad), 400)
        lone_surrogate = b'{"model": "baton-tiny", "prompt": "hi", "stop": ["\\ud800"]}'
        _assert_clean_error(client.post("/v1/completions", headers=key, content=lone_surrogate), 400)
        _assert_clean_error(client.post("/v1/completions", headers=key, json={**GOOD, "model": "gpt-9"}), 404)
        _assert_clean_error(client.post("/v1/completions", headers={**key, "x-request-timeout": "soon"}, json=GOOD), 400)
        big = b'{"model": "baton-tiny", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
        _assert_clean_error(client.post("/v1/completions", headers=key, content=big), 413)

        def chunked() -> Any:
            yield big[: len(big) // 2]
            yield big[len(big) // 2 :]

        _assert_clean_error(client.post("/v1/completions", headers=key, content=chunked()), 413)


def _boom(*args: object, **kwargs: object) -> Any:
    raise RuntimeError(f"secret state in {ROOT / 'cluster' / 'frontend.py'}: KeyError('x')")


async def _boom_stream(*args: object, **kwargs: object) -> AsyncIterator[StepOutput]:
    _boom()
    yield  # pragma: no cover


def test_internal_errors_leak_no_internals(guarded: Guarded, monkeypatch: pytest.MonkeyPatch) -> None:
    frontend: Frontend = guarded.server.running.frontend
    key = bearer(ALPHA_KEY)
    # uvicorn closes a connection whose app raised (after the 500 went out): one per request
    with httpx.Client(base_url=guarded.url, timeout=30, headers={**key, "Connection": "close"}) as client:
        monkeypatch.setattr(frontend, "status", _boom)
        _assert_clean_error(client.get("/status", headers=bearer(OPS_KEY)), 500)
        monkeypatch.setattr(frontend, "stream", _boom_stream)
        _assert_clean_error(client.post("/v1/completions", json=GOOD), 500)
        streamed = client.post("/v1/completions", json={**GOOD, "stream": True})
        assert streamed.status_code == 200 and '"internal_error"' in streamed.text  # in-band, then [DONE]
        assert not leaks(streamed.text) and streamed.text.endswith("data: [DONE]\n\n")
        # gRPC: the same internal failure is INTERNAL with a plain message
        monkeypatch.setattr(frontend, "prepare", _boom)
        with grpc.insecure_channel(guarded.grpc_target) as channel:
            path, kind, request = _generation_methods()[1]  # Complete
            code, details = raw_call(channel, path, kind, request, (("x-api-key", ALPHA_KEY),))
        assert code == grpc.StatusCode.INTERNAL and details == "internal error"
    monkeypatch.undo()
    assert httpx.post(guarded.url + "/v1/completions", json=GOOD, headers=key, timeout=30).status_code == 200


def test_grpc_error_details_leak_no_internals(guarded: Guarded) -> None:
    auth = (("x-api-key", ALPHA_KEY),)
    bad = [
        gen_pb.GenerateRequest(model="gpt-9", text="hi"),
        gen_pb.GenerateRequest(model=MODEL),
        gen_pb.GenerateRequest(model=MODEL, text="hi", sampling=gen_pb.Sampling(temperature=float("nan"))),
        gen_pb.GenerateRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=[2**31])),
        gen_pb.GenerateRequest(model=MODEL, chat=True, messages=[gen_pb.ChatMessage(role="root", content="x")]),
    ]
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        for request in bad:
            code, details = raw_call(channel, "/baton.v1.GenerationService/Complete", "unary_unary",
                                     request.SerializeToString(), auth)  # fmt: skip
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (request, code)
            assert details and not leaks(details), details


def test_a_malformed_grpc_message_is_invalid_argument_and_leaks_nothing(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        for path, kind, _ in _generation_methods():
            code, details = raw_call(channel, path, kind, b"\xff\xff\xff\xff\x0f")
            assert code == grpc.StatusCode.INVALID_ARGUMENT and not leaks(details), (path, code, details)


# -- admin routes --------------------------------------------------------------------------------


def test_a_tenant_key_cannot_drain_the_gateway(make_server: Callable[..., ServerHandle], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{ALPHA_KEY} alpha\n")
    victim = make_server(api_keys_file=keys)
    with victim.client(headers=bearer(ALPHA_KEY)) as client:
        reply = client.post("/admin/drain")
        assert reply.status_code in (401, 403, 404), reply.status_code
        assert client.get("/ready").status_code == 200
    # Enabled (a pod's preStop), it still takes only an operator key.
    ops_key = "o" * 32
    keys.write_text(f"{ALPHA_KEY} alpha\n{ops_key} ops role=operator\n")
    enabled = make_server(api_keys_file=keys, http=HttpConfig(enable_admin=True))
    with enabled.client() as client:
        assert client.post("/admin/drain", headers=bearer(ALPHA_KEY)).status_code == 403
        assert client.get("/ready").status_code == 200
        assert client.post("/admin/drain", headers=bearer(ops_key)).status_code == 200
        assert client.get("/ready").status_code == 503


def test_a_tenant_cannot_read_another_tenants_usage(guarded: Guarded) -> None:
    reply = httpx.post(guarded.url + "/v1/completions", json=GOOD, headers=bearer(BETA_KEY), timeout=30)
    assert reply.status_code == 200
    metrics = httpx.get(guarded.url + "/metrics", headers=bearer(ALPHA_KEY), timeout=10)
    assert metrics.status_code in (401, 403) or 'tenant="beta"' not in metrics.text
