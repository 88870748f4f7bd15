"""A worker that computes prompts for pushes -- a prefill worker, or a draining decode worker
handing its requests off (decode.handoff) -- answers each such call with the prompt's first
token while its step loop computes it; the push of the pages starts with that answer.

    result = await firsts.prefill(job, dest, submit)   the push to `dest` opened; `submit(on_device)`
                                                       queues the prompt; waits for the step loop's
    firsts.done(req_id, PrefillDone | exception)       answer -> PrefillResult (the push under way,
                                                       or dropped when the first token ends it)
    firsts.cancel(req_id)                              its caller went away
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cluster.fleet.worker_msgs import PrefillResult
from engine.job import Job
from kvtransfer.transport import KVDestination
from prefill.pushes import Pushes
from prefill.worker import PrefillDone


class FirstTokens:
    def __init__(self, pushes: Pushes) -> None:
        self.pushes = pushes
        self._waiting: dict[str, asyncio.Future[PrefillDone]] = {}  # req_id -> the call waiting on it

    def __len__(self) -> int:
        return len(self._waiting)

    async def prefill(self, job: Job, dest: KVDestination, submit: Callable[[bool], None]) -> PrefillResult:
        """Open the push to `dest`, `submit` the prompt (on_device: its chunks stay on the
        device, the nccl route), and wait for its first token; the pages follow by the push."""
        future: asyncio.Future[PrefillDone] = asyncio.get_running_loop().create_future()
        self._waiting[job.req_id] = future
        push = self.pushes.open(job.req_id, dest)
        try:
            submit(self.pushes.transport_to(dest.address) == "nccl")
            done = await future
        except BaseException:
            self.pushes.drop(dest.transfer_id)
            raise
        finally:
            self._waiting.pop(job.req_id, None)
        if done.finish_reason is not None:  # the first token ends the request: nothing more moves
            self.pushes.drop(dest.transfer_id)
            return PrefillResult(done.output, "")
        self.pushes.first_token(push, done.chunks)
        return PrefillResult(done.output, dest.transfer_id)

    def done(self, req_id: str, result: PrefillDone | BaseException) -> None:
        """The step loop's answer for `req_id`: its first token and chunks, or why it failed."""
        future = self._waiting.get(req_id)
        if future is None or future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def cancel(self, req_id: str) -> None:
        future = self._waiting.pop(req_id, None)
        if future is not None and not future.done():
            future.cancel()

    def waiting(self) -> list[str]:
        return list(self._waiting)
