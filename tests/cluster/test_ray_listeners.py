"""The real local Ray that `baton up` starts listens on loopback only (docs/architecture.md,
Rules): every listening socket of every process in its tree -- GCS, raylet, the dashboard's
minimal process, the agents, the workers and baton's actors in them -- is read from the kernel.
tests/security/test_listeners.py checks the settings handed to Ray; this checks what Ray did."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.disagg_config import DisaggConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle
from tests.faults.conftest import disaggregated
from tests.security.test_listeners import LOOPBACK, Listener, listening, socket_inodes

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pd(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    yield from disaggregated(tiny_engine_config, DisaggConfig(num_prefill=1, num_decode=1, transport="grpc"))


def descendants(root: int) -> set[int]:
    """`root` and every process below it (Ray's processes are this one's children and theirs)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


def _command(pid: int) -> str:
    """The process's whole command line (a checkout's path can be long: nothing is cut)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def test_every_process_of_the_local_ray_listens_on_loopback_only(pd: ServerHandle) -> None:
    pids = descendants(os.getpid())
    owner: dict[int, int] = {inode: pid for pid in pids for inode in socket_inodes(pid)}
    ours: list[tuple[Listener, int]] = [(s, owner[s.inode]) for s in listening() if s.inode in owner]
    commands = {_command(pid) for _, pid in ours}
    # the check sees Ray itself, not only this process: GCS, raylet and the actors' workers
    names = {Path(c.split(" ", 1)[0]).name for c in commands}  # each executable's own name
    assert {"gcs_server", "raylet"} <= names, names
    assert len({pid for _, pid in ours}) >= 4, names
    wide = [(str(s.address), s.port, _command(pid)) for s, pid in ours if s.address not in LOOPBACK]
    assert wide == [], wide
