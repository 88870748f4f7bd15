"""Baton's Ray: a private local cluster (tests, `baton up`) or an existing one (`baton serve`).

    start_local()    a fresh local Ray on 127.0.0.1 only, token auth on, no usage stats
    connect(addr)    attach this process to a running cluster (`ray start --head`)
    shutdown()       stop (local) or detach (connected)

Ray 2.60 reads some settings once, when `ray` is first imported, so this module sets them at
its own import and imports `ray` only inside its functions; import it before anything imports
`ray` (cluster/fleet/actors.py does not import `ray` at module level for the same reason):

- RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: otherwise Ray rewrites 127.0.0.1 to the machine's
  address and GCS, raylet and workers listen on every interface. Set after the import, it has
  no effect, so start_local() checks the node came up on loopback and refuses it otherwise.
- Token auth: with RAY_AUTH_MODE unset, a local ray.init() turns token auth on and writes a
  token to ~/.ray/auth_token when it finds none. start_local() hands Ray a fresh per-process
  token in RAY_AUTH_TOKEN instead (inherited by Ray's processes; nothing written to $HOME).
  connect() uses whatever token the environment gives (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
  ~/.ray/auth_token); RAY_AUTH_MODE=disabled must then be set on every side, before import.
- include_dashboard=False still starts a minimal dashboard process: dashboard_host keeps it
  on loopback.
- RAY_timeout_ms_task_wait_for_death_info=100 (Ray's default 1000): how long a call to an actor
  whose connection broke waits for the GCS to say whether it died before it fails. The
  gateway moves a dead decode worker's streams on that failure, so this is most of the wait
  a SIGKILLed worker costs them (measured here: about 1.0-1.4 s to the next token with Ray's
  default, 0.3-0.5 s with 100 ms). Either answer moves the streams, so waiting for which one
  buys nothing; the gateway's own watchdog still covers a worker that goes silent.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass

from engine.env import FAULT_INJECTION_ENV, fault_injection_allowed  # os and pathlib only: no torch

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_OBJECT_STORE_BYTES = 256 << 20  # KV pages travel over gRPC, not the object store
# Every worker process of this job: SIGTERM drains an actor instead of killing it (cluster.fleet.worker_signals).
WORKER_ENV = {"worker_process_setup_hook": "cluster.fleet.worker_signals.install"}

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "100")


@dataclass(frozen=True, slots=True)
class RayInfo:
    gcs_address: str  # "host:port": what `connect` and `ray start --address` take
    node_ip: str  # the GCS's host: 127.0.0.1 for a local cluster
    is_local: bool  # started by this process (shutdown stops it)
    init_s: float


def _runtime_env() -> dict[str, object]:
    """The job's runtime_env: the worker setup hook; a gateway allowed fault drills
    (engine.faults) passes the permission on to its actors."""
    env: dict[str, object] = dict(WORKER_ENV)
    if fault_injection_allowed():
        env["env_vars"] = {FAULT_INJECTION_ENV: "1"}
    return env


def start_local(
    num_cpus: int | None = None, object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
) -> RayInfo:
    """Start a private single-node Ray whose every listener is on loopback.

    `num_cpus` is the logical CPU count Ray schedules against (default: the machine's);
    baton's actors ask for 0 CPUs and set their own torch threads, so it does not limit them.
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    if os.environ.get("RAY_AUTH_MODE", "token").lower() == "token" and not _has_token_source():
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    started = time.monotonic()
    ray.init(
        address="local",  # never attach to a cluster named by RAY_ADDRESS
        num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        dashboard_host=LOOPBACK,
        _node_ip_address=LOOPBACK,
        configure_logging=False,
        runtime_env=_runtime_env(),
    )
    info = _info(is_local=True, init_s=time.monotonic() - started)
    if info.node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(
            f"Ray came up on {info.node_ip}, not loopback: `ray` was imported before "
            "cluster.fleet.ray_runtime could set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
        )
    logger.info("local Ray at %s in %.1f s", info.gcs_address, info.init_s)
    return info


def connect(address: str) -> RayInfo:
    """Attach to a running cluster at `address` ("host:port" of its GCS)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    started = time.monotonic()
    ray.init(address=address, configure_logging=False, runtime_env=_runtime_env())
    info = _info(is_local=False, init_s=time.monotonic() - started)
    logger.info("connected to Ray at %s", info.gcs_address)
    return info


def shutdown() -> None:
    """Stop the local cluster this process started, or detach from a connected one."""
    import ray

    ray.shutdown()


def _info(is_local: bool, init_s: float) -> RayInfo:
    import ray

    gcs_address = str(ray.get_runtime_context().gcs_address)
    return RayInfo(gcs_address, gcs_address.rpartition(":")[0], is_local, init_s)


def _has_token_source() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"))
