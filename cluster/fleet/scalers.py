"""Who resizes this gateway's worker pools (the planner's, and `baton scale`'s): on Kubernetes the
RayCluster's worker groups through KubeRay (cluster.ops.planner_k8s), elsewhere the Ray actors
the gateway starts and stops itself (cluster.ops.planner_loop.LocalRayScaler).

    scaler = scaler_for(fleet, kuberay_cluster())   KubeRay when the head pod names its
                                                    RayCluster (engine.env), else local
    control = ScaleControl(fleet, scaler, planner_owns=...)   `baton scale` (POST /admin/scale)

On KubeRay a worker is a pod and an actor: an add patches the group one replica up, then starts
the actor, which Ray places on the new pod by the group's custom resource (it waits there for
the pod: POD_START_S); a remove drains the actor through the gateway, then patches the group
one replica down naming that actor's pod (the POD_NAME the pod's downward API gives the actor:
pod_of_worker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from cluster.errors import EdgeError, Kind
from cluster.fleet.calls import ray_await
from cluster.fleet.fleet import Fleet
from cluster.fleet.workers import DecodeHandle
from cluster.ops.planner import Role
from cluster.ops.planner_k8s import CustomObjects, KubeRayScaler
from cluster.ops.planner_loop import LocalRayScaler, Scaler

logger = logging.getLogger(__name__)

POD_START_S = 840.0  # a GPU pod pulls its image and loads its model; below the planner's action bound (900 s)


def scaler_for(fleet: Fleet, where: tuple[str, str] | None, api: CustomObjects | None = None) -> Scaler:
    """`where`: (RayCluster, namespace) on KubeRay, else None; `api`: the RayCluster API
    (default: the kubernetes client, made at the first call)."""
    if where is None:
        return LocalRayScaler(fleet)
    name, namespace = where

    async def pod_of(worker: str) -> str:
        return await pod_of_worker(fleet, worker)

    async def spawn(role: Role) -> str:
        return await fleet.add_worker(role, timeout_s=POD_START_S)

    return KubeRayScaler(name, namespace, pod_of, api=api, drain=fleet.drain_worker, spawn=spawn)


async def pod_of_worker(fleet: Fleet, worker: str) -> str:
    """The Kubernetes pod `worker`'s actor runs in: the POD_NAME its pod's downward API gives it
    (WorkerPlace.pod), else its Ray node's host name (KubeRay sets it to the pod's name; a pod
    started without POD_NAME). KeyError for a worker this gateway does not have, or whose Ray
    node is not listed alive."""
    handle = fleet.handle(worker)
    if handle is None:
        raise KeyError(f"no worker named {worker!r}")
    place = await ray_await(handle.actor.place_of.remote())
    if place.pod:
        return str(place.pod)
    import ray

    listed = await asyncio.to_thread(ray.nodes)
    hosts = {n["NodeID"]: n["NodeManagerHostname"] for n in listed if n.get("Alive")}
    if place.node_id not in hosts:
        raise KeyError(f"{worker}'s Ray node {place.node_id} is not alive")
    return str(hosts[place.node_id])


class ScaleControl:
    """`baton scale` (POST /admin/scale): each role's worker count brought to its target, one
    worker at a time, through the planner's scaler. One scale at a time; refused while the
    planner owns the counts (it would undo this). It runs to the end even if its caller goes
    away (a half-done scale-in would leave a drained actor's pod running)."""

    def __init__(self, fleet: Fleet, scaler: Scaler, planner_owns: bool = False) -> None:
        self.fleet = fleet
        self.scaler = scaler
        self.planner_owns = planner_owns
        self._running: asyncio.Task[dict[str, Any]] | None = None

    async def scale(self, targets: Mapping[str, int]) -> dict[str, Any]:
        if self.planner_owns:
            raise EdgeError(Kind.ABORTED, "the planner owns the worker counts (planner.enabled): turn it off "
                            "to scale by hand, or set its min/max")  # fmt: skip
        if self._running is not None and not self._running.done():
            raise EdgeError(Kind.ABORTED, "a scale is under way: wait for it to finish", None, 5.0)
        self._running = asyncio.ensure_future(self._scale(dict(targets)))
        return await asyncio.shield(self._running)

    async def _scale(self, targets: dict[str, int]) -> dict[str, Any]:
        report: dict[str, Any] = {}
        roles: tuple[Role, ...] = ("prefill", "decode")
        for role in roles:
            if role not in targets:
                continue
            before = self._names(role)
            added, drained = [], []
            while len(self._names(role)) < targets[role]:
                added.append(await self.scaler.add(role))
            while len(names := self._names(role)) > targets[role]:
                victim = self._victim(role, names)
                await self.scaler.remove(role, victim)
                drained.append(victim)
            report[role] = {"before": len(before), "after": len(self._names(role)), "added": added,
                            "drained": drained}  # fmt: skip
            logger.info("scaled %s: %d -> %d workers", role, len(before), len(self._names(role)))
        return report

    def _names(self, role: str) -> list[str]:
        """The role's workers that serve (alive members: a draining one no longer counts)."""
        handles = self.fleet.prefills if role == "prefill" else self.fleet.decodes
        return [h.name for h in handles if h.is_alive and h.is_member]

    def _victim(self, role: str, names: list[str]) -> str:
        """The worker with the least work in flight; the newest of those (highest index)."""
        def load(name: str) -> tuple[int, int]:
            handle = self.fleet.handle(name)
            busy = handle.num_active if isinstance(handle, DecodeHandle) else handle.num_inflight if handle else 0
            index = name.rsplit("-", 1)[-1]
            return busy, -int(index) if index.isdigit() else 0

        return min(names, key=load)
