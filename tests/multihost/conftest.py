"""Fixtures of the multi-host suite: dev hosts (cluster.devhosts), network namespaces on this
machine, each with its own address, /dev/shm and Ray node.

    three_hosts         session-scoped DevHosts(3) with Ray up: baton_prefill on host 1,
                        baton_decode on host 2, baton_host_<i> on each; drive it from host 0
    devhosts_factory    make(n, **kw) -> a DevHosts not yet up; any still up at the end of
                        the test is torn down

They need root (`cluster.devhosts.available()`); elsewhere these tests skip with its one-line
reason, except where BATON_REQUIRE_MULTIHOST=1 (CI), where they fail instead.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from bench.etcd_proc import INSTALL_HINT, EtcdServer
from cluster.devhosts import DevHosts, available
from kvtransfer.tls import SERVER_NAME, KVTlsPaths
from tests.multihost.gateway import Gateway

REQUIRE_ENV = "BATON_REQUIRE_MULTIHOST"
LONG_MODEL_LEN = 4608  # the spread cluster's context: 4,000 prompt tokens and a long stream
TIMEOUT_S = 120  # per test, set-up included: the session's cluster comes up inside the first one
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test of this directory gets a timeout unless it sets its own."""
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S))


def require_devhosts() -> None:
    """Skip (or, under BATON_REQUIRE_MULTIHOST=1, fail) where dev hosts cannot be made."""
    reason = available()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def three_hosts() -> Iterator[DevHosts]:
    require_devhosts()
    with DevHosts(3, resources={1: {"baton_prefill": 100}, 2: {"baton_decode": 100}}) as hosts:
        yield hosts


@pytest.fixture
def devhosts_factory() -> Iterator[Callable[..., DevHosts]]:
    require_devhosts()
    made: list[DevHosts] = []

    def make(n: int, **kw: Any) -> DevHosts:
        hosts = DevHosts(n, **kw)
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.down()


class Spread(NamedTuple):
    hosts: DevHosts
    gw: Gateway
    etcd: EtcdServer
    etcd_ip: str  # a second address of this machine on the bridge: only etcd listens there


@pytest.fixture(scope="session")
def spread(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Spread]:
    """baton across three hosts (tests/multihost/gateway.py): the gateway on host 0, the prefill
    worker and one decode worker on host 1, the other decode worker on host 2 (one baton_decode
    unit on each, so Ray must put one there and one here), membership in a real etcd on this
    machine's own address on the bridge (its own, so that cutting host 0 from etcd leaves this
    process's path to the gateway alone), and mutual TLS on the KV ports (kvtransfer.tls: with
    one side's credential missing, no page would cross). test_across_hosts uses it first, test_host_faults
    then breaks and mends it."""
    require_devhosts()
    if shutil.which("etcd") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    resources = {1: {"baton_prefill": 100, "baton_decode": 1}, 2: {"baton_decode": 1}}
    with DevHosts(3, resources=resources) as hosts:
        etcd_ip = str(ipaddress.ip_address(hosts.bridge_ip) - 1)
        bridge = f"{hosts.tag}br"  # goes, with this address, when the hosts do
        subprocess.run(["ip", "addr", "add", f"{etcd_ip}/24", "dev", bridge], check=True, timeout=10)
        etcd = EtcdServer.launch(tmp_path_factory.mktemp("etcd-bridge"), host=etcd_ip)
        try:
            tls = kv_credential(tmp_path_factory.mktemp("kv-tls"))  # pages cross hosts over mutual TLS
            # the prefix cache on and a 4,000-token context: a lost or drained decode worker's
            # stream resumes from the prefill worker's retained copy (issue 26)
            extra = {"membership": {"backend": "etcd", "lease_ttl_s": 3, "etcd": {"host": etcd_ip, "port": etcd.port}},
                     "transfer": {"tls_cert": tls.cert, "tls_key": tls.key, "tls_ca": tls.ca},
                     "model": {"max_model_len": LONG_MODEL_LEN}, "kv_cache": {"prefix_cache": True}}  # fmt: skip
            with Gateway.start(hosts, tmp_path_factory.mktemp("across"), tiny_model_dir, extra=extra) as gw:
                yield Spread(hosts, gw, etcd, etcd_ip)
        finally:
            etcd.stop()


def kv_credential(directory: Path) -> KVTlsPaths:
    """The deployment's KV credential: a self-signed certificate naming SERVER_NAME, its own CA."""
    cert, key = directory / "kv.pem", directory / "kv.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=baton-kv",
         "-addext", f"subjectAltName=DNS:{SERVER_NAME}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return KVTlsPaths(str(cert), str(key), str(cert))
