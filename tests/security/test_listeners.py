"""Every listener binds loopback unless configured otherwise (docs/architecture.md, Rules).

The real servers are started with their defaults (the gateway's HTTP and gRPC, a decode
worker's KV server with its shm transport) and what they bound is read from the kernel:
every listening socket this process gained is on 127.0.0.1 or ::1, and nothing anywhere
listens on those ports on another address. Ray is not started: the settings cluster.fleet.ray_runtime
hands it are checked against a stand-in `ray` module. Every configuration surface (the CLI,
cluster.yaml, the config dataclasses, the actors) defaults to loopback, and no serving module
spells a wildcard address.
"""

from __future__ import annotations

import ast
import inspect
import ipaddress
import os
import stat
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from cluster.cli import _build_parser
from cluster.cluster_config import parse_cluster_file, to_server_config
from cluster.edge.grpc_server import GrpcConfig
from cluster.edge.http_api import HttpConfig
from cluster.fleet import ray_runtime
from cluster.fleet.decode_actor import DecodeActor
from cluster.membership.etcd import EtcdConfig
from cluster.server import ServerConfig
from kvcache.pool import DevicePool, KVLayout
from kvtransfer.grpc_transport import start_kv_server
from kvtransfer.listen import listen_address
from kvtransfer.shm import ShmRegion, shm_handler
from kvtransfer.transport import PoolReceiver, ReservationBook
from tests.cluster.conftest import ServerHandle, free_port
from tests.security.conftest import ROOT
from tests.security.test_no_pickle import SCANNED

pytestmark = pytest.mark.timeout(120)

LOOPBACK = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}


class Listener(NamedTuple):
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    inode: int


def listening() -> list[Listener]:
    """Every TCP socket in LISTEN state on this host (this network namespace)."""
    out = []
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":  # TCP_LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word in host (little-endian) order
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            address = ipaddress.ip_address(packed)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped  # a dual-stack socket bound to ::ffff:a.b.c.d
            out.append(Listener(address, int(hex_port, 16), inode))
    return out


def socket_inodes(pid: int | str = "self") -> set[int]:
    """The inodes of the sockets process `pid` holds open (none if it is gone)."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def own_listeners() -> list[Listener]:
    mine = socket_inodes()
    return [s for s in listening() if s.inode in mine]


def test_the_proc_reader_sees_a_wildcard_listener() -> None:
    # the check below must be able to fail: a socket on every interface is seen as such
    import socket

    with socket.socket() as wildcard:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        port = wildcard.getsockname()[1]
        seen = [s for s in own_listeners() if s.port == port]
        assert [s.address for s in seen] == [ipaddress.ip_address("0.0.0.0")]


async def test_every_listener_started_with_its_defaults_is_on_loopback(
    make_server: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    before = {s.inode for s in own_listeners()}
    # the gateway (HTTP + gRPC), on its default host
    grpc_port = free_port()
    gateway = make_server(grpc_port=grpc_port)
    assert gateway.running.http.config.host == HttpConfig().host
    http_port = int(gateway.url.rsplit(":", 1)[1])
    bound = {sock.getsockname()[0] for srv in gateway.running.http.servers for sock in srv.sockets}
    assert bound == {"127.0.0.1"}
    # a decode worker's KV server, with the shm transport beside it, on its default address
    pool = DevicePool(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2), 4, torch.float32)
    receiver = PoolReceiver(pool, ReservationBook(1, lambda res: None))
    region = ShmRegion(num_slots=1, slot_bytes=4096)
    kv_server, kv_port = await start_kv_server(receiver, extra_handlers=[shm_handler(receiver, region)])
    try:
        new = [s for s in own_listeners() if s.inode not in before]
        ports = {s.port for s in new}
        assert {http_port, grpc_port, kv_port} <= ports, (new, http_port, grpc_port, kv_port)
        assert all(s.address in LOOPBACK for s in new), [s for s in new if s.address not in LOOPBACK]
        # and no one (this process or another) listens on those ports on another address
        others = [s for s in listening() if s.port in ports and s.address not in LOOPBACK]
        assert not others, others
        # the shm region is a private file, not a socket
        mode = os.stat(region.path).st_mode
        assert stat.S_IMODE(mode) == 0o600 and region.path.startswith("/dev/shm/")
    finally:
        await kv_server.stop(None)
        region.close()


def test_every_configuration_surface_defaults_to_loopback() -> None:
    parser = _build_parser()
    for command in ("up", "serve"):
        assert parser.parse_args([command]).host == "127.0.0.1", command
    assert HttpConfig().host == GrpcConfig().host == ServerConfig().http.host == "127.0.0.1"
    from_yaml = to_server_config(parse_cluster_file(""))
    assert from_yaml.http.host == "127.0.0.1"
    assert from_yaml.disagg is None or from_yaml.disagg.membership.etcd_host == "127.0.0.1"
    assert EtcdConfig().host == "127.0.0.1"
    # the decode KV listener: loopback on a one-node Ray, and only an address the other nodes
    # can reach on more (kvtransfer.listen, tests/kvtransfer/test_listen.py)
    assert inspect.signature(DecodeActor.__init__).parameters["bind_host"].default == "auto"
    assert listen_address("auto", "", "10.0.0.5", num_nodes=1).bind == "127.0.0.1"
    assert from_yaml.disagg is None or from_yaml.disagg.bind_host == "auto"
    assert inspect.signature(start_kv_server).parameters["address"].default.startswith("127.0.0.1:")


def test_local_ray_is_asked_for_loopback_token_auth_and_no_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import: cluster.fleet.ray_runtime sets it
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    calls: list[dict[str, Any]] = []
    gcs = ["127.0.0.1:6379"]
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False  # type: ignore[attr-defined]
    fake.init = lambda **kw: calls.append(kw)  # type: ignore[attr-defined]
    fake.shutdown = lambda: calls.append({"shutdown": True})  # type: ignore[attr-defined]
    fake.get_runtime_context = lambda: types.SimpleNamespace(gcs_address=gcs[0])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake)
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.setenv(name, "x")  # recorded, so whatever start_local sets is undone
        monkeypatch.delenv(name)
    info = ray_runtime.start_local(num_cpus=1)
    (kw,) = calls
    assert kw["address"] == "local" and kw["_node_ip_address"] == "127.0.0.1"
    assert kw["include_dashboard"] is False and kw["dashboard_host"] == "127.0.0.1"
    assert len(os.environ["RAY_AUTH_TOKEN"]) >= 32  # token auth, a fresh per-process token
    assert info.node_ip == "127.0.0.1"
    # a Ray that came up anywhere else is shut down and refused
    calls.clear()
    gcs[0] = "10.0.0.5:6379"
    with pytest.raises(RuntimeError, match="not loopback"):
        ray_runtime.start_local(num_cpus=1)
    assert calls[-1] == {"shutdown": True}


WILDCARDS = {"0.0.0.0", "::", "[::]", "*"}


def test_no_serving_module_spells_a_wildcard_address() -> None:
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    value = node.value.strip()
                    if value in WILDCARDS or any(value.startswith(w + ":") for w in WILDCARDS - {"*"}):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, found
