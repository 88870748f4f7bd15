"""The stream's deadline (cluster.edge.frontend._Deadline): one timer per request that bounds the
waits for the engine, never the consumer's hold of a token. Each case gates its order with
futures; the only timers are the deadlines themselves (0 s: due at the loop's next turn)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.edge.frontend import _Deadline


async def test_a_wait_past_the_deadline_is_a_timeout() -> None:
    deadline = _Deadline(0.0)
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await deadline.wait(never)
    assert never.cancelled()  # the engine wait was cancelled (the stream aborts its request)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # nothing left over


async def test_a_deadline_that_passes_while_the_consumer_holds_a_token_is_raised_at_the_next_wait() -> None:
    deadline = _Deadline(0.0)
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[int] = loop.create_future()
    ready.set_result(1)
    assert await deadline.wait(ready) == 1  # the token came before the timer
    held: asyncio.Future[None] = loop.create_future()
    loop.call_soon(loop.call_soon, held.set_result, None)  # "the socket write": after the timer fired
    await held  # not cancelled here: the deadline never reaches the consumer's await
    with pytest.raises(TimeoutError):
        await deadline.wait(loop.create_future())


async def test_a_caller_cancellation_stays_a_cancellation() -> None:
    deadline_started = asyncio.Event()

    async def consume() -> None:
        deadline = _Deadline(3600.0)
        deadline_started.set()
        try:
            await deadline.wait(asyncio.get_running_loop().create_future())
        finally:
            deadline.cancel()

    task = asyncio.create_task(consume())
    await deadline_started.wait()
    await asyncio.sleep(0)  # the task is now inside its wait
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_no_deadline_arms_no_timer_and_a_cancelled_one_never_fires() -> None:
    loop = asyncio.get_running_loop()
    unbounded = _Deadline(None)
    done: asyncio.Future[str] = loop.create_future()
    done.set_result("ok")
    assert await unbounded.wait(done) == "ok"
    disarmed = _Deadline(0.0)
    disarmed.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the timer's turn has passed
    again: asyncio.Future[str] = loop.create_future()
    again.set_result("still")
    assert await disarmed.wait(again) == "still"
