"""Armed failures for fault drills and the fault suite (tests/faults): a named point in the
engine raises InjectedFault the next `times` times it is reached.

    faults = FaultPoints()                 one per engine (Engine.faults)
    faults.arm("forward", times=1)         PermissionError unless BATON_FAULT_INJECTION=1 in
                                           this process's environment (off in production: a
                                           worker started without it refuses every arm)
    faults.hit("forward")                  in the engine, where the fault belongs: raises when
                                           armed, costs one dict lookup when not

Points: "forward" (Engine.step, in place of the model's forward pass).
"""

from __future__ import annotations

import os
import threading

ENV = "BATON_FAULT_INJECTION"
POINTS = frozenset({"forward"})


class InjectedFault(RuntimeError):
    """A failure a drill asked for (FaultPoints.arm): it stands for a real one (a CUDA error,
    a corrupted weight read) that leaves the engine's state in doubt."""


def injection_enabled() -> bool:
    return os.environ.get(ENV) == "1"


class FaultPoints:
    def __init__(self) -> None:
        self._armed: dict[str, int] = {}
        self._lock = threading.Lock()  # arm() comes from an actor call, hit() from the step thread

    def arm(self, point: str, times: int = 1) -> None:
        if not injection_enabled():
            raise PermissionError(f"fault injection is off in this process (set {ENV}=1 to allow drills)")
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {sorted(POINTS)}")
        if not 1 <= times <= 1000:
            raise ValueError("times must be in 1..1000")
        with self._lock:
            self._armed[point] = times

    def hit(self, point: str) -> None:
        if not self._armed:
            return
        with self._lock:
            left = self._armed.get(point, 0)
            if not left:
                return
            if left == 1:
                del self._armed[point]
            else:
                self._armed[point] = left - 1
        raise InjectedFault(f"injected fault at {point!r}")
