"""The tokenizer routes, in vLLM's shapes (what a RAG pipeline calls to budget a context before
it generates), and OpenAI's model lookup. Behind the guard as the generation routes are (an API
key when keys are set; the body bounded).

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"? (true), "return_token_strs"?}
                      {"model"?, "messages", "add_generation_prompt"? (true), "tools"?,
                       "add_special_tokens"? (false), "return_token_strs"?}
                        -> {"count", "max_model_len", "tokens", "token_strs"}
                      the ids /v1/completions or /v1/chat/completions computes for the same
                      prompt or messages (the chat template rendered the same way)
    POST /detokenize  {"model"?, "tokens"} -> {"prompt"}   (special tokens kept, as vLLM's)
    GET /v1/models/{model}   the model's card, as in /v1/models (404 when no pool serves it)

"model" absent: the served model. On a gateway, a model of an external pool is answered by an
endpoint of that pool (cluster.gateway.tokenize_proxy) before these routes see the call.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from fastapi import FastAPI

from cluster.edge.frontend import Frontend
from cluster.edge.openai_output import checked_tools, template_messages
from cluster.edge.openai_schema import DetokenizeBody, TokenizeBody
from cluster.errors import EdgeError, Kind, invalid

_BIG_TEXT_CHARS = 20_000  # tokenized (or rendered) off the event loop beyond this

P = ParamSpec("P")
R = TypeVar("R")


def add_tokenize_routes(app: FastAPI, frontend: Frontend, cards: Callable[[], list[dict[str, Any]]]) -> None:
    """`cards`: /v1/models' list (the gateway's pools' models included)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        _check_model(frontend, body.model)
        tokens = await tokenize_body(frontend, body)
        return {"count": len(tokens), "max_model_len": frontend.max_model_len, "tokens": tokens,
                "token_strs": frontend.tokenizer.token_strs(tokens) if body.return_token_strs else None}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        _check_model(frontend, body.model)
        vocab = frontend.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise invalid(f"tokens: token ids must be in [0, {vocab})", "tokens")
        # about 4 characters a token: a long list is decoded off the loop, as a long text is encoded
        text = await off_loop(4 * len(body.tokens), frontend.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}

    @app.get("/v1/models/{model:path}")  # a model name may hold "/" (org/name), as Hugging Face's do
    async def model_card(model: str) -> dict[str, Any]:
        for card in cards():
            if card["id"] == model:
                return card
        raise EdgeError(Kind.NOT_FOUND, f"model {model!r} does not exist", "model")


async def tokenize_body(frontend: Frontend, body: TokenizeBody) -> list[int]:
    """The ids the generation routes compute for the body's prompt or messages."""
    tok = frontend.tokenizer
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return await off_loop(len(body.prompt), tok.encode, body.prompt, special)
    tools = [t.template_value() for t in checked_tools(body.tools)] if body.tools else None
    render = functools.partial(tok.apply_chat_template, tools=tools) if tools else tok.apply_chat_template
    size = sum(len(m.text()) for m in body.messages or ())
    text = await off_loop(size, render, template_messages(body), body.add_generation_prompt)
    return await off_loop(len(text), tok.encode, text, bool(body.add_special_tokens))


def _check_model(frontend: Frontend, model: str | None) -> None:
    if model is None and not frontend.model_names:  # a router (cluster.gateway.router_front)
        raise EdgeError(Kind.NOT_FOUND, "this gateway serves no model of its own: name one of /v1/models", "model")
    if model is not None and model not in frontend.model_names:
        raise EdgeError(Kind.NOT_FOUND, f"model {model!r} does not exist", "model")


async def off_loop(size: int, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """fn inline when its input (`size` characters) is small, on a thread when it would stall the
    loop; both edges tokenize and render through it."""
    if size > _BIG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
