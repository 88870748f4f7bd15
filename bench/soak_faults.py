"""The soak's faults (bench.soak): an etcd child it can restart, and SIGKILLs of actor
processes, each verified to have happened and followed until the cluster recovered.

    etcd = EtcdServer.launch(out_dir, "soak")       loopback, free ports, by its own PID (bench.etcd_proc)
    events = await inject(url, plan, baton_pid, etcd, start)
        every plan.kill_every_s: SIGKILL one process titled ray::DecodeActor / ray::PrefillActor
        (alternating) found among the descendants of `baton_pid` (the baton child this run
        started: nothing else is touched), wait until it is gone, then until every node is ok
        and one runs under a new epoch (Ray restarted it, it rejoined membership);
        once, at plan.etcd_restart_at of the run: stop etcd, wait etcd_down_s, start it again
        (same data dir and port), then wait until every node is ok and etcd holds a key for
        every worker under plan.members_prefix (membership converged).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.etcd_proc import EtcdServer

ACTORS = {"decode": "DecodeActor", "prefill": "PrefillActor"}  # Ray titles their processes ray::<class>


@dataclass(frozen=True, slots=True)
class FaultPlan:
    duration_s: float  # of the load
    kill_every_s: float
    etcd_restart_at: float  # share of the run
    etcd_down_s: float
    recover_timeout_s: float
    seed: int
    members_prefix: str  # etcd keys of the workers: /{cluster}/workers/
    num_workers: int


@dataclass(frozen=True, slots=True)
class FaultEvent:
    at_s: float
    kind: str  # kill-decode, kill-prefill, etcd-restart
    pid: int | None
    took_effect: bool  # the process died / etcd stopped answering
    recovered_s: float | None  # until every node was ok again (None: it was not)


def fault_schedule(plan: FaultPlan) -> list[tuple[float, str]]:
    """(seconds into the load, what): a kill every kill_every_s, decode and prefill in turn,
    and one etcd restart; no kill in the last 10% of the run."""
    times = [plan.kill_every_s * k for k in range(1, int(plan.duration_s / plan.kill_every_s) + 1)]
    kills = [(t, ("decode", "prefill")[i % 2]) for i, t in enumerate(times) if t <= 0.9 * plan.duration_s]
    return sorted([*kills, (plan.etcd_restart_at * plan.duration_s, "etcd")])


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def actor_pids(root: int, role: str) -> list[int]:
    """Live processes under `root` (our baton child) that Ray titled ray::<the role's actor>."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            with contextlib.suppress(OSError, IndexError):
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if title.startswith(f"ray::{ACTORS[role]}") and _stat(pid)[0] != "Z":
                    found.append(pid)
    return sorted(found)


def is_gone(pid: int) -> bool:
    try:
        return _stat(pid)[0] == "Z"
    except OSError:
        return True


async def nodes(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    resp = await client.get("/status", timeout=10)
    resp.raise_for_status()
    return list(resp.json()["nodes"])


async def wait_rejoined(
    client: httpx.AsyncClient, before: dict[str, int], timeout_s: float, converged: Callable[[], bool] | None = None
) -> float | None:
    """Seconds until every node is ok, (with `before`) one runs under a new epoch, and (with
    `converged`) that holds too."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            now = await nodes(client)
            if (all(n["health"] == "ok" for n in now)
                    and (not before or any(before.get(n["name"]) != n["epoch"] for n in now))
                    and (converged is None or await asyncio.to_thread(converged))):  # fmt: skip
                return time.monotonic() - start
        await asyncio.sleep(0.5)
    return None


async def kill_worker(client: httpx.AsyncClient, baton_pid: int, role: str, at_s: float,
                      plan: FaultPlan, rng: random.Random) -> FaultEvent:  # fmt: skip
    pids = actor_pids(baton_pid, role)
    if not pids:
        return FaultEvent(at_s, f"kill-{role}", None, False, None)
    before = {n["name"]: n["epoch"] for n in await nodes(client)}
    pid = rng.choice(pids)
    os.kill(pid, signal.SIGKILL)  # an actor process of the baton this run started
    deadline = time.monotonic() + 10
    while not is_gone(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    took_effect = is_gone(pid)
    return FaultEvent(at_s, f"kill-{role}", pid, took_effect, await wait_rejoined(client, before, plan.recover_timeout_s))


async def restart_etcd(client: httpx.AsyncClient, etcd: EtcdServer, at_s: float, plan: FaultPlan) -> FaultEvent:
    pid = etcd.proc.pid if etcd.proc is not None else None
    await asyncio.to_thread(etcd.stop)
    took_effect = etcd.proc is not None and etcd.proc.poll() is not None and not etcd.is_healthy()
    await asyncio.sleep(plan.etcd_down_s)
    await asyncio.to_thread(etcd.start)

    def converged() -> bool:
        return etcd.count_keys(plan.members_prefix) == plan.num_workers

    recovered = await wait_rejoined(client, {}, plan.recover_timeout_s, converged)
    return FaultEvent(at_s, "etcd-restart", pid, took_effect, recovered)


async def inject(url: str, plan: FaultPlan, baton_pid: int, etcd: EtcdServer, start: float) -> list[FaultEvent]:
    rng, events = random.Random(plan.seed + 1), []
    async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
        for at, what in fault_schedule(plan):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            now = time.monotonic() - start
            if what == "etcd":
                events.append(await restart_etcd(client, etcd, now, plan))
            else:
                events.append(await kill_worker(client, baton_pid, what, now, plan, rng))
    return events
