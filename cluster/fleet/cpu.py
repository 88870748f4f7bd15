"""How a worker's threads share the CPU: pinned to cores (`baton up --pin-cores`), and a step
loop that lets its actor's calls through between two steps.

Pinning is for measurements that must not share a core by accident (BENCHMARKS.md P6;
ENV-NOTES.md: one torch thread per worker, pinned):

    core = core_for(slot)     slot k -> the k-th core this process may run on, round robin
    pin_process(core)         every thread of this process (a Ray actor: its event loop,
                              gRPC's threads) and every thread it starts later -> `core`
    pin_thread(core)          the calling thread only (a colocated engine's step thread)

Slots: prefill workers first, then decode workers (`--prefill 1 --decode 1` on two cores:
prefill -> core 0, decode -> core 1); more workers than cores wrap around.
"""

from __future__ import annotations

import asyncio
import logging
import os

logger = logging.getLogger(__name__)

YIELDS_BETWEEN_STEPS = 16  # ~1 us each when nothing is ready (uvloop)


def available_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def core_for(slot: int, cores: list[int] | None = None) -> int:
    """The core of worker slot `slot`: round robin over `cores` (default: available_cores())."""
    cores = cores if cores is not None else available_cores()
    if slot < 0 or not cores:
        raise ValueError(f"no core for slot {slot} among {cores}")
    return cores[slot % len(cores)]


def pin_thread(core: int) -> int:
    """Pin the calling thread (and the threads it starts from now on) to `core`."""
    os.sched_setaffinity(0, {core})  # on Linux, pid 0 is the calling thread
    return core


def pin_process(core: int) -> int:
    """Pin every current thread of this process to `core`; threads started later inherit it
    from their creator. A thread that ends meanwhile is skipped."""
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), {core})
        except ProcessLookupError:
            continue
    logger.info("pid %d pinned to core %d", os.getpid(), core)
    return core


async def idle(wake: asyncio.Event, timeout_s: float) -> None:
    """A step loop with nothing to step: wait until `wake` is set (new work) or `timeout_s`
    passes (the loop's periodic duties: expiry, leases), whichever comes first."""
    wake.clear()
    try:
        await asyncio.wait_for(wake.wait(), timeout_s)
    except TimeoutError:
        pass


async def between_steps() -> None:
    """Let the event loop run what is ready before the next (blocking) engine step.

    A Ray call reaches an async actor through a chain of callbacks (Ray's thread hands the
    coroutine to the loop, the task runs, its result goes back to Ray's thread), and a push
    awaits its transport the same way; each `sleep(0)` advances every chain by one link, with
    the GIL given up to Ray's threads at each loop poll. One yield per step stretched a decode
    actor's `next_batch` round trip over ~7 steps (measured: ~70 ms at 10 ms steps, so tokens
    reached clients in bursts); a few yields finish the chain between two steps.
    """
    for _ in range(YIELDS_BETWEEN_STEPS):
        await asyncio.sleep(0)
