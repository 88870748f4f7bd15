"""A TEST DOUBLE of an OpenAI-compatible server, for testing bench's *client* side only.

`FakeOpenAIServer` is a real HTTP server (starlette under uvicorn, on 127.0.0.1, in a
background thread) that answers `/v1/models` and streams `/v1/completions` as OpenAI-format
SSE (`data: {...}` ... a usage chunk ... `data: [DONE]`). It generates nothing: the "output"
token ids are a function of the prompt, so tests can check that a multi-turn history carries
the previous turn's actual output. It stands in for baton's server only to test the load
generator's parsing, timing and scheduling; baton's own server is tested end to end elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FAKE_MODEL = "fake-model"


def fake_output_ids(prompt: list[int] | str, n: int) -> list[int]:
    """The double's deterministic "generation" for a prompt."""
    base = sum(prompt) if isinstance(prompt, list) else len(prompt)
    return [1000 + (base + i) % 5000 for i in range(n)]


@dataclass
class Behaviour:
    """Knobs a test turns; read by the handler on every request."""

    chunk_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    send_usage: bool = True
    send_done: bool = True
    status: int = 200
    stall_s: float = 0.0  # sleep before the first chunk (timeouts, time caps)
    honour_token_ids: bool = True  # False: like a server that ignores return_token_ids


@dataclass
class FakeState:
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[dict[str, Any]] = field(default_factory=list)
    seen_prompts: list[list[int] | str] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)  # one per request: which connection
    auth_headers: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cached_tokens(self, prompt: list[int] | str) -> int:
        """Longest common prefix with any earlier prompt (a stand-in for a prefix cache)."""
        best = 0
        for earlier in self.seen_prompts:
            if type(earlier) is not type(prompt):
                continue
            n = 0
            for a, b in zip(earlier, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best


def _chunk(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def build_app(state: FakeState) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        b = state.behaviour
        with state.lock:
            state.requests.append(body)
            state.client_ports.append(request.client.port if request.client else -1)
            state.auth_headers.append(request.headers.get("authorization"))
            cached = state.cached_tokens(body["prompt"])
            state.seen_prompts.append(body["prompt"])
        if b.status != 200:
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=b.status)
        n = int(body["max_tokens"])
        ids = fake_output_ids(body["prompt"], n)
        want_ids = bool(body.get("return_token_ids")) and b.honour_token_ids
        prompt_len = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())

        async def stream() -> AsyncIterator[bytes]:
            with state.lock:
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(b.stall_s)
                for start in range(0, n, b.tokens_per_chunk):
                    part = ids[start : start + b.tokens_per_chunk]
                    choice: dict[str, Any] = {"index": 0, "text": "".join(f" t{i}" for i in part)}
                    choice["finish_reason"] = "length" if start + len(part) >= n else None
                    if want_ids:
                        choice["token_ids"] = part
                    yield _chunk({"id": "cmpl-fake", "object": "text_completion", "choices": [choice]})
                    await asyncio.sleep(b.chunk_delay_s)
                if b.send_usage:
                    usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n,
                             "prompt_tokens_details": {"cached_tokens": cached}}
                    yield _chunk({"id": "cmpl-fake", "choices": [], "usage": usage})
                if b.send_done:
                    yield b"data: [DONE]\n\n"
            finally:
                with state.lock:
                    state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


class FakeOpenAIServer:
    """The test double, running on a free loopback port until `stop()`."""

    def __init__(self) -> None:
        self.state = FakeState()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self.state), log_level="warning", lifespan="off", loop="asyncio", http="h11")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def reset(self, behaviour: Behaviour | None = None) -> FakeState:
        with self.state.lock:
            self.state.behaviour = behaviour or Behaviour()
            self.state.requests.clear()
            self.state.seen_prompts.clear()
            self.state.client_ports.clear()
            self.state.auth_headers.clear()
            self.state.max_in_flight = 0
        return self.state


@pytest.fixture(scope="module")
def fake_server_module() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fake_server(fake_server_module: FakeOpenAIServer) -> FakeOpenAIServer:
    """The module's double, reset to default behaviour for each test."""
    fake_server_module.reset()
    return fake_server_module
