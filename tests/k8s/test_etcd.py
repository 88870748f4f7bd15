"""The etcd StatefulSet as built (issue 23, finding 8): each member starts from the config file
its init container writes with `cluster.membership.etcd_member` (whose rejoin is tested against
real etcd members in tests/cluster/test_etcd_member.py); that file, rendered here by running the
init container's own command line, listens where the Services, probes and scrapes look, keeps
history compacted, and names every replica."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.membership import etcd_member
from cluster.membership.etcd_member import main
from tests.k8s.manifests import TARGETS, Obj, PodTemplate, cluster_file, one, template

TLS_SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}  # a kubernetes.io/tls Secret with its CA (cert-manager's)


def etcd_config(
    objects: list[Obj], tmp_path: Path, pod: str = "baton-etcd-1", namespace: str = "baton"
) -> tuple[Any, dict[str, str]]:
    """The config file baton-etcd's init container writes for `pod` (its args run here, with the
    env it gets from the downward API; the data dir empty and no member answering: a first
    start), and those args by name."""
    init = _init(template(objects, "baton-etcd"))
    env = {"POD_NAME": pod, "POD_NAMESPACE": namespace}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in init["args"]]
    assert init["command"] == ["python3", "-m", "cluster.membership.etcd_member"]
    out = tmp_path / "etcd.conf.yml"
    local = [_local(a, tmp_path) for a in args]
    assert main(local) == 0
    return yaml.safe_load(out.read_text()), dict(a.removeprefix("--").split("=", 1) for a in args)


def _local(arg: str, tmp_path: Path) -> str:
    """The pod's paths, under tmp_path (the out file at tmp_path/etcd.conf.yml)."""
    if arg.startswith("--out="):
        return f"--out={tmp_path / 'etcd.conf.yml'}"
    if arg.startswith("--data-dir="):
        return f"--data-dir={tmp_path / 'data'}"
    return arg


def _init(t: PodTemplate) -> Obj:
    inits = t.spec.get("initContainers", [])
    assert len(inits) == 1, f"{t.owner}: one init container writes etcd's config"
    init: Obj = inits[0]
    return init


@pytest.fixture(autouse=True)
def nobody_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No member is asked over the network here (the cluster DNS names do not resolve offline):
    the first start's plan. Asking real members: tests/cluster/test_etcd_member.py."""
    async def none(*_: object) -> None:
        return None

    monkeypatch.setattr(etcd_member, "_running", none)


@pytest.mark.parametrize("target", TARGETS)
def test_members_start_from_the_file_their_init_container_writes(
    builds: dict[str, list[Obj]], target: str, tmp_path: Path
) -> None:
    objects = builds[target]
    sts = one(objects, "StatefulSet", "baton-etcd")
    t = template(objects, "baton-etcd")
    etcd, init = t.container("etcd"), _init(t)
    config, args = etcd_config(objects, tmp_path)
    [config_file] = [a.split("=", 1)[1] for a in etcd["args"] if a.startswith("--config-file=")]
    assert etcd["args"] == [f"--config-file={config_file}"], "etcd ignores other flags once it has a file"
    assert args["out"] == config_file
    mounts = {m["name"]: m["mountPath"] for m in etcd["volumeMounts"]}
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    run = [n for n, path in mounts.items() if config_file.startswith(path + "/")]
    assert run and init_mounts[run[0]]["mountPath"] == mounts[run[0]], "the file reaches etcd"
    assert args["data-dir"].startswith(mounts["data"] + "/") and init_mounts["data"]["mountPath"] == mounts["data"]
    # every replica, by the names the StatefulSet gives them, under its headless Service
    names = [f"baton-etcd-{i}" for i in range(sts["spec"]["replicas"])]
    assert args["members"].split(",") == names
    assert args["domain"] == f"{sts['spec']['serviceName']}.baton.svc"
    assert [p.split("=")[0] for p in config["initial-cluster"].split(",")] == names
    # where the Services, the probes and the scrape look
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    assert config["listen-client-urls"].endswith(f":{ports['client']}")
    assert config["listen-peer-urls"].endswith(f":{ports['peer']}")
    assert config["listen-metrics-urls"].endswith(f":{ports['health']}")
    assert config["advertise-client-urls"] == f"http://baton-etcd-1.baton-etcd.baton.svc:{ports['client']}"
    assert config["auto-compaction-mode"] == "periodic" and config["auto-compaction-retention"]
    assert config["quota-backend-bytes"] >= 1 << 30


def test_the_init_container_runs_baton_image_as_the_members_do(builds: dict[str, list[Obj]]) -> None:
    for target in ("overlays/cpu", "overlays/gpu"):
        objects = builds[target]
        init = _init(template(objects, "baton-etcd"))
        head = template(objects, "head").container("ray-head")
        assert init["image"] == head["image"], target  # the overlay's image, with etcd_member in it
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        assert init["securityContext"]["allowPrivilegeEscalation"] is False
        assert init["resources"]["limits"]
        data = [m for m in init["volumeMounts"] if m["name"] == "data"]
        assert data and data[0].get("readOnly") is True  # it only looks for a member there


def _secret_mounted_at(t: PodTemplate, container: Obj, directory: str) -> str:
    """The Secret `container` of `t` has mounted, read-only, at `directory`."""
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert mount.get("readOnly") is True, f"{t.owner} {container['name']}: {directory} is writable"
    secret: str = t.volume(mount["name"])["secret"]["secretName"]
    return secret


def test_the_etcd_tls_component_puts_each_certificate_where_its_reader_looks(
    builds: dict[str, list[Obj]], component_builds: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """optional/etcd-tls (with cluster.yaml's lines marked for it): the members' certificate
    where the init container's --tls-dir names it and etcd then reads it (both containers), and
    the client certificate where cluster.yaml's membership.etcd points, in every container that
    talks to etcd: the gateway and each worker (they register with leases). Each from a
    `kubernetes.io/tls` Secret's file names (ca.crt, tls.crt, tls.key)."""
    plain = cluster_file(builds["overlays/gpu"]).membership.etcd
    assert not (plain.tls_ca or plain.tls_cert or plain.tls_key), "TLS is the component's, off by default"
    objects = component_builds["etcd-tls"]
    members = template(objects, "baton-etcd")
    init = _init(members)
    [tls_dir] = [a.split("=", 1)[1] for a in init["args"] if a.startswith("--tls-dir=")]
    files = etcd_member.Tls.in_dir(Path(tls_dir))
    assert {p.name for p in (files.ca, files.cert, files.key)} == TLS_SECRET_KEYS
    for container in (init, members.container("etcd")):
        assert _secret_mounted_at(members, container, tls_dir) == "baton-etcd-tls"
    config, _ = etcd_config(objects, tmp_path)
    assert config["advertise-client-urls"].startswith("https://")
    for side in ("client-transport-security", "peer-transport-security"):
        assert config[side]["client-cert-auth"] is True and config[side]["cert-file"].startswith(tls_dir + "/")
    access = cluster_file(objects).membership.etcd
    client_files = [Path(p) for p in (access.tls_ca, access.tls_cert, access.tls_key)]
    assert {p.name for p in client_files} == TLS_SECRET_KEYS and len({p.parent for p in client_files}) == 1
    for group, name in (("head", "gateway"), ("prefill", "ray-worker"), ("decode", "ray-worker")):
        t = template(objects, group)
        assert _secret_mounted_at(t, t.container(name), str(client_files[0].parent)) == "baton-etcd-client", group
