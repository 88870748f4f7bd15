"""cluster.membership.etcd_member against three real etcd members on loopback, each started
from the config file it writes (as the StatefulSet's init container does): a first start makes
a new cluster, also for a member that starts after the others; a member whose volume is lost
rejoins the running cluster by itself, with the data replicated to it, instead of crash-looping
as a `new` member would (issue 23, finding 8), also when an earlier try stopped half way."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aetcd  # type: ignore[import-untyped]
import grpc
import pytest
import yaml

from bench.server_proc import free_port
from cluster.membership.etcd_member import Member, Tls, has_member, main, plan, write
from tests.cluster.test_etcd_tls import Pki, enable_auth
from tests.etcd_server import INSTALL_HINT

pytestmark = pytest.mark.timeout(120)

NAMES = ("etcd-0", "etcd-1", "etcd-2")


class Trio:
    """Three members on 127.0.0.1, each with its own ports, data dir and config file; with
    `tls`, clients and peers speak https with that member certificate (as --tls-dir makes them)."""

    def __init__(self, root: Path, tls: Tls | None = None) -> None:
        self.root = root
        self.tls = tls
        scheme = "https" if tls is not None else "http"
        self.members = {n: Member(n, f"{scheme}://127.0.0.1:{free_port()}", f"{scheme}://127.0.0.1:{free_port()}")
                        for n in NAMES}  # fmt: skip
        self.metrics = {n: f"http://127.0.0.1:{free_port()}" for n in NAMES}  # /health, plain as on Kubernetes
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def data_dir(self, name: str) -> Path:
        return self.root / name / "data"

    def listen(self, name: str) -> dict[str, str]:
        m = self.members[name]
        return {"client": m.client_url, "peer": m.peer_url, "metrics": self.metrics[name]}

    async def configure(self, name: str) -> dict[str, object]:
        config = await plan(self.members[name], self.members, self.data_dir(name), self.listen(name), self.tls)
        config |= {"heartbeat-interval": 50, "election-timeout": 500, "log-level": "warn"}  # a fast test
        write(config, self.root / name / "etcd.conf.yml")
        return config

    def start(self, name: str) -> None:
        binary = shutil.which("etcd")
        assert binary is not None
        with open(self.root / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen([binary, "--config-file", str(self.root / name / "etcd.conf.yml")],
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def wait_healthy(self, name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.log(name)}"
            try:
                with urllib.request.urlopen(f"{self.metrics[name]}/health", timeout=1) as resp:
                    if b'"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{name} not healthy within {timeout_s} s:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return "\n".join((self.root / f"{name}.log").read_text(errors="replace").splitlines()[-15:])

    def client(self, name: str) -> aetcd.Client:
        return aetcd.Client("127.0.0.1", int(self.members[name].client_url.rsplit(":", 1)[1]), timeout=5)

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Trio]:
    if shutil.which("etcd") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    made = Trio(tmp_path)
    yield made
    made.stop()


async def _members(trio: Trio, via: str) -> dict[str, list[str]]:
    async with trio.client(via) as client:
        listed = await client.clusterstub.MemberList(aetcd.rpc.MemberListRequest(), timeout=5)
    return {m.name: list(m.peerURLs) for m in listed.members}


async def test_a_member_that_lost_its_volume_rejoins_with_the_data(trio: Trio) -> None:
    for name in NAMES:  # the first start: no member answers yet
        config = await trio.configure(name)
        assert config["initial-cluster-state"] == "new"
    for name in NAMES[:2]:
        trio.start(name)
    for name in NAMES[:2]:
        trio.wait_healthy(name)  # two of three: a quorum
    # the third starts later than the others: the cluster lists it unstarted, nothing is removed
    assert (await trio.configure("etcd-2"))["initial-cluster-state"] == "new"
    trio.start("etcd-2")
    trio.wait_healthy("etcd-2")
    async with trio.client("etcd-0") as client:
        await client.put(b"/baton/workers/p-0", b"kept")
    # a restart with its data: as before, nothing removed or added
    assert (await trio.configure("etcd-1"))["initial-cluster-state"] == "new" and has_member(trio.data_dir("etcd-1"))
    assert set(await _members(trio, "etcd-0")) == set(NAMES)

    trio.kill("etcd-2")
    shutil.rmtree(trio.data_dir("etcd-2"))  # its volume is gone, and with it its member ID
    config = await trio.configure("etcd-2")
    assert config["initial-cluster-state"] == "existing"
    assert sorted(part.split("=")[0] for part in str(config["initial-cluster"]).split(",")) == list(NAMES)
    trio.start("etcd-2")
    trio.wait_healthy("etcd-2")
    async with trio.client("etcd-2") as client:  # a serializable read: etcd-2's own copy
        got = await client.get(b"/baton/workers/p-0", serializable=True)
    assert got is not None and got.value == b"kept"
    listed = await _members(trio, "etcd-2")
    assert set(listed) == set(NAMES) and listed["etcd-2"] == [trio.members["etcd-2"].peer_url]


async def test_a_rejoin_cut_short_is_picked_up_where_it_stopped(trio: Trio) -> None:
    """A pod can die between the steps of a rejoin: after removing its old member (the cluster
    no longer lists it) or after adding itself again (listed, unnamed, never started). The next
    try of its init container goes on from there: it adds itself only when it is not listed,
    never twice, and joins with the data."""
    for name in NAMES:
        await trio.configure(name)
        trio.start(name)
    for name in NAMES:
        trio.wait_healthy(name)
    async with trio.client("etcd-0") as client:
        await client.put(b"/baton/workers/p-0", b"kept")
        stub = client.clusterstub

        async def lose_etcd_2() -> int:
            listed = (await stub.MemberList(aetcd.rpc.MemberListRequest(), timeout=5)).members
            lost = next(m.ID for m in listed if m.name == "etcd-2")
            trio.kill("etcd-2")
            shutil.rmtree(trio.data_dir("etcd-2"))
            for _ in range(200):  # bounded: a leader among the two left (etcd-2 may have led)
                leader = (await client.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=5)).leader
                if leader not in (0, lost):
                    return lost
                await asyncio.sleep(0.05)
            raise AssertionError("no leader after etcd-2 went")

        async def rejoin() -> None:
            config = await trio.configure("etcd-2")
            assert config["initial-cluster-state"] == "existing"
            assert sorted(p.split("=")[0] for p in str(config["initial-cluster"]).split(",")) == list(NAMES)
            trio.start("etcd-2")
            trio.wait_healthy("etcd-2")
            for _ in range(200):  # bounded: until the cluster has applied etcd-2's start (its name)
                listed = await _members(trio, "etcd-0")
                if "etcd-2" in listed:
                    break
                await asyncio.sleep(0.05)
            assert sorted(listed) == list(NAMES), listed  # one member each: none added twice
            async with trio.client("etcd-2") as joined:
                got = await joined.get(b"/baton/workers/p-0", serializable=True)
            assert got is not None and got.value == b"kept"

        # cut short after the removal: the cluster lists two members
        await stub.MemberRemove(aetcd.rpc.MemberRemoveRequest(ID=await lose_etcd_2()), timeout=5)
        assert sorted(await _members(trio, "etcd-0")) == ["etcd-0", "etcd-1"]
        await rejoin()
        # cut short after the add: a try removed and added it, and the pod went before etcd started
        await lose_etcd_2()
        assert (await trio.configure("etcd-2"))["initial-cluster-state"] == "existing"
        assert sorted(await _members(trio, "etcd-0")) == ["", "etcd-0", "etcd-1"]  # listed, unnamed
        await rejoin()


async def test_with_tls_and_auth_on_a_member_rejoins_by_its_root_certificate(tmp_path: Path) -> None:
    """etcd over https with client certificates required and its auth on (the etcd-tls
    component): a member that lost its volume rejoins as root -- its certificate's CN -- the only
    user that may remove and add members; with another CN the rejoin stops at once with the
    reason, and nothing is removed."""
    if shutil.which("etcd") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed: the etcd TLS tests make their certificates with it", pytrace=False)
    (tmp_path / "pki").mkdir()
    pki = Pki(tmp_path / "pki")
    root = Tls(pki.ca, *pki.issue("root"))
    trio = Trio(tmp_path, root)
    try:
        for name in NAMES:
            assert (await trio.configure(name))["client-transport-security"] == root.security()
            trio.start(name)
        for name in NAMES:
            trio.wait_healthy(name)
        port = int(trio.members["etcd-0"].client_url.rsplit(":", 1)[1])
        await enable_auth(port, root.ca, root.cert, root.key)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", root.credentials()) as channel:
            await aetcd.rpc.KVStub(channel).Put(aetcd.rpc.PutRequest(key=b"/secure/p-0", value=b"kept"), timeout=5)

        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", root.credentials()) as channel:
            status = aetcd.rpc.MaintenanceStub(channel).Status
            listed = await aetcd.rpc.ClusterStub(channel).MemberList(aetcd.rpc.MemberListRequest(), timeout=5)
            lost = next(m.ID for m in listed.members if m.name == "etcd-2")
            trio.kill("etcd-2")
            shutil.rmtree(trio.data_dir("etcd-2"))
            for _ in range(200):  # bounded: a leader among the two left (etcd-2 may have led)
                if (await status(aetcd.rpc.StatusRequest(), timeout=5)).leader not in (0, lost):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("no leader after etcd-2 went")
        other = Tls(pki.ca, *pki.issue("baton"))  # a certificate of the same CA, for the user baton
        with pytest.raises(SystemExit, match="CN must be root"):
            await plan(trio.members["etcd-2"], trio.members, trio.data_dir("etcd-2"), trio.listen("etcd-2"), other)
        assert set(await _members_over(trio, "etcd-0")) == set(NAMES)  # refused before anything was removed

        config = await trio.configure("etcd-2")  # as root
        assert config["initial-cluster-state"] == "existing"
        trio.start("etcd-2")
        trio.wait_healthy("etcd-2")
        joined = trio.members["etcd-2"].client_url.split("://", 1)[1]
        async with grpc.aio.secure_channel(joined, root.credentials()) as channel:  # etcd-2's own copy
            got = await aetcd.rpc.KVStub(channel).Range(aetcd.rpc.RangeRequest(key=b"/secure/p-0", serializable=True),
                                                        timeout=5)  # fmt: skip
        assert [kv.value for kv in got.kvs] == [b"kept"]
        assert set(await _members_over(trio, "etcd-2")) == set(NAMES)
    finally:
        trio.stop()


async def _members_over(trio: Trio, via: str) -> list[str]:
    assert trio.tls is not None
    target = trio.members[via].client_url.split("://", 1)[1]
    async with grpc.aio.secure_channel(target, trio.tls.credentials()) as channel:
        listed = await aetcd.rpc.ClusterStub(channel).MemberList(aetcd.rpc.MemberListRequest(), timeout=5)
    return [m.name for m in listed.members]


def test_the_command_writes_the_pod_config(tmp_path: Path) -> None:
    out = tmp_path / "run" / "etcd.conf.yml"
    assert main(["--name", "baton-etcd-1", "--members", "baton-etcd-0,baton-etcd-1,baton-etcd-2",
                 "--domain", "baton-etcd.baton.svc", "--data-dir", str(tmp_path / "data"), "--out", str(out)]) == 0  # fmt: skip
    config = yaml.safe_load(out.read_text())
    assert config["name"] == "baton-etcd-1" and config["initial-cluster-state"] == "new"  # nothing answered
    assert config["advertise-client-urls"] == "http://baton-etcd-1.baton-etcd.baton.svc:2379"
    assert config["initial-cluster"].split(",")[2] == "baton-etcd-2=http://baton-etcd-2.baton-etcd.baton.svc:2380"
    assert config["auto-compaction-mode"] == "periodic" and config["quota-backend-bytes"] == 1 << 30
    with pytest.raises(SystemExit):
        main(["--name", "x", "--members", "a,b", "--domain", "d", "--data-dir", "d", "--out", str(out)])


def test_tls_dir_makes_clients_and_peers_https(tmp_path: Path) -> None:
    out = tmp_path / "etcd.conf.yml"
    tls = tmp_path / "tls"
    main(["--name", "e-0", "--members", "e-0", "--domain", "d.svc", "--data-dir", str(tmp_path / "data"),
          "--out", str(out), "--tls-dir", str(tls)])  # fmt: skip
    config = yaml.safe_load(out.read_text())
    assert config["listen-client-urls"].startswith("https://") and config["initial-cluster"] == "e-0=https://e-0.d.svc:2380"
    for side in ("client-transport-security", "peer-transport-security"):
        assert config[side] == {"cert-file": str(tls / "tls.crt"), "key-file": str(tls / "tls.key"),
                                "trusted-ca-file": str(tls / "ca.crt"), "client-cert-auth": True}  # fmt: skip
    assert config["listen-metrics-urls"] == "http://0.0.0.0:2381"  # probes and scrapes stay plain


def test_probe_gives_up_quickly_when_nobody_answers(tmp_path: Path) -> None:
    started = time.monotonic()
    members = {n: Member(n, f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}") for n in NAMES}
    listen = {"client": "http://127.0.0.1:1", "peer": "http://127.0.0.1:2", "metrics": "http://127.0.0.1:3"}
    config = asyncio.run(plan(members["etcd-0"], members, tmp_path / "data", listen))
    assert config["initial-cluster-state"] == "new" and time.monotonic() - started < 10
