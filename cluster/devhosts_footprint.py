"""What one DevHosts owns and how it goes away (cluster.devhosts): the footprint recorded in a
state file before anything is made, the teardown that removes exactly that (down() and, for an
owner that died, sweep_stale()), and the process bookkeeping both need.

    /tmp/baton-devhosts/<tag>.json    a Footprint: the owner (pid and start time), its subnet,
                                      namespaces, links, mounts and directories, all named by
                                      its tag; a file naming anything outside the tag is refused
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import BatonError

logger = logging.getLogger(__name__)

STATE_DIR = Path("/tmp/baton-devhosts")
_TAG = re.compile(r"bt[0-9a-f]{6}")


class DevHostsError(BatonError):
    """A step of making or running the dev hosts failed; the message names it (and a log tail)."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """Everything one DevHosts makes, recorded before it is made: down() and sweep_stale()
    remove exactly this, whatever step a failure or a SIGKILL interrupted."""

    tag: str
    owner_pid: int
    owner_start: int  # the owner's start time in clock ticks: a reused pid is not the owner
    subnet: int
    netns: tuple[str, ...]
    links: tuple[str, ...]  # veths first, then the bridge
    mounts: tuple[str, ...]
    dirs: tuple[str, ...]

    @staticmethod
    def plan(tag: str, subnet: int, n: int, root: Path) -> Footprint:
        pid = os.getpid()
        return Footprint(
            tag, pid, start_ticks(pid), subnet,
            netns=tuple(f"{tag}-h{i}" for i in range(n)),
            links=(*(f"{tag}h{i}" for i in range(n)), f"{tag}br"),
            mounts=tuple(f"{root}/h{i}/shm" for i in range(n)),
            dirs=(str(root),),
        )  # fmt: skip

    @staticmethod
    def from_json(text: str) -> Footprint:
        """Parse a state file, refusing any name outside its own tag (never remove another's)."""
        raw: dict[str, Any] = json.loads(text)
        fp = Footprint(str(raw["tag"]), int(raw["owner_pid"]), int(raw["owner_start"]), int(raw["subnet"]),
                       *(tuple(str(x) for x in raw[k]) for k in ("netns", "links", "mounts", "dirs")))
        names = (*fp.netns, *fp.links)
        paths = (*fp.mounts, *fp.dirs)
        if (not _TAG.fullmatch(fp.tag) or not all(x.startswith(fp.tag) for x in names)
                or not all(f"/{fp.tag}" in p and p.startswith("/") and ".." not in p for p in paths)):
            raise ValueError(f"state file of {fp.tag!r} names something outside its tag")
        return fp


def sweep_stale() -> list[str]:
    """Remove what DevHosts left behind whose owner process is gone (SIGKILL, a crash); those
    of live owners stay. Returns the tags removed."""
    removed = []
    for path in sorted(STATE_DIR.glob("bt*.json")):
        try:
            fp = Footprint.from_json(path.read_text())
        except (OSError, ValueError, TypeError, KeyError) as exc:
            logger.warning("dev hosts: ignoring unreadable state file %s: %s", path, exc)
            continue
        if is_alive(fp.owner_pid, fp.owner_start):
            continue
        logger.info("dev hosts: removing %s, left by dead owner %d", fp.tag, fp.owner_pid)
        remove(fp)
        path.unlink(missing_ok=True)
        removed.append(fp.tag)
    return removed


# ---- tearing down (shared by down() and sweep_stale()) ----


def remove(fp: Footprint) -> None:
    stop_processes(list(fp.netns), grace_s=5.0)
    for link in fp.links:  # a veth goes with its namespace too, but asynchronously: delete it now
        sh(["ip", "link", "del", link], check=False)
    for ns in fp.netns:
        sh(["ip", "netns", "del", ns], check=False)
    for mount in fp.mounts:
        if os.path.ismount(mount):
            sh(["umount", "-l", mount], check=False)
    for d in fp.dirs:
        shutil.rmtree(d, ignore_errors=True)


def stop_processes(netns: list[str], grace_s: float, timeout_s: float = 15.0) -> None:
    """Stop every process in these namespaces, bounded. SIGTERM first to those no `ray start
    --block` started: the caller's (a gateway drains its actors) and the `ray start` processes
    themselves (each stops its node in order, ~2 s; a raylet or GCS that gets a SIGTERM of its
    own meanwhile makes that hang). Then to what is left, SIGKILL after grace_s, and wait until
    none is left."""
    start = time.monotonic()
    signalled: set[int] = set()
    while time.monotonic() - start < timeout_s:
        pids = pids_in(netns)
        if not pids:
            return
        late = time.monotonic() - start >= grace_s
        parents = {p: int(f[1]) for p in pids if len(f := _stat(p)) > 1}
        leaders = {p for p in pids if _is_ray_start(p)}
        first = [p for p in pids if not _is_under(p, leaders, parents)]
        for pid in pids if late or not leaders else first:
            if late or pid not in signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                signalled.add(pid)
        time.sleep(0.1)
    logger.warning("dev hosts: processes %s outlived SIGKILL in %s", pids_in(netns), netns)


def _is_under(pid: int, ancestors: set[int], parents: Mapping[int, int]) -> bool:
    seen = {pid}
    while (parent := parents.get(pid, 0)) and parent not in seen:
        if parent in ancestors:
            return True
        seen.add(parent)
        pid = parent
    return False


def _is_ray_start(pid: int) -> bool:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"start" in args[1:3] and any(a == b"ray" or a.endswith(b"/ray") for a in args[:2])


def pids_in(netns: Sequence[str]) -> list[int]:
    """Live processes whose network namespace is one of these (as `ip netns pids` finds them;
    a zombie has none and is not listed)."""
    inodes = set()
    for ns in netns:
        with contextlib.suppress(OSError):
            st = os.stat(f"/run/netns/{ns}")
            inodes.add((st.st_dev, st.st_ino))
    if not inodes:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{entry.name}/ns/net")
                if (st.st_dev, st.st_ino) in inodes:
                    found.append(int(entry.name))
    return found


def claimed_subnets() -> set[int]:
    taken = set()
    for path in STATE_DIR.glob("bt*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            taken.add(Footprint.from_json(path.read_text()).subnet)
    return taken


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state, ppid, ...); [] for a process gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()  # comm may hold spaces
    except OSError:
        return []


def start_ticks(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else 0  # field 22, starttime


def is_alive(pid: int, start_ticks: int) -> bool:
    """The owner still runs: same start time (not a reused pid) and not a zombie."""
    fields = _stat(pid)
    return len(fields) > 19 and fields[0] != "Z" and int(fields[19]) == start_ticks


def sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise DevHostsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc
