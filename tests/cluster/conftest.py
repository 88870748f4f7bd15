"""A real baton server (uvicorn + the real engine) on 127.0.0.1, run on its own thread and
event loop, so tests can talk HTTP to it and still inspect the engine's pages."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop

from bench.server_proc import free_port
from cluster.fleet import ray_runtime  # sets Ray's environment before any test module imports `ray`
from cluster.server import Running, ServerConfig, start
from engine.engine import Engine
from engine.engine_config import EngineConfig


@dataclass
class ServerHandle:
    url: str
    running: Running
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def engine(self) -> Engine:
        assert self.running.engine is not None, "this server's engines are Ray actors"
        return self.running.engine

    def pages_free(self) -> bool:
        # Free, or held only by the prefix cache (reusable on demand): no request holds any.
        return self.engine.free_pages_at_idle() == self.engine.pool.num_pages

    def wait_idle(self, timeout_s: float = 2.0) -> bool:
        """True once no request is in the engine and every page is free (bounded wait)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.engine.has_unfinished() and self.pages_free():
                return True
            time.sleep(0.01)
        return False

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def stop(self) -> None:
        self.running.http.should_exit = True
        self.thread.join(timeout=15)


def start_server(cfg: ServerConfig, engine: Engine | None) -> ServerHandle:
    port = free_port()
    cfg = replace(cfg, http=replace(cfg.http, port=port))
    loop = uvloop.new_event_loop()
    box: dict[str, Running] = {}
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)

        async def go() -> None:
            running = await start(cfg, engine)
            box["running"] = running
            serving = asyncio.ensure_future(running.http.serve())
            while not running.http.started and not serving.done():
                await asyncio.sleep(0.01)
            started.set()
            try:
                await serving
            finally:
                await running.stop()

        try:
            loop.run_until_complete(go())
        except BaseException as exc:  # a failed start fails the test at once, not at the timeout
            failed.append(exc)
            started.set()

    failed: list[BaseException] = []
    thread = threading.Thread(target=main, name="baton-test-server", daemon=True)
    thread.start()
    if not started.wait(120) or failed:
        raise RuntimeError("test server did not start") from (failed[0] if failed else None)
    return ServerHandle(f"http://127.0.0.1:{port}", box["running"], loop, thread)


_ray: list[ray_runtime.RayInfo] = []  # the running local Ray, if any
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_cluster() -> ray_runtime.RayInfo:
    """One private loopback Ray shared by the cluster and fault tests that need actors (its
    start costs seconds); each test stops the actors it started. It is stopped when the run
    leaves those suites, so the ones after them do not share the machine with an idle Ray."""
    pytest.importorskip("ray")
    if not _ray:
        info = ray_runtime.start_local()
        assert info.node_ip == ray_runtime.LOOPBACK
        _ray.append(info)
    return _ray[0]


RAY_SUITES = (HERE, HERE.parent / "faults")  # run one after the other (tests/conftest.py orders them)


def stop_ray_when_leaving(nextitem: pytest.Item | None) -> None:
    if _ray and (nextitem is None or not any(suite in nextitem.path.parents for suite in RAY_SUITES)):
        ray_runtime.shutdown()
        _ray.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the item's fixtures (servers, actors) are torn down first
    stop_ray_when_leaving(nextitem)


def kill_actor(actor: Any, timeout_s: float = 30.0) -> None:
    """ray.kill, then prove the actor is dead: ray.kill only asks, and a call made right after
    it may still be served, so call until Ray answers RayActorError (bounded)."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{actor} still answers {timeout_s} s after ray.kill")


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512, num_pages=256)


def _server_factory(tiny_engine_config: EngineConfig) -> Iterator[Callable[..., ServerHandle]]:
    handles: list[ServerHandle] = []

    def make(**overrides: Any) -> ServerHandle:
        engine_cfg = overrides.pop("engine", tiny_engine_config)
        cfg = replace(ServerConfig(engine=engine_cfg, grpc_port=None, served_model_name="baton-tiny"), **overrides)
        handle = start_server(cfg, Engine(engine_cfg))
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        handle.stop()


@pytest.fixture
def make_server(tiny_engine_config: EngineConfig) -> Iterator[Callable[..., ServerHandle]]:
    """Start servers with config overrides; each gets its own engine; they stop when the test
    ends (a server left running holds an engine, threads and sockets for the rest of the run)."""
    yield from _server_factory(tiny_engine_config)


@pytest.fixture(scope="module")
def make_module_server(tiny_engine_config: EngineConfig) -> Iterator[Callable[..., ServerHandle]]:
    """make_server for module-scoped fixtures: these servers stop when the module's tests end."""
    yield from _server_factory(tiny_engine_config)


@pytest.fixture(scope="session")
def make_shared_server(tiny_engine_config: EngineConfig) -> Iterator[Callable[..., ServerHandle]]:
    """make_server for session-scoped fixtures (the shared `server`): they stop at session end."""
    yield from _server_factory(tiny_engine_config)


@pytest.fixture(scope="session")
def server(make_shared_server: Callable[..., ServerHandle]) -> ServerHandle:
    """The shared default server: no keys, default admission."""
    return make_shared_server()


async def all_pages_free(engine: Engine) -> bool:
    """Every page back and nothing running, within ~3 s (an abort lands on the step thread's next
    turn: this waits for that end state, never for a transient one)."""
    for _ in range(150):  # an abort lands on the step thread's next turn
        if engine.free_pages_at_idle() == engine.pool.num_pages and not engine.has_unfinished():
            return True
        await asyncio.sleep(0.02)
    return False
