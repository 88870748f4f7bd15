"""Calls from the gateway to its worker actors: bounded, abandonable, and cut short the moment
the worker stalls or dies (its handle's `trouble` event), so a request moves on at once instead
of waiting out a deadline.

    decode_call(decode, ref, timeout_s)    WorkerLost when decode stalls or dies (the request moves)
    prefill_call(prefill, ref, timeout_s)  Stalled when prefill stalls or dies (the next path)
    pending.fire(ref)                      a call nobody waits for; a failure is only logged

`ray` is imported after cluster.fleet.ray_runtime (which sets Ray's environment first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cluster.fleet import ray_runtime  # noqa: F401  (before `ray`)
from cluster.fleet.worker_msgs import PrefillResult
from cluster.fleet.workers import DecodeHandle, PrefillHandle, WorkerLost

import ray  # isort: skip

logger = logging.getLogger(__name__)


class Stalled(Exception):
    """The prefill worker stalled or died while the request waited on it."""


async def ray_await(ref: Any) -> Any:
    return await ref


def abandonable(coro: Any) -> asyncio.Future[Any]:
    """A call the caller may stop waiting for (a stall, a cancel): its late failure is
    retrieved here, not left as "Task exception was never retrieved"."""
    call: asyncio.Future[Any] = asyncio.ensure_future(coro)
    call.add_done_callback(lambda f: f.cancelled() or f.exception())
    return call


async def prefill_call(prefill: PrefillHandle, ref: Any, timeout_s: float) -> PrefillResult:
    """The prefill's first token within `timeout_s` (the reservation's life), else TimeoutError;
    Stalled as soon as the worker stalls or dies."""
    call = abandonable(ray_await(ref))
    if await _answered(call, prefill.trouble, timeout_s,
                       lambda: Stalled(f"prefill worker {prefill.name} stalled or died")):  # fmt: skip
        result: PrefillResult = call.result()
        return result
    raise TimeoutError


async def decode_call(decode: DecodeHandle, ref: Any, timeout_s: float) -> Any:
    """A call to `decode` within `timeout_s`, else TimeoutError; WorkerLost as soon as it stalls
    or dies. An exception the actor raised (the engine refusing the request) is raised here."""
    call = abandonable(ray_await(ref))
    if not await _answered(call, decode.trouble, timeout_s,
                           lambda: WorkerLost(f"decode worker {decode.name} stalled or failed", decode.name)):  # fmt: skip
        raise TimeoutError
    try:
        return call.result()
    except ray.exceptions.RayActorError:
        decode.mark_dead()
        raise WorkerLost(f"decode worker {decode.name} failed", decode.name) from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, Exception):  # e.g. the engine refusing the request
            raise cause from None
        raise


async def _answered(
    call: asyncio.Future[Any], trouble: asyncio.Event, timeout_s: float, lost: Callable[[], Exception]
) -> bool:
    """Whether `call` ended within `timeout_s`; raises `lost()` as soon as the worker's trouble
    is set first (the call is cancelled then, as when the time runs out)."""
    watch = asyncio.ensure_future(trouble.wait())
    try:
        done, _ = await asyncio.wait({call, watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if call in done:
        return True
    call.cancel()
    if watch in done:
        raise lost()
    return False


class Pending:
    """Calls whose answer nobody waits for (aborts, cancels): kept referenced until they end,
    and a failure (a dead actor) is only logged."""

    def __init__(self) -> None:
        self._calls: set[asyncio.Future[Any]] = set()

    def fire(self, call: Any) -> None:
        """`call`: an actor call's ref, or a coroutine of the gateway's own (both are awaitable)."""
        task = asyncio.ensure_future(ray_await(call))
        self._calls.add(task)
        task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Future[Any]) -> None:
        self._calls.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("fire-and-forget call failed: %r", task.exception())
