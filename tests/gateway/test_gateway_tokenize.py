"""/tokenize and /detokenize through the gateway: an external pool's model is tokenized by that
pool's engine (a baton server as a plain OpenAI endpoint, vLLM's shapes passed through; a server
speaking llama-server's documented shapes, translated), the own model by the gateway itself."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from bench.server_proc import free_port
from engine.tokenizer import Tokenizer
from tests.cluster.conftest import ServerHandle
from tests.gateway.conftest import EXT, pool
from tests.gateway.test_gateway import count

pytestmark = pytest.mark.timeout(120)

PROMPT = "the quick brown fox"


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


class LlamaServerShapes:
    """/health, /tokenize and /detokenize as llama-server answers them (its README's shapes: `content`,
    `add_special` (default false), `with_pieces`; a piece that is not whole UTF-8 as its bytes),
    over a real tokenizer, on its own thread and loop. `garbled`: answers in another shape."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.garbled = False
        self.broken = False  # the answer's headers, part of its body, then the connection closed
        self.seen: list[dict[str, Any]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _health(self, _: web.Request) -> web.Response:  # what the gateway probes
        return web.json_response({"status": "ok"})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.garbled:
            return web.json_response({"ids": [1, 2]})
        if self.broken:
            return await self._break(request, b'{"tokens": [1, 2, ')
        ids = self.tokenizer.encode(body["content"], body.get("add_special", False))
        if not body.get("with_pieces", False):
            return web.json_response({"tokens": ids})
        pieces: list[dict[str, Any]] = []
        for i in ids:
            piece = self.tokenizer.decode([i], skip_special_tokens=False).encode()
            pieces.append({"id": i, "piece": piece.decode() if i % 2 else list(piece)})  # both of its forms
        return web.json_response({"tokens": pieces})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        """Only ever broken: headers and part of a body, then the connection closed."""
        await request.json()
        return await self._break(request, b'{"id": "cmpl-1", "choices": [{"text": "par')

    async def _break(self, request: web.Request, part: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json", "content-length": "1000"})
        await response.prepare(request)
        await response.write(part)
        assert request.transport is not None
        request.transport.close()
        return response

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body)
        return web.json_response({"content": self.tokenizer.decode(body["tokens"], skip_special_tokens=False)})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def llama(tiny_model_dir: Path) -> Iterator[LlamaServerShapes]:
    server = LlamaServerShapes(Tokenizer.from_dir(tiny_model_dir))
    yield server
    server.stop()


def test_an_external_models_tokens_come_from_its_pool(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    gw = make_gateway([pool("ext", [upstreams[0].url], models=(EXT, "chat"), upstream_models=(("chat", EXT),))])
    direct = post(upstreams[0].url, "/tokenize", {"model": EXT, "prompt": PROMPT, "return_token_strs": True}).json()
    before = count(gw.url, "baton_pool_requests_total", pool="ext", outcome="ok")
    for model in (EXT, "chat"):  # "chat" goes upstream as EXT: the upstream answers no other name
        got = post(gw.url, "/tokenize", {"model": model, "prompt": PROMPT, "return_token_strs": True})
        assert got.status_code == 200 and got.headers["x-baton-pool"] == "ext", got.text
        assert got.json() == direct
    chat = post(gw.url, "/tokenize", {"model": EXT, "messages": [{"role": "user", "content": PROMPT}]})
    assert chat.status_code == 200 and chat.json()["count"] > direct["count"]
    back = post(gw.url, "/detokenize", {"model": EXT, "tokens": direct["tokens"][1:]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT} and back.headers["x-baton-pool"] == "ext"
    assert count(gw.url, "baton_pool_requests_total", pool="ext", outcome="ok") == before + 4
    refused = post(gw.url, "/tokenize", {"model": EXT, "prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert refused.status_code == 400 and refused.json()["error"]["message"]  # the engine's refusal, passed on
    # the own model, named or not, is the gateway's: no pool header, its own tokenizer
    for body in ({"model": "baton-tiny", "prompt": PROMPT}, {"prompt": PROMPT}):
        own = post(gw.url, "/tokenize", body)
        assert own.status_code == 200 and "x-baton-pool" not in own.headers
        assert own.json()["max_model_len"] == gw.engine.max_model_len
    missing = post(gw.url, "/tokenize", {"model": "nope", "prompt": PROMPT})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(gw.url + "/v1/models/chat").json() == {"id": "chat", "object": "model", "created": 0,
                                                           "owned_by": "ext"}  # fmt: skip


def test_a_llama_cpp_pool_is_asked_in_its_own_shapes(
    llama: LlamaServerShapes, make_gateway: Callable[..., ServerHandle], tiny_model_dir: Path
) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    gw = make_gateway([pool("llama", [llama.url], kind="llama.cpp")])
    got = post(gw.url, "/tokenize", {"model": EXT, "prompt": PROMPT})
    assert got.status_code == 200, got.text
    ids = tok.encode(PROMPT, True)
    assert got.json() == {"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": None}
    assert llama.seen[-1] == {"content": PROMPT, "add_special": True, "with_pieces": False}  # vLLM's default, said
    bare = post(gw.url, "/tokenize", {"model": EXT, "prompt": PROMPT, "add_special_tokens": False,
                                      "return_token_strs": True}).json()  # fmt: skip
    assert bare["tokens"] == ids[1:] and "".join(bare["token_strs"]) == PROMPT
    back = post(gw.url, "/detokenize", {"model": EXT, "tokens": ids[1:]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    chat = post(gw.url, "/tokenize", {"model": EXT, "messages": [{"role": "user", "content": PROMPT}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert "llama.cpp" in chat.json()["error"]["message"]
    llama.garbled = True
    odd = post(gw.url, "/tokenize", {"model": EXT, "prompt": PROMPT})
    assert odd.status_code == 503 and "shape" in odd.json()["error"]["message"]
    llama.garbled, llama.broken = False, True
    cut = post(gw.url, "/tokenize", {"model": EXT, "prompt": PROMPT})
    assert cut.status_code == 503 and "broke off" in cut.json()["error"]["message"], cut.text
    assert count(gw.url, "baton_pool_requests_total", pool="llama", outcome="broken") == 1


def test_a_pool_of_another_kind_is_asked_before_a_llama_cpp_one(
    llama: LlamaServerShapes, upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    gw = make_gateway([pool("llama", [llama.url], kind="llama.cpp"), pool("ext", [upstreams[0].url])])
    got = post(gw.url, "/tokenize", {"model": EXT, "messages": [{"role": "user", "content": PROMPT}]})
    assert got.status_code == 200 and got.headers["x-baton-pool"] == "ext" and not llama.seen


def test_grpc_tokenize_and_detokenize_ask_the_models_pool(
    llama: LlamaServerShapes, upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    import grpc

    from batonpb.baton.v1 import generation_pb2 as pb
    from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc

    port = free_port()
    gw = make_gateway([pool("ext", [upstreams[0].url]), pool("llama", [llama.url], kind="llama.cpp", models=("small",))],
                      grpc_port=port)  # fmt: skip
    direct = post(upstreams[0].url, "/tokenize", {"model": EXT, "prompt": PROMPT}).json()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        ext = stub.Tokenize(pb.TokenizeRequest(model=EXT, text=PROMPT), timeout=30)
        small = stub.Tokenize(pb.TokenizeRequest(model="small", text=PROMPT, add_special_tokens=False), timeout=30)
        own = stub.Tokenize(pb.TokenizeRequest(model="baton-tiny", text=PROMPT), timeout=30)
        back = stub.Detokenize(pb.DetokenizeRequest(model=EXT, token_ids=direct["tokens"][1:]), timeout=30)
        small_back = stub.Detokenize(pb.DetokenizeRequest(model="small", token_ids=direct["tokens"][1:]), timeout=30)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Tokenize(pb.TokenizeRequest(model="nope", text=PROMPT), timeout=30)
    assert list(ext.token_ids) == direct["tokens"] and ext.max_model_len == direct["max_model_len"]
    assert list(small.token_ids) == direct["tokens"][1:] and small.max_model_len == 0  # llama-server does not say
    assert llama.seen[0] == {"content": PROMPT, "add_special": False, "with_pieces": False}
    assert list(own.token_ids) == direct["tokens"] and own.max_model_len == gw.engine.max_model_len
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # an answer broken off part-way
        with pytest.raises(grpc.RpcError) as cut:
            pb_grpc.GenerationServiceStub(channel).Complete(
                pb.CompleteRequest(model="small", text=PROMPT, sampling=pb.Sampling(max_tokens=2)), timeout=30)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "broke off" in (cut.value.details() or "")
    assert count(gw.url, "baton_pool_requests_total", pool="llama", outcome="broken") == 1
    assert back.text == small_back.text == PROMPT and llama.seen[-1] == {"tokens": direct["tokens"][1:]}
