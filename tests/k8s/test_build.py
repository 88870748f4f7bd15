"""`kubectl kustomize` renders the base, both overlays and the gpu overlay with each optional
component; the objects hang together (namespaces, names referenced, images); the README sends
an operator there."""

from __future__ import annotations

import re

import pytest

from tests.k8s.manifests import (
    COMPONENTS,
    NAMESPACE,
    OVERLAYS,
    ROOT,
    TARGETS,
    Obj,
    of_kind,
    one,
    pod_templates,
)

pytestmark = pytest.mark.timeout(120)

CLUSTER_SCOPED = {"Namespace"}
# Secrets a deployment has but the build does not make: KubeRay generates "baton" (the Ray
# auth token, named after the RayCluster); the user creates the optional components' ones.
EXTERNAL_SECRETS = {"baton", "baton-model-store", "baton-redis", "baton-etcd-tls", "baton-etcd-client"}


@pytest.mark.parametrize("target", TARGETS)
def test_target_builds(builds: dict[str, list[Obj]], target: str) -> None:
    kinds = {o["kind"] for o in builds[target]}
    assert {"Namespace", "RayCluster", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget",
            "ConfigMap", "Secret"} <= kinds  # fmt: skip


@pytest.mark.parametrize("component", COMPONENTS)
def test_gpu_builds_with_each_optional_component(
    component_builds: dict[str, list[Obj]], component: str
) -> None:
    assert of_kind(component_builds[component], "RayCluster")


def test_gpu_overlay_brings_monitoring(builds: dict[str, list[Obj]]) -> None:
    gpu = builds["overlays/gpu"]
    one(gpu, "PodMonitor")
    one(gpu, "PrometheusRule")
    dashboards = [
        c
        for c in of_kind(gpu, "ConfigMap")
        if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(dashboards) == 1 and "baton.json" in dashboards[0]["data"]


def _all_builds(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> list[tuple[str, list[Obj]]]:
    return list(builds.items()) + [(f"gpu+{c}", objs) for c, objs in component_builds.items()]


def test_everything_in_one_namespace(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> None:
    for target, objects in _all_builds(builds, component_builds):
        one(objects, "Namespace", NAMESPACE)
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                assert o["metadata"].get("namespace") == NAMESPACE, (
                    f"{target}: {o['kind']}/{o['metadata']['name']}"
                )


def test_pods_reference_only_what_the_build_makes(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]]
) -> None:
    for target, objects in _all_builds(builds, component_builds):
        have = {(o["kind"], o["metadata"]["name"]) for o in objects}
        for t in pod_templates(objects):
            for v in t.spec.get("volumes", []):
                if "configMap" in v:
                    assert ("ConfigMap", v["configMap"]["name"]) in have, f"{target} {t.owner}: {v}"
                if "secret" in v:
                    name = v["secret"]["secretName"]
                    assert ("Secret", name) in have or name in EXTERNAL_SECRETS, f"{target} {t.owner}: {v}"
                if "persistentVolumeClaim" in v:
                    assert (
                        "PersistentVolumeClaim",
                        v["persistentVolumeClaim"]["claimName"],
                    ) in have, f"{target}: {v}"
            for c in t.containers():
                refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                        if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
                refs += [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
                for name in refs:
                    assert ("Secret", name) in have or name in EXTERNAL_SECRETS, (
                        f"{target} {t.owner}: secret {name}"
                    )


@pytest.mark.parametrize("target", OVERLAYS)
def test_images_are_pinned(builds: dict[str, list[Obj]], target: str) -> None:
    for t in pod_templates(builds[target]):
        for c in t.containers():
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and "/" not in tag and tag != "latest", (
                f"{t.owner}/{c['name']}: {image} has no pinned tag"
            )


def test_the_ray_version_is_the_projects(builds: dict[str, list[Obj]]) -> None:
    import tomllib

    from tests.k8s.manifests import ROOT, ray_cluster

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "cluster"
    ]
    pinned = [d.split("==", 1)[1] for d in deps if d.startswith("ray==")]
    assert pinned, "pyproject.toml's cluster extra pins no ray version"
    for target in TARGETS:
        assert ray_cluster(builds[target])["spec"]["rayVersion"] == pinned[0]


def test_the_readme_sends_an_operator_to_the_deployment() -> None:
    """Issue 23, finding 11: the README's layout has a `k8s/` row and a "Deploy on Kubernetes"
    section with the first three commands, pointing to k8s/README.md, and every path it names
    exists; nothing says `k8s/` is still to come."""
    text = (ROOT / "README.md").read_text()
    assert "| `k8s/` |" in text and "joins as its issue lands" not in text
    section = text.split("\n## Deploy on Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None and len(block.group(1).strip().splitlines()) == 3
    assert "kubectl apply -k k8s/overlays/gpu" in block.group(1)
    named = re.findall(r"\]\((k8s/[^)]+)\)", section) + re.findall(r"k8s/overlays/\w+", section)
    assert "k8s/README.md" in named and all((ROOT / path).exists() for path in named), named
