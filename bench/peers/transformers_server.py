"""The serial floor of the peer comparison: an OpenAI-compatible server that runs a Hugging Face
model directory with plain `transformers`, in float32, ONE REQUEST AT A TIME (a global lock
around generation), greedy only.

Start:  python -m bench.peers.transformers_server --model DIR --served-model-name NAME \\
            --host 127.0.0.1 --port 8000 [--threads 4]
It prints one JSON line ({"pid", "url", "versions"}) once it listens; stop it by that PID:
`kill PID` (SIGTERM; SIGINT works too).

Endpoints: GET /v1/models, GET /health, POST /v1/completions (prompt: a string or token ids;
max_tokens, temperature 0 only, stream, stream_options.include_usage, ignore_eos, min_tokens).
Each token is one forward pass with the KV cache, run in a worker thread so the event loop
stays responsive; a client that disconnects mid-stream stops its generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import torch
import transformers
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model: str
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class Generator:
    """Greedy decoding with the KV cache; `lock` makes it one request at a time."""

    def __init__(self, model_dir: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, use_safetensors=True
        ).eval()
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.vocab_size = int(self.model.config.vocab_size)
        self.lock = asyncio.Lock()

    def _step(self, input_ids: list[int], past: Any, ban_eos: bool) -> tuple[int, Any]:
        """One forward pass (blocking): the greedy next token and the grown cache."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([input_ids]), past_key_values=past, use_cache=True)
            logits = out.logits[0, -1]
            if ban_eos and self.eos_ids:
                logits[self.eos_ids] = float("-inf")
            return int(logits.argmax()), out.past_key_values

    async def tokens(self, prompt_ids: list[int], req: CompletionRequest) -> AsyncGenerator[tuple[int, str | None]]:
        """(token, finish_reason) per generated token; finish_reason is set on the last."""
        async with self.lock:
            past: Any = None
            next_input = prompt_ids
            for i in range(req.max_tokens):
                ban_eos = not req.ignore_eos and i < req.min_tokens
                token, past = await asyncio.to_thread(self._step, next_input, past, ban_eos)
                if not req.ignore_eos and token in self.eos_ids:
                    yield token, "stop"
                    return
                yield token, "length" if i + 1 == req.max_tokens else None
                next_input = [token]


class Detokenizer:
    """Incremental text: each token's text is what it adds to the decoded whole, so the
    pieces concatenate to `tokenizer.decode(ids)` (an incomplete UTF-8 character waits)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] was decoded last; ids[read:] is new

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return str(after[len(before) :])


def create_app(gen: Generator, served_name: str) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, str(first.get("msg", "invalid request")), param)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_name, "object": "model", "created": 0, "owned_by": "transformers"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        if req.model != served_name:
            return error(404, f"The model `{req.model}` does not exist.", "model")
        if req.temperature != 0:
            return error(400, "only greedy decoding (temperature 0) is supported", "temperature")
        if isinstance(req.prompt, str):
            prompt_ids = list(gen.tokenizer(req.prompt)["input_ids"])
        elif all(0 <= t < gen.vocab_size for t in req.prompt):
            prompt_ids = req.prompt
        else:
            return error(400, f"prompt token ids must be in [0, {gen.vocab_size})", "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": served_name}

        def usage(n: int) -> dict[str, int]:
            p = len(prompt_ids)
            return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

        if not req.stream:
            ids: list[int] = []
            finish: str | None = None
            async for token, reason in gen.tokens(prompt_ids, req):
                ids.append(token)
                finish = reason
            text = gen.tokenizer.decode(ids, skip_special_tokens=True)
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return JSONResponse({**head, "choices": [choice], "usage": usage(len(ids))})

        async def events() -> AsyncIterator[str]:
            detok, n = Detokenizer(gen.tokenizer), 0
            tokens = gen.tokens(prompt_ids, req)
            try:
                async for token, finish in tokens:
                    n += 1
                    choice = {"index": 0, "text": detok.add(token), "logprobs": None, "finish_reason": finish}
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                    if finish is None and await request.is_disconnected():
                        return
            finally:
                await tokens.aclose()  # releases the lock even when the client went away
            if req.stream_options is not None and req.stream_options.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(n)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (safetensors)")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    app = create_app(Generator(args.model), args.served_model_name)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            versions = {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__}  # fmt: skip
            line = {"pid": os.getpid(), "url": f"http://{args.host}:{args.port}", "versions": versions}
            print(json.dumps(line), flush=True)
        await task  # uvicorn handles SIGTERM and SIGINT: a graceful shutdown

    asyncio.run(serve())


if __name__ == "__main__":
    main()
