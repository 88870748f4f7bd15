"""The fault suite (issue 8): real Ray actors, real processes, real faults.

Each test injects one fault and first proves it took effect -- the process is stopped (its
/proc state), the actor is dead (Ray says so), the engine raised -- before it asserts the
outcome: every stream completes with the no-fault reference's tokens, pages return to
their baseline, the worker comes back.

`recovering` is a gateway over one prefill and two decode actors with short clocks: a 1.5 s
watchdog, 2 s membership leases, two restarts per actor. The local Ray is the one
tests/cluster started (this suite runs right after it: tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai
import pytest

from cluster.disagg_config import DisaggConfig, MembershipConfig
from cluster.fleet.front import RayFront
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import (
    ServerHandle,
    make_server,
    make_shared_server,
    ray_cluster,
    server,
    start_server,
    stop_ray_when_leaving,
    tiny_engine_config,
)

__all__ = ["make_server", "make_shared_server", "ray_cluster", "server", "tiny_engine_config"]  # fixtures, re-exported

T = TypeVar("T")
MODEL = "baton-tiny"
WATCHDOG_S = 1.5
LEASE_TTL_S = 2
RECOVERING = DisaggConfig(num_prefill=1, num_decode=2, transport="grpc", watchdog_s=WATCHDOG_S, max_restarts=2,
                          poll_wait_s=0.5, membership=MembershipConfig(lease_ttl_s=LEASE_TTL_S))  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    stop_ray_when_leaving(nextitem)


def disaggregated(engine: EngineConfig, disagg: DisaggConfig) -> Iterator[ServerHandle]:
    """A gateway over Ray actors as `disagg` says, for a module-scoped fixture to yield from."""
    handle = start_server(ServerConfig(engine=engine, grpc_port=None, served_model_name=MODEL, disagg=disagg), None)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def recovering(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    yield from disaggregated(tiny_engine_config, RECOVERING)


def front_of(handle: ServerHandle) -> RayFront:
    front = handle.running.front
    assert isinstance(front, RayFront)
    return front


def on_loop(handle: ServerHandle, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    return asyncio.run_coroutine_threadsafe(coro, handle.loop).result(timeout_s)


def wait_for(check: Callable[[], object], what: str | Callable[[], str], timeout_s: float = 30.0) -> None:
    """Until check(); else fail with `what` (a callable: the message as things are at the end)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what() if callable(what) else what}"
        time.sleep(0.02)


def prompts(n: int, tag: str, scale: int = 1) -> list[str]:
    return [f"# {tag} {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i % 3) * scale for i in range(n)]


def reference(server: ServerHandle, texts: list[str], max_tokens: int) -> list[str]:
    """What a colocated engine writes at temperature 0: the no-fault output."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    return [client.completions.create(model=MODEL, prompt=t, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for t in texts]  # fmt: skip


@dataclass
class Streams:
    """Streaming completions through the gateway, one thread each; `started` passes once every
    stream has its first token, so a fault injected then lands mid-stream."""

    handle: ServerHandle
    texts: list[str]
    max_tokens: int
    got: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.got = [""] * len(self.texts)
        self.started = threading.Barrier(len(self.texts) + 1, timeout=60)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(self.texts))]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        client = openai.OpenAI(base_url=self.handle.url + "/v1", api_key="x", timeout=90, max_retries=0)
        try:
            chunks = iter(client.completions.create(model=MODEL, prompt=self.texts[i], max_tokens=self.max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
            self.got[i] += next(chunks).choices[0].text
            self.started.wait()
            for chunk in chunks:
                self.got[i] += chunk.choices[0].text
        except Exception as exc:
            self.errors.append(repr(exc))
            self.started.abort()
        finally:
            self.finished_at.append(time.monotonic())

    def wait_started(self) -> None:
        self.started.wait()

    def join(self, timeout_s: float = 90) -> None:
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"


def counter(front: RayFront, name: str, role: str) -> float:
    metric = getattr(front.metrics, name)
    return float(metric.labels(role)._value.get())  # noqa: SLF001


def node(front: RayFront, name: str) -> Any:
    return next(n for n in front.nodes() if n.name == name)


def proc_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has). A process reaped between the open
    of /proc/<pid>/stat and its read makes the read fail with ESRCH (ProcessLookupError), not
    ENOENT: seen once in a clean-clone run, where it failed a kill test and the next one."""
    try:
        return proc_state(pid) != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def decode_pid(d: Any) -> int:
    """A decode worker's process (its DecodeHandle's actor, asked)."""
    import ray

    return int(ray.get(d.actor.place_of.remote(), timeout=30).pid)
