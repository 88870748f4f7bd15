"""What both roles share about a request, below them both: the prefill worker computes a Job
(engine.job), the decode worker reserves pages for the same job and resumes it; either refuses
a call for a request the gateway already aborted (AbortedIds); how a push went is a
TransferReport. The roles meet through these, the transfer and the scheduler -- never by
importing each other."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


class AbortedIds:
    """Request ids the gateway aborted, each kept `ttl_s`: a call for one that Ray delivers
    after its abort (an async actor's calls are not ordered) is refused, not started."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._at: dict[str, float] = {}  # oldest first

    def add(self, req_id: str) -> None:
        self.expire()
        self._at.pop(req_id, None)
        self._at[req_id] = self.clock()

    def expire(self) -> None:
        now = self.clock()
        while self._at and next(iter(self._at.values())) + self.ttl_s <= now:
            del self._at[next(iter(self._at))]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._at


@dataclass(frozen=True, slots=True)
class TransferReport:
    transfer_id: str
    transport: str  # "grpc", ...
    accepted: bool  # every page arrived and verified
    num_pages: int
    num_bytes: int  # payload bytes sent
    seconds: float
    error: str  # why not, when not accepted ("aborted", "deadline exceeded", ...)
    wire_seconds: float = 0.0  # of `seconds`, the part not spent waiting for pages to be computed
