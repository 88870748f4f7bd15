"""Where a worker's KV listener binds, and the address its reservations advertise.

A decode worker's KV server is what prefill workers push pages to, so its address must be one
they can reach. On one machine that is loopback, and nothing else should see the port; once
the Ray cluster spans nodes it must be the node's address, and a loopback address there is a
silent failure on every cross-node transfer (each one falls back to local prefill). So:

    bind_host   auto      loopback on a one-node cluster, the node's address on more
                node      the node's address (Ray's node IP), whatever the cluster's size
                <ip>      that address; 0.0.0.0 or :: binds every interface
    advertise   advertise_host when set (a NAT or a pod address), else the bound address,
                or the node's address when bound to every interface

listen_address refuses (ConfigError) an advertised address that other nodes cannot reach
(loopback on a multi-node cluster, a wildcard): a worker that cannot be reached must not
start, rather than start and fail every transfer.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from engine.errors import ConfigError

LOOPBACK = "127.0.0.1"
BIND_MODES = ("auto", "node")


@dataclass(frozen=True, slots=True)
class ListenAddress:
    bind: str  # the host the server binds (an IP, or a wildcard)
    advertise: str  # the host reservations name: what senders connect to

    def bind_at(self, port: int) -> str:
        return host_port(self.bind, port)

    def advertise_at(self, port: int) -> str:
        return host_port(self.advertise, port)


def listen_address(bind_host: str, advertise_host: str, node_ip: str, num_nodes: int) -> ListenAddress:
    """The KV listener of a worker on a node at `node_ip`, in a Ray cluster of `num_nodes`."""
    if bind_host == "auto":
        bind = node_ip if num_nodes > 1 else LOOPBACK
    elif bind_host == "node":
        bind = node_ip
    else:
        bind = check_host(bind_host, "transfer.bind_host")
    advertise = check_host(advertise_host, "transfer.advertise_host") if advertise_host else bind
    if is_wildcard(advertise):
        advertise = node_ip
    if is_wildcard(advertise):
        raise ConfigError("transfer.advertise_host", f"{advertise} is not an address a sender can connect to")
    if num_nodes > 1 and is_loopback(advertise):
        raise ConfigError(
            "transfer.bind_host",
            f"the KV listener would advertise {advertise}, which the other nodes of this {num_nodes}-node Ray "
            "cluster cannot reach; use bind_host auto or node (or an address of this node)",
        )  # fmt: skip
    return ListenAddress(bind, advertise)


def check_host(host: str, key: str) -> str:
    """An IP address as written in the config (a name would resolve differently per node)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        raise ConfigError(key, f"use auto, node or an IP address, got {host!r}") from None


def is_wildcard(host: str) -> bool:
    """Every interface (an unspecified address): what a server may bind, never what a sender dials."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def host_of(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
