"""`baton up` / `baton serve`: one gateway process serving the OpenAI HTTP API (and gRPC, when
available) in front of one of three engine sides; the edges do not change between them.

    engine (step thread) <- AsyncEngine <- Frontend <- FastAPI on uvicorn (uvloop)
                                                    <- grpc.aio server (same event loop)

    colocated      AsyncEngine: one engine in this process (--prefill 0)
    router         RouterFront: no engine; every model is an external pool's (pools.baton.enabled: false)
    in-process PD  PDFront: a prefill and a decode engine in this process (--prefill 1 --no-ray)
    Ray PD         RayFront: P PrefillActors and D DecodeActors on Ray (--prefill P --decode D);
                   a private loopback Ray, or an existing cluster (`baton serve --ray-address`)

--pin-cores puts each engine on its own core (cluster.fleet.cpu): in this process, each step
thread (prefill first); on Ray, each actor's whole process (prefills first, then decodes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
import uvloop

from cluster.disagg_config import DisaggConfig
from cluster.edge.admission import AdmissionConfig
from cluster.edge.frontend import Frontend
from cluster.edge.http_api import HttpConfig, create_app
from cluster.edge.tenants import ApiKeys
from cluster.fleet.cpu import available_cores, core_for, pin_thread
from cluster.gateway.config import MODEL_NAME, GatewaySpec
from cluster.gateway.router_front import RouterFront
from cluster.gateway.service import Gateway
from cluster.ops.metrics import watch_loop_lag
from cluster.ops.tracing import TracingConfig, configure
from cluster.placement.pair_health import PairCollector
from engine.allocator import tune_allocator
from engine.async_engine import AsyncEngine
from engine.engine_config import EngineConfig
from engine.env import api_keys_file
from engine.errors import ConfigError
from engine.omp import release_thread_pool
from kvcache.tiers import TierConfig

if TYPE_CHECKING:  # the engine side is imported where it is built: a router imports no torch
    from cluster.fleet.front import RayFront
    from cluster.fleet.pd import PDFront
    from cluster.ops.planner import PlannerConfig
    from cluster.ops.planner_loop import Scaler
    from engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    grpc_port: int | None = 50051  # None: no gRPC listener
    api_keys_file: Path | None = None
    request_timeout_s: float = 600.0
    # The names the model is served under, the first the one answers carry (vLLM's
    # --served-model-name NAME [NAME ...]); None: the model directory's name.
    served_model_name: str | tuple[str, ...] | None = None
    prefill_workers: int = 0  # 0: colocated; 1 without `disagg`: a prefill engine beside the decode one
    disagg: DisaggConfig | None = None  # set: prefill and decode workers are Ray actors
    shared_prefix_texts: tuple[str, ...] = ()  # prompts every tenant may share (tokenized at start)
    local_prefill_tokens: int = 32  # in-process PD: decode prefills prompts this short itself
    pin_cores: bool = False  # in-process engines: each step thread on its own core (Ray: disagg.pin_cores)
    planner: PlannerConfig | None = None  # set (Ray only): the gateway resizes its worker pools
    planner_period_s: float = 5.0
    tracing: TracingConfig = field(default_factory=TracingConfig)  # off unless an OTLP endpoint is set
    gateway: GatewaySpec | None = None  # cluster.yaml's pools and routing (external pools: cluster.gateway)


def load_api_keys(path: Path | None) -> ApiKeys:
    """From the config, else the BATON_API_KEYS file; no keys means no auth (loopback default)."""
    raw = path or api_keys_file()
    return ApiKeys.from_file(raw) if raw else ApiKeys({})


@dataclass(slots=True)
class Running:
    """A started server's parts (tests drive these directly)."""

    engine: Engine | None  # the decode (or colocated) engine; None when the engines are actors (or none)
    front: AsyncEngine | PDFront | RayFront | RouterFront
    frontend: Frontend
    http: uvicorn.Server
    grpc: Any | None
    planner: asyncio.Task[Any] | None = None
    loop_lag: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        self.frontend.draining = True
        if self.frontend.gateway is not None:
            await self.frontend.gateway.stop()
        for task in (self.planner, self.loop_lag):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.grpc is not None:
            await self.grpc.stop(grace=2.0)
        await self.front.stop()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        await asyncio.to_thread(self.frontend.tracing.shutdown)  # exports the spans still queued


async def start(cfg: ServerConfig, engine: Engine | None = None) -> Running:
    """Build and start everything but the HTTP accept loop (`running.http.serve()`). With
    `cfg.disagg`, Ray must be up in this process already (`run` starts or connects it)."""
    router_only = cfg.gateway is not None and cfg.gateway.is_router_only
    if router_only and (cfg.disagg is not None or cfg.prefill_workers):
        raise ConfigError("pools.baton.enabled", "a gateway without workers of its own starts none: no "
                          "workers:, ray: or --prefill")  # fmt: skip
    names = () if router_only else served_names(cfg)  # refused before anything starts, as a pool naming another is
    gateway = cfg.gateway.with_own_models(names) if cfg.gateway is not None and cfg.gateway.has_external else None
    front: AsyncEngine | PDFront | RayFront | RouterFront
    ray_front: RayFront | None = None
    if router_only:
        front, engine = RouterFront(), None  # no model, no step thread (cluster.gateway.router_front)
    elif cfg.disagg is not None:
        from cluster.fleet.launch import launch

        front = ray_front = await launch(cfg.engine, cfg.disagg, cfg.shared_prefix_texts)
        engine = None
    else:
        engine, front = await _start_in_process(cfg, engine)
    front.start()
    if cfg.pin_cores and not isinstance(front, RouterFront):  # a router has no step thread to pin
        await _pin_step_threads(front)
    frontend = Frontend(front, names[0] if names else "", cfg.admission, cfg.request_timeout_s,
                        configure(cfg.tracing), names[1:])  # fmt: skip
    if ray_front is not None:
        ray_front.metrics.register(frontend.metrics.registry, ray_front.fleet)
        frontend.metrics.registry.register(PairCollector(ray_front.pairs))
    if gateway is not None:
        frontend.gateway = Gateway(gateway, frontend.metrics.registry, cfg.request_timeout_s)
        await frontend.gateway.start()
    keys = load_api_keys(cfg.api_keys_file)
    app = create_app(frontend, keys, cfg.http)
    grpc_server = await _start_grpc(frontend, keys, cfg)
    http = DrainingServer(
        frontend, cfg.request_timeout_s,
        uvicorn.Config(app, host=cfg.http.host, port=cfg.http.port, loop="none", log_level="warning",
                       lifespan="off", timeout_graceful_shutdown=5,
                       ssl_certfile=cfg.http.tls_certfile, ssl_keyfile=cfg.http.tls_keyfile)
    )
    planner = None
    if cfg.planner is not None and ray_front is None:
        raise ConfigError("planner", "the planner resizes Ray worker pools: run disaggregated on Ray")
    if ray_front is not None:
        from cluster.fleet.scalers import ScaleControl, scaler_for
        from engine.env import kuberay_cluster

        scaler = scaler_for(ray_front.fleet, kuberay_cluster())  # KubeRay in a head pod, else its own Ray actors
        frontend.scaling = ScaleControl(ray_front.fleet, scaler, planner_owns=cfg.planner is not None)
        if cfg.planner is not None:
            planner = asyncio.create_task(_plan(cfg.planner, cfg.planner_period_s, frontend, scaler),
                                          name="baton-planner")  # fmt: skip
    loop_lag = asyncio.create_task(watch_loop_lag(frontend.metrics), name="baton-loop-lag")
    return Running(engine, front, frontend, http, grpc_server, planner, loop_lag)


async def _plan(cfg: PlannerConfig, period_s: float, frontend: Frontend, scaler: Scaler) -> None:
    from cluster.ops.planner import Planner
    from cluster.ops.planner_loop import LatencyWindow, run, sample_from

    window = LatencyWindow(frontend.metrics)
    await run(Planner(cfg), scaler, lambda: sample_from(frontend, window), period_s, asyncio.Event())


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first (DESIGN: the gateway does for its connections
    what a worker's drain does): not-ready, new requests refused with 503 + Retry-After, the
    ones in flight (streams included, and calls to external pools: Frontend.num_inflight)
    finish, at most `drain_timeout_s`; then the usual
    shutdown, and the process exits 0. A second SIGTERM, or SIGINT, exits at once."""

    def __init__(self, frontend: Frontend, drain_timeout_s: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig != signal.SIGTERM or self._drain is not None:
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_running_loop()
        self._drain = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        self.frontend.draining = True
        end = time.monotonic() + self.drain_timeout_s
        logger.warning("SIGTERM: draining %d requests in flight", self.frontend.num_inflight)
        while self.frontend.num_inflight and time.monotonic() < end:  # external pools' calls too
            await asyncio.sleep(0.05)
        logger.warning("drained: %d requests left; shutting down", self.frontend.num_inflight)
        self.should_exit = True


def _build_engine(cfg: EngineConfig) -> Engine:
    """An engine built on a worker thread, which then lets its OpenMP workers go: the step
    thread's pool must be the only one for its workers to spin (engine.omp)."""
    from engine.engine import Engine

    engine = Engine(cfg)
    release_thread_pool()
    return engine


async def _start_in_process(cfg: ServerConfig, engine: Engine | None) -> tuple[Engine, AsyncEngine | PDFront]:
    if engine is None:
        engine = await asyncio.to_thread(_build_engine, cfg.engine)
    engine.shared_prefixes += tuple(tuple(engine.tokenizer.encode(t)) for t in cfg.shared_prefix_texts)
    decode = AsyncEngine(engine)
    front: AsyncEngine | PDFront = decode
    if cfg.prefill_workers:
        # Disaggregated in one process: the prefill role gets its own engine (its own pool and
        # prefix cache); the Ray deployment puts each role in its own actor instead.
        prefill = await asyncio.to_thread(_build_engine, replace(cfg.engine, tiers=TierConfig()))
        prefill.shared_prefixes = engine.shared_prefixes
        from cluster.fleet.pd import PDFront

        front = PDFront(AsyncEngine(prefill), decode, cfg.local_prefill_tokens)
    return engine, front


async def _pin_step_threads(front: AsyncEngine | PDFront | RayFront) -> None:
    """--pin-cores in one process: each engine's step thread (the one thread that runs torch,
    on one torch thread) on its own core, prefill first; the edge (HTTP, gRPC, detokenizing)
    runs anywhere. Ray actors pin themselves (cluster.fleet.launch)."""
    from cluster.fleet.pd import PDFront

    if isinstance(front, PDFront):
        steppers = [front.prefill, front.decode]
    elif isinstance(front, AsyncEngine):
        steppers = [front]
    else:
        return
    cores = available_cores()
    for slot, stepper in enumerate(steppers):
        core = core_for(slot, cores)
        await stepper.call(functools.partial(_pin_step_thread, core=core))
        logger.info("engine step thread %d pinned to core %d", slot, core)


def _pin_step_thread(_engine: Engine, core: int) -> int:
    return pin_thread(core)  # runs on the step thread (AsyncEngine.call)


async def serve(cfg: ServerConfig) -> None:
    running = await start(cfg)
    gateway = running.frontend.gateway
    name = running.frontend.model_name or (gateway.spec.pools[0].models[0] if gateway is not None else "")
    _announce(cfg, name, bool(cfg.api_keys_file or api_keys_file()), running.grpc is not None)
    try:
        await running.http.serve()
    finally:
        # Ctrl-C reaches us as a cancellation (asyncio.Runner's SIGINT handler, re-raised by
        # uvicorn after its own shutdown): the stop still runs to its end, so the engine's disk
        # tier is flushed and the actors release what outlives them (/dev/shm regions). A second
        # Ctrl-C interrupts at once.
        stopping = asyncio.ensure_future(running.stop())
        while not stopping.done():
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                continue


async def _start_grpc(frontend: Frontend, keys: ApiKeys, cfg: ServerConfig) -> Any | None:
    if cfg.grpc_port is None:
        return None
    try:
        from cluster.edge.grpc_server import GrpcConfig, create_grpc_server
    except ImportError as exc:  # the gRPC extra is not installed
        logger.warning("gRPC disabled: %s", exc)
        return None
    grpc_cfg = GrpcConfig(host=cfg.http.host, port=cfg.grpc_port, tls_cert_file=cfg.http.tls_certfile,
                          tls_key_file=cfg.http.tls_keyfile, allow_priority_field=cfg.http.allow_priority_field)
    server = create_grpc_server(frontend, keys, grpc_cfg)
    await server.start()
    return server


MAX_SERVED_NAMES = 16


def served_names(cfg: ServerConfig) -> tuple[str, ...]:
    """The names clients call the model by, the first the one answers carry; ConfigError
    (model.served_name) for one a client could not send or two the same."""
    given = cfg.served_model_name
    names = (given,) if isinstance(given, str) else tuple(given or ()) or (Path(cfg.engine.model).name,)
    if len(names) > MAX_SERVED_NAMES:
        raise ConfigError("model.served_name", f"at most {MAX_SERVED_NAMES} names")
    if len(set(names)) != len(names):
        raise ConfigError("model.served_name", "each name once")
    for name in names:
        if not MODEL_NAME.fullmatch(name):
            raise ConfigError("model.served_name", f"{name[:64]!r}: 1 to 256 characters, no spaces or control "
                              "characters")  # fmt: skip
    return names


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
    # Before any thread has a malloc arena of its own: the step thread then shares the main
    # heap, which keeps a step's activations (engine.allocator; Engine's own call is too late
    # for threads that allocated before it).
    tune_allocator()
    if cfg.disagg is None:
        uvloop.run(serve(cfg))
        return 0
    from cluster.fleet import ray_runtime  # before anything imports `ray`

    # Ray first, outside the event loop: its init blocks for seconds and wants the main thread.
    address = cfg.disagg.ray_address
    info = ray_runtime.connect(address) if address else ray_runtime.start_local()
    try:
        uvloop.run(serve(cfg))
    finally:
        ray_runtime.shutdown()  # stops a local Ray; detaches from a connected one
        logger.info("Ray %s %s", info.gcs_address, "stopped" if info.is_local else "detached")
    return 0
