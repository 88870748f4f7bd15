"""An etcd member's start on Kubernetes: its config file, and a member that lost its volume
rejoining the running cluster by itself (the etcd StatefulSet's init container, k8s/base/etcd.yaml).

    python -m cluster.membership.etcd_member --name baton-etcd-1 \\
        --members baton-etcd-0,baton-etcd-1,baton-etcd-2 --domain baton-etcd.baton.svc \\
        --data-dir /var/lib/etcd/data --out /run/etcd/etcd.conf.yml [--tls-dir /etc/etcd/tls]

Then `etcd --config-file /run/etcd/etcd.conf.yml` (the etcd image has no shell: the whole
configuration is this file). What it says depends on what this member finds:

    its data dir holds a member       as at the first start (etcd ignores initial-cluster-* then)
    empty, and no other member        initial-cluster-state new: the first start, every member
      answers                         starting at once (the StatefulSet's Parallel policy)
    empty, the cluster answers and    this member's first start, later than the others': `new`
      lists this member unstarted
    empty, the cluster answers and    the volume was lost, and with it the member's ID: remove the
      this member ran before          stale member of this name, add it again with its peer URL,
                                      and start as `existing` (a member started `new` against a
                                      running cluster crash-loops until someone repairs it by hand;
                                      an interrupted try is picked up where it stopped: _rejoin)

With --tls-dir (ca.crt, tls.crt, tls.key: a cert-manager or `kubernetes.io/tls` Secret), clients
and peers speak https and must present a certificate from that CA (--client-cert-auth). With
etcd's auth on, that certificate's CN must be `root`: removing and adding members is root's
(with another CN the rejoin stops at once, removing nothing, and says why).

Not told apart: an empty volume while no other member runs (all of etcd down at once) looks like
a first start, and that member starts a new cluster the others refuse (k8s/README.md, "etcd").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd.rpc  # type: ignore[import-untyped]
import grpc
import yaml

logger = logging.getLogger(__name__)

CLIENT_PORT, PEER_PORT, METRICS_PORT = 2379, 2380, 2381
CLUSTER_TOKEN = "baton-etcd"
PROBE_TIMEOUT_S = 3.0  # per member asked: a first start waits this long in all
ADD_PATIENCE_S = 60.0  # for the cluster to take a member again (add_member)
# Steady-state settings (the same for every start): history compacted hourly, a 1 GiB quota.
SETTINGS: dict[str, Any] = {
    "auto-compaction-mode": "periodic",
    "auto-compaction-retention": "1h",
    "quota-backend-bytes": 1 << 30,
    "initial-cluster-token": CLUSTER_TOKEN,
    "logger": "zap",
}


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    client_url: str  # where clients (and this tool) reach it
    peer_url: str  # where the other members reach it


@dataclass(frozen=True, slots=True)
class Tls:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> Tls:
        return cls(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")

    def security(self) -> dict[str, Any]:
        return {"cert-file": str(self.cert), "key-file": str(self.key), "trusted-ca-file": str(self.ca),
                "client-cert-auth": True}  # fmt: skip

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), self.key.read_bytes(), self.cert.read_bytes())


def has_member(data_dir: Path) -> bool:
    """etcd has initialised this data dir (its member/ directory, with a WAL)."""
    return (data_dir / "member" / "wal").is_dir()


async def plan(me: Member, members: Mapping[str, Member], data_dir: Path, listen: Mapping[str, str],
               tls: Tls | None = None) -> dict[str, Any]:  # fmt: skip
    """The config file's content for member `me` of `members` (by name); `listen` has the
    client, peer and metrics listen URLs. Rejoins the running cluster when the data dir is empty
    and the cluster answers (module docstring)."""
    config: dict[str, Any] = {
        **SETTINGS, "name": me.name, "data-dir": str(data_dir),
        "listen-client-urls": listen["client"], "advertise-client-urls": me.client_url,
        "listen-peer-urls": listen["peer"], "initial-advertise-peer-urls": me.peer_url,
        "listen-metrics-urls": listen["metrics"],
        "initial-cluster": ",".join(f"{m.name}={m.peer_url}" for m in members.values()),
        "initial-cluster-state": "new",
    }  # fmt: skip
    if tls is not None:
        config["client-transport-security"] = config["peer-transport-security"] = tls.security()
    if has_member(data_dir):
        logger.info("%s: its data dir holds a member: starting as before", me.name)
        return config
    others = [m for m in members.values() if m.name != me.name]
    running = await _running(others, tls)
    if running is None:
        logger.info("%s: empty data dir and no other member answers: a new cluster", me.name)
        return config
    joined = await _rejoin(running, me, tls)
    if joined is not None:
        config["initial-cluster"], config["initial-cluster-state"] = joined, "existing"
    return config


async def _running(others: list[Member], tls: Tls | None) -> Member | None:
    """The first other member that answers a member list (the cluster runs), or None."""
    for member in others:
        try:
            async with _channel(member, tls) as channel:
                await aetcd.rpc.ClusterStub(channel).MemberList(aetcd.rpc.MemberListRequest(),
                                                                timeout=PROBE_TIMEOUT_S)  # fmt: skip
            return member
        except grpc.aio.AioRpcError as exc:
            logger.info("%s does not answer (%s)", member.name, exc.code().name)
    return None


async def _rejoin(via: Member, me: Member, tls: Tls | None) -> str | None:
    """Join the cluster `via` answers for -> the initial-cluster string to start `existing`
    with, or None to start `new` as planned.

    The cluster lists `me` ...
      by its name, never started (no client URLs)   the first start, later than the others': None
      unnamed, never started                        added by an earlier try of this: join as added
      by its name, started                          it ran, and its data is gone: remove it, add it again
      not at all                                    removed by an earlier try: add it again"""
    async with _channel(via, tls) as channel:
        cluster = aetcd.rpc.ClusterStub(channel)
        listed = (await cluster.MemberList(aetcd.rpc.MemberListRequest(), timeout=PROBE_TIMEOUT_S)).members
        mine = [m for m in listed if m.name == me.name or list(m.peerURLs) == [me.peer_url]]
        if any(m.name == me.name and not m.clientURLs for m in mine):
            logger.info("%s: the cluster waits for this member's first start", me.name)
            return None
        if not any(not m.name and not m.clientURLs for m in mine):
            try:
                for old in mine:
                    logger.warning("%s lost its data: removing its old member %x", me.name, old.ID)
                    await cluster.MemberRemove(aetcd.rpc.MemberRemoveRequest(ID=old.ID), timeout=PROBE_TIMEOUT_S)
                added = await add_member(cluster, me.peer_url)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise
                raise SystemExit(f"{me.name} lost its data, and etcd refused to remove or add its member "
                                 f"({exc.details()}): with etcd's auth on, removing and adding members is the "
                                 "root user's, so the member certificate's CN must be root (k8s/README.md, "
                                 "etcd)") from None  # fmt: skip
            logger.warning("%s added again as member %x: joining the running cluster", me.name, added.member.ID)
            listed = added.members
        # the member added has no name until it starts: it is this one
        return ",".join(f"{m.name or me.name}={m.peerURLs[0]}" for m in listed if m.peerURLs)


async def add_member(cluster: Any, peer_url: str) -> Any:
    """MemberAdd, retried while etcd refuses it for the moment: as unsafe (UNAVAILABLE: it adds a
    voting member only once its leader has been connected to every other member for 5 s,
    --strict-reconfig-check, which a member removed a moment ago, or a cluster just started, is
    not yet), or as a removed member (NOT_FOUND: etcd derives a new member's ID from its peer
    URLs and the time in whole seconds, so adding the peer URL removed within the same second
    gives the removed ID again -- a member that rejoined, lost its volume again at once)."""
    deadline = asyncio.get_running_loop().time() + ADD_PATIENCE_S
    while True:
        try:
            return await cluster.MemberAdd(aetcd.rpc.MemberAddRequest(peerURLs=[peer_url]), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            retry = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
            if not retry or asyncio.get_running_loop().time() > deadline:
                raise
            logger.info("etcd does not add a member yet (%s): retrying", exc.details())
            await asyncio.sleep(1.0)


def _channel(member: Member, tls: Tls | None) -> grpc.aio.Channel:
    target = member.client_url.split("://", 1)[-1]
    if tls is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, tls.credentials())


def write(config: Mapping[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.membership.etcd_member", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--name", required=True, help="this member (the pod's name)")
    parser.add_argument("--members", required=True, help="every member's name, comma-separated")
    parser.add_argument("--domain", required=True, help="the headless Service's domain (baton-etcd.NAMESPACE.svc)")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="the config file etcd starts with")
    parser.add_argument("--tls-dir", type=Path, default=None, help="ca.crt, tls.crt, tls.key: https for all")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    names = [n for n in args.members.split(",") if n]
    if args.name not in names:
        parser.error(f"--name {args.name} is not one of --members")
    tls = Tls.in_dir(args.tls_dir) if args.tls_dir is not None else None
    scheme = "https" if tls is not None else "http"
    members = {n: Member(n, f"{scheme}://{n}.{args.domain}:{CLIENT_PORT}", f"{scheme}://{n}.{args.domain}:{PEER_PORT}")
               for n in names}  # fmt: skip
    listen = {"client": f"{scheme}://0.0.0.0:{CLIENT_PORT}", "peer": f"{scheme}://0.0.0.0:{PEER_PORT}",
              "metrics": f"http://0.0.0.0:{METRICS_PORT}"}  # fmt: skip
    write(asyncio.run(plan(members[args.name], members, args.data_dir, listen, tls)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
