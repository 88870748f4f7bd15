"""Membership over an etcd that takes https only, with client certificates required and etcd's
own auth on (issue 23, finding 8): a real etcd on loopback, real certificates from openssl.

A worker proves itself by its client certificate (its CN is the etcd user: no token), or by
username and password (a token, which etcd forgets when it restarts: the client fetches a new
one and keeps its lease); a client without TLS, without a user or with a wrong password gets a
clear MembershipUnavailable, not a hang."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aetcd  # type: ignore[import-untyped]
import grpc
import pytest

from bench.etcd_proc import EtcdServer, EtcdServerTls
from cluster.cluster_config import load_cluster_config
from cluster.disagg_config import EtcdAccess
from cluster.membership.etcd import EtcdConfig, EtcdMembership
from cluster.membership.protocol import MembershipUnavailable, Role, WorkerInfo
from engine.errors import ConfigError
from tests.cluster.test_membership import wait_until

pytestmark = pytest.mark.timeout(90)

CLUSTER = "secure"  # the baton user's role may read and write /secure/ only
PASSWORD = "correct horse battery staple"


class Pki:
    """A CA and certificates it signed, each for 127.0.0.1 and both TLS uses."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca = directory / "ca.pem"
        self._ca_key = directory / "ca.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", self._ca_key, "-out", self.ca, "-days", "1", "-subj", "/CN=baton-test-ca")  # fmt: skip
        (directory / "ext.cnf").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:etcd.baton\nextendedKeyUsage=serverAuth,clientAuth\n"
        )

    def issue(self, name: str) -> tuple[Path, Path]:
        """(cert, key) with CN=`name`."""
        cert, key, csr = self.dir / f"{name}.pem", self.dir / f"{name}.key", self.dir / f"{name}.csr"
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", key, "-out", csr, "-subj", f"/CN={name}")  # fmt: skip
        _openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self._ca_key, "-CAcreateserial",
                 "-out", cert, "-days", "1", "-extfile", self.dir / "ext.cnf")  # fmt: skip
        return cert, key

    def access(self, name: str, **auth: str) -> EtcdAccess:
        cert, key = self.issue(name) if not (self.dir / f"{name}.pem").exists() else (
            self.dir / f"{name}.pem", self.dir / f"{name}.key")  # fmt: skip
        return EtcdAccess(tls_ca=str(self.ca), tls_cert=str(cert), tls_key=str(key), **auth)


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed: the etcd TLS tests make their certificates with it", pytrace=False)
    return Pki(tmp_path_factory.mktemp("etcd-pki"))


@pytest.fixture(scope="module")
def secure_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """An etcd serving https only (client certificates from `pki`), with auth on: users root
    and baton (role baton: read/write on /secure/), the way `etcdctl auth enable` leaves it."""
    server_cert, server_key = pki.issue("etcd-server")
    root_cert, root_key = pki.issue("root")
    tls = EtcdServerTls(pki.ca, server_cert, server_key, root_cert, root_key)
    server = EtcdServer.launch(tmp_path_factory.mktemp("secure-etcd"), name="secure", tls=tls)
    try:
        asyncio.run(enable_auth(server.port, pki.ca, root_cert, root_key))
        yield server
    finally:
        server.stop()


async def enable_auth(port: int, ca: Path, cert: Path, key: Path) -> None:
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        auth, rpc = aetcd.rpc.AuthStub(channel), aetcd.rpc
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=PASSWORD), timeout=10)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=10)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
        prefix = f"/{CLUSTER}/".encode()
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="baton"), timeout=10)
        permission = rpc.Permission(permType=rpc.Permission.READWRITE, key=prefix, range_end=prefix[:-1] + b"0")
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="baton", perm=permission), timeout=10)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="baton", password=PASSWORD), timeout=10)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="baton", role="baton"), timeout=10)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)


def _config(server: EtcdServer, access: EtcdAccess) -> EtcdConfig:
    return EtcdConfig(port=server.port, cluster=CLUSTER, lease_ttl_s=3, request_timeout_s=2.0, retry_s=0.1,
                      access=access)  # fmt: skip


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, Role.DECODE, f"{worker_id}.actor", "node-a", kv_address="127.0.0.1:7000",
                      num_pages=64)  # fmt: skip


async def test_a_client_certificate_is_the_worker_identity(secure_etcd: EtcdServer, pki: Pki) -> None:
    membership = await EtcdMembership.open(_config(secure_etcd, pki.access("baton")))  # CN=baton: no password
    try:
        epoch = await membership.register(_worker("d-cert"))
        await wait_until(lambda: "d-cert" in membership.members(), 20, "the worker in the view")
        assert membership.members()["d-cert"].epoch == epoch
        await membership.deregister("d-cert")
        await wait_until(lambda: not membership.members(), 20, "the worker gone")
    finally:
        await membership.close()


async def test_password_auth_survives_an_etcd_restart_that_forgets_the_token(
    secure_etcd: EtcdServer, pki: Pki, tmp_path: Path
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")  # a mounted Secret ends with a newline
    # a certificate whose CN is no etcd user: the password is what grants access
    access = pki.access("stranger", username="baton", password_file=str(password_file))
    membership = await EtcdMembership.open(_config(secure_etcd, access))
    try:
        epoch = await membership.register(_worker("d-pass"))
        secure_etcd.stop()
        secure_etcd.start()  # its simple tokens were in memory: the client's token is now unknown
        await wait_until(lambda: membership.stats().num_reauthentications >= 1, 20, "a new token fetched")
        await wait_until(lambda: membership.stats().is_connected, 20, "the watch back")
        assert await membership.register(_worker("d-after")) > epoch  # writes work again
        await wait_until(lambda: set(membership.members()) == {"d-pass", "d-after"}, 20, "both in the view")
        # the lease outlived etcd's restart and the new token: the first worker kept its epoch
        assert membership.members()["d-pass"].epoch == epoch
    finally:
        await membership.close()


async def test_clients_etcd_does_not_admit_get_a_clear_error(secure_etcd: EtcdServer, pki: Pki, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not the password")
    refused = {
        "plaintext": EtcdAccess(),
        "no etcd user": pki.access("stranger"),
        "wrong password": pki.access("stranger", username="baton", password_file=str(wrong)),
        "another cluster's keys": pki.access("baton"),
    }
    for why, access in refused.items():
        cfg = _config(secure_etcd, access)
        if why == "another cluster's keys":  # baton's role covers /secure/ only
            cfg = EtcdConfig(port=secure_etcd.port, cluster="other", request_timeout_s=2.0, access=access)
        with pytest.raises(MembershipUnavailable):
            membership = await EtcdMembership.open(cfg)
            await membership.close()
            pytest.fail(f"admitted: {why}")


def test_etcd_access_is_checked_and_read_from_cluster_yaml(tmp_path: Path) -> None:
    for bad in ({"tls_cert": "c.pem"}, {"tls_cert": "c.pem", "tls_key": "k.pem"}, {"username": "baton"},
                {"server_name": "etcd"}):  # fmt: skip
        with pytest.raises(ConfigError):
            EtcdAccess(**bad)
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "membership:\n  backend: etcd\n  etcd:\n    host: etcd.baton.svc\n    port: 2379\n"
        "    tls_ca: /etc/baton/etcd/ca.crt\n    tls_cert: /etc/baton/etcd/tls.crt\n"
        "    tls_key: /etc/baton/etcd/tls.key\n    server_name: etcd.baton\n"
        "workers:\n  prefill: {count: 1}\n  decode: {count: 1}\n"
    )
    disagg = load_cluster_config(path).disagg
    assert disagg is not None
    assert disagg.membership.etcd_access == EtcdAccess(
        "/etc/baton/etcd/ca.crt", "/etc/baton/etcd/tls.crt", "/etc/baton/etcd/tls.key", "etcd.baton"
    )
    path.write_text("membership:\n  etcd:\n    password: inline\n")
    with pytest.raises(ConfigError, match="password"):  # only a file: a password never sits in the config
        load_cluster_config(path)


async def test_a_missing_secret_file_is_a_config_error(pki: Pki, tmp_path: Path) -> None:
    access = pki.access("baton", username="baton", password_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="password_file"):
        await EtcdMembership.open(EtcdConfig(access=access))
