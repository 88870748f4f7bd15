"""A prefill actor that Ray restarts between two health polls: the poll in between timed out
(the worker stalled), and the next one is answered by the fresh process. The gateway must see
a new worker (its process changed), not the old one answering again: the fresh actor has not
joined membership, so only the revive path (ping, join, route) puts it back in rotation.
(tests/faults/test_stall_and_restart.py runs the real thing; this is the decision alone.)"""

from __future__ import annotations

import types
from typing import Any

import pytest

from cluster.fleet.fleet import Fleet
from cluster.fleet.worker_msgs import PrefillStats
from cluster.fleet.workers import PrefillHandle

pytestmark = pytest.mark.timeout(30)


class _Method:
    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def remote(self) -> Any:
        async def call() -> Any:
            return self._answer()

        return call()


class _Actor:
    """Answers `stats` from a sequence of processes."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.stats = _Method(lambda: PrefillStats(1, 0, 0, 0, 0, 0, 0, pid=self.pids.pop(0)))


class _Stalls:
    def labels(self, role: str) -> Any:
        return types.SimpleNamespace(inc=lambda: None)


def _front() -> Any:
    return types.SimpleNamespace(cfg=types.SimpleNamespace(watchdog_s=1.0), metrics=types.SimpleNamespace(stalls=_Stalls()))


async def test_an_answer_from_another_process_marks_the_worker_dead_for_a_revive() -> None:
    front, actor = _front(), _Actor([100, 100, 200])
    handle = PrefillHandle("prefill-0", actor, epoch=1)
    await Fleet._poll_prefill(front, handle)
    assert handle.pid == 100 and handle.is_alive and handle.stats is not None
    handle.is_stalled = True  # the poll before the restart went unanswered
    await Fleet._poll_prefill(front, handle)
    assert handle.is_alive and not handle.is_stalled  # the same process: re-admitted
    await Fleet._poll_prefill(front, handle)
    assert not handle.is_alive and handle.trouble.is_set() and not handle.is_routable
    handle.revive(2, 200)  # Fleet._revive: pinged (its pid), joined, routed
    assert handle.is_routable and handle.pid == 200 and handle.epoch == 2


async def test_an_answer_without_a_pid_changes_nothing() -> None:
    front, actor = _front(), _Actor([100, 0])
    handle = PrefillHandle("prefill-0", actor, epoch=1)
    await Fleet._poll_prefill(front, handle)
    await Fleet._poll_prefill(front, handle)
    assert handle.is_alive and handle.pid == 100
