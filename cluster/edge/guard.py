"""ASGI middleware that runs before any body is read: API keys (401) and the body limit (413).

Auth runs first, so an unauthenticated caller learns nothing about what the server would
accept; the limit is enforced from Content-Length when present and by counting bytes as they
arrive otherwise, so an oversized body is refused before it is parsed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from cluster.edge.tenants import DEFAULT_TENANT, ApiKeys, Tenant

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _BodyTooLarge(HTTPException):
    """Raised from receive() once a body passes the limit. An HTTPException, because FastAPI's
    body reader re-raises those (the app then answers 413) and turns any other exception
    into a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes")


async def send_error(
    send: Send, status: int, message: str, kind: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}}).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


class EdgeGuard:
    def __init__(
        self, app: ASGIApp, keys: ApiKeys, max_body_bytes: int, open_paths: tuple[str, ...],
        observer_paths: tuple[str, ...] = (), operator_paths: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths
        # Prefixes. With keys set: observer paths take a metrics or operator key, operator paths
        # only an operator key, and a metrics key takes nothing else.
        self.observer_paths = observer_paths
        self.operator_paths = operator_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        tenant = DEFAULT_TENANT
        if scope["path"] not in self.open_paths:
            found = self.keys.lookup(bearer_key(headers))
            if found is None:
                await send_error(send, 401, "a valid API key is required", "authentication_error",
                                 ((b"www-authenticate", b"Bearer"),))
                return
            tenant = found
            refusal = self._refusal(tenant, scope["path"]) if self.keys.enabled else None
            if refusal is not None:
                await send_error(send, 403, refusal, "permission_error")
                return
        scope.setdefault("state", {})["tenant"] = tenant
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await send_error(send, 413, f"request body over {self.max_body_bytes} bytes", "invalid_request_error")
                return
        await self._guarded(scope, receive, send)

    def _refusal(self, tenant: Tenant, path: str) -> str | None:
        """Why `tenant`'s key may not use `path` (a 403's message), or None."""
        if path.startswith(self.operator_paths):
            return None if tenant.is_operator else "this route needs an operator key (role=operator)"
        if path.startswith(self.observer_paths):
            return None if tenant.may_observe else "this route needs a metrics or operator key (role=metrics)"
        return None if tenant.may_generate else "a metrics key (role=metrics) only reads /metrics and /status"

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_error(send, 413, f"request body over {self.max_body_bytes} bytes", "invalid_request_error")
