"""cluster.fleet.cpu: pinning a worker to a core (`--pin-cores`) and the step loop's yield."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.fleet.cpu import YIELDS_BETWEEN_STEPS, available_cores, between_steps, core_for
from cluster.fleet.pd import PDFront
from cluster.server import _pin_step_threads
from engine.async_engine import AsyncEngine

ROOT = Path(__file__).resolve().parents[2]


def test_slots_take_the_cores_round_robin() -> None:
    assert [core_for(slot, [2, 5]) for slot in range(5)] == [2, 5, 2, 5, 2]
    assert core_for(0) == available_cores()[0]
    with pytest.raises(ValueError):
        core_for(-1, [0])


def test_pin_process_pins_every_thread_and_the_threads_started_after() -> None:
    # In a child: pinning the test process itself would slow every later test.
    core = available_cores()[-1]
    script = f"""
import json, os, threading
started = threading.Event(); stop = threading.Event()
def wait(): started.set(); stop.wait()
before = threading.Thread(target=wait); before.start(); started.wait()
from cluster.fleet.cpu import pin_process
pin_process({core})
after = threading.Thread(target=stop.wait); after.start()
tasks = {{t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}}
stop.set(); before.join(); after.join()
print(json.dumps(tasks))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    tasks: dict[str, list[int]] = json.loads(out.stdout)
    assert len(tasks) >= 3  # main, the thread from before the pin, the one from after
    assert all(cores == [core] for cores in tasks.values()), tasks


class _IdleEngine:
    """What AsyncEngine's step thread touches of an engine with nothing to do."""

    def has_unfinished(self) -> bool:
        return False

    def flush_cache(self) -> None:
        pass


def _stepper() -> AsyncEngine:
    return AsyncEngine(_IdleEngine(), idle_wait_s=0.01)  # type: ignore[arg-type]


async def _affinity(stepper: AsyncEngine) -> set[int]:
    return await stepper.call(lambda _engine: os.sched_getaffinity(0))  # on the step thread


async def test_colocated_pinning_pins_the_step_thread_only() -> None:
    stepper = _stepper()
    stepper.start()
    try:
        await _pin_step_threads(stepper)
        assert await _affinity(stepper) == {core_for(0)}
        assert os.sched_getaffinity(0) == set(available_cores())  # the edge's thread is free
    finally:
        await stepper.stop()


async def test_in_process_pd_pins_prefill_then_decode() -> None:
    prefill, decode = _stepper(), _stepper()
    front: Any = object.__new__(PDFront)  # only its two engines matter here
    front.prefill, front.decode = prefill, decode
    prefill.start()
    decode.start()
    try:
        await _pin_step_threads(front)
        assert await _affinity(prefill) == {core_for(0)} and await _affinity(decode) == {core_for(1)}
    finally:
        await prefill.stop()
        await decode.stop()


async def test_between_steps_lets_a_chain_of_callbacks_finish() -> None:
    # A Ray call's way into an async actor is a chain of loop callbacks; one yield per step
    # would advance it one link per engine step.
    links: list[int] = []

    async def chain(n: int) -> None:
        for i in range(n):
            links.append(i)
            await asyncio.sleep(0)

    task = asyncio.ensure_future(chain(YIELDS_BETWEEN_STEPS - 2))
    await between_steps()
    assert task.done() and len(links) == YIELDS_BETWEEN_STEPS - 2
