"""The asyncio face of an Engine: the step loop runs on its own thread.

    event loop                         step thread
    ----------                         -----------
    generate() -> commands.append ──▶  drain commands (add / abort)
                                       step()  (torch releases the GIL in the forward)
    queue.put_nowait(out) ◀─────────── loop.call_soon_threadsafe(dispatch, outputs)  one call per step

The engine itself is only ever touched by the step thread. A consumer that stops iterating
(disconnect, cancellation) aborts its request, which frees its pages on the next step.
`heartbeat` is the time of the loop's last turn, for a liveness probe that means "the step
loop is alive", not just "the socket answers".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

from engine.errors import RequestError, SlowReaderError
from engine.job import Job
from engine.omp import release_thread_pool
from engine.outputs import StepOutput, StepStats
from engine.sampling import SamplingParams

if TYPE_CHECKING:  # an edge without an engine (a router) imports this module, never torch
    from engine.engine import Engine

logger = logging.getLogger(__name__)


class _Start(NamedTuple):
    req_id: str
    start: Callable[[Engine], None]  # puts the request into the engine, on the step thread


class _Call(NamedTuple):
    fn: Callable[[Engine], Any]
    future: asyncio.Future[Any]


T = TypeVar("T")


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _Failed(NamedTuple):
    error: BaseException


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.5, max_buffered: int = 4096) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        # A consumer more than this many step outputs behind is cancelled: its buffer is
        # bounded and the batch never waits for it.
        self._max_buffered = max_buffered
        self._commands: deque[_Start | _Call | str] = deque()  # a str is an abort
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue[StepOutput | _Failed]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.heartbeat = time.monotonic()
        self.last_stats: StepStats | None = None
        self.error: BaseException | None = None
        # Set each time the step thread, idle for a whole idle wait, lets its OpenMP workers go (a
        # no-op when it has none: a call that ran torch there since made new ones); cleared when it
        # steps. An idle engine's pool would keep every other thread of this process that runs
        # torch from spinning its own (engine.omp).
        self.pool_released = threading.Event()

    def start(self) -> None:
        """Start stepping on a thread of its own. This thread (which may have built and warmed
        the engine) lets its OpenMP workers go, so that the step thread's pool is the only one
        and its workers spin between parallel regions (engine.omp)."""
        release_thread_pool()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="baton-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def is_live(self, max_heartbeat_age_s: float) -> bool:
        """The step thread runs and turned within `max_heartbeat_age_s` (it turns at least every
        idle wait): False means this process's engine is stuck or dead."""
        return self.is_alive and time.monotonic() - self.heartbeat < max_heartbeat_age_s

    def generate(self, job: Job) -> AsyncIterator[StepOutput]:
        """Stream a job's outputs; raises the engine's RequestError (or ConstraintError) if
        it is refused. A constraint is compiled off the step thread before the request is
        queued (see `prepare`)."""
        stream = self.stream(job.req_id, lambda e: e.add(job))
        if self.engine.is_prepared(job.sampling):
            return stream
        return self._prepared(job.sampling, stream)

    async def prepare(self, sampling: SamplingParams) -> None:
        """Compile the request's constraint, if any, on a worker thread (the step loop goes
        on meanwhile); ConstraintError if it is refused, now or earlier (refusals are cached
        too). Call it before `stream` for a start function that adds a constrained request,
        so that the step thread never compiles."""
        if sampling.constraint is not None:
            await asyncio.to_thread(self.engine.prepare, sampling)

    async def _prepared(self, sampling: SamplingParams, stream: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
        await self.prepare(sampling)
        async with contextlib.aclosing(cast(AsyncGenerator[StepOutput, None], stream)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, req_id: str, start: Callable[[Engine], None]) -> AsyncIterator[StepOutput]:
        """Stream the outputs of the request that `start` puts into the engine (any role)."""
        if not self.is_alive:
            raise RuntimeError("the engine's step loop is not running")
        if req_id in self._queues:
            raise RequestError("req_id", f"request {req_id!r} is already running")
        queue: asyncio.Queue[StepOutput | _Failed] = asyncio.Queue()
        self._queues[req_id] = queue
        self._commands.append(_Start(req_id, start))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Failed):
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(req_id, None)
            if not finished:
                self.abort(req_id)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the step thread (the only thread that touches the engine)."""
        if not self.is_alive:
            raise RuntimeError("the engine's step loop is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.append(_Call(fn, future))
        self._wake.set()
        return cast(T, await future)

    def abort(self, req_id: str) -> None:
        self._commands.append(req_id)
        self._wake.set()

    # -- the step thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.heartbeat = time.monotonic()
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self.engine.flush_cache()
                    if not self._wake.wait(self._idle_wait_s):
                        release_thread_pool()  # the next step makes a new pool: one thread start
                        self.pool_released.set()
                    self._wake.clear()
                    continue
                if self.pool_released.is_set():  # an attribute read: Event.clear() takes a lock
                    self.pool_released.clear()
                outputs = self.engine.step()
                self.last_stats = self.engine.last_stats
                if outputs:
                    self._post(self._dispatch, outputs)
        except BaseException as exc:  # the loop must report its death, not vanish
            logger.exception("step loop died")
            self.error = exc
            self._post(self._fail_all, exc)

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, str):
                self.engine.abort(command)
            elif isinstance(command, _Call):
                try:
                    self._post(_resolve, command.future, command.fn(self.engine), None)
                except Exception as exc:
                    self._post(_resolve, command.future, None, exc)
            else:
                try:
                    command.start(self.engine)
                except Exception as exc:  # refused: tell that caller only
                    self._post(self._deliver, command.req_id, _Failed(exc))

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- on the event loop ------------------------------------------------------------------

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self._deliver(out.req_id, out)

    def _deliver(self, req_id: str, item: StepOutput | _Failed) -> None:
        queue = self._queues.get(req_id)
        if queue is None:
            return
        if queue.qsize() >= self._max_buffered:
            logger.warning("cancelling %s: its reader is %d outputs behind", req_id, queue.qsize())
            del self._queues[req_id]
            self.abort(req_id)
            while not queue.empty():
                queue.get_nowait()
            item = _Failed(SlowReaderError(f"request {req_id} cancelled: the client reads too slowly"))
        queue.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(_Failed(RuntimeError(f"engine failed: {exc!r}")))
