"""The OpenAI API's generation routes in front of the pools: ASGI middleware inside the edge's
guard (so the caller is authenticated and the body bounded before anything here runs).

    POST /v1/completions, /v1/chat/completions
      body read whole; route tokens (the model's tokenizer -- its pools' `tokenizer`, else the
            gateway's own -- over the prompt or the chat template's rendering of the messages),
            the route key, the router's choice
        own pool  -> the app, with the body replayed
        external  -> the endpoint (cluster.gateway.proxy), the body as it came (its model
                     renamed where the pool's upstream_models says); status, content type and
                     body passed through as they arrive (SSE unbuffered); the client leaving
                     closes the upstream request; errors before an answer are OpenAI-shaped JSON

    POST /tokenize, /detokenize
      a model of an external pool -> an endpoint of that pool (cluster.gateway.tokenize_proxy)
      the rest                    -> the app (the own model's tokenizer)

A body that is not a JSON object, or names a model no pool serves, goes to the app, which
answers it as it answers any bad request (400, 404).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from cluster.errors import EdgeError, Kind
from cluster.gateway import tokenize_proxy
from cluster.gateway.proxy import Attempt, Upstreams, Watch
from cluster.gateway.route_log import RouteLog
from cluster.gateway.router import Route, Router
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
MAX_ROUTE_KEY_CHARS = 256
_BIG_TEXT = 20_000  # characters: tokenized off the event loop beyond this


def route_text(body: dict[str, Any], chat: bool, tokenizer: Tokenizer) -> str | list[int]:
    """What the router hashes: the prompt (the first, for a batch), or the messages as the chat
    template renders them (their text parts; a template that refuses them: role and text)."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 1 << 31 for t in prompt):
            return list(prompt)
        return ""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    plain = [{"role": str(m.get("role", "")), "content": _text_of(m.get("content"))}
             for m in messages if isinstance(m, dict)]  # fmt: skip
    try:
        return tokenizer.apply_chat_template(plain, True)
    except Exception:  # the checkpoint's template refused them: still a deterministic text
        return "\n".join(f"{m['role']}: {m['content']}" for m in plain)


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class GatewayRouting:
    def __init__(
        self, app: ASGIApp, router: Router, upstreams: Upstreams, tokenizer: Callable[[str], Tokenizer],
        count: Callable[[str], None], log: RouteLog | None = None, draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.app = app
        self.router = router
        self.upstreams = upstreams
        self.tokenizer = tokenizer  # a model's route tokens' (cluster.gateway.service.Gateway.tokenizer_for)
        self.count = count  # the edge's baton_requests_total{api="http"} for calls it never sees
        self.log = log
        self.draining = draining  # the edge's drain (SIGTERM, /admin/drain): no new calls go out
        self.route_key = router.spec.routing.route_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        post = scope["type"] == "http" and scope.get("method") == "POST"
        if post and scope["path"] in tokenize_proxy.PATHS:
            await self._tokenizer(scope, receive, send)
            return
        chat = ROUTES.get(scope["path"]) if post else None
        if chat is None:
            await self.app(scope, receive, send)
            return
        raw, more = await _read_body(receive)
        if more:  # the client left before its body arrived whole: the app counts and answers it
            await self.app(scope, _replay(raw, receive, more=True), send)
            return
        body = _json_object(raw)
        model = body.get("model") if body is not None else None
        if body is None or not isinstance(model, str) or not self.router.serving(model):
            await self.app(scope, _replay(raw, receive), send)
            return
        try:
            tok = self.tokenizer(model)
            tokens = await self._tokens(route_text(body, chat, tok), tok)
        except Exception:  # a prompt the gateway's tokenizer refuses is the engine's to judge
            logger.debug("route tokens: the prompt did not tokenize", exc_info=True)
            tokens = []
        key = self._key(scope, body)
        if self.draining():  # as the edge's admission answers while draining
            self.count("rejected")
            await _send_error(send, EdgeError(Kind.UNAVAILABLE, "the server is not accepting requests", None, 1.0))
            return
        try:
            route = self.router.admit(model, key, tokens)
        except EdgeError as err:
            self.count("rejected")
            await _send_error(send, err)
            return
        self.router_metrics_decision(route)
        if route.is_own:
            await self._own(scope, receive, send, raw, route, body)
        else:
            await self._external(scope, receive, send, raw, route, body, model, tokens)

    async def _tokenizer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/tokenize, /detokenize: an external pool's model is tokenized by that pool's engine."""
        raw, more = await _read_body(receive)
        body = None if more else _json_object(raw)
        model = body.get("model") if body is not None else None
        pool = tokenize_proxy.external_pool(self.router, model) if isinstance(model, str) else None
        if body is None or pool is None or not isinstance(model, str):  # the app answers (or refuses) it
            await self.app(scope, _replay(raw, receive, more=more), send)
            return
        try:
            answer = await tokenize_proxy.forward(self.upstreams, self.router, pool, scope["path"], body, model,
                                                  _headers(scope))  # fmt: skip
        except EdgeError as err:
            await _send_error(send, err)
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer.body)).encode()),
                   (b"x-baton-pool", answer.pool.encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    def router_metrics_decision(self, route: Route) -> None:
        self.upstreams.metrics.decisions.labels(route.pool.name, route.reason).inc()

    async def _tokens(self, text: str | list[int], tok: Tokenizer) -> list[int]:
        if isinstance(text, list):
            return text
        if len(text) > _BIG_TEXT:
            return await asyncio.to_thread(tok.encode, text, True)
        return tok.encode(text, True)

    def _key(self, scope: Scope, body: dict[str, Any]) -> str:
        tenant = scope.get("state", {}).get("tenant")
        fallback = str(getattr(tenant, "name", "default"))
        if self.route_key == "tenant":
            return fallback
        if self.route_key == "user":
            user = body.get("user")
            return str(user)[:MAX_ROUTE_KEY_CHARS] if isinstance(user, str) and user else fallback
        wanted = self.route_key[len("header:"):].lower().encode("latin-1")
        for name, value in scope.get("headers", ()):
            if name == wanted and value:
                return str(value.decode("latin-1"))[:MAX_ROUTE_KEY_CHARS]
        return fallback

    async def _own(self, scope: Scope, receive: Receive, send: Send, raw: bytes, route: Route,
                   body: dict[str, Any]) -> None:  # fmt: skip
        status = 500
        watch: Watch | None = None  # a streamed answer's, watched as an external pool's is

        async def watched(message: Message) -> None:
            nonlocal status, watch
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 200 and any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                         for k, v in message.get("headers", ())):  # fmt: skip
                    watch = Watch(route)
                message = {**message, "headers": [*message.get("headers", ()), (b"x-baton-pool", route.pool.name.encode())]}
            elif watch is not None and message["type"] == "http.response.body":
                # the first output ends the route's prompt work: the cost rule's queue for the
                # own pool drains then, and its prompt rate is measured, as an external pool's
                self.upstreams.watch(watch, message.get("body", b""), time.monotonic())
            await send(message)

        try:
            await self.app(scope, _replay(raw, receive), watched)
        finally:
            self.upstreams.ended(route, "ok" if status < 400 else "error")
            self._log(route, str(body.get("model")), status < 400, body)

    async def _external(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, first: Route, body: dict[str, Any], model: str,
        tokens: Sequence[int],
    ) -> None:
        def route_for(tried: Sequence[Any]) -> Route:
            if not tried:
                return first
            again = self.router.admit(model, first.route_key, tokens, exclude=tried, only_pool=first.pool.name)
            self.router_metrics_decision(again)
            return again

        headers = _headers(scope)
        stream = body.get("stream") is True
        upstream = first.pool.spec.upstream_model(model)  # a pool's endpoints serve one name for it
        if upstream != model:  # the rest as it came: no \u escapes to swell a non-ASCII prompt
            raw = json.dumps({**body, "model": upstream}, ensure_ascii=False, separators=(",", ":")).encode()
        try:
            attempt = await self.upstreams.send(route_for, scope["path"], raw, headers, stream)
        except EdgeError as err:
            self.count("error")
            await _send_error(send, err)
            return
        outcome = "cancelled"  # unless the relay says otherwise (this task may be cancelled)
        try:
            outcome = await self._relay(attempt, receive, send)
        finally:
            self.upstreams.finish(attempt, outcome)
        answered = outcome == "ok" and attempt.response.status < 400
        self.count("ok" if answered else "cancelled" if outcome == "cancelled" else "error")
        self._log(attempt.route, model, answered, body)

    async def _relay(self, attempt: Attempt, receive: Receive, send: Send) -> str:
        """Pass the answer on; -> ok, cancelled (the client left) or broken (the upstream did)."""
        response = attempt.response
        headers = [(b"content-type", response.headers.get("content-type", "application/json").encode("latin-1")),
                   (b"x-baton-pool", attempt.route.pool.name.encode())]  # fmt: skip
        if attempt.stream:
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        left = asyncio.ensure_future(_disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            relay = asyncio.ensure_future(self._pass(attempt, send))
            try:
                done, _ = await asyncio.wait({relay, left}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not relay.done():
                    relay.cancel()
                    await asyncio.gather(relay, return_exceptions=True)
            if relay in done and relay.exception() is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return "ok"
            if relay in done:
                logger.warning("pool %s endpoint %s broke off a response: %r", attempt.route.pool.name,
                               attempt.route.endpoint.url, relay.exception())  # fmt: skip
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return "broken"
            return "cancelled"
        except OSError:  # the client's connection is gone
            return "cancelled"
        finally:
            left.cancel()
            await asyncio.gather(left, return_exceptions=True)

    async def _pass(self, attempt: Attempt, send: Send) -> None:
        async for chunk in self.upstreams.relay(attempt):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    def _log(self, route: Route, model: str, ok: bool, body: dict[str, Any]) -> None:
        if self.log is None or not ok:
            return
        wanted = body.get("max_completion_tokens", body.get("max_tokens"))
        out = wanted if isinstance(wanted, int) and 0 < wanted < 1 << 31 else 1
        self.log.write(route.route_key, model, route.pool.name, route.reason, route.overlap_hashes,
                       route.prompt_tokens, out)  # fmt: skip


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """(the body, whether the client left before it ended)."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts), True
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), False


def _replay(raw: bytes, receive: Receive, more: bool = False) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if more:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replayed


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _send_error(send: Send, err: EdgeError) -> None:
    body = json.dumps(err.openai_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, round(err.retry_after_s + 0.499))).encode()))
    await send({"type": "http.response.start", "status": err.kind.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
