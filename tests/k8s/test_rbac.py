"""The planner's way to the Kubernetes API (issue 23, finding 4), as built: the gateway runs
under a ServiceAccount whose Role may get and patch the RayClusters of baton's generations and
nothing else, the head pod names its RayCluster and namespace in the environment the scaler
reads (engine.env.kuberay_cluster), the workers mount no token, and a NetworkPolicy lets
the gateway reach the API server. (The patches it sends validate against the RayCluster schema:
tests/cluster/test_planner.py; with real Ray actors: tests/cluster/test_ray_drain.py.)"""

from __future__ import annotations

import pytest

from cluster.ops.planner_k8s import GROUP, PLURAL
from engine.env import KUBERAY_ENV, POD_NAME_ENV
from tests.k8s.manifests import K8S, TARGETS, Obj, kustomize, of_kind, one, template

SCALER_VERBS = {"get", "patch"}  # KubeRayScaler.apply: GET the RayCluster, merge-PATCH it


@pytest.fixture(scope="module")
def upgrade() -> list[Obj]:
    return kustomize(K8S / "upgrade")


def _role_for(objects: list[Obj], service_account: str) -> list[Obj]:
    """The rules of every Role bound to `service_account` in these objects."""
    rules: list[Obj] = []
    for binding in of_kind(objects, "RoleBinding"):
        if any(s["kind"] == "ServiceAccount" and s["name"] == service_account for s in binding["subjects"]):
            assert binding["roleRef"]["kind"] == "Role", "a ClusterRole would reach past the namespace"
            rules += one(objects, "Role", binding["roleRef"]["name"])["rules"]
    return rules


@pytest.mark.parametrize("target", [*TARGETS, "upgrade"])
def test_the_gateway_may_scale_its_raycluster_and_nothing_else(
    builds: dict[str, list[Obj]], upgrade: list[Obj], target: str
) -> None:
    objects = upgrade if target == "upgrade" else builds[target]
    head = template(objects, "head")
    account = head.spec.get("serviceAccountName")
    assert account and one(objects, "ServiceAccount", account)
    assert head.spec.get("automountServiceAccountToken", True) is not False
    rules = _role_for(objects, account)
    assert rules, f"no Role bound to {account}"
    name = one(objects, "RayCluster")["metadata"]["name"]
    for rule in rules:  # exactly the scaler's calls, on named RayClusters only
        assert rule["apiGroups"] == [GROUP] and rule["resources"] == [PLURAL], rule
        assert set(rule["verbs"]) == SCALER_VERBS, rule
        assert rule.get("resourceNames"), "a rule without resourceNames reaches every RayCluster"
    assert any(name in rule["resourceNames"] for rule in rules), f"RayCluster {name} is not in the Role"


@pytest.mark.parametrize("target", TARGETS)
def test_the_head_pod_names_its_raycluster_and_the_workers_their_pod_and_no_token(
    builds: dict[str, list[Obj]], target: str
) -> None:
    objects = builds[target]
    env = {e["name"]: e for e in template(objects, "head").container("gateway")["env"]}
    cluster_env, namespace_env = KUBERAY_ENV
    assert env[cluster_env]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['ray.io/cluster']"
    assert env[namespace_env]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    for group in ("prefill", "decode"):
        worker = template(objects, group)
        assert worker.spec.get("automountServiceAccountToken") is False, group
        # the pod a scale-in names: the actor reports it (cluster.fleet.scalers.pod_of_worker)
        pod = {e["name"]: e for e in worker.container("ray-worker")["env"]}[POD_NAME_ENV]
        assert pod["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", group


@pytest.mark.parametrize("target", TARGETS)
def test_the_gateway_reaches_the_api_server(builds: dict[str, list[Obj]], target: str) -> None:
    gateway = template(builds[target], "head").labels
    ports: set[int] = set()
    for np in of_kind(builds[target], "NetworkPolicy"):
        selector = np["spec"]["podSelector"].get("matchLabels", {})
        if "Egress" in np["spec"].get("policyTypes", []) and selector and all(
            gateway.get(k) == v for k, v in selector.items()
        ):
            for rule in np["spec"].get("egress", []):
                if not rule.get("to"):  # any address: the API server is no pod a selector names
                    ports |= {p["port"] for p in rule.get("ports", [])}
    assert {443, 6443} <= ports
