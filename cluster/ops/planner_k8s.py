"""The planner's decisions on Kubernetes: the RayCluster's worker groups (k8s/base/raycluster.yaml:
groups `prefill` and `decode`, one worker actor per pod), scaled through KubeRay.

    add(role)              rc = GET rayclusters/{name}; PATCH scale_patch(rc, +1); then
                           spawn(role): the gateway starts the worker actor, which Ray places
                           on the new pod (its group's custom resource) once KubeRay made it
    remove(role, victim)   pod = await pod_of(victim); drain(victim) through the gateway;
                           rc = GET; PATCH scale_patch(rc, -1, pod): replicas - 1 and
                           scaleStrategy.workersToDelete = [pod]
    dry_run                the same GET, then the patch printed as JSON (one line) instead
                           of sent; nothing drained

Why a whole list: the patch is a JSON merge patch (RFC 7386), which replaces a list whole, and
workerGroupSpecs is a list. So it carries every group as read, with only the target group's
replicas and scaleStrategy changed, and the object's metadata.resourceVersion: if anything
changed the RayCluster since the GET (KubeRay, a `kubectl edit`), the API server answers 409
Conflict rather than letting the patch overwrite it; the scaler then reads it again and
builds the patch afresh (CONFLICT_TRIES times in all), so a drained worker's pod is still named.

workersToDelete: KubeRay deletes the named pods, so it does not pick one at random when
replicas go down. An add sets it to [] (the planner's previous victim is gone by then: it
waits for that), so a stale name never lingers.

pod_of: the gateway names its workers (prefill-0, decode-1) and KubeRay names the pods; the
caller maps one to the other (the gateway: the host name of the Ray node the actor runs on,
which on KubeRay is its pod's name). It raises KeyError for a worker it cannot place; the
remove then fails before anything is drained, and the planner backs off.

The RayCluster is the one the gateway runs in (engine.env.kuberay_cluster: the head pod names
it and its namespace in its environment, k8s/base/raycluster.yaml); the pod's ServiceAccount may
get and patch that RayCluster and nothing else (k8s/base/rbac.yaml).

`kubernetes` (tested with 37.0.2; not a dependency of baton's) is imported only by
custom_objects_api(), at the first real call: the rest of baton, and these patches, need none.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TextIO

from cluster.ops.planner import Decision, Role

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
GROUP_NAMES: dict[Role, str] = {"prefill": "prefill", "decode": "decode"}  # workerGroupSpecs[].groupName
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "baton-planner"
REQUEST_TIMEOUT_S = 30.0
CONFLICT_TRIES = 3

Obj = dict[str, Any]  # a Kubernetes object as JSON


class CustomObjects(Protocol):
    """The two calls of kubernetes.client.CustomObjectsApi used here (tests: a recording fake)."""

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                     name: str, **kwargs: Any) -> Any: ...  # fmt: skip

    def patch_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                       name: str, body: Any, **kwargs: Any) -> Any: ...  # fmt: skip


def custom_objects_api() -> CustomObjects:
    """The real client: the pod's service account in a cluster, else ~/.kube/config."""
    kubernetes = importlib.import_module("kubernetes")
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    api: CustomObjects = kubernetes.client.CustomObjectsApi()
    return api


def scale_patch(cluster: Obj, decision: Decision, pod: str | None = None) -> Obj:
    """The merge patch that carries out `decision` on the RayCluster `cluster` (as read): its
    role's group one replica up or down, within the group's minReplicas..maxReplicas; a
    remove names `pod` for deletion. Raises ValueError when the decision does not fit."""
    groups = copy.deepcopy(cluster["spec"]["workerGroupSpecs"])
    name = GROUP_NAMES[decision.role]
    group = next((g for g in groups if g.get("groupName") == name), None)
    if group is None:
        raise ValueError(f"RayCluster {cluster['metadata'].get('name')!r} has no worker group {name!r}")
    replicas = int(group.get("replicas", group.get("minReplicas", 0)))
    target = replicas + (1 if decision.action == "add" else -1)
    low, high = int(group.get("minReplicas", 0)), int(group.get("maxReplicas", 2**31 - 1))
    if not low <= target <= high:
        raise ValueError(f"worker group {name!r}: {replicas} -> {target} replicas is outside {low}..{high}")
    group["replicas"] = target
    if decision.action == "remove":
        if not pod:
            raise ValueError("a remove names the pod to delete")
        group["scaleStrategy"] = {"workersToDelete": [pod]}
    else:
        group["scaleStrategy"] = {"workersToDelete": []}
    patch: Obj = {"spec": {"workerGroupSpecs": groups}}
    version = cluster.get("metadata", {}).get("resourceVersion")
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


class KubeRayScaler:
    """planner_loop.Scaler for a RayCluster `name` in `namespace`.

    drain: the gateway's drain of one worker (Fleet.drain_worker), awaited before the pod is
    named for deletion; None when something else drains (the pod's preStop). spawn: the
    gateway's start of one worker actor of a role (Fleet.add_worker), awaited after the patch
    that makes room for it -> its name; None: a worker starts by other means. api: a
    CustomObjectsApi (default: made on first use). dry_run: print, do not patch, drain or spawn."""

    def __init__(
        self, name: str, namespace: str, pod_of: Callable[[str], Awaitable[str]], *,
        api: CustomObjects | None = None, drain: Callable[[str], Awaitable[object]] | None = None,
        spawn: Callable[[Role], Awaitable[str]] | None = None, dry_run: bool = False, out: TextIO | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.namespace = namespace
        self.pod_of = pod_of
        self.drain = drain
        self.spawn = spawn
        self._unfilled: dict[Role, int] = {}  # replicas added whose actor did not start
        self.dry_run = dry_run
        self.out = out if out is not None else sys.stdout
        self._api = api

    async def add(self, role: Role) -> str:
        if self._unfilled.get(role, 0) > 0:  # a pod made for an actor that never started: reuse it
            self._unfilled[role] -= 1
        else:
            await self.apply(Decision("add", role, None, "KubeRayScaler.add"))
        if self.spawn is None or self.dry_run:
            return ""  # KubeRay names the pod; the planner counts healthy workers instead
        try:
            return await self.spawn(role)
        except BaseException:
            # The group has its new replica and no actor on it: the next add of this role starts
            # an actor there instead of asking for yet another pod (no pile of idle pods).
            self._unfilled[role] = self._unfilled.get(role, 0) + 1
            logger.error("RayCluster %s/%s: a %s pod was added, its actor did not start; the next add reuses it",
                         self.namespace, self.name, role)  # fmt: skip
            raise

    async def remove(self, role: Role, victim: str) -> None:
        pod = await self.pod_of(victim)
        if self.dry_run:
            logger.info("dry run: would drain %s (pod %s)", victim, pod)
        elif self.drain is not None:
            await self.drain(victim)
        await self.apply(Decision("remove", role, victim, "KubeRayScaler.remove"), pod)

    async def apply(self, decision: Decision, pod: str | None = None) -> Obj:
        """Read the RayCluster, patch it (or print the patch); returns the patch."""
        api = self._client()
        for attempt in range(1, CONFLICT_TRIES + 1):
            cluster = await asyncio.to_thread(api.get_namespaced_custom_object, GROUP, VERSION, self.namespace,
                                              PLURAL, self.name, _request_timeout=REQUEST_TIMEOUT_S)  # fmt: skip
            patch = scale_patch(cluster, decision, pod)
            if self.dry_run:
                self.out.write(json.dumps(patch, sort_keys=True, separators=(",", ":")) + "\n")
                self.out.flush()
                return patch
            try:
                await asyncio.to_thread(
                    api.patch_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, self.name, patch,
                    field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_S,
                )
                break
            except Exception as exc:
                if getattr(exc, "status", None) != 409 or attempt == CONFLICT_TRIES:
                    raise
                logger.info("RayCluster %s/%s changed under the patch; reading it again", self.namespace, self.name)
        logger.info("patched RayCluster %s/%s: %s %s%s", self.namespace, self.name, decision.action,
                    decision.role, f" (deleting pod {pod})" if pod else "")  # fmt: skip
        return patch

    def _client(self) -> CustomObjects:
        if self._api is None:
            self._api = custom_objects_api()
        return self._api
