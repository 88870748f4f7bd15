"""SIGTERM to a worker actor's process drains it instead of killing it mid-request.

Ray owns a worker process's signals: its main loop installs a SIGTERM handler that exits at
once (exit code 1), and Python lets only the main thread install handlers, while an async
actor's code runs on another thread. So the gateway's `ray.init` names `install` as the job's
`worker_process_setup_hook`: it runs on each worker's main thread before Ray's main loop, and
wraps `signal.signal` so the SIGTERM handler Ray then installs is kept as the fallback behind
ours:

    actor, once started:  worker_signals.on_sigterm(loop, actor.drain_and_exit)
    SIGTERM ->            the drain runs on the actor's event loop (not-ready, leave
                          membership, finish in-flight work, exit 0 through Ray)
    SIGTERM, no actor registered (or a second SIGTERM) -> Ray's own handler: exit now

Nothing here runs unless Ray calls the hook; a process without it keeps Ray's behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

HOOK = "cluster.fleet.worker_signals.install"  # runtime_env={"worker_process_setup_hook": HOOK}

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

_lock = threading.Lock()
_drain: tuple[asyncio.AbstractEventLoop, Callable[[], Coroutine[Any, Any, None]]] | None = None
_fallback: _Handler = signal.SIG_DFL
_draining = False
_installed = False


def install() -> None:
    """The worker process setup hook (main thread, before Ray's main loop)."""
    global _installed
    if _installed:
        return
    _installed = True
    original = signal.signal

    def patched(signum: int, handler: _Handler) -> _Handler:
        global _fallback
        if signum != signal.SIGTERM or handler is _on_sigterm:
            return original(signum, handler)
        previous, _fallback = _fallback, handler  # Ray's: kept as what a second SIGTERM does
        original(signal.SIGTERM, _on_sigterm)
        return previous

    signal.signal = patched  # type: ignore[assignment]
    original(signal.SIGTERM, _on_sigterm)


def on_sigterm(loop: asyncio.AbstractEventLoop, drain: Callable[[], Coroutine[Any, Any, None]]) -> bool:
    """Run `drain()` on `loop` when SIGTERM arrives; False when the hook is not installed."""
    global _drain
    with _lock:
        _drain = (loop, drain)
    return _installed


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _draining
    with _lock:
        target, again = _drain, _draining
        _draining = True
    if target is None or again:
        fallback = _fallback
        if callable(fallback):
            fallback(signum, frame)
        else:
            raise SystemExit(1)
        return
    loop, drain = target
    logger.warning("SIGTERM: draining")
    loop.call_soon_threadsafe(lambda: loop.create_task(drain()))
