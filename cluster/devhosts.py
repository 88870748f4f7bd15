"""Dev hosts: N "machines" on one Linux box, each a network namespace with its own IPv4 address,
its own /dev/shm and its own Ray node, so baton's prefill and decode actors can sit on different
hosts and move KV pages over a real (veth) link that a test can cut, slow down or lose.

    with DevHosts(3, resources={1: {"baton_prefill": 100}, 2: {"baton_decode": 100}}) as hosts:
        hosts.popen(0, [".venv/bin/baton", "serve", "--config", "cluster.yaml"])   # a driver on host 0
        hosts.shape(2, rate_mbit=50); hosts.link_down(2); hosts.kill_host(2); hosts.start_ray(2)

Layout; one tag (bt + 6 hex) names everything, so interface names stay within 15 characters:

    root namespace                                      namespace <tag>-h<i>
    <tag>br 10.R.0.254/24 --- <tag>h<i> (veth) ======== eth0 10.R.0.<i+1>/24, lo
                                                        ray start --block (the head on h0, :6379)
    /tmp/<tag>/h<i>/       Ray's --temp-dir (short: its unix socket paths must stay < 107 bytes)
    /tmp/<tag>/h<i>/shm    a tmpfs every process started on host i sees as /dev/shm
    /tmp/baton-devhosts/<tag>.json   what the tag owns, written before any of it is made

Why a private /dev/shm per host: two machines do not share one, so a transport that wrongly
used shm between hosts fails here as it would in production; baton's baton-kv-* regions (a
SIGKILLed decode worker leaves its own) go with the tmpfs, and the machine's /dev/shm is never
touched (Ray's plasma store unlinks its files at once: it leaves nothing there by name).
Drivers belong on host 0: Ray 2.60 finds a driver's raylet with `ps`, which sees every host's
(one pid namespace), and picks the head node's unless ray.init names `_node_ip_address`.

Children run without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (cluster.fleet.ray_runtime sets it to 0, which
keeps every listener on loopback and makes a second node refuse to join) and with a fresh
token (RAY_AUTH_MODE=token). Root only: `available()` says why not. A killed owner's leftovers
are removed by `sweep_stale()`, which every `up()` runs first (cluster/devhosts_footprint.py:
what a DevHosts owns and how it goes away).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from cluster.devhosts_footprint import (
    STATE_DIR,
    DevHostsError,
    Footprint,
    claimed_subnets,
    locked,
    pids_in,
    remove,
    sh,
    stop_processes,
    sweep_stale,
)

logger = logging.getLogger(__name__)

__all__ = ["STATE_DIR", "DevHosts", "DevHostsError", "Host", "available", "cluster_yaml", "describe", "sweep_stale"]

RAY_PORT = 6379  # each namespace has its own ports: the same one on every head never collides
OBJECT_STORE_BYTES = 128 << 20  # Ray's minimum is 75 MiB; KV pages do not travel through it
SUBNETS = range(200, 251)  # 10.R.0.0/24 candidates
START_TIMEOUT_S = 90.0
_MAX_ROOT_CHARS = 40  # + "/h12/session_<date>_<pid>/sockets/plasma_store" stays under 107
# Runs after `ip netns exec` has given the command a mount namespace of its own: bind the host's
# tmpfs over /dev/shm there, then become the command.
_WITH_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'
# Polls the GCS (no driver, no job) until every wanted IP has an alive node that is not an old
# one; prints {ip: node_id}. GcsClient is Ray-internal (pinned ray==2.60.0), `ray status` uses it.
_NODES_SNIPPET = """
import json, sys, time
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
address, want = sys.argv[1], json.loads(sys.argv[2])
while True:
    try:
        nodes = GcsClient(address=address).get_all_node_info(
            timeout=5, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
        found = {i.node_manager_address: n.hex() for n, i in nodes.items() if n.hex() != want.get(i.node_manager_address)}
        if all(ip in found for ip in want):
            print(json.dumps({ip: found[ip] for ip in want}), flush=True)
            break
    except Exception as exc:
        print(repr(exc), file=sys.stderr, flush=True)
    time.sleep(0.3)
"""


@dataclass(frozen=True, slots=True)
class Host:
    index: int
    netns: str
    ip: str
    veth: str  # the root-side interface: what link_down cuts and shape slows
    temp_dir: str  # Ray's --temp-dir and the node's log (ray.log)

    @property
    def shm_dir(self) -> str:
        """What this host's processes see as /dev/shm."""
        return f"{self.temp_dir}/shm"


def available() -> str | None:
    """None when dev hosts can be made here (root, `ip netns`, mount); else a one-line reason."""
    if not sys.platform.startswith("linux"):
        return "dev hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "dev hosts need root (network namespaces, veth, bridge, tmpfs mounts)"
    missing = [b for b in ("ip", "mount", "umount", "sh") if shutil.which(b) is None]
    if missing:
        return f"dev hosts need {', '.join(missing)} on PATH"
    probe = f"bt{secrets.token_hex(3)}-probe"
    made = sh(["ip", "netns", "add", probe], check=False)
    sh(["ip", "netns", "del", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip() or made.returncode}"
    return None


class DevHosts:
    """N namespaced hosts on a private bridge, each with a Ray node (ray=True); a context
    manager whose exit always tears everything down."""

    def __init__(self, n: int, *, resources: Mapping[int, Mapping[str, float]] | None = None,
                 num_cpus: int = 2, base_dir: Path | None = None, ray: bool = True) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n={n}: use 1..200 hosts")
        if any(not 0 <= i < n for i in resources or {}):
            raise ValueError(f"resources name hosts outside 0..{n - 1}")
        self.tag = f"bt{secrets.token_hex(3)}"
        self.n = n
        self.num_cpus = num_cpus
        self.resources = {i: dict((resources or {}).get(i, {})) for i in range(n)}
        self.root = (base_dir or Path("/tmp")) / self.tag
        if len(str(self.root)) > _MAX_ROOT_CHARS:
            raise ValueError(f"{self.root}: too long for Ray's unix sockets; use a base_dir "
                             f"of at most {_MAX_ROOT_CHARS - 9} characters")
        self.with_ray = ray
        self.env = _child_env()
        self._fp: Footprint | None = None
        self._nodes: dict[int, subprocess.Popen[bytes]] = {}
        self._node_ids: dict[int, str] = {}

    # ---- what the caller reads ----

    @property
    def hosts(self) -> list[Host]:
        fp = self._footprint()
        return [Host(i, fp.netns[i], f"10.{fp.subnet}.0.{i + 1}", fp.links[i], f"{self.root}/h{i}")
                for i in range(self.n)]

    @property
    def bridge_ip(self) -> str:
        """The root namespace's own address on the bridge: this machine as the hosts see it."""
        return f"10.{self._footprint().subnet}.0.254"

    @property
    def ray_address(self) -> str:
        return f"{self.hosts[0].ip}:{RAY_PORT}"

    @property
    def node_ids(self) -> dict[int, str]:
        """Each host's current Ray node id (a restarted node has a new one)."""
        return dict(self._node_ids)

    # ---- lifecycle ----

    def __enter__(self) -> DevHosts:
        return self.up()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.down()

    def up(self) -> DevHosts:
        if self._fp is not None:
            raise DevHostsError(f"{self.tag} is already up")
        started = time.monotonic()
        try:
            self._claim()
            self._make_bridge()
            for host in self.hosts:
                self._make_host(host)
            if self.with_ray:
                self._start_cluster()
        except BaseException:
            self.down()
            raise
        logger.info("dev hosts %s: %d hosts up in %.1f s", self.tag, self.n, time.monotonic() - started)
        return self

    def down(self) -> None:
        """Stop every process on the hosts and remove all this made; safe to call again."""
        fp, self._fp = self._fp, None
        if fp is None:
            return
        started = time.monotonic()
        remove(fp)
        for proc in self._nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._nodes.clear()
        (STATE_DIR / f"{fp.tag}.json").unlink(missing_ok=True)
        logger.info("dev hosts %s: down in %.1f s", fp.tag, time.monotonic() - started)

    # ---- processes on a host ----

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv as run inside host's namespace, with the host's /dev/shm."""
        h = self.hosts[host]
        return ["ip", "netns", "exec", h.netns, "sh", "-c", _WITH_SHM, h.shm_dir, *argv]

    def popen(self, host: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start argv on host (env: self.env unless given). It returns before `ip netns exec`
        has switched namespaces: pids(host) lists the process a moment later."""
        kw.setdefault("env", self.env)
        return subprocess.Popen(self.command(host, argv), **kw)

    def run(self, host: int, argv: Sequence[str], timeout_s: float, **kw: Any) -> subprocess.CompletedProcess[Any]:
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
            kw.setdefault("text", True)
        kw.setdefault("env", self.env)
        return subprocess.run(self.command(host, argv), timeout=timeout_s, check=False, **kw)

    def pids(self, host: int) -> list[int]:
        return pids_in([self.hosts[host].netns])

    # ---- faults ----

    def link_down(self, host: int) -> None:
        """Cut the host off from every other (its eth0 loses carrier; nothing is reset)."""
        _ip("link", "set", self.hosts[host].veth, "down")

    def link_up(self, host: int) -> None:
        _ip("link", "set", self.hosts[host].veth, "up")

    def shape(self, host: int, rate_mbit: float) -> None:
        """Limit the host's link to rate_mbit each way (a token bucket on both veth ends)."""
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(64 << 10, int(rate_bytes * 0.01))  # >= a GSO packet; ~10 ms of traffic
        tbf = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        h = self.hosts[host]
        sh(["tc", "qdisc", "replace", "dev", h.veth, *tbf])
        sh(["tc", "-n", h.netns, "qdisc", "replace", "dev", "eth0", *tbf])

    def unshape(self, host: int) -> None:
        h = self.hosts[host]
        sh(["tc", "qdisc", "del", "dev", h.veth, "root"], check=False)  # none there: fine
        sh(["tc", "-n", h.netns, "qdisc", "del", "dev", "eth0", "root"], check=False)

    def kill_host(self, host: int) -> None:
        """A lost machine: its link goes down first (peers get no FIN or RST, only silence),
        then every process on it is SIGKILLed. Its /dev/shm keeps what they left."""
        self.link_down(host)
        stop_processes([self.hosts[host].netns], grace_s=0.0)
        node = self._nodes.pop(host, None)
        if node is not None:
            node.wait(timeout=5)

    def start_ray(self, host: int) -> None:
        """(Re)start host's Ray node and wait until the head lists it alive (after kill_host
        and link_up it joins as a new node). Restarting the head alone does not bring the other
        nodes back: theirs lose the GCS they knew."""
        node = self._nodes.get(host)
        if node is not None and node.poll() is None:
            raise DevHostsError(f"host {host}'s Ray node is still running (pid {node.pid})")
        self._spawn_ray(host)
        if host == 0:
            self._wait_head()
        self._node_ids.update(self._wait_nodes([host]))

    # ---- making it ----

    def _footprint(self) -> Footprint:
        if self._fp is None:
            raise DevHostsError(f"{self.tag} is not up")
        return self._fp

    def _claim(self) -> None:
        """Sweep, pick a free subnet and record the footprint, under one lock so that two
        owners never pick the same subnet."""
        STATE_DIR.mkdir(mode=0o700, exist_ok=True)
        with locked(STATE_DIR / ".lock"):
            sweep_stale()
            fp = Footprint.plan(self.tag, _pick_subnet(claimed_subnets()), self.n, self.root)
            tmp = STATE_DIR / f".{self.tag}.tmp"
            tmp.write_text(json.dumps(asdict(fp)))
            os.replace(tmp, STATE_DIR / f"{self.tag}.json")
            self._fp = fp

    def _make_bridge(self) -> None:
        bridge = self._footprint().links[-1]
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_ip}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")

    def _make_host(self, h: Host) -> None:
        _ip("netns", "add", h.netns)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        _ip("link", "set", h.veth, "master", self._footprint().links[-1])
        _ip("link", "set", h.veth, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        os.makedirs(h.shm_dir, exist_ok=True)
        sh(["mount", "-t", "tmpfs", "-o", "mode=1777", f"{self.tag}-shm", h.shm_dir])

    def _start_cluster(self) -> None:
        self._spawn_ray(0)
        self._wait_head()
        for i in range(1, self.n):
            self._spawn_ray(i)
        self._node_ids = self._wait_nodes(range(self.n))

    def _spawn_ray(self, host: int) -> None:
        h = self.hosts[host]
        where = (["--head", "--port", str(RAY_PORT), "--include-dashboard", "false", "--dashboard-host", "127.0.0.1"]
                 if host == 0 else ["--address", self.ray_address])
        resources = {f"baton_host_{host}": 100.0, **self.resources[host]}
        argv = [_ray_bin(), "start", *where, "--node-ip-address", h.ip, "--block", "--temp-dir", h.temp_dir,
                "--num-cpus", str(self.num_cpus), "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--disable-usage-stats", "--resources", json.dumps(resources)]
        with open(f"{h.temp_dir}/ray.log", "ab") as log:
            # a session of its own: the CLI's Ctrl-C reaches baton, which then stops the nodes in order
            self._nodes[host] = self.popen(host, argv, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_head(self) -> None:
        """Until the GCS port accepts connections (from the root namespace, over the bridge)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_nodes([0])
            with contextlib.suppress(OSError), socket.create_connection((self.hosts[0].ip, RAY_PORT), 0.5):
                return
            time.sleep(0.2)
        raise DevHostsError(f"the Ray head did not listen within {START_TIMEOUT_S:.0f} s{self._tails([0])}")

    def _wait_nodes(self, indices: Sequence[int]) -> dict[int, str]:
        """Until each host in indices has a new alive node; its node id by host."""
        want = {self.hosts[i].ip: self._node_ids.get(i, "") for i in indices}
        probe = self.popen(0, [sys.executable, "-c", _NODES_SNIPPET, self.ray_address, json.dumps(want)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while probe.poll() is None:
                self._check_nodes(indices)
                if time.monotonic() > deadline:
                    raise DevHostsError(f"hosts {list(indices)} did not join the Ray cluster within "
                                        f"{START_TIMEOUT_S:.0f} s{self._tails(indices)}")
                time.sleep(0.2)
            out, err = probe.communicate()
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.communicate()
        if probe.returncode != 0:
            raise DevHostsError(f"the node probe failed ({probe.returncode}): {err.strip()[-2000:]}")
        by_ip: dict[str, str] = json.loads(out)
        return {i: by_ip[self.hosts[i].ip] for i in indices}

    def _check_nodes(self, indices: Sequence[int]) -> None:
        for i in indices:
            node = self._nodes.get(i)
            if node is not None and node.poll() is not None:
                raise DevHostsError(f"host {i}'s `ray start` exited with {node.returncode}{self._tails([i])}")

    def _tails(self, indices: Sequence[int]) -> str:
        return "".join(f"\n--- host {i}: {h.temp_dir}/ray.log\n{_tail(Path(h.temp_dir) / 'ray.log')}"
                       for i, h in enumerate(self.hosts) if i in indices)


# ---- what `baton dev hosts` prints ----


def cluster_yaml(hosts: DevHosts, roles: Mapping[str, int]) -> str:
    """A minimal cluster.yaml for `baton serve` on host 0: the gateway on host 0's address (this
    machine reaches it over the bridge), each role's workers held to its host by the resource
    DevHosts gave that host (roles: "prefill"/"decode" -> host index)."""
    lines = ["ray:", f"  address: {hosts.ray_address}", "workers:"]
    for role in ("prefill", "decode"):
        pin = f", resources: {{baton_{role}: 1}}" if role in roles else ""
        lines.append(f"  {role}: {{count: 1{pin}}}")
    lines += ["api:", f"  host: {hosts.hosts[0].ip}", "  port: 8000", ""]
    return "\n".join(lines)


def describe(hosts: DevHosts, roles: Mapping[str, int], baton: str, written: str | None = None) -> str:
    """How to use running dev hosts: each host, the Ray address and token, a serve line (its
    --config the file `written`, where the cluster.yaml was saved, else cluster.yaml to make)."""
    by_host = {i: f"baton_{role}" for role, i in roles.items()}
    rows = [f"  host {h.index}  {h.netns:<14} {h.ip:<13} {'Ray head  ' if h.index == 0 else ''}"
            f"{by_host.get(h.index, '')}".rstrip() for h in hosts.hosts]
    token = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN={hosts.env['RAY_AUTH_TOKEN']}"
    return "\n".join([
        f"{len(rows)} dev hosts up (tag {hosts.tag}); this machine is {hosts.bridge_ip} on their bridge",
        *rows,
        f"Ray address: {hosts.ray_address}",
        "",
        "Ray's token, for drivers and `ray status`:",
        f"  export {token}",
        "",
        f"cluster.yaml (written to {written}):" if written else "cluster.yaml (save it as such):",
        *("  " + line for line in cluster_yaml(hosts, roles).splitlines()),
        "",
        "serve from host 0 (drivers belong there):",
        f"  ip netns exec {hosts.hosts[0].netns} env {token} {baton} serve --config {written or 'cluster.yaml'}",
        f"  curl http://{hosts.hosts[0].ip}:8000/v1/models",
        "",
        "Ctrl-C (or SIGTERM) stops every host and removes them.",
    ])  # fmt: skip


# ---- small helpers ----


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_TOKEN_PATH", None)  # the token above is the one every node and driver uses
    return env


def _pick_subnet(taken: set[int]) -> int:
    """The first 10.R.0.0/24 that overlaps no address or route here nor another owner's."""
    used = []
    for what in ("addr", "route"):
        for entry in json.loads(sh(["ip", "-4", "-j", what]).stdout or "[]"):
            if what == "addr":
                used += [f"{a['local']}/{a['prefixlen']}" for a in entry.get("addr_info", [])]
            elif entry.get("dst", "default") != "default":
                used.append(entry["dst"])
    nets = [ipaddress.ip_network(u, strict=False) for u in used]
    for r in SUBNETS:
        if r not in taken and not any(ipaddress.ip_network(f"10.{r}.0.0/24").overlaps(n) for n in nets):
            return r
    raise DevHostsError(f"no free subnet among 10.{SUBNETS[0]}..10.{SUBNETS[-1]}.0.0/24")


def _ray_bin() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray") or "ray"


def _ip(*args: str) -> None:
    sh(["ip", *args])


def _tail(path: Path, num_bytes: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - num_bytes))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
