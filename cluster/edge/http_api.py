"""The OpenAI-compatible HTTP API (FastAPI on uvicorn + uvloop).

Why FastAPI: the request bodies are pydantic models, so validation, bounds and /openapi.json
come from one declaration (and schemathesis tests the server against that very schema);
Starlette's StreamingResponse cancels the body iterator when a client disconnects, which is
how a dropped stream aborts its engine request.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when `stream`), GET /v1/models,
GET /v1/models/{model}, POST /tokenize and /detokenize (cluster.edge.tokenize_api),
/live, /ready, /health (/ready's answer, where other engines' routers look), /metrics, /status (the gateway and every node: cluster.ops.node_status), /dashboard
(a live page over /status), POST /admin/drain and /admin/scale (cluster.edge.admin), /openapi.json. Every error body is OpenAI-shaped.

Tracing (cluster.ops.tracing, when configured): an outermost middleware opens each generation call's
`baton.request` span before auth and validation, so refused calls are traced too; its parent
is the client's `traceparent` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.edge.admin import add_admin_routes
from cluster.edge.admission import Ticket
from cluster.edge.constraint_fields import OutputSpec
from cluster.edge.frontend import CacheHints, Frontend, GenerateRequest, allowed_slo, merge_streams
from cluster.edge.guard import EdgeGuard
from cluster.edge.openai_output import output_spec, template_messages
from cluster.edge.openai_render import ChoiceState, Renderer, error_body, sse
from cluster.edge.openai_schema import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from cluster.edge.tenants import ApiKeys, Tenant
from cluster.edge.tokenize_api import add_tokenize_routes, off_loop
from cluster.errors import EdgeError, Kind, classify, invalid
from cluster.gateway.http_routing import GatewayRouting
from cluster.ops.tracing import NO_TRACE, RequestTrace, Tracing
from engine.errors import BatonError
from engine.outputs import StepOutput
from engine.request import SloClass
from engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"
_DONE = b"data: [DONE]\n\n"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's and vLLM's


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 << 20
    allow_priority_field: bool = False  # let clients set `priority` (else the key's) and slo_class "latency"
    tls_certfile: str | None = None  # both set: HTTPS (and TLS on gRPC)
    tls_keyfile: str | None = None
    enable_admin: bool = False  # POST /admin/drain, /admin/scale (off: 404); with keys: an operator key


GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
OBSERVER_PATHS = ("/metrics", "/status")  # every tenant and node: a metrics or operator key
OPERATOR_PATHS = ("/admin/",)  # changes the gateway: an operator key


def error_response(err: EdgeError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s + 0.499)))
    return JSONResponse(error_body(err), status_code=err.kind.http_status, headers=headers)


def create_app(frontend: Frontend, keys: ApiKeys, cfg: HttpConfig) -> FastAPI:
    app = FastAPI(title="baton", version="0.1.0", docs_url=None, redoc_url=None)
    gateway = frontend.gateway
    if gateway is not None:  # added first: innermost, behind the guard (cluster.gateway.http_routing)
        app.add_middleware(GatewayRouting, router=gateway.router, upstreams=gateway.upstreams,
                           tokenizer=lambda model: gateway.tokenizer_for(model, frontend.tokenizer),
                           count=lambda outcome: frontend.metrics.requests.labels("http", outcome).inc(),
                           draining=lambda: frontend.draining,
                           log=gateway.log)  # fmt: skip
    # /dashboard is a static page (no data): it reads /status, which needs the key when keys are set
    # With keys set, what shows every tenant and node (or changes the gateway) needs an operator key.
    app.add_middleware(EdgeGuard, keys=keys, max_body_bytes=cfg.max_body_bytes,
                       open_paths=("/live", "/ready", "/health", "/dashboard"), observer_paths=OBSERVER_PATHS,
                       operator_paths=OPERATOR_PATHS)  # fmt: skip
    if frontend.tracing.is_enabled:  # added last: outermost, so it sees 401s and 413s too
        app.add_middleware(TracedCalls, tracing=frontend.tracing)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path in GENERATION_ROUTES:
            frontend.metrics.requests.labels("http", "rejected").inc()
        return error_response(_traced_error(request, _validation_error(exc)))

    @app.exception_handler(EdgeError)
    async def _edge(request: Request, exc: EdgeError) -> JSONResponse:
        return error_response(_traced_error(request, exc))

    @app.exception_handler(BatonError)
    async def _baton(request: Request, exc: BatonError) -> JSONResponse:
        # e.g. a checkpoint's chat template refusing the messages: the caller's input, a 400.
        return error_response(_traced_error(request, classify(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return error_response(EdgeError(Kind.INTERNAL, "internal error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Framework-level errors (unparseable body, unknown route, wrong method), OpenAI-shaped.
        # A generation call whose body never arrived whole is still one call: counted cancelled
        # when its client left mid-body, rejected when the body did not parse.
        if request.url.path in GENERATION_ROUTES and exc.status_code == 400:
            left = isinstance(exc.__cause__, ClientDisconnect)
            frontend.metrics.requests.labels("http", "cancelled" if left else "rejected").inc()
        kind = {404: Kind.NOT_FOUND, 401: Kind.UNAUTHENTICATED}.get(exc.status_code, Kind.INVALID_ARGUMENT)
        message = "the request body is not valid JSON" if exc.status_code == 400 else str(exc.detail)
        return JSONResponse(error_body(EdgeError(kind, message)), status_code=exc.status_code)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(frontend, cfg, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(frontend, cfg, request, body, chat=True)

    def cards() -> list[dict[str, Any]]:
        out = [{"id": name, "object": "model", "created": 0, "owned_by": "baton",
                "max_model_len": frontend.max_model_len} for name in frontend.model_names]  # fmt: skip
        if gateway is not None:  # and every external pool's, owned by the first pool serving it
            owners: dict[str, str] = {}
            for pool in gateway.router.pools.values():
                for name in pool.spec.models:
                    owners.setdefault(name, pool.name)
            out += [{"id": name, "object": "model", "created": 0, "owned_by": owner}
                    for name, owner in owners.items() if name not in frontend.model_names]  # fmt: skip
        return out

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": cards()}

    add_tokenize_routes(app, frontend, cards)  # /tokenize, /detokenize, /v1/models/{model}

    @app.get("/live")
    async def live() -> JSONResponse:
        ok = frontend.is_live()
        return JSONResponse({"status": "ok" if ok else "dead"}, status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = frontend.is_ready()
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        # What routers probe on vLLM, SGLang and llama.cpp (a gateway's pools included): /ready's answer.
        return await ready()

    @app.get("/metrics")
    async def metrics() -> Response:
        frontend.refresh_gauges()
        await frontend.nodes()  # the per-node families read a fresh snapshot
        return Response(frontend.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(_dashboard_page(), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": DASHBOARD_CSP})  # fmt: skip

    add_admin_routes(app, frontend, cfg.enable_admin)  # /admin/drain, /admin/scale (cluster.edge.admin)

    @app.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(await frontend.status(), headers={"Cache-Control": "no-store"})

    return app


DASHBOARD_CSP = "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"  # noqa: E501


@functools.cache
def _dashboard_page() -> bytes:
    """cluster/ops/static/dashboard.html: one self-contained file (inline JS and CSS, no build step)."""
    return (Path(__file__).resolve().parent.parent / "ops" / "static" / "dashboard.html").read_bytes()


class TracedCalls:
    """ASGI middleware: the `baton.request` span of each generation call, from the first byte to
    the last (a stream's too), with the status it answered."""

    PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

    def __init__(self, app: Any, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        trace = self.tracing.request("http", scope["path"], scope.get("headers", ()))
        state = scope.setdefault("state", {})
        state["trace"] = trace
        status = 500  # an exception before the response started is answered with a 500

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            tenant = state.get("tenant")
            if isinstance(tenant, Tenant):
                trace.set(tenant=tenant.name)
            trace.http_status(status)
            trace.end()


def _trace(request: Request) -> RequestTrace:
    trace = request.scope.get("state", {}).get("trace", NO_TRACE)
    return trace if isinstance(trace, RequestTrace) else NO_TRACE


def _traced_error(request: Request, err: EdgeError) -> EdgeError:
    """The call's trace learns why it failed (kind and field) before the status says that it did."""
    _trace(request).fail(err)
    return err


def _validation_error(exc: RequestValidationError) -> EdgeError:
    errors = exc.errors()
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    kind = first.get("type")
    if kind == "json_invalid":
        return invalid("the request body is not valid JSON")
    # loc is like ("body", "prompt", "constrained-str"): keep the field path, drop the
    # union-member tags pydantic adds, which mean nothing to a client.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
    param = ".".join(loc) or None
    message = "not valid UTF-8" if kind == "string_unicode" else str(first.get("msg", "invalid value"))
    return invalid(f"{param}: {message}" if param else message, param)


# -- one call ----------------------------------------------------------------------------------


async def _serve(
    frontend: Frontend, cfg: HttpConfig, request: Request, body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
) -> Response:
    try:
        spec = output_spec(body)
        admitted = await _admit(frontend, cfg, request, body, spec)
    except Exception:
        frontend.metrics.requests.labels("http", "rejected").inc()  # refused before any engine work
        raise
    return await _respond(frontend, request, body, chat, spec, *admitted)


async def _admit(
    frontend: Frontend, cfg: HttpConfig, request: Request, body: CompletionRequest | ChatCompletionRequest,
    spec: OutputSpec,
) -> tuple[list[GenerateRequest], list[Ticket], int, Any]:
    """Check, admit, tokenize and prepare every choice of one call (tickets released on failure);
    an output constraint is compiled before the response starts (a 400 if it does not)."""
    if body.model not in frontend.model_names:
        raise EdgeError(Kind.NOT_FOUND, f"model {body.model!r} does not exist", "model")
    tenant: Tenant = request.state.tenant
    trace = _trace(request)
    trace.set(model=frontend.model_name, tenant=tenant.name, stream=body.stream, choices=body.n)
    deadline = frontend.deadline(_timeout_header(request))
    num_choices = _num_prompts(body) * body.n
    if num_choices > MAX_CHOICES:
        raise invalid(f"{num_choices} choices (prompts x n) exceed {MAX_CHOICES} per call", "n")
    slo = _slo_class(body, cfg)
    tickets: list[Ticket] = []
    try:
        # Admission first, before any tokenizing: one O(1) ticket per engine request.
        for _ in range(num_choices):
            tickets.append(frontend.admit(slo))
        prompts = await _prompts(frontend, body, spec)
        reqs = _requests(frontend, cfg, body, prompts, tenant, deadline, trace.req_id, spec, slo)
        for req, ticket in zip(reqs, tickets, strict=True):
            frontend.check_tenant(ticket, req)
        await frontend.prepare_constraint(reqs[0].job.sampling, spec.param)
    except BaseException:
        _release(tickets)
        raise
    return reqs, tickets, len(prompts), trace


async def _respond(
    frontend: Frontend, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool,
    spec: OutputSpec, reqs: list[GenerateRequest], tickets: list[Ticket], num_prompts: int, trace: Any,
) -> Response:
    want_logprobs = (body.logprobs is not None) if isinstance(body, CompletionRequest) else body.logprobs
    prefix = "chatcmpl-" if chat else "cmpl-"
    renderer = Renderer(chat, prefix + uuid.uuid4().hex, frontend.model_name, int(time.time()),
                        lambda t: frontend.tokenizer.decode([t], skip_special_tokens=False), want_logprobs,
                        body.return_token_ids, spec.tools)
    streams = [frontend.stream(r, t, "http", trace) for r, t in zip(reqs, tickets, strict=True)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(
            _sse(renderer, streams, num_prompts, include_usage),
            on_close=lambda: _release(tickets),
        )
    try:
        return JSONResponse(await _collect(request, renderer, streams, num_prompts))
    finally:
        _release(tickets)


def _release(tickets: Sequence[Ticket]) -> None:
    for ticket in tickets:
        ticket.release()


class _EventStream(StreamingResponse):
    """SSE response that releases its admission tickets however the response ends (even when
    the client leaves before the body iterator was ever started)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _timeout_header(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise invalid(f"{TIMEOUT_HEADER} must be a number of seconds", TIMEOUT_HEADER) from None
    if not 0 < value < 1e7:
        raise invalid(f"{TIMEOUT_HEADER} must be positive", TIMEOUT_HEADER)
    return value


def _slo_class(body: CompletionRequest | ChatCompletionRequest, cfg: HttpConfig) -> SloClass:
    """The request's service class (engine.request.SloClass), as the edge may take it."""
    if body.slo_class is None:
        return SloClass.STANDARD
    return allowed_slo(SloClass[body.slo_class.upper()], cfg.allow_priority_field)


def _num_prompts(body: CompletionRequest | ChatCompletionRequest) -> int:
    if isinstance(body, ChatCompletionRequest) or isinstance(body.prompt, str):
        return 1
    return 1 if all(isinstance(t, int) for t in body.prompt) else len(body.prompt)


async def _prompts(
    frontend: Frontend, body: CompletionRequest | ChatCompletionRequest, spec: OutputSpec
) -> list[list[int]]:
    tok = frontend.tokenizer
    if isinstance(body, ChatCompletionRequest):
        extra = {"tools": [t.template_value() for t in spec.tools.tools]} if spec.tools else {}
        text = tok.apply_chat_template(template_messages(body), body.add_generation_prompt, **extra)
        return [await _encode(frontend, text, special=False)]
    prompt = body.prompt
    if isinstance(prompt, str):
        return [await _encode(frontend, prompt, special=True)]
    if all(isinstance(t, int) for t in prompt):
        return [[t for t in prompt if isinstance(t, int)]]
    out: list[list[int]] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(await _encode(frontend, p, special=True))
        elif isinstance(p, list):
            out.append(list(p))
    return out


async def _encode(frontend: Frontend, text: str, special: bool) -> list[int]:
    return await off_loop(len(text), frontend.tokenizer.encode, text, special)


def _requests(
    frontend: Frontend, cfg: HttpConfig, body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]], tenant: Tenant, deadline: float, first_req_id: str | None, spec: OutputSpec,
    slo: SloClass,
) -> list[GenerateRequest]:
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if cfg.allow_priority_field and body.priority is not None:
        tenant = replace(tenant, priority=body.priority)
    hints = CacheHints(body.cache_salt or None, body.prompt_cache_key or None, ("cache_salt", "prompt_cache_key"))
    reqs: list[GenerateRequest] = []
    for prompt in prompts:
        if max_tokens is not None:
            wanted = max_tokens
        elif isinstance(body, CompletionRequest):  # the legacy endpoint's default, as OpenAI's and vLLM's
            wanted = min(COMPLETIONS_DEFAULT_MAX_TOKENS, frontend.default_max_tokens(prompt))
        else:  # Chat: the rest of the context
            wanted = frontend.default_max_tokens(prompt)
        sampling = replace(_sampling(body, wanted), constraint=spec.constraint)
        for i in range(body.n):
            params = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
            req_id = None if reqs else first_req_id  # the trace's, for the call's first request
            reqs.append(frontend.prepare(prompt, params, tenant, deadline, req_id, hints, slo=slo))
    return reqs


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    if isinstance(body, CompletionRequest):
        logprobs = body.logprobs
    else:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,  # above max_tokens is refused, as on gRPC
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        logit_bias=tuple((int(token), bias) for token, bias in (body.logit_bias or {}).items()),
    )


# -- streams -------------------------------------------------------------------------------------


async def _sse(
    renderer: Renderer, streams: list[AsyncIterator[StepOutput]], prompts: int, include_usage: bool
) -> AsyncIterator[bytes]:
    choices = [ChoiceState() for _ in streams]
    try:
        async with contextlib.aclosing(merge_streams(streams)) as outs:
            async for index, out in outs:
                first = not choices[index].completion_tokens and not choices[index].text
                choices[index].add(out)
                data = renderer.chunk_sse(index, out, first)
                if data is not None:
                    yield data
        if include_usage:
            yield sse(renderer.usage_chunk(choices, prompts))
    except Exception as exc:  # the status line is gone: report in-band, then end the stream
        yield sse(error_body(classify(exc)))
    yield _DONE


async def _collect(
    request: Request, renderer: Renderer, streams: list[AsyncIterator[StepOutput]], prompts: int
) -> dict[str, Any]:
    choices = [ChoiceState() for _ in streams]

    async def run() -> None:
        async with contextlib.aclosing(merge_streams(streams)) as outs:
            async for index, out in outs:
                choices[index].add(out)

    task = asyncio.create_task(run())
    try:
        # A non-streaming client that hangs up must not keep its requests running.
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                raise EdgeError(Kind.CANCELLED, "client disconnected")
    finally:  # left early (the client, or this handler cancelled): abort the choices
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    task.result()
    return renderer.body(choices, prompts)
