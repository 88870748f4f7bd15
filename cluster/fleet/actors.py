"""The two roles as Ray actors (cluster/fleet/prefill_actor.py, cluster/fleet/decode_actor.py): thin
wrappers that own a worker, its Engine and its transport. One request, disaggregated:

    decode = spawn_decode(cfg); addr = decode.start()    its KV server (gRPC) and step loop
    dest = decode.place(job, epoch)                       pages reserved; dest.address = addr
    first = prefill.prefill(job, dest)                    chunked prefill; the first token
                                                          returns at once, the actor pushes
                                                          the pages to dest.address meanwhile
    decode.admit(job, dest, first.output, wait_s)         joins the batch once all arrived
    decode.next_batch(after, wait_s)                      the worker's output stream

Page bytes go prefill -> decode over gRPC (protobuf header + raw bytes + checksum), never through
Ray's object store or pickle. Actor methods take and return frozen dataclasses only
(cluster/fleet/worker_msgs.py).

Each actor asks Ray for what its role's ActorResources say (default 0 CPUs) and runs torch on
`num_threads` threads: by default the machine's cores are shared by choice, not by Ray's CPU
accounting (ENV-NOTES.md). `ray` is imported inside
`_remote` only: cluster.fleet.ray_runtime must set Ray's environment before the first `import ray`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from cluster.disagg_config import ActorResources
from cluster.fleet.decode_actor import DecodeActor
from cluster.fleet.prefill_actor import PrefillActor
from cluster.fleet.worker_msgs import DecodeStats, PrefillResult, PrefillStats
from engine.engine_config import EngineConfig
from kvtransfer.jobs import TransferReport

NO_RESOURCES = ActorResources()  # 0 CPUs: see DisaggConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "DecodeActor", "DecodeStats", "PrefillActor", "PrefillResult", "PrefillStats", "TransferReport",
    "spawn_decode", "spawn_prefill",
]


def spawn_prefill(
    cfg: EngineConfig, *, name: str | None = None, resources: ActorResources = NO_RESOURCES, max_restarts: int = 0,
    **kwargs: Any,
) -> ActorHandle[Any]:
    """A PrefillActor on the current Ray cluster (ray_runtime started or connected it). With
    max_restarts, Ray starts a fresh process when this one dies (its engine failed: the actor
    exits on purpose); the gateway then has it rejoin (Fleet._revive)."""
    handle: ActorHandle[Any] = _remote(PrefillActor).options(
        name=name, max_restarts=max_restarts, **resources.options()).remote(cfg, exit_on_failure=max_restarts > 0,
                                                                           **kwargs)  # fmt: skip
    return handle


def spawn_decode(
    cfg: EngineConfig, *, name: str | None = None, resources: ActorResources = NO_RESOURCES, max_restarts: int = 0,
    **kwargs: Any,
) -> ActorHandle[Any]:
    """A DecodeActor on the current Ray cluster; call `start()` on it before placing requests
    (and again after Ray restarted it: see spawn_prefill)."""
    handle: ActorHandle[Any] = _remote(DecodeActor).options(
        name=name, max_restarts=max_restarts, **resources.options()).remote(cfg, exit_on_failure=max_restarts > 0,
                                                                           **kwargs)  # fmt: skip
    return handle


@functools.cache
def _remote(cls: type) -> Any:
    import ray

    return ray.remote(num_cpus=0)(cls)  # spawn_* set the role's resources per actor
