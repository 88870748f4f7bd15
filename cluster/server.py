"""`baton up`: one process serving the OpenAI HTTP API (and gRPC, when available) over one
colocated engine. The disaggregated Ray deployment replaces the engine behind the same
Frontend later; the edges do not change.

    engine (step thread) <- AsyncEngine <- Frontend <- FastAPI on uvicorn (uvloop)
                                                    <- grpc.aio server (same event loop)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from cluster.admission import AdmissionConfig
from cluster.frontend import Frontend
from cluster.http_api import HttpConfig, create_app
from cluster.pd import PDFront
from cluster.tenants import ApiKeys
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_config import EngineConfig
from kvcache.tiers import TierConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    grpc_port: int | None = 50051  # None: no gRPC listener
    api_keys_file: Path | None = None
    request_timeout_s: float = 600.0
    served_model_name: str | None = None
    prefill_workers: int = 0  # 0: colocated; 1: a prefill engine beside the decode one (in-process)
    shared_prefix_texts: tuple[str, ...] = ()  # prompts every tenant may share (tokenized at start)


def load_api_keys(path: Path | None) -> ApiKeys:
    """From the config, else the BATON_API_KEYS file; no keys means no auth (loopback default)."""
    raw = path or (Path(os.environ["BATON_API_KEYS"]) if os.environ.get("BATON_API_KEYS") else None)
    return ApiKeys.from_file(raw) if raw else ApiKeys({})


@dataclass(slots=True)
class Running:
    """A started server's parts (tests drive these directly)."""

    engine: Engine  # the decode (or colocated) engine
    front: AsyncEngine | PDFront
    frontend: Frontend
    http: uvicorn.Server
    grpc: Any | None

    async def stop(self) -> None:
        self.frontend.draining = True
        if self.grpc is not None:
            await self.grpc.stop(grace=2.0)
        await self.front.stop()
        await asyncio.to_thread(self.engine.close)


async def start(cfg: ServerConfig, engine: Engine | None = None) -> Running:
    """Build and start everything but the HTTP accept loop (`running.http.serve()`)."""
    if engine is None:
        engine = await asyncio.to_thread(Engine, cfg.engine)
    engine.shared_prefixes += tuple(tuple(engine.tokenizer.encode(t)) for t in cfg.shared_prefix_texts)
    decode = AsyncEngine(engine)
    front: AsyncEngine | PDFront = decode
    if cfg.prefill_workers:
        # Disaggregated in one process: the prefill role gets its own engine (its own pool and
        # prefix cache); the Ray deployment puts each role in its own actor instead.
        prefill = await asyncio.to_thread(Engine, replace(cfg.engine, tiers=TierConfig()))
        prefill.shared_prefixes = engine.shared_prefixes
        front = PDFront(AsyncEngine(prefill), decode)
    front.start()
    name = cfg.served_model_name or Path(cfg.engine.model).name
    frontend = Frontend(front, name, cfg.admission, cfg.request_timeout_s)
    keys = load_api_keys(cfg.api_keys_file)
    app = create_app(frontend, keys, cfg.http)
    grpc_server = await _start_grpc(frontend, keys, cfg)
    http = uvicorn.Server(
        uvicorn.Config(app, host=cfg.http.host, port=cfg.http.port, loop="none", log_level="warning",
                       lifespan="off", timeout_graceful_shutdown=5,
                       ssl_certfile=cfg.http.tls_certfile, ssl_keyfile=cfg.http.tls_keyfile)
    )
    return Running(engine, front, frontend, http, grpc_server)


async def serve(cfg: ServerConfig) -> None:
    running = await start(cfg)
    _announce(cfg, running.frontend.model_name, bool(cfg.api_keys_file or os.environ.get("BATON_API_KEYS")),
              running.grpc is not None)
    try:
        await running.http.serve()
    finally:
        await running.stop()


async def _start_grpc(frontend: Frontend, keys: ApiKeys, cfg: ServerConfig) -> Any | None:
    if cfg.grpc_port is None:
        return None
    try:
        from cluster.grpc_api import GrpcConfig, create_grpc_server
    except ImportError as exc:  # the gRPC extra is not installed
        logger.warning("gRPC disabled: %s", exc)
        return None
    grpc_cfg = GrpcConfig(host=cfg.http.host, port=cfg.grpc_port, tls_cert_file=cfg.http.tls_certfile,
                          tls_key_file=cfg.http.tls_keyfile, allow_priority_field=cfg.http.allow_priority_field)
    server = create_grpc_server(frontend, keys, grpc_cfg)
    await server.start()
    return server


def _announce(cfg: ServerConfig, name: str, auth: bool, grpc_on: bool) -> None:
    scheme = "https" if cfg.http.tls_certfile else "http"
    url = f"{scheme}://{cfg.http.host}:{cfg.http.port}"
    key = ' -H "Authorization: Bearer $KEY"' if auth else ""
    lines = [
        f"baton is serving {name} on {url}" + (f" (gRPC on {cfg.http.host}:{cfg.grpc_port})" if grpc_on else ""),
        "try:",
        f"  curl -s {url}/v1/completions{key} -H 'Content-Type: application/json' \\",
        f"       -d '{{\"model\": \"{name}\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}}'",
        f"  curl -sN {url}/v1/chat/completions{key} -H 'Content-Type: application/json' \\",
        f"       -d '{{\"model\": \"{name}\", \"stream\": true, \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'",
        f"  curl -s {url}/metrics | grep baton_",
        "Ctrl-C stops it.",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def run(cfg: ServerConfig) -> int:
    uvloop.run(serve(cfg))
    return 0
