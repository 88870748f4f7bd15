"""What moving pages between two workers costs, per (prefill, decode) link, as measured: the
placement's transfer term (cluster.placement.policy) reads it, every completed push feeds it.

    links = Links(default_bytes_per_s)
    links.observe(p, d, num_bytes, wire_s)   a push: its bytes over the time it spent sending
                                             (not waiting for its pages to be computed)
    links.bytes_per_s(p, d)                  measured, or the default until a push has been seen
    links.set_same_host(p, d, bool)          from the route (both workers' node addresses)

A link's rate is a decayed ratio of sums (bytes over seconds, each halved every HALF_LIFE
observations' worth), so one slow push moves it a little and a link that changed (a cut path
back, shaping added) is followed within a few transfers. Pushes too small to measure a link
(under MIN_BYTES: latency, not bandwidth) are skipped.

Two things keep a measurement from shutting a link for good (placement stops sending over a
link it judges slow, so no push would ever revise the judgement):
- A link's measurement ages: its time per byte blends back toward the default's, halfway
  every AGE_HALF_LIFE_S since its last push, so an unused link is tried again.
- A same-host link is not measured: its push is a copy through memory, and what slows it is
  the CPU its workers share (a burst of streams on a small host), which the placement's queue
  and compute terms already count; it stays at the default.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

HALF_LIFE = 8  # observations
AGE_HALF_LIFE_S = 60.0  # an unused link's measurement gives way to the default this fast
MIN_BYTES = 256 << 10
_DECAY = 0.5 ** (1 / HALF_LIFE)


@dataclass(slots=True)
class _Link:
    num_bytes: float = 0.0
    seconds: float = 0.0
    is_same_host: bool = False
    last_seen: float = 0.0  # the clock's time of its last measured push


class Links:
    def __init__(self, default_bytes_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not default_bytes_per_s > 0:
            raise ValueError("default_bytes_per_s must be > 0")
        self.default_bytes_per_s = default_bytes_per_s
        self.clock = clock
        self._links: dict[tuple[str, str], _Link] = {}

    def observe(self, prefill: str, decode: str, num_bytes: int, wire_s: float) -> None:
        if num_bytes < MIN_BYTES or not wire_s > 0:
            return
        link = self._links.setdefault((prefill, decode), _Link())
        if link.is_same_host:
            return  # CPU contention, not a link (the module's docstring)
        link.num_bytes = link.num_bytes * _DECAY + num_bytes
        link.seconds = link.seconds * _DECAY + wire_s
        link.last_seen = self.clock()

    def bytes_per_s(self, prefill: str, decode: str) -> float:
        link = self._links.get((prefill, decode))
        if link is None or not link.seconds > 0:
            return self.default_bytes_per_s
        fresh: float = 0.5 ** (max(0.0, self.clock() - link.last_seen) / AGE_HALF_LIFE_S)
        s_per_byte = fresh * link.seconds / link.num_bytes + (1 - fresh) / self.default_bytes_per_s
        return 1 / s_per_byte

    def set_same_host(self, prefill: str, decode: str, is_same_host: bool) -> None:
        link = self._links.setdefault((prefill, decode), _Link())
        link.is_same_host = is_same_host
        if is_same_host:
            link.num_bytes = link.seconds = 0.0

    def is_same_host(self, prefill: str, decode: str) -> bool:
        link = self._links.get((prefill, decode))
        return link is not None and link.is_same_host

    def forget(self, worker: str) -> None:
        for key in [k for k in self._links if worker in k]:
            del self._links[key]
