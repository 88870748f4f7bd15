"""Fleet's lifecycle where nothing is left to talk to (the Ray paths run in test_ray_*)."""

from __future__ import annotations

import types

import pytest

from cluster.fleet.fleet import Fleet

pytestmark = pytest.mark.timeout(30)


async def test_stopping_a_fleet_whose_workers_are_all_gone_does_not_fail() -> None:
    # Every actor already dead (or drained away): nothing to close, nothing to kill.
    fleet = types.SimpleNamespace(_tasks=[], prefills=[], decodes=[], _spawned={"x": object()}, membership=None,
                                  registry=None)  # fmt: skip
    await Fleet.stop(fleet)  # type: ignore[arg-type]
    assert fleet._spawned == {}
