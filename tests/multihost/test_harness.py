"""The dev-hosts harness itself (cluster/devhosts.py): hosts reach each other over their veths,
a cut or shaped link acts on one host only, Ray nodes form one cluster whose actors land on the
hosts their resources name, a killed host rejoins, and nothing of a tag outlives its owner:
not after a clean exit, not after a failed `up`, not after the owner is SIGKILLed.

Cheap tests (no Ray) come first; the ones with Ray nodes last, so that at most the session's
three hosts run at once on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.cluster_config import parse_cluster_file
from cluster.devhosts import (
    STATE_DIR,
    DevHosts,
    DevHostsError,
    Host,
    cluster_yaml,
    describe,
    sweep_stale,
)
from tests.multihost.conftest import require_devhosts

ROOT = Path(__file__).resolve().parents[2]
PORT = 7000

# Host 0's echo server: reads each connection to EOF, answers with the byte count.
SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    c, _ = s.accept()
    n = 0
    while chunk := c.recv(1 << 16):
        n += len(chunk)
    c.sendall(str(n).encode())
    c.close()
"""
# Sends N bytes to the server and waits for its count: {"ok", "secs", "count"} or {"ok", "error"}.
CLIENT = """
import json, socket, sys, time
ip, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for attempt in range(20):  # the server may still be starting (refused); a cut link times out
    try:
        start = time.monotonic()
        c = socket.create_connection((ip, port), timeout=1.0)
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
    except OSError as exc:
        print(json.dumps({"ok": False, "error": repr(exc)})); sys.exit()
c.settimeout(30)
c.sendall(b"x" * size)
c.shutdown(socket.SHUT_WR)
count = int(c.recv(64))
print(json.dumps({"ok": True, "secs": time.monotonic() - start, "count": count}))
"""
# A driver on host 0: one actor by each role's resource; the decode one sums an array the
# prefill one made, which Ray's object manager moves between the two nodes over their link.
DRIVER = """
import json, sys
import numpy as np
import ray
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
class Where:
    def ip(self): return ray.util.get_node_ip_address()
    def make(self, n): return np.arange(n, dtype=np.uint8)
    def total(self, arr): return int(arr.sum(dtype=np.int64))

p = Where.options(resources={"baton_prefill": 1}).remote()
d = Where.options(resources={"baton_decode": 1}).remote()
total = ray.get(d.total.remote(p.make.remote(8 << 20)))
print(json.dumps({"prefill": ray.get(p.ip.remote()), "decode": ray.get(d.ip.remote()), "total": total}))
"""
# Owns two hosts (no Ray), leaves a process and a /dev/shm file on them, then waits to be killed.
OWNER = """
import sys, time
from cluster.devhosts import DevHosts
hosts = DevHosts(2, ray=False).up()
hosts.run(0, ["sh", "-c", "echo x > /dev/shm/baton-kv-probe"], timeout_s=10)
hosts.popen(1, [sys.executable, "-c", "import time; time.sleep(300)", hosts.tag])
while not hosts.pids(1):  # Popen returns before `ip netns exec` has switched namespaces
    time.sleep(0.01)
print(hosts.tag, flush=True)
time.sleep(300)
"""


def leftovers(tag: str) -> list[str]:
    """Whatever of this tag still exists on the machine."""
    found = [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(tag)] if os.path.isdir("/run/netns") else []
    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True).stdout)
    found += [f"link {x['ifname']}" for x in links if x["ifname"].startswith(tag)]
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if tag.encode() in cmdline:
                found.append(f"process {entry.name}: {cmdline[:120]!r}")
    found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines() if tag in line]
    found += [f"dir {p}" for p in (Path("/tmp") / tag,) if p.exists()]
    found += [f"state {p}" for p in (STATE_DIR / f"{tag}.json",) if p.exists()]
    found += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if tag in n]
    return found


def is_gone(pid: int) -> bool:
    """No such process, or only its zombie (this machine's init may not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def send(hosts: DevHosts, host: int, size: int) -> dict[str, object]:
    proc = hosts.run(host, [sys.executable, "-c", CLIENT, hosts.hosts[0].ip, str(PORT), str(size)], timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def start_server(hosts: DevHosts) -> subprocess.Popen[bytes]:
    return hosts.popen(0, [sys.executable, "-c", SERVER, hosts.hosts[0].ip, str(PORT)])


# ---- no Ray ----


class FailingHosts(DevHosts):
    """Fails half-way through `up`: after the bridge and host 0 are made."""

    def _make_host(self, h: Host) -> None:
        if h.index == 1:
            raise RuntimeError("injected failure making host 1")
        super()._make_host(h)


def test_a_failure_half_way_through_up_leaves_nothing() -> None:
    require_devhosts()
    hosts = FailingHosts(3, ray=False)
    with pytest.raises(RuntimeError, match="injected"):
        hosts.up()
    assert leftovers(hosts.tag) == []


def test_a_ray_node_that_refuses_to_start_fails_up_with_its_log_and_leaves_nothing(
    devhosts_factory: Callable[..., DevHosts],
) -> None:
    hosts = devhosts_factory(2, resources={0: {"CPU": 1}})  # Ray: CPU is --num-cpus, not a custom resource
    with pytest.raises(DevHostsError, match=r"(?s)host 0's `ray start` exited.*ray\.log"):
        hosts.up()
    assert leftovers(hosts.tag) == []


def test_sweep_removes_a_killed_owners_hosts_and_only_those(devhosts_factory: Callable[..., DevHosts]) -> None:
    live = devhosts_factory(1, ray=False).up()  # up() sweeps: this one must be up before the kill
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert owner.stdout is not None
        tag = owner.stdout.readline().strip()
        assert tag, "the owner did not bring its hosts up"
        sleeper = subprocess.run(["ip", "netns", "pids", f"{tag}-h1"], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert sleeper, "no process on host 1"
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
    # the fault happened: the owner is dead and its hosts are all still there
    there = leftovers(tag)
    assert {f"netns {tag}-h0", f"netns {tag}-h1", f"link {tag}br", f"state {STATE_DIR}/{tag}.json"} <= set(there)
    assert (Path("/tmp") / tag / "h0" / "shm" / "baton-kv-probe").exists()
    assert not os.path.exists("/dev/shm/baton-kv-probe"), "the host wrote to the machine's /dev/shm"

    removed = sweep_stale()

    # (a DevHosts.up() elsewhere on this machine may have swept it first: then its state file is gone)
    assert tag in removed or not (STATE_DIR / f"{tag}.json").exists()
    assert live.tag not in removed
    assert leftovers(tag) == []
    assert all(is_gone(int(p)) for p in sleeper)
    assert f"netns {live.hosts[0].netns}" in leftovers(live.tag)


def test_a_cut_link_isolates_one_host_until_restored(devhosts_factory: Callable[..., DevHosts]) -> None:
    hosts = devhosts_factory(3, ray=False).up()
    server = start_server(hosts)
    assert send(hosts, 1, 1000)["count"] == 1000
    assert send(hosts, 2, 1000)["count"] == 1000

    hosts.link_down(2)
    cut = send(hosts, 2, 1000)
    assert not cut["ok"] and "timed out" in str(cut["error"])
    assert send(hosts, 1, 1000)["ok"], "cutting host 2 cut host 1 too"

    hosts.link_up(2)
    assert send(hosts, 2, 1000)["count"] == 1000
    server.kill()
    server.wait()


def test_a_shaped_link_is_slow_until_unshaped(devhosts_factory: Callable[..., DevHosts]) -> None:
    hosts = devhosts_factory(2, ray=False).up()
    server = start_server(hosts)
    h = hosts.hosts[1]

    hosts.shape(1, rate_mbit=16)
    assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", h.veth], capture_output=True, text=True).stdout
    assert "tbf" in hosts.run(1, ["tc", "qdisc", "show", "dev", "eth0"], timeout_s=10).stdout
    shaped = send(hosts, 1, 2 << 20)  # 2 MiB at 16 Mbit/s: ~1 s; a shaper can only make it slower
    assert shaped["count"] == 2 << 20 and float(str(shaped["secs"])) > 0.8

    hosts.unshape(1)
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", h.veth], capture_output=True, text=True).stdout
    assert "tbf" not in hosts.run(1, ["tc", "qdisc", "show", "dev", "eth0"], timeout_s=10).stdout
    assert send(hosts, 1, 2 << 20)["count"] == 2 << 20
    server.kill()
    server.wait()


# ---- Ray ----


def test_a_ray_cluster_leaves_nothing_behind() -> None:
    require_devhosts()
    with DevHosts(2) as hosts:
        tag = hosts.tag
        assert len(set(hosts.node_ids.values())) == 2
        assert hosts.pids(0) and hosts.pids(1)
        probe = hosts.run(1, ["sh", "-c", f"echo x > /dev/shm/{tag}-probe"], timeout_s=10)
        assert probe.returncode == 0, probe.stderr
        assert Path(hosts.hosts[1].shm_dir, f"{tag}-probe").exists(), "host 1's /dev/shm is not its own"
        assert any("raylet" in x for x in leftovers(tag))
    assert leftovers(tag) == []


def test_actors_land_on_the_hosts_their_resources_name(three_hosts: DevHosts) -> None:
    hosts = three_hosts
    proc = hosts.run(0, [sys.executable, "-c", DRIVER, hosts.ray_address], timeout_s=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = json.loads(proc.stdout.strip().splitlines()[-1])
    n = 8 << 20
    assert placed == {"prefill": hosts.hosts[1].ip, "decode": hosts.hosts[2].ip, "total": (n // 256) * sum(range(256))}


def test_the_printed_cluster_yaml_is_valid(three_hosts: DevHosts) -> None:
    roles = {"prefill": 1, "decode": 2}
    f = parse_cluster_file(cluster_yaml(three_hosts, roles))
    assert f.ray.address == three_hosts.ray_address
    assert f.workers.prefill.resources == {"baton_prefill": 1} and f.workers.decode.resources == {"baton_decode": 1}
    assert f.api.host == three_hosts.hosts[0].ip
    # `baton dev hosts --write-config PATH`: the serve line names the file written
    assert "serve --config cluster.yaml\n" in describe(three_hosts, roles, "baton")
    said = describe(three_hosts, roles, "baton", "/run/dev.yaml")
    assert "cluster.yaml (written to /run/dev.yaml):" in said and "serve --config /run/dev.yaml\n" in said


def test_a_killed_host_rejoins_as_a_new_node(three_hosts: DevHosts) -> None:
    hosts = three_hosts
    old_id, old_pids = hosts.node_ids[2], hosts.pids(2)
    assert old_pids

    hosts.kill_host(2)
    assert hosts.pids(2) == [] and all(is_gone(p) for p in old_pids)

    hosts.link_up(2)
    hosts.start_ray(2)
    assert hosts.node_ids[2] != old_id and hosts.pids(2)  # start_ray waited for the head to list it alive
