"""A clock a test moves by hand (`clock.now += 5.0`): deadlines, leases and expiries are
reached by the test, never waited for."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
