"""The one place the engine reads environment variables (all prefixed BATON_)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built-in models and other generated files live (BATON_CACHE_DIR)."""
    raw = os.environ.get("BATON_CACHE_DIR")
    if raw:
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "baton"


def c_compiler() -> str:
    """The C compiler that builds engine/csrc (CC, as make has it; default cc)."""
    return os.environ.get("CC", "cc")


def num_threads() -> int | None:
    """Torch intra-op threads for one engine (BATON_NUM_THREADS); None keeps torch's default."""
    raw = os.environ.get("BATON_NUM_THREADS")
    return int(raw) if raw else None


def cpu_linear() -> str:
    """Which matmul the CPU float32 path uses (BATON_CPU_LINEAR, engine.linear): "auto" (baton's
    panel kernel where it builds and agrees with F.linear on a probe, else oneDNN's likewise,
    else F.linear), "panel", "onednn" or "torch"."""
    raw = os.environ.get("BATON_CPU_LINEAR", "auto").strip().lower()
    if raw not in ("auto", "panel", "onednn", "torch"):
        raise ValueError(f"BATON_CPU_LINEAR must be auto, panel, onednn or torch, not {raw!r}")
    return raw


def malloc_policy() -> str:
    """How the engine sets up glibc's malloc (BATON_MALLOC, engine.allocator): "engine" (keep a
    step's activations in the heap; the default) or "system" (glibc's own settings)."""
    raw = os.environ.get("BATON_MALLOC", "engine").strip().lower()
    if raw not in ("engine", "system"):
        raise ValueError(f"BATON_MALLOC must be engine or system, not {raw!r}")
    return raw
