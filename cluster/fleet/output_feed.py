"""A decode worker's long-lived output stream, consumed by long-polling.

    step loop:  feed.publish(outputs)            one entry per step (all requests' new tokens)
    gateway:    feed.take(after=s, wait_s)       every step after s, merged; waits up to wait_s
                                                 when there is none (an empty batch then)

The consumer names the last step it has, so a batch lost in flight is asked for again, and
steps at or before `after` are dropped as acknowledged. The feed keeps at most `max_steps`
unacknowledged steps: a consumer that falls further behind (or is gone) loses the oldest, and
sees the gap in the batch's `first_seq`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple

from engine.outputs import StepOutput


class Taken(NamedTuple):
    first_seq: int
    last_seq: int
    outputs: tuple[StepOutput, ...]


class OutputFeed:
    def __init__(self, max_steps: int = 4096) -> None:
        self.max_steps = max_steps
        self._steps: deque[tuple[int, list[StepOutput]]] = deque()
        self._seq = 0  # the last published step
        self._changed = asyncio.Event()
        self.num_dropped = 0

    @property
    def seq(self) -> int:
        return self._seq

    def publish(self, outputs: list[StepOutput]) -> None:
        self._seq += 1
        self._steps.append((self._seq, outputs))
        while len(self._steps) > self.max_steps:
            self._steps.popleft()
            self.num_dropped += 1
        self._changed.set()

    async def take(self, after: int, wait_s: float) -> Taken:
        while self._steps and self._steps[0][0] <= after:
            self._steps.popleft()  # acknowledged
        if not self._steps and wait_s > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                pass
        if not self._steps:
            return Taken(after + 1, after, ())
        first = self._steps[0][0]
        outputs = tuple(out for _, step in self._steps for out in step)
        return Taken(first, self._seq, outputs)
