"""Ways in and upgrades (issue 23, findings 9 and 10).

Ways in: k8s/examples/ (Gateway API routes, ingress-nginx, the OTLP egress) build with
`kubectl kustomize`; built-in kinds validate with kubernetes-validate (strict, 1.29 and the
newest it knows), the Gateway API objects against the Gateway API CRDs (tests/k8s/crds/gateway-api/,
with their SOURCE), made strict; every route reaches the gateway Service and port its protocol
needs, with timeouts longer than baton's request timeout; the gateway container has a gRPC
readiness probe on its gRPC port.

Upgrades: k8s/upgrade/ builds generation baton-b of the gpu overlay beside generation baton;
the shared objects select both generations' pods alike, and the generation label selects
exactly one generation's own objects (k8s/UPGRADE.md's `kubectl apply -l`).

The Gateway API objects also pass their CRDs' CEL rules (x-kubernetes-validations, tests/k8s/cel.py:
defaults applied first, as the API server does). Not checked here (no API server on these
machines): what an implementation does with the routes.
"""

from __future__ import annotations

import copy
import re
from functools import cache

import jsonschema
import kubernetes_validate
import pytest

from cluster.cluster_config import parse_cluster_file
from tests.k8s.cel import cel_errors
from tests.k8s.manifests import (
    CRDS,
    K8S,
    NAMESPACE,
    ROOT,
    TARGETS,
    Obj,
    cluster_file,
    crd_schema,
    kustomize,
    of_kind,
    one,
    pod_templates,
    selects,
    template,
)

pytestmark = pytest.mark.timeout(120)

EXAMPLES = ("gateway-api", "ingress-nginx", "otlp-egress")  # k8s/examples/
GATEWAY_API = CRDS / "gateway-api"
CRD_FILES = {
    "Gateway": GATEWAY_API / "gateway.networking.k8s.io_gateways.yaml",
    "HTTPRoute": GATEWAY_API / "gateway.networking.k8s.io_httproutes.yaml",
    "GRPCRoute": GATEWAY_API / "gateway.networking.k8s.io_grpcroutes.yaml",
}
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
INSTANCE = "app.kubernetes.io/instance"  # the generation label (k8s/UPGRADE.md)
UPGRADE = K8S / "upgrade"
NGINX = "nginx.ingress.kubernetes.io/"


@pytest.fixture(scope="module")
def examples() -> dict[str, list[Obj]]:
    return {name: kustomize(K8S / "examples" / name) for name in EXAMPLES}


@pytest.fixture(scope="module")
def upgrade() -> list[Obj]:
    return kustomize(UPGRADE)


def _all_examples(examples: dict[str, list[Obj]]) -> list[Obj]:
    return [o for objects in examples.values() for o in objects]


# --- helpers ----------------------------------------------------------------------------------


def gateway_api_seconds(duration: str) -> float:
    """A Gateway API Duration (GEP-2257: `1h`, `5m30s`, `360s`, `500ms`) in seconds."""
    parts = re.findall(r"([0-9]{1,5})(h|ms|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(int(n) * unit[u] for n, u in parts)


def selectors(objects: list[Obj]) -> dict[str, Obj]:
    """Every pod selector of the shared objects: Services, budgets, NetworkPolicies, PodMonitors."""
    out: dict[str, Obj] = {}
    for o in objects:
        kind, name, spec = o["kind"], o["metadata"]["name"], o.get("spec", {})
        if kind == "Service" and spec.get("selector"):
            out[f"Service/{name}"] = {"matchLabels": spec["selector"]}
        elif kind in ("PodDisruptionBudget", "PodMonitor"):
            out[f"{kind}/{name}"] = spec["selector"]
        elif kind == "NetworkPolicy":
            out[f"NetworkPolicy/{name}"] = spec["podSelector"]
    return out


def service_port(objects: list[Obj], service: str, port: int | str) -> int:
    """The gateway container port that Service `service`'s port (number or name) reaches."""
    svc = one(objects, "Service", service)
    (p,) = [p for p in svc["spec"]["ports"] if port in (p["port"], p.get("name"))]
    target = p.get("targetPort", p["port"])
    gw = template(objects, "head").container("gateway")
    assert selects({"matchLabels": svc["spec"]["selector"]}, template(objects, "head").labels)
    by_name = {cp["name"]: cp["containerPort"] for cp in gw["ports"]}
    return int(by_name.get(target, target))


def crd_errors(objects: list[Obj]) -> tuple[int, list[str]]:
    checked, errors = 0, []
    for o in objects:
        if o["apiVersion"] != "gateway.networking.k8s.io/v1":
            continue
        checked += 1
        for err in _crd_validator(o["kind"]).iter_errors(o):
            errors.append(
                f"{o['kind']}/{o['metadata']['name']}: {err.message} at {list(err.absolute_path)}"
            )
    return checked, errors


@cache
def _crd_validator(kind: str) -> jsonschema.protocols.Validator:
    schema = crd_schema(CRD_FILES[kind], "v1")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def core_errors(objects: list[Obj], version: str) -> list[str]:
    errors = []
    for o in objects:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {exc.message} at {list(exc.path)}")
    return errors


def max_request_timeout_s(builds: dict[str, list[Obj]], upgrade: list[Obj]) -> float:
    files = [cluster_file(objects) for objects in builds.values()]
    b = one(upgrade, "ConfigMap", "baton-b-config")["data"]["cluster.yaml"]
    files.append(parse_cluster_file(b, "k8s/upgrade/cluster.yaml"))
    return max(float(f.api.request_timeout_s) for f in files)


# --- ways in: builds and schemas --------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_builds_into_the_namespace(
    examples: dict[str, list[Obj]], example: str
) -> None:
    objects = examples[example]
    assert objects
    assert all(o["metadata"].get("namespace") == NAMESPACE for o in objects)
    want = {"gateway-api": {"Gateway", "HTTPRoute", "GRPCRoute"}, "ingress-nginx": {"Ingress"},
            "otlp-egress": {"NetworkPolicy"}}[example]  # fmt: skip
    assert {o["kind"] for o in objects} == want


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_of_the_examples_validate_strictly(
    examples: dict[str, list[Obj]], version: str
) -> None:
    core = [
        o for o in _all_examples(examples) if not o["apiVersion"].startswith("gateway.networking")
    ]
    assert {o["kind"] for o in core} == {"Ingress", "NetworkPolicy"}
    assert not core_errors(core, version), "\n".join(core_errors(core, version))


def test_gateway_api_objects_validate_against_their_crds(examples: dict[str, list[Obj]]) -> None:
    checked, errors = crd_errors(examples["gateway-api"])
    assert checked == 3 and not errors, "\n".join(errors)


def test_gateway_api_objects_pass_their_crds_cel_rules(examples: dict[str, list[Obj]]) -> None:
    checked, errors = cel_checked(examples["gateway-api"])
    assert checked >= 40 and not errors, "\n".join(errors)  # 42 rules apply to these three objects


def test_the_cel_check_can_fail(examples: dict[str, list[Obj]]) -> None:
    """What the schemas alone let through: a Service backend without a port, two listeners of
    one name."""
    route = copy.deepcopy(one(examples["gateway-api"], "GRPCRoute"))
    del route["spec"]["rules"][0]["backendRefs"][0]["port"]
    assert crd_errors([route]) == (1, [])
    assert cel_checked([route])[1] == [
        "GRPCRoute/baton-grpc: self.spec.rules[0].backendRefs[0]: Must have port for Service reference"]
    gateway = copy.deepcopy(one(examples["gateway-api"], "Gateway"))
    gateway["spec"]["listeners"][1]["name"] = gateway["spec"]["listeners"][0]["name"]
    assert "Gateway/baton: self.spec.listeners: Listener name must be unique within the Gateway" in cel_checked(
        [gateway])[1]


def cel_checked(objects: list[Obj]) -> tuple[int, list[str]]:
    checked, errors = 0, []
    for o in objects:
        n, found = cel_errors(o, crd_schema(CRD_FILES[o["kind"]], "v1"))
        checked += n
        errors += [f"{o['kind']}/{o['metadata']['name']}: {e}" for e in found]
    return checked, errors


def test_the_gateway_api_check_can_fail(examples: dict[str, list[Obj]]) -> None:
    """A misspelt field and a malformed duration are both caught."""
    route = copy.deepcopy(one(examples["gateway-api"], "HTTPRoute"))
    route["spec"]["rules"][0]["timeout"] = "360s"
    assert crd_errors([route])[1]
    route = copy.deepcopy(one(examples["gateway-api"], "HTTPRoute"))
    route["spec"]["rules"][0]["timeouts"]["request"] = "6 minutes"
    assert crd_errors([route])[1]


# --- ways in: where they lead -----------------------------------------------------------------


def test_routes_reach_the_gateway_ports_of_their_protocol(
    builds: dict[str, list[Obj]], examples: dict[str, list[Obj]]
) -> None:
    base = builds["base"]
    want = {"HTTPRoute": 8000, "GRPCRoute": 50051}
    for route in [
        *of_kind(examples["gateway-api"], "HTTPRoute"),
        *of_kind(examples["gateway-api"], "GRPCRoute"),
    ]:
        refs = [r for rule in route["spec"]["rules"] for r in rule["backendRefs"]]
        assert refs
        for ref in refs:
            assert service_port(base, ref["name"], ref["port"]) == want[route["kind"]], (
                route["metadata"],
                ref,
            )
    for ingress in of_kind(examples["ingress-nginx"], "Ingress"):
        is_grpc = (
            ingress["metadata"].get("annotations", {}).get(NGINX + "backend-protocol") == "GRPC"
        )
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                svc = path["backend"]["service"]
                port = svc["port"].get("name", svc["port"].get("number"))
                assert service_port(base, svc["name"], port) == (50051 if is_grpc else 8000), (
                    ingress["metadata"]
                )


def test_routes_attach_to_a_listener_that_takes_them(examples: dict[str, list[Obj]]) -> None:
    objects = examples["gateway-api"]
    gateway = one(objects, "Gateway")
    listeners = {li["name"]: li for li in gateway["spec"]["listeners"]}
    for route in [*of_kind(objects, "HTTPRoute"), *of_kind(objects, "GRPCRoute")]:
        for parent in route["spec"]["parentRefs"]:
            assert parent["name"] == gateway["metadata"]["name"]
            listener = listeners[parent["sectionName"]]
            assert {"kind": route["kind"]} in listener["allowedRoutes"]["kinds"]
            assert route["spec"]["hostnames"] == [listener["hostname"]]


def test_http_ways_in_outlast_the_request_timeout_and_do_not_buffer(
    builds: dict[str, list[Obj]], examples: dict[str, list[Obj]], upgrade: list[Obj]
) -> None:
    longest = max_request_timeout_s(builds, upgrade)
    (http_route,) = of_kind(examples["gateway-api"], "HTTPRoute")
    for rule in http_route["spec"]["rules"]:
        timeouts = rule["timeouts"]
        assert gateway_api_seconds(timeouts["request"]) > longest
        assert gateway_api_seconds(timeouts["backendRequest"]) > longest
    ingresses = {
        i["metadata"]["name"]: i["metadata"]["annotations"]
        for i in of_kind(examples["ingress-nginx"], "Ingress")
    }
    assert ingresses["baton-http"][NGINX + "proxy-buffering"] == "off"
    assert ingresses["baton-grpc"][NGINX + "backend-protocol"] == "GRPC"
    for notes in ingresses.values():
        for key in ("proxy-read-timeout", "proxy-send-timeout"):
            assert float(notes[NGINX + key]) > longest, (key, notes)


def test_the_otlp_egress_opens_the_collector_port_to_the_gateway_only(
    builds: dict[str, list[Obj]], examples: dict[str, list[Obj]]
) -> None:
    (policy,) = examples["otlp-egress"]
    selected = [
        t.group
        for t in pod_templates(builds["overlays/gpu"])
        if selects(policy["spec"]["podSelector"], t.labels)
    ]
    assert selected == ["head"]
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert [p for rule in policy["spec"]["egress"] for p in rule["ports"]] == [
        {"protocol": "TCP", "port": 4317}
    ]


# --- the gRPC probe ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_the_gateway_has_a_grpc_readiness_probe_on_its_grpc_port(
    builds: dict[str, list[Obj]], target: str
) -> None:
    """grpc.health.v1 is NOT_SERVING while draining: a readiness probe, never liveness (a
    liveness probe would restart a draining gateway and end the streams it was finishing)."""
    objects = builds[target]
    gw = template(objects, "head").container("gateway")
    grpc_probes = {
        k: gw[k]["grpc"]
        for k in ("livenessProbe", "readinessProbe", "startupProbe")
        if "grpc" in gw.get(k, {})
    }
    assert list(grpc_probes) == ["readinessProbe"], grpc_probes
    probe = grpc_probes["readinessProbe"]
    assert probe.get("service", "") == ""  # the whole server (cluster/edge/grpc_server.py, LiveHealth)
    assert probe["port"] == service_port(objects, "baton-grpc", "grpc") == 50051
    assert cluster_file(objects).api.grpc_port == probe["port"]


# --- upgrades: a second generation ------------------------------------------------------------


def test_upgrade_builds_a_second_generation(
    builds: dict[str, list[Obj]], upgrade: list[Obj]
) -> None:
    rc = one(upgrade, "RayCluster")
    assert rc["metadata"]["name"] == "baton-b"
    head = template(upgrade, "head")
    (token,) = [e for e in head.container("gateway")["env"] if e["name"] == "RAY_AUTH_TOKEN"]
    # KubeRay's token Secret is named after the RayCluster
    assert token["valueFrom"]["secretKeyRef"]["name"] == "baton-b"
    config = head.volume("config")["configMap"]["name"]
    text = one(upgrade, "ConfigMap", config)["data"]["cluster.yaml"]
    assert parse_cluster_file(text, config).cluster == "baton-b"
    assert cluster_file(builds["overlays/gpu"]).cluster == "baton"  # etcd keys of their own
    schema = crd_schema(CRDS / "kuberay" / "ray.io_rayclusters.yaml", "v1")
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(rc)]
    assert not errors, errors


@pytest.mark.parametrize("target", [*TARGETS, "upgrade"])
def test_the_generation_label_selects_one_generations_own_objects(
    builds: dict[str, list[Obj]], upgrade: list[Obj], target: str
) -> None:
    """`kubectl apply -l app.kubernetes.io/instance=<generation>` applies the RayCluster and
    the ConfigMap it mounts, nothing shared, and the label is the RayCluster's name, which is
    its cluster.yaml's `cluster:` (its etcd keys)."""
    objects = upgrade if target == "upgrade" else builds[target]
    for rc in of_kind(objects, "RayCluster"):
        name = rc["metadata"]["name"]
        generation = [o for o in objects if o["metadata"].get("labels", {}).get(INSTANCE) == name]
        (head,) = [t for t in pod_templates([rc]) if t.group == "head"]
        config = head.volume("config")["configMap"]["name"]
        own = sorted((o["kind"], o["metadata"]["name"]) for o in generation)
        assert own == [("ConfigMap", config), ("RayCluster", name)]
        text = one(objects, "ConfigMap", config)["data"]["cluster.yaml"]
        assert parse_cluster_file(text, config).cluster == name
    assert of_kind(objects, "RayCluster")


def test_shared_objects_select_both_generations_alike(
    builds: dict[str, list[Obj]], upgrade: list[Obj]
) -> None:
    a, b = builds["overlays/gpu"], upgrade
    shared = selectors(a)
    assert selectors(b) == shared
    for name, selector in shared.items():
        keys = set(selector.get("matchLabels", {})) | {
            e["key"] for e in selector.get("matchExpressions", [])
        }
        assert not keys & {INSTANCE, "ray.io/cluster"}, f"{name} selects one generation"
        in_a = [t.group for t in pod_templates(a) if selects(selector, t.labels)]
        in_b = [
            t.group
            for t in pod_templates(b)
            if selects(selector, t.labels) and t.owner.startswith("RayCluster/")
        ]
        assert [g for g in in_a if g in ("head", "prefill", "decode")] == in_b, name
    for service in ("baton-http", "baton-grpc", "baton-metrics"):
        assert "head" in [
            t.group for t in pod_templates(b) if selects(shared[f"Service/{service}"], t.labels)
        ]


def test_the_upgrade_cluster_yaml_is_the_overlays_but_for_its_name() -> None:
    ours = (UPGRADE / "cluster.yaml").read_text().splitlines()
    theirs = (K8S / "overlays" / "gpu" / "cluster.yaml").read_text().splitlines()
    assert len(ours) == len(theirs)
    differ = [(a, b) for a, b in zip(theirs, ours, strict=True) if a != b]
    assert differ == [("cluster: baton", "cluster: baton-b")]


def test_the_upgrade_moves_every_use_of_the_baton_image_to_its_release(
    builds: dict[str, list[Obj]], upgrade: list[Obj]
) -> None:
    """Every Ray container of baton-b runs the new release; a shared object that runs the baton
    image follows it too (applied with the full build only); other images stay."""

    def images(objects: list[Obj]) -> dict[tuple[str, str], str]:
        return {
            (t.group, c["name"]): c["image"] for t in pod_templates(objects) for c in t.containers()
        }

    def ray(objects: list[Obj]) -> set[str]:
        return {
            c["image"]
            for t in pod_templates(of_kind(objects, "RayCluster"))
            for c in t.containers()
        }

    old, new = images(builds["overlays/gpu"]), images(upgrade)
    (old_release,), (new_release,) = ray(builds["overlays/gpu"]), ray(upgrade)
    assert new_release != old_release
    assert new_release.rpartition(":")[0] == old_release.rpartition(":")[0]
    assert new == {k: new_release if v == old_release else v for k, v in old.items()}


def test_the_upgrade_doc_uses_the_names_the_builds_make(
    builds: dict[str, list[Obj]], upgrade: list[Obj]
) -> None:
    doc = (K8S / "UPGRADE.md").read_text()
    assert f"kubectl -n {NAMESPACE} apply -k k8s/upgrade -l {INSTANCE}=baton-b" in doc
    assert f"kubectl -n {NAMESPACE} apply -k k8s/overlays/gpu -l {INSTANCE}=baton" in doc
    hooks = [
        m["mountPath"]
        for m in template(upgrade, "head").container("gateway")["volumeMounts"]
        if m["name"] == "hooks"
    ]
    assert hooks == ["/etc/baton/hooks"] and "python3 /etc/baton/hooks/drain.py" in doc
    assert (ROOT / "k8s" / "base" / "hooks" / "drain.py").is_file()
