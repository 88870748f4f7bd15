"""Fixtures of the security suite (issue 8).

Real parts on loopback, as everywhere in tests/: the gateway servers come from
tests/cluster/conftest.py (re-exported here, so this suite gets its own session-scoped
instances), a guarded gateway serves HTTP and gRPC with two tenants' API keys, the session's real etcd
(tests/conftest.py) serves the membership tests, and `canary` is the pickle payload every listener is fed: if
anything on the other side ever unpickles it, a file appears.
"""

from __future__ import annotations

import pathlib
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.edge.http_api import HttpConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import (
    ServerHandle,
    free_port,
    make_module_server,
    make_server,
    make_shared_server,
    tiny_engine_config,
)

__all__ = ["make_module_server", "make_server", "make_shared_server", "tiny_engine_config"]  # fixtures, re-exported for this suite

ROOT = Path(__file__).resolve().parents[2]
MODEL = "baton-tiny"
ALPHA_KEY = "alpha-key-0123456789abcdef"
BETA_KEY = "beta-key-0123456789abcdef0"
OPS_KEY = "ops-key-0123456789abcdef00"  # role=operator: /metrics, /status, /admin/*
METRICS_KEY = "metrics-key-0123456789abcd"  # role=metrics: /metrics and /status, nothing else
OPERATOR_PATHS = ("/metrics", "/status", "/admin/")
OPEN_PATHS = frozenset({"/live", "/ready", "/health", "/dashboard"})  # no key needed (README, http_api)
MAX_BODY_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Guarded:
    """A gateway with API keys (tenants alpha and beta), serving HTTP and gRPC."""

    server: ServerHandle
    grpc_target: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def start_guarded(
    make_server: Callable[..., ServerHandle], engine: EngineConfig, tmp_path_factory: pytest.TempPathFactory
) -> Guarded:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{ALPHA_KEY} alpha\n{BETA_KEY} beta priority=3\n{OPS_KEY} ops role=operator\n"
                    f"{METRICS_KEY} prometheus role=metrics\n")
    grpc_port = free_port()
    handle = make_server(api_keys_file=keys, grpc_port=grpc_port, http=HttpConfig(max_body_bytes=MAX_BODY_BYTES),
                         engine=engine)  # fmt: skip
    return Guarded(handle, f"127.0.0.1:{grpc_port}")


@pytest.fixture(scope="session")
def guarded(
    make_shared_server: Callable[..., ServerHandle], tiny_engine_config: EngineConfig,
    tmp_path_factory: pytest.TempPathFactory,
) -> Guarded:
    """The suite's gateway: baton-tiny with a 512-token context."""
    return start_guarded(make_shared_server, tiny_engine_config, tmp_path_factory)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


_EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z0-9_]*(?:Error|Exception|Exit|Interrupt|Warning)\b")
_INTERNALS = ("Traceback", str(ROOT), "site-packages", ".py\"", ".py:", 'File "', "<class ", "<module")


def leaks(text: str) -> list[str]:
    """What in an error text tells a caller about the server's insides: a traceback, a
    source path, an exception class name."""
    return [marker for marker in _INTERNALS if marker in text] + _EXCEPTION_NAME.findall(text)


class _Touch:
    """Unpickling this calls Path(path).touch(): no shell, no os.system, just a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


@dataclass(frozen=True, slots=True)
class Canary:
    path: Path
    payload: bytes  # a pickle whose loading creates `path`

    @property
    def fired(self) -> bool:
        return self.path.exists()


def make_canary(path: Path) -> Canary:
    return Canary(path, pickle.dumps(_Touch(path), protocol=pickle.HIGHEST_PROTOCOL))


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    """A live canary: proved to fire when unpickled (on a twin path), then armed unfired."""
    twin = make_canary(tmp_path / "twin-fired")
    pickle.loads(twin.payload)  # noqa: S301  (the test proves its canary works)
    assert twin.fired, "the canary does not fire when unpickled: the tests below would prove nothing"
    armed = make_canary(tmp_path / "canary-fired")
    assert not armed.fired
    return armed


