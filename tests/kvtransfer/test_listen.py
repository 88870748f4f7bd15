"""kvtransfer.listen: a KV listener binds loopback on one node and an address the other nodes
can reach on more, and refuses to advertise one they cannot."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError
from kvtransfer.listen import ListenAddress, host_of, host_port, listen_address


@pytest.mark.parametrize(
    ("bind_host", "advertise_host", "num_nodes", "expected"),
    [
        ("auto", "", 1, ListenAddress("127.0.0.1", "127.0.0.1")),  # one node: nothing else sees the port
        ("auto", "", 3, ListenAddress("10.1.0.2", "10.1.0.2")),  # the cluster spans nodes
        ("node", "", 1, ListenAddress("10.1.0.2", "10.1.0.2")),
        ("0.0.0.0", "", 2, ListenAddress("0.0.0.0", "10.1.0.2")),  # every interface: the node's address
        ("0.0.0.0", "192.0.2.7", 2, ListenAddress("0.0.0.0", "192.0.2.7")),  # behind a NAT
        ("10.1.0.2", "", 2, ListenAddress("10.1.0.2", "10.1.0.2")),
        ("::", "", 2, ListenAddress("::", "10.1.0.2")),
    ],
)
def test_listen_address(bind_host: str, advertise_host: str, num_nodes: int, expected: ListenAddress) -> None:
    assert listen_address(bind_host, advertise_host, "10.1.0.2", num_nodes) == expected


@pytest.mark.parametrize(
    ("bind_host", "advertise_host", "node_ip"),
    [
        ("127.0.0.1", "", "10.1.0.2"),  # loopback on purpose, on a cluster of several nodes
        ("auto", "127.0.0.1", "10.1.0.2"),
        ("node", "", "127.0.0.1"),  # the node itself says loopback while others exist
        ("0.0.0.0", "::1", "10.1.0.2"),
    ],
)
def test_an_address_other_nodes_cannot_reach_is_refused(bind_host: str, advertise_host: str, node_ip: str) -> None:
    with pytest.raises(ConfigError, match="cannot reach") as err:
        listen_address(bind_host, advertise_host, node_ip, num_nodes=2)
    assert err.value.field == "transfer.bind_host"


@pytest.mark.parametrize(("bind_host", "advertise_host"), [("kv.example", ""), ("auto", "host-a"), ("auto", "0.0.0.0")])
def test_names_and_wildcards_are_refused_by_key(bind_host: str, advertise_host: str) -> None:
    with pytest.raises(ConfigError) as err:
        listen_address(bind_host, advertise_host, "0.0.0.0", num_nodes=1)
    assert err.value.field in ("transfer.bind_host", "transfer.advertise_host")


def test_addresses_format_and_parse_both_families() -> None:
    assert ListenAddress("::", "fd00::2").advertise_at(5) == "[fd00::2]:5" == host_port("fd00::2", 5)
    assert host_of("[fd00::2]:5") == "fd00::2" and host_of("10.0.0.1:80") == "10.0.0.1"
