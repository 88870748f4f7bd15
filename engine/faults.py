"""Armed failures for fault drills and the fault suite (tests/faults): a named point in the
engine raises InjectedFault the next `times` times it is reached.

    faults = FaultPoints()                 one per engine (Engine.faults)
    faults.arm("forward", times=1)         PermissionError unless BATON_FAULT_INJECTION=1 in
                                           this process's environment (off in production: a
                                           worker started without it refuses every arm)
    faults.arm("forward", after=5)         it passes 5 times first: the engine's 6th forward
                                           fails (a fault mid-stream that no timing can miss)
    faults.hit("forward")                  in the engine, where the fault belongs: raises when
                                           armed, costs one dict lookup when not

Points: "forward" (Engine.step, in place of the model's forward pass); and a prefill
worker's next push (prefill.pushes, the points of TRANSFER; a draining decode worker's
hand-off pushes too): "transfer_corrupt" (a payload byte of its first chunk flipped in flight;
the in-process P/D's local transfer honours it too, cluster.fleet.pd), "transfer_corrupt_last"
(the same in its last chunk: the pages before it arrive verified), "transfer_truncate" (the
stream ends before its last chunk), "transfer_stall" (the push stops sending past its deadline).
"""

from __future__ import annotations

import threading

from engine.env import FAULT_INJECTION_ENV, fault_injection_allowed

TRANSFER = ("transfer_corrupt", "transfer_corrupt_last", "transfer_truncate", "transfer_stall")
POINTS = frozenset({"forward", *TRANSFER})


class InjectedFault(RuntimeError):
    """A failure a drill asked for (FaultPoints.arm): it stands for a real one (a CUDA error,
    a corrupted weight read) that leaves the engine's state in doubt."""



def require_injection() -> None:
    """PermissionError unless this process allows fault drills (a drill's first call)."""
    if not fault_injection_allowed():
        raise PermissionError(f"fault injection is off in this process (set {FAULT_INJECTION_ENV}=1 to allow drills)")


class FaultPoints:
    def __init__(self) -> None:
        self._armed: dict[str, tuple[int, int]] = {}  # point -> (passes left first, failures left)
        self._lock = threading.Lock()  # arm() comes from an actor call, hit() from the step thread

    def arm(self, point: str, times: int = 1, after: int = 0) -> None:
        """`point` fails its next `times` passes, once `after` passes have gone through."""
        require_injection()
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {sorted(POINTS)}")
        if not 1 <= times <= 1000:
            raise ValueError("times must be in 1..1000")
        if not 0 <= after <= 100_000:
            raise ValueError("after must be in 0..100000")
        with self._lock:
            self._armed[point] = (after, times)

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def hit(self, point: str) -> None:
        """Raise InjectedFault when `point` is armed (a failure that is an exception)."""
        if self.take(point):
            raise InjectedFault(f"injected fault at {point!r}")

    def take(self, point: str) -> bool:
        """Whether `point` fails this time (one arm used): for faults that are not exceptions."""
        if not self._armed:
            return False
        with self._lock:
            passes, left = self._armed.get(point, (0, 0))
            if passes:
                self._armed[point] = (passes - 1, left)
                return False
            if not left:
                return False
            if left == 1:
                del self._armed[point]
            else:
                self._armed[point] = (0, left - 1)
        return True
