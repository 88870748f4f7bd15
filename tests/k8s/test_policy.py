"""What a reviewer checks before this runs in a shared cluster: non-root containers with no
capabilities, Ray and etcd unreachable from outside their pods (Services and NetworkPolicies),
a gateway that is probed and drains, /dev/shm in memory and big enough, GPUs where they belong,
disruption budgets."""

from __future__ import annotations

from typing import Any

import pytest

from tests.k8s.manifests import (
    COMPONENTS,
    OVERLAYS,
    TARGETS,
    Obj,
    PodTemplate,
    cluster_file,
    of_kind,
    one,
    pod_templates,
    ray_cluster,
    selects,
    template,
    worker_group,
)

pytestmark = pytest.mark.timeout(120)

RAY_PORTS = (6379, 8265, 10001, 8080, 52365)  # GCS, dashboard, client, metrics, dashboard agent
RAY_DYNAMIC_PORT = 23456  # a worker / object-manager / KV-transfer port picked at run time
ETCD_CLIENT, ETCD_PEER = 2379, 2380
GATEWAY_PORTS = (8000, 50051)
OUTSIDER = {"app.kubernetes.io/name": "something-else"}  # any other pod in the namespace
# Prometheus, where the NetworkPolicies expect it (k8s/README.md: change both together), and the
# metrics port it scrapes on each kind of pod (k8s/monitoring/podmonitor.yaml)
SCRAPER_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}
SCRAPER = {"app.kubernetes.io/name": "prometheus"}
GATEWAY_METRICS, RAY_METRICS, ETCD_METRICS = 8000, 8080, 2381


def _all(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> list[tuple[str, list[Obj]]]:
    return list(builds.items()) + [(f"gpu+{c}", o) for c, o in component_builds.items()]


# --- security contexts ------------------------------------------------------------------------


def test_every_container_runs_non_root_without_capabilities(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> None:
    problems = []
    for target, objects in _all(builds, component_builds):
        for t in pod_templates(objects):
            pod_sc = t.spec.get("securityContext", {})
            where = f"{target} {t.owner}"
            for flag in ("hostNetwork", "hostPID", "hostIPC"):
                if t.spec.get(flag):
                    problems.append(f"{where}: {flag}")
            problems += [
                f"{where}: hostPath volume {v['name']}"
                for v in t.spec.get("volumes", [])
                if "hostPath" in v
            ]
            for c in t.containers():
                sc = c.get("securityContext", {})
                name = f"{where}/{c['name']}"
                if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                    problems.append(f"{name}: runAsNonRoot is not set")
                if sc.get("runAsUser", pod_sc.get("runAsUser")) in (0, None):
                    problems.append(f"{name}: no non-zero runAsUser")
                if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
                    problems.append(f"{name}: may escalate privileges")
                caps = sc.get("capabilities", {})
                if "ALL" not in caps.get("drop", []) or caps.get("add"):
                    problems.append(f"{name}: capabilities not all dropped ({caps})")
                seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
                if seccomp.get("type") != "RuntimeDefault":
                    problems.append(f"{name}: seccompProfile is {seccomp}")
                if sc.get("readOnlyRootFilesystem") is not True:
                    problems.append(f"{name}: writable root filesystem")
    assert not problems, "\n".join(problems)


def test_the_namespace_enforces_the_restricted_pod_security_standard(
    builds: dict[str, list[Obj]],
) -> None:
    for target in TARGETS:
        labels = one(builds[target], "Namespace")["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


# --- network exposure -------------------------------------------------------------------------


def test_no_service_exposes_ray_or_etcd_outside_the_cluster(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> None:
    guarded = {*RAY_PORTS, ETCD_CLIENT, ETCD_PEER}
    for target, objects in _all(builds, component_builds):
        for svc in of_kind(objects, "Service"):
            spec, name = svc["spec"], f"{target} Service/{svc['metadata']['name']}"
            ports = {p["port"] for p in spec["ports"]} | {
                p.get("targetPort") for p in spec["ports"]
            }
            assert spec.get("type", "ClusterIP") == "ClusterIP", f"{name}: {spec.get('type')}"
            assert not spec.get("externalIPs") and not spec.get("loadBalancerIP"), name
            if not svc["metadata"]["name"].startswith("baton-etcd"):
                assert not ports & guarded, f"{name} publishes a Ray or etcd port"
        head = ray_cluster(objects)["spec"]["headGroupSpec"]
        assert head.get("serviceType", "ClusterIP") == "ClusterIP", (
            f"{target}: KubeRay's head Service"
        )
        assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1", (
            f"{target}: Ray dashboard off loopback"
        )


def _port_in(rule: dict[str, Any], port: int) -> bool:
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        if (
            "port" not in p
            or p["port"] == port
            or (p.get("endPort") and p["port"] <= port <= p["endPort"])
        ):
            return True
    return False


def _ingress_peers(
    objects: list[Obj], pod: dict[str, str], port: int
) -> list[dict[str, Any] | None]:
    """The peers allowed to reach `pod` on `port` (None: any source); [] means denied."""
    peers: list[dict[str, Any] | None] = []
    for np in of_kind(objects, "NetworkPolicy"):
        spec = np["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]) or not selects(
            spec["podSelector"], pod
        ):
            continue
        for rule in spec.get("ingress", []):
            if _port_in(rule, port):
                peers += rule.get("from") or [None]
    return peers


def _is_the_scraper(peer: dict[str, Any] | None) -> bool:
    """`peer` admits Prometheus's pods in its namespace and nothing else there or elsewhere."""
    if peer is None or "namespaceSelector" not in peer or "podSelector" not in peer:
        return False
    ns, pods = peer["namespaceSelector"], peer["podSelector"]
    return (selects(ns, SCRAPER_NAMESPACE) and not selects(ns, {"kubernetes.io/metadata.name": "elsewhere"})
            and selects(pods, SCRAPER) and not selects(pods, OUTSIDER))  # fmt: skip


def _only_from(
    objects: list[Obj], pod: dict[str, str], port: int, allowed: list[dict[str, str]],
    scraper: bool = False,
) -> list[str]:
    """Why `port` of `pod` is reachable from something outside `allowed` (and, with `scraper`,
    Prometheus's pods) (empty: it is not)."""
    problems = []
    for peer in _ingress_peers(objects, pod, port):
        if scraper and _is_the_scraper(peer):
            continue
        if peer is None or "ipBlock" in peer or "namespaceSelector" in peer:
            problems.append(f"port {port} open to {peer or 'any source'}")
        elif selects(peer["podSelector"], OUTSIDER):
            problems.append(f"port {port} open to every pod in the namespace")
        elif not any(selects(peer["podSelector"], a) for a in allowed):
            problems.append(f"port {port} open to pods outside {allowed}")
    return problems


def _labels(objects: list[Obj], group: str) -> dict[str, str]:
    return template(objects, group).labels


def test_default_deny_covers_every_pod(builds: dict[str, list[Obj]]) -> None:
    for target in TARGETS:
        deny = [np for np in of_kind(builds[target], "NetworkPolicy")
                if np["spec"]["podSelector"] == {} and not np["spec"].get("ingress") and not np["spec"].get("egress")]  # fmt: skip
        assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}, target


def test_ray_and_etcd_ports_are_reachable_only_from_their_pods(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> None:
    problems = []
    for target, objects in _all(builds, component_builds):
        ray = [_labels(objects, g) for g in ("head", "prefill", "decode")]
        etcd = _labels(objects, "baton-etcd")
        for pod in ray:
            for port in (*RAY_PORTS, RAY_DYNAMIC_PORT):
                problems += [f"{target} {pod}: {p}"
                             for p in _only_from(objects, pod, port, ray, scraper=port == RAY_METRICS)]  # fmt: skip
        problems += [
            f"{target} etcd: {p}" for p in _only_from(objects, etcd, ETCD_CLIENT, [*ray, etcd])
        ]
        problems += [f"{target} etcd: {p}" for p in _only_from(objects, etcd, ETCD_PEER, [etcd])]
        problems += [f"{target} etcd: {p}" for p in _only_from(objects, etcd, ETCD_METRICS, [], scraper=True)]
        # ...and they are reachable where they must be (or nothing would work)
        assert _ingress_peers(objects, ray[2], RAY_DYNAMIC_PORT) and _ingress_peers(
            objects, etcd, ETCD_PEER
        )
        assert any(
            p is not None and selects(p["podSelector"], ray[1])
            for p in _ingress_peers(objects, etcd, ETCD_CLIENT)
        )
    assert not problems, "\n".join(problems)


def test_clients_reach_the_gateway_and_nothing_else(builds: dict[str, list[Obj]]) -> None:
    for target in TARGETS:
        objects = builds[target]
        head, prefill, etcd = (_labels(objects, g) for g in ("head", "prefill", "baton-etcd"))
        for port in GATEWAY_PORTS:
            assert None in _ingress_peers(objects, head, port), (
                f"{target}: clients cannot reach {port}"
            )
        for pod in (prefill, etcd):
            for port in (*GATEWAY_PORTS, ETCD_CLIENT):
                assert None not in _ingress_peers(objects, pod, port), (
                    f"{target}: {pod} open on {port}"
                )


def _scraper_reaches(objects: list[Obj], pod: dict[str, str], port: int) -> bool:
    return any(p is None or _is_the_scraper(p) for p in _ingress_peers(objects, pod, port))


def test_the_scraper_reaches_every_metrics_port(builds: dict[str, list[Obj]]) -> None:
    """Prometheus (namespace monitoring) reaches what the PodMonitor scrapes: the gateway's
    /metrics, Ray's metrics agent on the head and every worker, etcd's metrics listener."""
    for target in TARGETS:
        objects = builds[target]
        wanted = [(g, _labels(objects, g), RAY_METRICS) for g in ("head", "prefill", "decode")]
        wanted += [("head", _labels(objects, "head"), GATEWAY_METRICS),
                   ("baton-etcd", _labels(objects, "baton-etcd"), ETCD_METRICS)]  # fmt: skip
        shut = [f"{g}:{port}" for g, pod, port in wanted if not _scraper_reaches(objects, pod, port)]
        assert not shut, f"{target}: Prometheus cannot scrape {shut}"
        # ...and only those: not Ray's GCS, etcd's client port, a worker's KV-transfer server
        for g, port in (("head", 6379), ("baton-etcd", ETCD_CLIENT), ("decode", RAY_DYNAMIC_PORT)):
            assert not _scraper_reaches(objects, _labels(objects, g), port), f"{target}: {g}:{port}"


def test_the_scraper_peer_check_can_fail() -> None:
    assert _is_the_scraper({"namespaceSelector": {"matchLabels": SCRAPER_NAMESPACE},
                            "podSelector": {"matchLabels": SCRAPER}})  # fmt: skip
    for too_wide in ({"namespaceSelector": {}, "podSelector": {"matchLabels": SCRAPER}},
                     {"namespaceSelector": {"matchLabels": SCRAPER_NAMESPACE}, "podSelector": {}},
                     {"namespaceSelector": {"matchLabels": SCRAPER_NAMESPACE}},
                     {"podSelector": {"matchLabels": SCRAPER}}, None):  # fmt: skip
        assert not _is_the_scraper(too_wide), too_wide


def test_the_network_check_can_fail(builds: dict[str, list[Obj]]) -> None:
    """A policy opening the GCS to any source is caught."""
    objects = [
        *builds["base"],
        {
            "kind": "NetworkPolicy",
            "metadata": {"name": "oops"},
            "spec": {
                "podSelector": {},
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"port": 6379}]}],
            },
        },
    ]
    assert _only_from(objects, _labels(objects, "head"), 6379, [_labels(objects, "head")])


# --- the gateway: probes, drain ---------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_gateway_is_probed_and_drains(builds: dict[str, list[Obj]], target: str) -> None:
    head = template(builds[target], "head")
    gw = head.container("gateway")
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    for probe, path in (("livenessProbe", "/live"), ("startupProbe", "/live")):
        get = gw[probe]["httpGet"]
        assert get["path"] == path and ports.get(get["port"], get["port"]) == 8000, (
            f"{probe}: {get}"
        )
    # readiness is grpc.health.v1 on the gRPC port (the same answer as /ready; test_ways_in.py)
    assert gw["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    assert (
        gw["command"][0] == "/bin/sh"
        and "exec baton serve --config /etc/baton/cluster.yaml" in gw["args"][0]
    )
    assert gw["lifecycle"]["preStop"]["exec"]["command"][:2] == [
        "python3",
        "/etc/baton/hooks/drain.py",
    ]
    ray_head = head.container("ray-head")
    assert "--wait-for-exit" in ray_head["lifecycle"]["preStop"]["exec"]["command"]
    assert head.spec["containers"][0]["name"] == "ray-head", (
        "KubeRay takes containers[0] as the Ray container"
    )
    assert head.spec.get("shareProcessNamespace") is True, (
        "the gateway's driver finds the raylet by its process"
    )
    shared = [m["name"] for m in gw["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert shared and shared == [
        m["name"] for m in ray_head["volumeMounts"] if m["mountPath"] == "/tmp"
    ]


def test_the_hooks_configmap_ships_the_repository_script(builds: dict[str, list[Obj]]) -> None:
    from tests.k8s.manifests import K8S

    for target in TARGETS:
        data = one(builds[target], "ConfigMap", "baton-hooks")["data"]
        assert data["drain.py"] == (K8S / "base" / "hooks" / "drain.py").read_text()


# --- memory: /dev/shm -------------------------------------------------------------------------

_UNITS = {
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
}


def quantity(q: str | int) -> int:
    s = str(q)
    for unit, mult in _UNITS.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def _shm(t: PodTemplate, container: str) -> Obj:
    mounts = [m for m in t.container(container)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(mounts) == 1, f"{t.owner}/{container}: no /dev/shm mount"
    return dict(t.volume(mounts[0]["name"])["emptyDir"])


# the gpu overlay's page: Llama-3.1-8B class, bf16 (its cluster.yaml): 32 x 2 x 8 x 128 x 16 x 2
GPU_PAGE_BYTES = 2 << 20
NCCL_SHM_BYTES = 4 << 30  # NCCL's buffers between peers: a few GiB


@pytest.mark.parametrize("target", TARGETS)
def test_dev_shm_is_memory_backed_and_sized(builds: dict[str, list[Obj]], target: str) -> None:
    objects, f = builds[target], cluster_file(builds[target])
    transport = f.transfer.shm_slots * (f.transfer.pages_per_chunk or 0)  # the gpu overlay sets it
    for group, containers in (
        ("head", ("ray-head", "gateway")),
        ("prefill", ("ray-worker",)),
        ("decode", ("ray-worker",)),
    ):
        t = template(objects, group)
        params = (
            ray_cluster(objects)["spec"]["headGroupSpec"]
            if group == "head"
            else worker_group(objects, group)
        )["rayStartParams"]
        for c in containers:
            shm = _shm(t, c)
            assert shm.get("medium") == "Memory" and "sizeLimit" in shm, (
                f"{target} {group}/{c}: {shm}"
            )
            size = quantity(shm["sizeLimit"])
            assert size >= int(params["object-store-memory"]), (
                f"{target} {group}: /dev/shm below Ray's object store"
            )
            limit = quantity(t.container(c)["resources"]["limits"]["memory"])
            assert size < limit, f"{target} {group}/{c}: /dev/shm counts against the memory limit"
        if target == "overlays/gpu" and group != "head":
            need = int(params["object-store-memory"]) + NCCL_SHM_BYTES + transport * GPU_PAGE_BYTES
            assert quantity(_shm(t, "ray-worker")["sizeLimit"]) >= need, (
                f"gpu {group}: /dev/shm too small"
            )


# --- GPUs, NCCL -------------------------------------------------------------------------------


def test_gpu_overlay_gives_each_worker_group_gpus(builds: dict[str, list[Obj]]) -> None:
    objects, f = builds["overlays/gpu"], cluster_file(builds["overlays/gpu"])
    for role, section in (("prefill", f.workers.prefill), ("decode", f.workers.decode)):
        group = worker_group(objects, role)
        c = template(objects, role).container("ray-worker")
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= 1 and int(c["resources"]["requests"]["nvidia.com/gpu"]) == gpus
        assert int(group["rayStartParams"]["num-gpus"]) == gpus
        assert 0 < section.num_gpus <= gpus, f"workers.{role}.num_gpus"
        env = {e["name"] for e in c["env"]}
        assert {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG"} <= env, f"{role}: NCCL settings"
        tolerations = template(objects, role).spec.get("tolerations", [])
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    head = template(objects, "head")
    assert not any(
        "nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in head.containers()
    )


def test_cpu_overlay_asks_for_no_gpu(builds: dict[str, list[Obj]]) -> None:
    for t in pod_templates(builds["overlays/cpu"]):
        for c in t.containers():
            assert "nvidia.com/gpu" not in str(c.get("resources", {})), t.owner


# --- volumes, disruption budgets --------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_decode_disk_tier_is_a_claim_of_its_own(builds: dict[str, list[Obj]], target: str) -> None:
    vol = template(builds[target], "decode").volume("kv-disk")
    claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert (
        claim["accessModes"] == ["ReadWriteOnce"]
        and quantity(claim["resources"]["requests"]["storage"]) > 0
    )


def test_shared_disk_tier_component_uses_one_rwx_claim(
    component_builds: dict[str, list[Obj]],
) -> None:
    objects = component_builds["kv-disk-shared"]
    vol = template(objects, "decode").volume("kv-disk")
    pvc = one(objects, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("target", OVERLAYS)
def test_disruption_budgets(builds: dict[str, list[Obj]], target: str) -> None:
    """One pod of each kind at a time, with budgets Kubernetes can compute: over a RayCluster's
    pods (no /scale subresource) only an integer minAvailable works -- maxUnavailable or a
    percentage leaves the budget at SyncFailed and every node drain hangs -- and it is the
    group's replicas minus one; etcd's StatefulSet has /scale, so maxUnavailable 1 there."""
    objects = builds[target]
    pdbs = of_kind(objects, "PodDisruptionBudget")
    raycluster = one(objects, "RayCluster", "baton")
    replicas = {g["groupName"]: g["replicas"] for g in raycluster["spec"]["workerGroupSpecs"]}
    for group in ("prefill", "decode"):
        [pdb] = [p for p in pdbs if selects(p["spec"]["selector"], _labels(objects, group))]
        assert "maxUnavailable" not in pdb["spec"], f"{target} {group}: needs the owner's /scale"
        assert pdb["spec"]["minAvailable"] == replicas[group] - 1, f"{target} {group}"
    [etcd] = [p for p in pdbs if selects(p["spec"]["selector"], _labels(objects, "baton-etcd"))]
    assert etcd["spec"]["maxUnavailable"] == 1
    assert not [p for p in pdbs if selects(p["spec"]["selector"], _labels(objects, "head"))], (
        "a head PDB blocks drains"
    )
    assert one(objects, "StatefulSet", "baton-etcd")["spec"]["replicas"] == 3


@pytest.mark.parametrize("target", TARGETS)
def test_no_budget_over_pods_without_a_scale_subresource_needs_one(builds: dict[str, list[Obj]], target: str) -> None:
    """Every budget that selects a RayCluster's pods is an integer minAvailable (the one form
    Kubernetes computes without the owner's /scale)."""
    objects = builds[target]
    ray_pods = [t for t in pod_templates(objects) if t.owner.startswith("RayCluster/")]
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        if any(selects(pdb["spec"]["selector"], t.labels) for t in ray_pods):
            spec = pdb["spec"]
            assert "maxUnavailable" not in spec and isinstance(spec.get("minAvailable"), int), pdb["metadata"]["name"]


def test_optional_components_do_what_they_say(component_builds: dict[str, list[Obj]]) -> None:
    fetch = template(component_builds["model-fetch"], "head")
    init = fetch.container("model-fetch")
    assert init in fetch.spec["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    assert {"MODEL_NAME", "MODEL_REVISION", "MODEL_SOURCE", "MODEL_SHA256"} <= set(env)
    writable = [m for m in init["volumeMounts"] if m["mountPath"] == "/models"]
    assert writable and not writable[0].get("readOnly")
    for c in fetch.spec["containers"]:
        assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] == "models"), c["name"]
    gcs = ray_cluster(component_builds["gcs-ft"])["spec"]["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] and gcs["redisPassword"]["valueFrom"]["secretKeyRef"]["name"]
    assert COMPONENTS == ("model-fetch", "gcs-ft", "kv-disk-shared", "etcd-tls")
