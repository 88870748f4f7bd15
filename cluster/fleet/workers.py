"""The gateway's view of each worker actor: health, load, and the decode output streams.

    DecodeHandle   one long-poll loop per decode actor (`next_batch`): each batch carries every
                   request's new tokens of the steps since the last one, plus the worker's
                   stats; the handle demultiplexes them to per-request queues
    PrefillHandle  health (a failed call or stats poll marks it dead) and in-flight count

A request subscribes before it is started on the actor, so no output can arrive unseen. A
reader more than `max_buffered` outputs behind is cancelled (its request aborted on the actor)
rather than stalling the batch or growing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cluster.errors import EdgeError, Kind
from cluster.fleet.worker_msgs import DecodeStats, OutputBatch, PrefillStats
from engine.errors import SlowReaderError
from engine.outputs import StepOutput

logger = logging.getLogger(__name__)


class WorkerLost(EdgeError):
    """The worker died or its output stream broke; the message is safe to show a client."""

    def __init__(self, message: str, worker: str = "", handing_off: bool = False) -> None:
        super().__init__(Kind.UNAVAILABLE, message, None, 1.0)
        self.worker = worker  # the decode worker it was lost with
        self.handing_off = handing_off  # that worker drains and lives on: it hands the context over


class _Failed(NamedTuple):
    error: BaseException


Outputs = asyncio.Queue[StepOutput | _Failed]


@dataclass(slots=True)
class PrefillHandle:
    name: str
    actor: Any  # ray.actor.ActorHandle[PrefillActor]
    epoch: int
    is_alive: bool = True
    num_inflight: int = 0  # requests this gateway has on it now
    stats: PrefillStats | None = None
    reported_at: float = 0.0  # time.monotonic() of `stats`
    is_member: bool = True  # registered: new work may go there (a lease lost or a drain: False)
    is_stalled: bool = False  # its stats poll went unanswered past the watchdog
    pid: int | None = None  # its actor's process, from its answers (another one: Ray restarted it)
    trouble: asyncio.Event = field(default_factory=asyncio.Event)  # set while stalled or dead

    @property
    def is_routable(self) -> bool:
        return self.is_alive and self.is_member and not self.is_stalled

    def mark_dead(self, why: object) -> None:
        if self.is_alive:
            logger.warning("prefill worker %s is gone: %s", self.name, why)
        self.is_alive = False
        self.trouble.set()

    def mark_stalled(self, watchdog_s: float) -> bool:
        """True when this newly stalls (its in-flight prefills move: see `trouble`)."""
        if self.is_stalled or not self.is_alive:
            return False
        logger.warning("prefill worker %s answered nothing in %.1f s: stalled, no new work", self.name, watchdog_s)
        self.is_stalled = True
        self.trouble.set()
        return True

    def mark_answering(self) -> None:
        if self.is_stalled:
            logger.warning("prefill worker %s answers again: re-admitted", self.name)
        self.is_stalled = False
        if self.is_alive:
            self.trouble.clear()

    def revive(self, epoch: int, pid: int | None = None) -> None:
        """Ray restarted its actor and it rejoined (Fleet._revive)."""
        self.epoch, self.is_alive, self.is_stalled, self.stats, self.pid = epoch, True, False, None, pid
        self.trouble.clear()


class DecodeHandle:
    def __init__(
        self, name: str, actor: Any, address: str, poll_wait_s: float = 1.0, max_buffered: int = 4096,
        epoch: int = 1, watchdog_s: float = 30.0,
    ) -> None:
        self.name = name
        self.epoch = epoch  # its membership registration's
        self.is_member = True  # registered: new work may go there (a lease lost or a drain: False)
        self.actor = actor  # ray.actor.ActorHandle[DecodeActor]
        self.address = address
        self.poll_wait_s = poll_wait_s
        self.max_buffered = max_buffered
        self.stats: DecodeStats | None = None
        self.heartbeat = time.monotonic()
        self.is_alive = True
        self.watchdog_s = watchdog_s  # no answer this long past a long-poll: stalled
        self.is_stalled = False
        self.trouble = asyncio.Event()  # set while stalled or dead: calls waiting on it give up
        self.on_stall: Callable[[], None] | None = None  # RayFront counts stalls
        # whether its requests may move elsewhere now (the Fleet: another decode worker routable)
        self.may_hand_off: Callable[[], bool] = lambda: False
        self._queues: dict[str, Outputs] = {}
        self._task: asyncio.Task[None] | None = None
        self.num_batches = 0
        self.num_outputs = 0

    @property
    def is_routable(self) -> bool:
        return self.is_alive and self.is_member and not self.is_stalled

    @property
    def num_active(self) -> int:
        return len(self._queues)

    def load(self) -> tuple[int, int]:
        """Lower is less loaded: active requests, then fewest free pages."""
        free = self.stats.num_free_pages_at_idle - self.stats.num_reserved_pages if self.stats else 0
        return (self.num_active, -free)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll(), name=f"baton-poll-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    # -- per request ----------------------------------------------------------------------------

    def subscribe(self, req_id: str) -> Outputs:
        if not self.is_alive:
            raise WorkerLost(f"decode worker {self.name} is not available", self.name)
        queue: Outputs = asyncio.Queue()
        self._queues[req_id] = queue
        return queue

    def unsubscribe(self, req_id: str) -> None:
        self._queues.pop(req_id, None)

    @staticmethod
    async def outputs(queue: Outputs) -> AsyncIterator[StepOutput]:
        """A subscription's outputs until its request finishes; raises what the stream failed with."""
        while True:
            item = await queue.get()
            if isinstance(item, _Failed):
                raise item.error
            yield item
            if item.finished:
                return

    # -- the stream -----------------------------------------------------------------------------

    def revive(self, address: str, epoch: int) -> None:
        """Ray restarted its actor and it rejoined (Fleet._revive): a fresh output stream."""
        self.address, self.epoch, self.stats = address, epoch, None
        self.is_alive, self.is_stalled, self.heartbeat = True, False, time.monotonic()
        self.trouble.clear()
        self.start()

    async def _poll(self) -> None:
        after = 0
        while True:
            call = asyncio.ensure_future(_answer(self.actor.next_batch.remote(after, self.poll_wait_s)))
            call.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is not "never retrieved"
            try:
                done, _ = await asyncio.wait({call}, timeout=self.poll_wait_s + self.watchdog_s)
                if not done:  # a stopped process, a wedged loop: its requests move now
                    self._stall()
                    await call  # no new calls pile up behind it; its answer re-admits it
                batch: OutputBatch = call.result()
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:
                self._fail_all(WorkerLost(f"decode worker {self.name} failed", self.name), exc)
                return
            if self.is_stalled:
                logger.warning("decode worker %s answers again: re-admitted", self.name)
                self.is_stalled = False
                self.trouble.clear()
            if batch.first_seq > after + 1:  # the feed dropped steps we never saw
                self._fail_all(WorkerLost(f"decode worker {self.name}'s output stream lost steps", self.name), None)
            after = max(after, batch.last_seq)
            self.stats, self.heartbeat = batch.stats, time.monotonic()
            self.num_batches += bool(batch.outputs)
            self.num_outputs += len(batch.outputs)
            for out in batch.outputs:
                self._deliver(out)
            if batch.stats.handing_off:
                self._hand_off()

    def _hand_off(self) -> None:
        """The worker drains and hands its requests off: nothing new goes there, and what runs
        there moves (each stream's WorkerLost migrates it; its abort frees it there), unless no
        other decode worker could take it -- then it finishes here."""
        self.is_member = False
        if self._queues and self.may_hand_off():
            logger.info("decode worker %s drains: its %d requests move", self.name, len(self._queues))
            lost = WorkerLost(f"decode worker {self.name} is draining: its requests move", self.name, handing_off=True)
            self._fail_all(lost, None)

    def _deliver(self, out: StepOutput) -> None:
        queue = self._queues.get(out.req_id)
        if queue is None:
            return  # cancelled or re-dispatched meanwhile
        if queue.qsize() >= self.max_buffered:
            logger.warning("cancelling %s: its reader is %d outputs behind", out.req_id, queue.qsize())
            del self._queues[out.req_id]
            self.actor.abort.remote(out.req_id)
            queue.put_nowait(_Failed(SlowReaderError(f"request {out.req_id} cancelled: the client reads too slowly")))
            return
        queue.put_nowait(out)

    def mark_dead(self, why: object = None) -> None:
        if self.is_alive and why is not None:
            logger.warning("decode worker %s is gone: %s", self.name, why)
        self.is_alive = False
        self.trouble.set()

    def _stall(self) -> None:
        logger.warning("decode worker %s answered nothing in %.1f s: stalled; its %d requests move",
                       self.name, self.poll_wait_s + self.watchdog_s, len(self._queues))  # fmt: skip
        self.is_stalled = True
        self.trouble.set()
        if self.on_stall is not None:
            self.on_stall()
        self._fail_all(WorkerLost(f"decode worker {self.name} stalled", self.name), None)

    def fail_all(self, error: WorkerLost) -> None:
        """End every subscribed stream with `error` (a drain's abandoned requests)."""
        self._fail_all(error, None)

    def _fail_all(self, error: WorkerLost, cause: BaseException | None) -> None:
        if cause is not None:
            logger.warning("decode worker %s: output stream ended: %r", self.name, cause)
            self.mark_dead()
        for queue in self._queues.values():
            queue.put_nowait(_Failed(error))
        self._queues.clear()


async def _answer(ref: Any) -> Any:
    return await ref
