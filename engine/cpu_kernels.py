"""Compiled CPU attention (engine/csrc/paged_attention.c): decode reads K/V in place in the pool.

The torch path (engine.attention) gathers every decode row's pages into a fresh tensor per
layer and step and masks the padding; on the bursty long-prefix traffic baton serves that
gather was most of a step (issue 21's profile: 55% of samples in decode attention, 24% in its
gathers). This kernel reads the pages through the page table, shares a prefix's pages among
the rows that start with them (read once per page for all of them: the cascade, generalised),
and splits long contexts so every core has work.

    kernel = load(kv_dtype)              None where no C compiler is found (torch path then)
    plan = DecodePlan.build(rows, page_size, num_heads, head_dim)   once per step
    paged_decode(kernel, q, k_cache, v_cache, plan, scale, out)      once per layer

Built on first use with the system's C compiler (`cc`, -O3 -march=native -fopenmp) into the
baton cache dir, keyed by the source, the flags and this CPU's feature flags, so a cache shared
between machines never loads a build for another CPU; an atomic rename makes concurrent
builds safe. OpenMP resolves to the libgomp that torch loaded: one thread pool, torch's size.
The torch path stays the reference: tests compare the two on random pools.

K/V in float32, or in bfloat16/float16 (kv_cache_dtype): one library per KV dtype, built from
the same source with -DKV_BF16 / -DKV_F16, which widens each key and value as it reads it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.env import c_compiler, cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# one library: the kernels, engine.cpu_ops' and engine.linear's, and engine.cpu_decode's driver of them all
SOURCES = (CSRC / "paged_attention.c", CSRC / "fused_ops.c", CSRC / "linear.c", CSRC / "decode_step.c")
HEADERS = (CSRC / "common.h",)
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-std=c11")  # fmt: skip
SPLIT_PAGES = 32  # a part's pages at most: long contexts split so both cores work on one row
MIN_SPLIT_PAGES = 4  # a part's pages at least where a step has fewer rows than threads (below)
MIN_SHARED_PAGES = 1  # leading pages shared by two or more rows: read once for all of them
_ITEM_FIELDS = 5  # row_start, row_end, page_offset, num_keys, slot (the C item_t)

KV_DEFINES = {torch.float32: (), torch.bfloat16: ("-DKV_BF16",), torch.float16: ("-DKV_F16",)}

_lock = threading.Lock()
_kernels: dict[torch.dtype, ctypes.CDLL | None] = {}  # per KV dtype; None: tried, not buildable


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(target: Path, defines: tuple[str, ...] = (), march: str = "native") -> None:
    """Compile the library into `target` for `march` (this CPU's ISA by default; the tests build
    it for each x86-64 level too, csrc/linear.c's register tile being chosen by ISA)."""
    compiler = shutil.which(c_compiler()) or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([compiler, f"-march={march}", *FLAGS, *defines, f"-I{CSRC}", *map(str, SOURCES), "-o",
                        str(partial), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)  # fmt: skip
        os.replace(partial, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{compiler} failed: {exc.stderr.strip()[-2000:]}") from None
    finally:
        partial.unlink(missing_ok=True)


def load(kv_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The compiled kernel for KV in `kv_dtype`, built on first use; None (logged once) where
    it cannot be built, or for a KV dtype it does not read. Asked once a layer and step: after
    the first call it is a dict lookup, without the lock."""
    if kv_dtype in _kernels:  # only ever set once the build has ended, either way
        return _kernels[kv_dtype]
    with _lock:
        if kv_dtype not in _kernels:
            _kernels[kv_dtype] = _load_locked(kv_dtype)
        return _kernels[kv_dtype]


def loaded(kv_dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernel for KV in `kv_dtype` if an earlier `load` built it; never builds."""
    return _kernels.get(kv_dtype)


def require(kv_dtype: torch.dtype, user: str) -> ctypes.CDLL:
    """`load(kv_dtype)`, or a RuntimeError naming `user` (what cannot run without it)."""
    lib = load(kv_dtype)
    if lib is None:
        raise RuntimeError(f"the CPU kernels ({kv_dtype} KV) could not be built: {user} is unavailable")
    return lib


def _load_locked(kv_dtype: torch.dtype) -> ctypes.CDLL | None:
    defines = KV_DEFINES.get(kv_dtype)
    if defines is None:
        return None
    flags = " ".join(("-march=native", *FLAGS, *defines))
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + flags.encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_attention-{platform.machine()}-{key}.so"
    try:
        if not target.exists():
            _build(target, defines)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        logger.warning("CPU kernels (%s KV) unavailable (%s): decode attention uses the torch path, "
                       "projections oneDNN's linear or F.linear", kv_dtype, exc)  # fmt: skip
        return None
    return bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give the library's entry points their C signatures (ctypes checks the calls by them)."""
    fn = lib.baton_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 5 + [ctypes.c_float]
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.baton_add_rms_norm.restype = None
    lib.baton_add_rms_norm.argtypes = [ptr] * 4 + [i64, i64, ctypes.c_float]
    lib.baton_silu_mul.restype = None
    lib.baton_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.baton_rope_and_cache.restype = ctypes.c_int
    lib.baton_rope_and_cache.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32]
    lib.baton_linear.restype = ctypes.c_int
    lib.baton_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr]
    lib.baton_linear_subpanel.restype = ctypes.c_int
    lib.baton_linear_subpanel.argtypes = []
    lib.baton_linear_isa.restype = ctypes.c_char_p
    lib.baton_linear_isa.argtypes = []
    lib.baton_decode_layers.restype = ctypes.c_int
    lib.baton_decode_layers.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr]
    return lib


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One step's decode rows as the kernel's items (see csrc/paged_attention.c): built once per
    step, read by every layer. Arrays are numpy, kept alive here while the kernel reads them."""

    items: np.ndarray  # [num_items, 5] int32
    pages: np.ndarray  # [n] int64: every item's page ids, one after another
    row_ptr: np.ndarray  # [B + 1] int32
    row_slots: np.ndarray  # [num_slots] int32
    partials: np.ndarray  # [num_slots, heads, head_dim + 2] float32: scratch, reused by every layer
    num_rows: int
    num_shared_pages: int  # pages read once for several rows (the step's saving, for profiles)

    @classmethod
    def build(
        cls, rows: Sequence[tuple[Sequence[int], int]], keys: Sequence[int], page_size: int, num_heads: int,
        head_dim: int, threads: int = 1,
    ) -> DecodePlan:  # fmt: skip
        """rows: each decode row's (page ids, keys attended = context length), in batch order;
        keys: per row a prefix key (engine.runner.prefix_keys) — rows with the same key >= 0
        stand together and may share leading pages. threads: the kernel's OpenMP threads; a
        step of fewer rows than that splits them finer (down to MIN_SPLIT_PAGES a part), so
        one row's attention runs on every core (at one row of 320 keys: 28 -> 20 us a layer
        on the 2-core machine)."""
        items: list[tuple[int, int, int, int, int]] = []
        pages: list[int] = []
        slots_of: list[list[int]] = [[] for _ in rows]
        next_slot = 0
        num_shared = 0

        split = SPLIT_PAGES
        if rows and len(rows) < threads:
            longest = max(-(-length // page_size) for _, length in rows)
            split = max(MIN_SPLIT_PAGES, min(SPLIT_PAGES, -(-longest // -(-threads // len(rows)))))
        per = split * page_size

        def emit(first: int, end: int, ids: Sequence[int], num_keys: int) -> None:
            nonlocal next_slot
            for start in range(0, num_keys, per):
                n = min(per, num_keys - start)
                first_page = start // page_size
                items.append((first, end, len(pages), n, next_slot))
                pages.extend(ids[first_page : first_page + -(-n // page_size)])
                for r in range(first, end):
                    slots_of[r].append(next_slot + r - first)
                next_slot += end - first

        row = 0
        while row < len(rows):
            end = row + 1
            while end < len(rows) and keys[row] >= 0 and keys[end] == keys[row]:
                end += 1
            shared = _shared_pages([rows[r] for r in range(row, end)], page_size) if end - row > 1 else 0
            if shared:
                emit(row, end, rows[row][0], shared * page_size)
                num_shared += shared
            for r in range(row, end):
                ids, length = rows[r]
                emit(r, r + 1, ids[shared:], length - shared * page_size)
            row = end
        row_ptr = np.zeros(len(rows) + 1, dtype=np.int32)
        row_ptr[1:] = np.cumsum([len(s) for s in slots_of])
        return cls(
            np.asarray(items, dtype=np.int32).reshape(-1, _ITEM_FIELDS),
            np.asarray(pages, dtype=np.int64),
            row_ptr,
            np.asarray([s for slots in slots_of for s in slots], dtype=np.int32),
            np.empty((max(next_slot, 1), num_heads, head_dim + 2), dtype=np.float32),
            len(rows),
            num_shared,
        )


def _shared_pages(rows: Sequence[tuple[Sequence[int], int]], page_size: int) -> int:
    """Leading page ids all of `rows` have in common, counting only pages wholly before each
    row's last key (every row keeps a key of its own); 0 below MIN_SHARED_PAGES."""
    shared = min((length - 1) // page_size for _, length in rows)
    first = list(rows[0][0][:shared])
    for ids, _ in rows[1:]:
        head = list(ids[:shared])
        if head != first[:shared]:  # compared in C; the first difference found only when there is one
            shared = next(i for i, (a, b) in enumerate(zip(head, first, strict=False)) if a != b)
    return shared if shared >= MIN_SHARED_PAGES else 0


def paged_decode(
    kernel: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
    scale: float, out: torch.Tensor,
) -> None:  # fmt: skip
    """out [B, heads, head_dim] = attention of q [B, heads, head_dim] over each row's pages
    (k_cache, v_cache: [pages, page_size, kv_heads, head_dim], contiguous, in the dtype `kernel`
    was built for: load(k_cache.dtype)); q and out float32."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode needs contiguous q, out and caches")
    if q.dtype != torch.float32 or out.dtype != torch.float32 or batch != plan.num_rows:
        raise ValueError("paged_decode takes float32 queries and the plan's rows")
    if kernel is not _kernels.get(k_cache.dtype) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode: the kernel was not built for {k_cache.dtype} KV (load(kv_dtype))")
    rc = kernel.baton_paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), plan.items.ctypes.data, len(plan.items),
        plan.pages.ctypes.data, plan.row_ptr.ctypes.data, plan.row_slots.ctypes.data, plan.partials.ctypes.data,
        out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, page_size, scale,
    )  # fmt: skip
    if rc == -2:
        raise MemoryError("paged_decode: out of memory for an item's queries")
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported shape (heads {num_heads}, kv heads {num_kv_heads}, "
                         f"page size {page_size}, head_dim {head_dim})")  # fmt: skip
