"""/tokenize and /detokenize for a model of an external pool: each engine tokenizes with its own
tokenizer, so the call goes to an endpoint of a pool serving the model (the own pool answers
its own models itself, cluster.edge.tokenize_api).

    kinds vllm, sglang, openai-compatible   the body as it came (its model renamed where the
                                            pool's upstream_models says); the answer passed on
    kind llama.cpp                          vLLM's shapes translated to llama-server's and back:
        /tokenize {"prompt", "add_special_tokens" (true), "return_token_strs"}
              <-> {"content", "add_special", "with_pieces"} -> {"tokens": [id | {"id", "piece"}]}
              -> {"count", "max_model_len": null, "tokens", "token_strs"}
        /detokenize {"tokens"} <-> {"tokens"} -> {"content"} -> {"prompt"}
        chat `messages` are refused (400): llama-server tokenizes text only

A pool serving the model in another kind is preferred to a llama.cpp one. The call counts in
its pool's concurrency and `baton_pool_requests_total` like any other; a connection failure is
retried once on another endpoint, as generation calls are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.errors import EdgeError, Kind, invalid
from cluster.gateway.endpoints import Endpoint, Pool
from cluster.gateway.proxy import Upstreams
from cluster.gateway.router import Route, Router

PATHS = ("/tokenize", "/detokenize")
LLAMA_CPP = "llama.cpp"
MAX_ANSWER_BYTES = 64 << 20  # a tokenized 4M-character prompt, as JSON, with room


@dataclass(frozen=True, slots=True)
class Answer:
    """What goes back to the client: a status, a JSON body and the pool that answered."""

    status: int
    body: bytes
    pool: str


def external_pool(router: Router, model: str) -> Pool | None:
    """The pool that tokenizes for `model`, or None when the own pool serves it (or none does)."""
    pools = router.serving(model)
    if not pools or any(p.spec.is_own for p in pools):
        return None
    return min(pools, key=lambda p: p.spec.kind == LLAMA_CPP)  # first of the others, else llama.cpp


async def forward(
    upstreams: Upstreams, router: Router, pool: Pool, path: str, body: dict[str, Any], model: str,
    incoming: Mapping[str, str],
) -> Answer:
    """The pool's answer to one tokenizer call (EdgeError when it cannot be asked)."""
    llama = pool.spec.kind == LLAMA_CPP
    sent = _to_llama(path, body, pool.name) if llama else {**body, "model": pool.spec.upstream_model(model)}

    def route_for(tried: Sequence[Endpoint]) -> Route:
        return router.admit(model, "", (), exclude=tried, only_pool=pool.name)  # no overlap sample: not a prompt

    data = json.dumps(sent, ensure_ascii=False, separators=(",", ":")).encode()
    attempt = await upstreams.send(route_for, path, data, incoming, stream=False)
    outcome = "cancelled"
    try:
        raw = await upstreams.read_body(attempt, MAX_ANSWER_BYTES)
        outcome = "ok"
    except EdgeError:
        outcome = "broken"
        raise
    finally:
        upstreams.finish(attempt, outcome)
    status = attempt.response.status
    if llama and status == 200:
        raw = _from_llama(path, raw, pool.name)
    return Answer(status, raw, pool.name)


def _to_llama(path: str, body: dict[str, Any], pool: str) -> dict[str, Any]:
    if path == "/detokenize":
        return {"tokens": body.get("tokens")}
    if body.get("messages") is not None:
        raise invalid(f"messages: pool {pool!r} (llama.cpp) tokenizes a text prompt only", "messages")
    special = body.get("add_special_tokens")
    return {"content": body.get("prompt"), "add_special": True if special is None else special,
            "with_pieces": body.get("return_token_strs") is True}  # fmt: skip


def _from_llama(path: str, raw: bytes, pool: str) -> bytes:
    try:
        answer = json.loads(raw)
        if path == "/detokenize":
            out: dict[str, Any] = {"prompt": str(answer["content"])}
        else:
            items = answer["tokens"]
            pieces = bool(items) and isinstance(items[0], dict)
            ids = [int(t["id"]) if pieces else int(t) for t in items]
            strs = [_piece(t["piece"]) for t in items] if pieces else None
            out = {"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": strs}
    except (ValueError, TypeError, KeyError) as exc:
        raise EdgeError(Kind.UNAVAILABLE, f"pool {pool!r} answered {path} in a shape llama.cpp's is not: {exc}") from None
    return json.dumps(out, ensure_ascii=False).encode()


def _piece(piece: object) -> str:
    """llama-server gives a piece that is not whole UTF-8 as its bytes (a list of ints)."""
    if isinstance(piece, list):
        return bytes(int(b) for b in piece).decode("utf-8", "replace")
    return str(piece)
