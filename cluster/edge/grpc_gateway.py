"""gRPC clients served from HTTP backends: a `Generate` or `Complete` call whose model the
gateway routes to an external pool (cluster.gateway) is sent there as an OpenAI request and
its SSE answer translated back into `GenerateResponse` messages.

    GenerateRequest (text / token_ids / chat messages, Sampling, n)
        -> POST /v1/completions or /v1/chat/completions, stream, include_usage; only the
           fields that were set (a strict OpenAI server refuses what it does not know)
    SSE chunks -> GenerateResponse: text, index, finish_reason and usage on each sample's last
                  message; token ids and logprobs are not carried (engines' text APIs differ)
    an error answer -> the gRPC status its HTTP status maps to, with the engine's message

A cancelled call closes the upstream request (cluster.gateway.proxy), as an HTTP client's does.

    route_key(gateway, context, tenant)    the call's route key: a metadata header, or the tenant
    call_pool(frontend, route, ...)        the whole trip to an external pool, counted as the
                                           edge counts a call (baton_requests_total{api="grpc"})
    own_route(gateway, route)              a call the gateway sent to its own pool, ended there
    output_watch(gateway, route)           its stream's outputs, watched as an external one's (TTFT, ITL)
    tokenize_at_pool(frontend, pool, ...)  Tokenize and Detokenize for an external pool's model,
    detokenize_at_pool(...)                by its engine
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc

from batonpb.baton.v1 import generation_pb2 as pb
from cluster.edge.frontend import Frontend
from cluster.edge.tenants import Tenant
from cluster.errors import EdgeError, Kind
from cluster.gateway import tokenize_proxy
from cluster.gateway.endpoints import Endpoint, Pool
from cluster.gateway.proxy import Attempt, Upstreams, Watch
from cluster.gateway.router import Route, Router
from cluster.gateway.service import Gateway

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
           "tool_calls": pb.FINISH_REASON_TOOL_CALLS}  # fmt: skip
# An engine's HTTP status -> the call's; 401/403 refuse the gateway's credential, not the caller's.
_STATUS = {400: Kind.INVALID_ARGUMENT, 401: Kind.UNAVAILABLE, 403: Kind.UNAVAILABLE, 404: Kind.NOT_FOUND,
           408: Kind.DEADLINE_EXCEEDED, 413: Kind.INVALID_ARGUMENT, 422: Kind.INVALID_ARGUMENT,
           429: Kind.RESOURCE_EXHAUSTED}  # fmt: skip
MAX_ERROR_CHARS = 512


def route_key(gateway: Gateway, context: grpc.aio.ServicerContext, tenant: Tenant) -> str:
    key = gateway.spec.routing.route_key
    if key.startswith("header:"):
        wanted = key[len("header:"):].lower()
        for name, value in context.invocation_metadata() or ():
            if name == wanted and isinstance(value, str) and value:
                return value[:256]
    return tenant.name


def output_watch(gateway: Gateway | None, route: Route | None) -> Callable[[], None] | None:
    """What an own-pool stream calls at each message with output (Upstreams.output: the first is
    its TTFT and ends its prompt work, the rest give the pool's ITL), or None where the gateway
    did not route it."""
    if gateway is None or route is None:
        return None
    watch, upstreams = Watch(route), gateway.upstreams
    return lambda: upstreams.output(watch, time.monotonic())


@contextlib.contextmanager
def own_route(gateway: Gateway | None, route: Route | None) -> Iterator[None]:
    ok = False
    try:
        yield
        ok = True
    finally:
        if route is not None and gateway is not None:
            gateway.upstreams.ended(route, "ok" if ok else "error")


async def call_pool(
    frontend: Frontend, route: Route, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
    whole: bool = False,
) -> pb.CompleteResponse | None:
    """Generate (its messages written to `context`) or, `whole`, Complete (its reply) on an
    external pool."""
    gateway = frontend.gateway
    assert gateway is not None
    backend = HttpBackend(gateway.router, gateway.upstreams)
    try:
        attempt = await backend.open(route, route.tokens, request, stream=not whole)
    except Exception:
        frontend.metrics.requests.labels("grpc", "error").inc()
        raise
    outcome = "cancelled"
    try:
        if whole:
            reply = await backend.complete(attempt)
            outcome = "ok"
            return reply
        async for message in backend.stream(attempt):
            await context.write(message)
        outcome = "ok"
        return None
    except EdgeError:
        outcome = "broken"
        raise
    finally:
        gateway.upstreams.finish(attempt, outcome)
        frontend.metrics.requests.labels("grpc", {"broken": "error"}.get(outcome, outcome)).inc()


def openai_body(request: pb.GenerateRequest, stream: bool) -> tuple[str, dict[str, Any]]:
    """(path, body) of the OpenAI request that asks what `request` asks."""
    s = request.sampling
    body: dict[str, Any] = {"model": request.model, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if request.chat:
        path = "/v1/chat/completions"
        body["messages"] = [_message(m) for m in request.messages]
    else:
        path = "/v1/completions"
        body["prompt"] = request.text if request.WhichOneof("prompt") == "text" else list(request.token_ids.ids)
    if request.n > 1:
        body["n"] = request.n
    for name in ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty"):
        if s.HasField(name):
            body[name] = getattr(s, name)
    for name in ("top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            body[name] = getattr(s, name)
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    return path, body


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]  # fmt: skip
    return out


class HttpBackend:
    """One gRPC call's trip to an external pool."""

    def __init__(self, router: Router, upstreams: Upstreams) -> None:
        self.router = router
        self.upstreams = upstreams

    async def open(self, route: Route, tokens: Sequence[int], request: pb.GenerateRequest, stream: bool) -> Attempt:
        path, body = openai_body(request, stream)
        model = request.model
        body["model"] = route.pool.spec.upstream_model(model)

        def route_for(tried: Sequence[Endpoint]) -> Route:
            if not tried:
                return route
            return self.router.admit(model, route.route_key, tokens, exclude=tried, only_pool=route.pool.name)

        attempt = await self.upstreams.send(route_for, path, json.dumps(body).encode(),
                                            {"content-type": "application/json"}, stream)  # fmt: skip
        if attempt.response.status >= 400:
            try:
                raw = await self.upstreams.read_body(attempt)
            finally:
                self.upstreams.finish(attempt, "ok")
            raise _error(attempt, raw)
        return attempt

    async def stream(self, attempt: Attempt) -> AsyncIterator[pb.GenerateResponse]:
        """The answer as GenerateResponse messages; the caller finishes the attempt."""
        first = True
        usage: dict[str, Any] | None = None
        finals: dict[int, pb.GenerateResponse] = {}
        async for event in self.upstreams.events(attempt):
            if isinstance(event.get("error"), dict):
                raise _error_of(attempt, event["error"], 500)
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                msg = pb.GenerateResponse(index=int(choice.get("index", 0) or 0))
                msg.text = _choice_text(choice)
                reason = choice.get("finish_reason")
                if first:
                    msg.request_id = str(event.get("id", ""))[:256]
                    first = False
                if isinstance(reason, str):
                    msg.finish_reason = _FINISH.get(reason, pb.FINISH_REASON_STOP)
                    finals[msg.index] = msg  # held back until the usage chunk (the stream's last)
                    continue
                if msg.text:
                    yield msg
        for index in sorted(finals):
            msg = finals[index]
            if usage is not None:
                msg.usage.CopyFrom(_usage(usage, per_sample=len(finals) > 1))
            yield msg

    async def complete(self, attempt: Attempt) -> pb.CompleteResponse:
        raw = await self.upstreams.read_body(attempt)
        try:
            body = json.loads(raw)
        except ValueError:
            raise EdgeError(Kind.UNAVAILABLE, f"pool {attempt.route.pool.name!r} answered no JSON") from None
        choices = [pb.CompleteChoice(index=int(c.get("index", i) or 0), text=_choice_text(c, whole=True),
                                     finish_reason=_FINISH.get(str(c.get("finish_reason")), pb.FINISH_REASON_STOP))
                   for i, c in enumerate(body.get("choices") or ()) if isinstance(c, dict)]  # fmt: skip
        if not choices:
            raise EdgeError(Kind.UNAVAILABLE, f"pool {attempt.route.pool.name!r} answered no choices")
        first = choices[0]
        reply = pb.CompleteResponse(request_id=str(body.get("id", ""))[:256], text=first.text,
                                    finish_reason=first.finish_reason, choices=choices if len(choices) > 1 else ())  # fmt: skip
        if isinstance(body.get("usage"), dict):
            reply.usage.CopyFrom(_usage(body["usage"], per_sample=False))
        return reply


def _choice_text(choice: dict[str, Any], whole: bool = False) -> str:
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    part = choice.get("message" if whole else "delta")
    if isinstance(part, dict) and isinstance(part.get("content"), str):
        return str(part["content"])
    return ""


def _usage(usage: dict[str, Any], per_sample: bool) -> pb.Usage:
    def num(value: object) -> int:
        return value if isinstance(value, int) and 0 <= value < 1 << 31 else 0

    details = usage.get("prompt_tokens_details")
    cached = num(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return pb.Usage(prompt_tokens=num(usage.get("prompt_tokens")), cached_tokens=cached,
                    completion_tokens=0 if per_sample else num(usage.get("completion_tokens")))  # fmt: skip


def _error(attempt: Attempt, raw: bytes) -> EdgeError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    return _error_of(attempt, err if isinstance(err, dict) else {}, attempt.response.status)


def _error_of(attempt: Attempt, err: dict[str, Any], status: int) -> EdgeError:
    return _pool_error(attempt.route.pool.name, err, status)


def _pool_error(pool: str, err: dict[str, Any], status: int) -> EdgeError:
    message = str(err.get("message") or f"HTTP {status}")[:MAX_ERROR_CHARS]
    kind = _STATUS.get(status, Kind.UNAVAILABLE)
    param = err.get("param")
    return EdgeError(kind, f"pool {pool!r}: {message}", param if isinstance(param, str) and len(param) <= 64 else None)


async def tokenize_at_pool(frontend: Frontend, pool: Pool, model: str, text: str, special: bool) -> pb.TokenizeResponse:
    """Tokenize for an external pool's model: its engine's tokenizer answers (cluster.gateway.tokenize_proxy);
    max_model_len is 0 where the engine does not say it (llama.cpp)."""
    reply = await _ask_pool(frontend, pool, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": special})
    tokens, limit = reply.get("tokens"), reply.get("max_model_len")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
        raise EdgeError(Kind.UNAVAILABLE, f"pool {pool.name!r} answered /tokenize without token ids")
    known = limit if isinstance(limit, int) and 0 <= limit < 1 << 32 else 0
    return pb.TokenizeResponse(token_ids=tokens, max_model_len=known)


async def detokenize_at_pool(frontend: Frontend, pool: Pool, model: str, ids: list[int]) -> pb.DetokenizeResponse:
    """Detokenize for an external pool's model, by its engine (cluster.gateway.tokenize_proxy)."""
    reply = await _ask_pool(frontend, pool, "/detokenize", {"model": model, "tokens": ids})
    text = reply.get("prompt")
    if not isinstance(text, str):
        raise EdgeError(Kind.UNAVAILABLE, f"pool {pool.name!r} answered /detokenize without a prompt")
    return pb.DetokenizeResponse(text=text)


async def _ask_pool(frontend: Frontend, pool: Pool, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer route's JSON answer from the pool; its error answer as the call's status."""
    gateway = frontend.gateway
    assert gateway is not None
    answer = await tokenize_proxy.forward(gateway.upstreams, gateway.router, pool, path, body, str(body["model"]),
                                          {"content-type": "application/json"})  # fmt: skip
    try:
        reply = json.loads(answer.body)
    except ValueError:
        reply = None
    if answer.status != 200:
        err = reply.get("error") if isinstance(reply, dict) else None
        raise _pool_error(pool.name, err if isinstance(err, dict) else {}, answer.status)
    if not isinstance(reply, dict):
        raise EdgeError(Kind.UNAVAILABLE, f"pool {pool.name!r} answered {path} with no JSON object")
    return reply
