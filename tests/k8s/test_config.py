"""The cluster.yaml each build ships parses with baton's own schema, and agrees with the
manifests around it: worker counts and Ray resources, etcd's Service, the mounted paths, the
drain time; the placeholder key Secret parses as baton's key file."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cluster_config import to_server_config
from cluster.edge.tenants import ApiKeys
from tests.k8s.manifests import (
    K8S,
    TARGETS,
    Obj,
    cluster_file,
    one,
    ray_cluster,
    ray_resources,
    template,
    worker_group,
)

pytestmark = pytest.mark.timeout(120)


def _mounts(objects: list[Obj], group: str, container: str) -> dict[str, Obj]:
    t = template(objects, group)
    return {m["mountPath"]: t.volume(m["name"]) | {"_subPath": m.get("subPath")}
            for m in t.container(container).get("volumeMounts", [])}  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
def test_cluster_yaml_parses_and_builds_a_server_config(
    builds: dict[str, list[Obj]], target: str
) -> None:
    f = cluster_file(builds[target])
    cfg = to_server_config(f)
    assert cfg.disagg is not None and cfg.disagg.ray_address == "127.0.0.1:6379"
    assert f.api.host == "0.0.0.0" and f.api.port == 8000 and f.api.grpc_port == 50051
    assert f.api.api_keys_file is not None


def test_each_overlay_ships_its_own_cluster_yaml(builds: dict[str, list[Obj]]) -> None:
    texts = {
        t: one(builds[t], "ConfigMap", "baton-config")["data"]["cluster.yaml"] for t in TARGETS
    }
    for target in TARGETS:
        assert texts[target] == (K8S / target / "cluster.yaml").read_text()
    assert len(set(texts.values())) == 3
    assert cluster_file(builds["overlays/cpu"]).model.path == "baton-tiny"
    gpu = cluster_file(builds["overlays/gpu"])
    assert (
        gpu.model.device == "cuda"
        and gpu.workers.prefill.num_gpus >= 1
        and gpu.workers.decode.num_gpus >= 1
    )


@pytest.mark.parametrize("target", TARGETS)
def test_worker_counts_and_resources_match_the_groups(
    builds: dict[str, list[Obj]], target: str
) -> None:
    f = cluster_file(builds[target])
    for role, section in (("prefill", f.workers.prefill), ("decode", f.workers.decode)):
        group = worker_group(builds[target], role)
        assert section.count == group["replicas"], (
            f"{target}: workers.{role}.count != the {role} group's replicas"
        )
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        declared = ray_resources(group["rayStartParams"])
        for name, amount in section.resources.items():
            assert declared.get(name, 0) >= amount, (
                f"{target}: the {role} group does not declare {name}"
            )
        assert section.resources, (
            f"{target}: workers.{role}.resources is empty: actors could land anywhere"
        )
    # one actor per pod, and nothing baton places lands on the head
    head = ray_resources(ray_cluster(builds[target])["spec"]["headGroupSpec"]["rayStartParams"])
    assert not set(head) & (set(f.workers.prefill.resources) | set(f.workers.decode.resources))
    assert not set(f.workers.prefill.resources) & set(f.workers.decode.resources)


@pytest.mark.parametrize("target", TARGETS)
def test_membership_reaches_the_etcd_client_service(
    builds: dict[str, list[Obj]], target: str
) -> None:
    f = cluster_file(builds[target])
    assert f.membership.backend == "etcd"
    svc = one(builds[target], "Service", f.membership.etcd.host)
    assert f.membership.etcd.port in [p["port"] for p in svc["spec"]["ports"]]
    assert (
        svc["spec"]["selector"]
        == one(builds[target], "StatefulSet", "baton-etcd")["spec"]["selector"]["matchLabels"]
    )


@pytest.mark.parametrize("target", TARGETS)
def test_the_paths_cluster_yaml_names_are_mounted(
    builds: dict[str, list[Obj]], target: str
) -> None:
    objects, f = builds[target], cluster_file(builds[target])
    gateway = _mounts(objects, "head", "gateway")
    assert gateway["/etc/baton/cluster.yaml"]["configMap"]["name"] == "baton-config"
    assert gateway["/etc/baton/cluster.yaml"]["_subPath"] == "cluster.yaml"
    assert f.api.api_keys_file is not None
    keys_dir = str(Path(f.api.api_keys_file).parent)
    assert gateway[keys_dir]["secret"]["secretName"] == "baton-api-keys"
    assert Path(f.api.api_keys_file).name in one(objects, "Secret", "baton-api-keys")["data"]
    if f.model.path.startswith("/"):
        root = "/" + Path(f.model.path).parts[1]
        for group, container in (
            ("head", "gateway"),
            ("prefill", "ray-worker"),
            ("decode", "ray-worker"),
        ):
            assert root in _mounts(objects, group, container), (
                f"{target}: {group} does not mount {root}"
            )
    if f.kv_cache.disk_pages:
        assert f.kv_cache.disk_dir in _mounts(objects, "decode", "ray-worker"), (
            f"{target}: no volume at disk_dir"
        )


@pytest.mark.parametrize("target", TARGETS)
def test_a_draining_head_outlasts_the_longest_request(
    builds: dict[str, list[Obj]], target: str
) -> None:
    f = cluster_file(builds[target])
    head = template(builds[target], "head")
    grace = head.spec["terminationGracePeriodSeconds"]
    assert f.api.request_timeout_s + 20 <= grace
    for name in ("gateway", "ray-head"):
        cmd = head.container(name)["lifecycle"]["preStop"]["exec"]["command"]
        deadline = float(cmd[cmd.index("--deadline") + 1])
        assert f.api.request_timeout_s < deadline < grace, f"{name}: preStop deadline {deadline}"


def test_placeholder_keys_parse_and_each_token_is_one_of_them_with_its_role(
    builds: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """The ops token (the preStop drain) is an operator key; the scrape token (the PodMonitor)
    is a metrics key, which can neither generate nor drain."""
    import base64

    objects = builds["base"]
    keys_text = base64.b64decode(
        one(objects, "Secret", "baton-api-keys")["data"]["api_keys.txt"]
    ).decode()
    path = tmp_path / "api_keys.txt"
    path.write_text(keys_text)
    keys = ApiKeys.from_file(path)
    for secret, role in (("baton-ops-token", "operator"), ("baton-metrics-token", "metrics")):
        token = base64.b64decode(one(objects, "Secret", secret)["data"]["token"]).decode()
        assert token == token.strip() and " " not in token, (
            "the token goes into an Authorization header as is"
        )
        tenant = keys.lookup(token)
        assert tenant is not None and tenant.role == role, secret
    lines = [
        ln.split()[0]
        for ln in keys_text.splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    assert len(lines) == 3
    assert all(k.startswith("REPLACE_ME") for k in lines), (
        "placeholders must be recognisable (the gateway refuses them)"
    )


def test_the_gateway_refuses_placeholder_keys_except_in_the_demo(
    builds: dict[str, list[Obj]],
) -> None:
    def allow(target: str) -> str:
        env = {
            e["name"]: e.get("value")
            for e in template(builds[target], "head").container("gateway")["env"]
        }
        return str(env["BATON_K8S_ALLOW_PLACEHOLDER_KEYS"])

    assert allow("base") == "0" and allow("overlays/gpu") == "0" and allow("overlays/cpu") == "1"
    script = " ".join(template(builds["base"], "head").container("gateway")["args"])
    assert "REPLACE_ME" in script and "BATON_K8S_ALLOW_PLACEHOLDER_KEYS" in script
