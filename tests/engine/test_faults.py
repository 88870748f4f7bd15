"""Armed failures (engine.faults): a point fails exactly as often as armed, after exactly as
many passes as asked -- what lets the fault suite break a worker mid-stream without a race."""

from __future__ import annotations

import pytest

from engine.faults import FaultPoints, InjectedFault


def test_a_point_passes_after_times_then_fails_times_then_passes_again() -> None:
    faults = FaultPoints()
    faults.arm("forward", times=2, after=3)
    assert [faults.take("forward") for _ in range(7)] == [False, False, False, True, True, False, False]
    assert not faults.take("transfer_corrupt")  # other points were never armed
    faults.arm("forward")
    with pytest.raises(InjectedFault, match="forward"):
        faults.hit("forward")
    faults.hit("forward")  # used up


@pytest.mark.parametrize(("times", "after"), [(0, 0), (1, -1), (1, 100_001)])
def test_arming_is_bounded(times: int, after: int) -> None:
    with pytest.raises(ValueError):
        FaultPoints().arm("forward", times, after)
