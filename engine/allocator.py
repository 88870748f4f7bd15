"""glibc malloc settings for a process that runs the engine: keep a step's activations in the heap.

torch has no caching allocator on the CPU: every activation is a fresh `malloc`, freed when
the op that used it ends. glibc hands out a chunk at or above its mmap threshold as a fresh
`mmap`, and gives the free top of a heap back to the kernel past its trim threshold, so a
prefill step's large activations were page-faulted in and zeroed anew, layer after layer, step
after step. glibc's threshold adapts to what was freed, but not to a step's mix of sizes.
Measured on the 2-core machine, baton-tiny, one step of 8 prompts × 256 tokens (its gate_up
output is 16 MB, the SiLU and the product 8 MB each): 11,917 minor page faults a step with
glibc's defaults, 2 with these settings; the step took 144-163 ms, now 126-153 ms (4 runs
each). Decode steps allocate little and do not change.

    tune_allocator()   once per process, before its threads allocate (the server's run()
                       does it first; Engine again, for embedders): M_MMAP_THRESHOLD at glibc's
                       maximum (32 MiB on 64-bit: larger chunks are still mmap'd),
                       M_TRIM_THRESHOLD TRIM_BYTES (the heap keeps what a step freed for the next
                       one), M_ARENA_MAX 1 (a thread's own arena deletes a heap as soon as it is
                       empty, whatever the trim threshold: 8,196 faults a step on a step thread
                       with the first two settings alone). Threads that allocated before keep
                       their arenas. A no-op off glibc, or with BATON_MALLOC=system.

What it costs: freed memory under 32 MiB a chunk stays with the process (each thread's heap may
keep up to TRIM_BYTES free at its top) instead of going back to the kernel after every step. Models whose activations pass 32 MiB a tensor (hidden
sizes in the thousands at 2k-token steps) still fault those in: a caching allocator
(tcmalloc or jemalloc by LD_PRELOAD, as vLLM's CPU build recommends) covers them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

from engine import env

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_BYTES = 512 << 20


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (whose mallopt takes these settings)."""
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


@functools.cache
def tune_allocator() -> bool:
    """Apply the settings above once per process; True when glibc took them (two threads
    racing the first call both apply them: mallopt is idempotent)."""
    if env.malloc_policy() == "system":
        return False
    libc = glibc()
    if libc is None:
        logger.debug("not glibc: malloc left as it is")
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    ok: bool = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1 and ok
    ok = libc.mallopt(M_ARENA_MAX, 1) == 1 and ok
    if not ok:
        logger.warning("glibc refused the engine's malloc settings: large activations are mmap'd per op")
    return ok
