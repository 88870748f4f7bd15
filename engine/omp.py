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
took 3.3 ms on the building thread and 6.7 ms on a step thread (served ITL at c=1: 6.9 ms).
With the building thread's pool released, the step thread's linear is back at 21 us.

    release_thread_pool()   on a thread that ran torch and will not step the engine: its
                            workers exit (OpenMP 5's omp_pause_resource_all, soft); a later
                            parallel region there would make a new pool
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the pool's threads exit; settings are kept
_RUNTIMES = ("libgomp", "libomp", "libiomp")  # GNU, LLVM and Intel OpenMP


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded into this process (found in its memory map, so this
    opens that same copy, never another), or None where there is none or no map to read."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(_RUNTIMES) and ".so" in name:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
                return lib
    return None


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers exit; True when the runtime did so. Call it on
    a thread that built or warmed an engine that another thread will step."""
    import torch  # noqa: F401  (the runtime is loaded with torch)

    lib = _runtime()
    if lib is None:
        return False
    released: bool = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not released:
        logger.debug("the OpenMP runtime kept this thread's pool")
    return released
