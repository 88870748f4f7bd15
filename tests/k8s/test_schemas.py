"""Every object of every build validates: core kinds with kubernetes-validate in strict mode
(unknown fields are errors), the RayCluster's pod templates as Pods the same way, and the
custom resources with jsonschema against their CRDs (copied to tests/k8s/crds/), made strict,
and their CRDs' CEL rules (tests/k8s/cel.py)."""

from __future__ import annotations

from functools import cache

import jsonschema
import kubernetes_validate
import pytest

from tests.k8s.cel import cel_errors
from tests.k8s.manifests import COMPONENTS, CRDS, TARGETS, Obj, crd_schema, of_kind, pod_templates

pytestmark = pytest.mark.timeout(120)

# the oldest Kubernetes the manifests support and the newest kubernetes-validate ships (offline)
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_FILES = {
    ("ray.io/v1", "RayCluster"): CRDS / "kuberay" / "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): CRDS
    / "prometheus-operator"
    / "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): CRDS
    / "prometheus-operator"
    / "monitoring.coreos.com_prometheusrules.yaml",
}


@cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = crd_schema(CRD_FILES[(api_version, kind)], api_version.rsplit("/", 1)[1])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def _is_custom(o: Obj) -> bool:
    return (o["apiVersion"], o["kind"]) in CRD_FILES


def _core_errors(objects: list[Obj], version: str = KUBERNETES_VERSIONS[-1]) -> list[str]:
    errors = []
    for o in objects:
        if _is_custom(o):
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {exc.message} at {list(exc.path)}")
    return errors


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_core_objects_validate_strictly(builds: dict[str, list[Obj]], target: str, version: str) -> None:
    objects = builds[target]
    assert [o for o in objects if not _is_custom(o)]
    assert not _core_errors(objects, version), "\n".join(_core_errors(objects, version))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_ray_pod_templates_validate_as_pods(builds: dict[str, list[Obj]], target: str, version: str) -> None:
    rc = of_kind(builds[target], "RayCluster")
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": t.group, "labels": t.labels}, "spec": t.spec}
            for t in pod_templates(rc)]  # fmt: skip
    assert len(pods) == 3
    assert not _core_errors(pods, version), "\n".join(_core_errors(pods, version))


def _custom_errors(objects: list[Obj]) -> tuple[int, list[str]]:
    checked, errors = 0, []
    for o in objects:
        if not _is_custom(o):
            continue
        checked += 1
        for err in _crd_validator(o["apiVersion"], o["kind"]).iter_errors(o):
            errors.append(
                f"{o['kind']}/{o['metadata']['name']}: {err.message} at {list(err.absolute_path)}"
            )
        schema = crd_schema(CRD_FILES[(o["apiVersion"], o["kind"])], o["apiVersion"].rsplit("/", 1)[1])
        errors += [f"{o['kind']}/{o['metadata']['name']}: {e}" for e in cel_errors(o, schema)[1]]
    return checked, errors


@pytest.mark.parametrize("target", TARGETS)
def test_custom_resources_validate_against_their_crds(
    builds: dict[str, list[Obj]], target: str
) -> None:
    checked, errors = _custom_errors(builds[target])
    assert checked >= (3 if target == "overlays/gpu" else 1)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("component", COMPONENTS)
def test_optional_components_validate(
    component_builds: dict[str, list[Obj]], component: str
) -> None:
    objects = component_builds[component]
    checked, errors = _custom_errors(objects)
    assert checked == 3 and not errors, "\n".join(errors)
    for version in KUBERNETES_VERSIONS:
        assert not _core_errors(objects, version), "\n".join(_core_errors(objects, version))


def test_the_strict_crd_schema_rejects_a_misspelt_field(builds: dict[str, list[Obj]]) -> None:
    """The check above can fail: an unknown field in a pod template is an error."""
    import copy

    rc = copy.deepcopy(of_kind(builds["base"], "RayCluster")[0])
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert _custom_errors([rc])[1]


def test_a_crd_cel_rule_is_checked(builds: dict[str, list[Obj]]) -> None:
    """KubeRay's rule on spec.managedBy (x-kubernetes-validations), which the schema alone lets
    through."""
    import copy

    rc = copy.deepcopy(of_kind(builds["base"], "RayCluster")[0])
    rc["spec"]["managedBy"] = "someone-else"
    assert [e for e in _custom_errors([rc])[1] if "managedBy" in e]
    rc["spec"]["managedBy"] = "ray.io/kuberay-operator"
    assert not _custom_errors([rc])[1]


def test_strict_core_validation_rejects_a_misspelt_field(builds: dict[str, list[Obj]]) -> None:
    import copy

    sts = copy.deepcopy(of_kind(builds["base"], "StatefulSet")[0])
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPrt"] = 1
    assert _core_errors([sts])
