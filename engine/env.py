"""The one place baton reads environment variables: its own (BATON_*), the C compiler (CC), the
cache base (XDG_CACHE_HOME) and the standard OpenTelemetry endpoint names. Nothing here sets one.
Ray's own RAY_* settings are cluster/fleet/ray_runtime.py's: Ray reads some of them once, at its own
import, so that module sets them at its import and reads the auth ones where it starts Ray."""

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


FAULT_INJECTION_ENV = "BATON_FAULT_INJECTION"  # "1": this process (and its actors) allow fault drills


def fault_injection_allowed() -> bool:
    """Whether fault drills may be armed here (engine.faults); off unless BATON_FAULT_INJECTION=1."""
    return os.environ.get(FAULT_INJECTION_ENV) == "1"


def api_keys_file() -> Path | None:
    """The gateway's API keys file when the configuration names none (BATON_API_KEYS)."""
    raw = os.environ.get("BATON_API_KEYS")
    return Path(raw) if raw else None


KUBERAY_ENV = ("BATON_RAYCLUSTER", "POD_NAMESPACE")  # the head pod sets both (k8s/base/raycluster.yaml)


def kuberay_cluster() -> tuple[str, str] | None:
    """(RayCluster name, namespace) when this process runs in a KubeRay head pod that names them
    (the planner's scaler patches that RayCluster: cluster.fleet.scalers); None elsewhere."""
    name, namespace = (os.environ.get(key, "") for key in KUBERAY_ENV)
    return (name, namespace) if name and namespace else None


POD_NAME_ENV = "POD_NAME"  # the worker pods set it from the downward API (k8s/base/raycluster.yaml)


def pod_name() -> str:
    """The Kubernetes pod this process runs in; "" outside Kubernetes."""
    return os.environ.get(POD_NAME_ENV, "")


def api_key() -> str | None:
    """The key a client command (`baton status`) sends (BATON_API_KEY)."""
    return os.environ.get("BATON_API_KEY") or None


OTLP_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")  # the standard names


def otlp_endpoint() -> str | None:
    """The OTLP endpoint from the standard variables, traces' own first."""
    return next((os.environ[name] for name in OTLP_ENDPOINT_ENV if os.environ.get(name)), None)
