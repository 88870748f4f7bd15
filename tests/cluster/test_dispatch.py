"""The one dispatcher (cluster.fleet.dispatch) on its own, over recording sides: the order of a
disaggregated request's steps, the next path after a failed one, a first token that ends the
request, and what is let go when it is cancelled. The real flows run it over engines
(tests/cluster/test_pd_server.py) and over Ray actors (tests/cluster/test_ray_serving.py,
tests/faults)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from cluster.fleet.dispatch import Handed, PrefillSide, Redispatch, Started, dispatch, replayable
from cluster.ops.tracing import NO_TRACE, RequestTrace, Span
from engine.job import Job
from engine.outputs import StepOutput
from engine.request import NOT_CACHED, CachedTokens
from engine.sampling import SamplingParams
from kvtransfer.transport import KVDestination

JOB = Job("r", (1, 2, 3, 4), SamplingParams(max_tokens=3, temperature=0.0))


def _out(tokens: tuple[int, ...], n: int, finish: str | None = None) -> StepOutput:
    return StepOutput("r", tokens, "", (), finish, 4, n, NOT_CACHED)  # type: ignore[arg-type]


FIRST = _out((7,), 1)
REST = [_out((8,), 2), _out((9,), 3, "length")]


def _dest(n: int) -> KVDestination:
    return KVDestination("decode", "r", f"t{n}", b"k", 1, (n,))


@dataclass
class Log:
    calls: list[str] = field(default_factory=list)
    computed: list[tuple[str, str | None, int]] = field(default_factory=list)  # (decode, prefill, cached tokens)


@dataclass
class FakePrefill:
    name: str
    log: Log
    fails: bool = False
    first: StepOutput = FIRST
    hang: bool = False
    epoch: int = 3

    async def prefill(self, job: Job, dest: KVDestination, span: Span) -> Started:
        self.log.calls.append(f"prefill {self.name} {dest.transfer_id}")
        if self.hang:
            await asyncio.Event().wait()
        if self.fails:
            raise Redispatch
        return Started(self.first, self.name)

    def abort(self, req_id: str) -> None:
        self.log.calls.append(f"abort prefill {self.name}")


@dataclass
class FakeDecode:
    log: Log
    hand_over_fails: int = 0  # how many hand-overs fail
    damaged: int = 0  # how many of those fail with their pages damaged in flight (Redispatch.again)
    local_outputs: list[StepOutput] = field(default_factory=lambda: [FIRST, *REST])
    name: str = "decode-0"
    epoch: int = 5
    _reserved: int = 0

    async def reserve(self, job: Job, prefill: PrefillSide | None) -> KVDestination | None:
        if prefill is None:
            self.log.calls.append("start local")
            return None
        self._reserved += 1
        self.log.calls.append(f"reserve t{self._reserved} for epoch {prefill.epoch}")
        return _dest(self._reserved)

    async def hand_over(self, job: Job, dest: KVDestination, started: Started, trace: RequestTrace) -> None:
        self.log.calls.append(f"hand over {dest.transfer_id} from {started.ticket}")
        if self.hand_over_fails:
            self.hand_over_fails -= 1
            again = self.damaged > 0
            self.damaged -= again
            raise Redispatch(again=again)

    async def outputs(self, job: Job, handed: Handed | None) -> AsyncIterator[StepOutput]:
        self.log.calls.append("outputs " + ("local" if handed is None else f"of {handed.dest.transfer_id}"))
        for out in self.local_outputs if handed is None else REST:
            yield out

    def cancel(self, dest: KVDestination) -> None:
        self.log.calls.append(f"cancel {dest.transfer_id}")

    def abort(self, req_id: str) -> None:
        self.log.calls.append("abort decode")


@dataclass
class Tally:
    log: Log

    def placed(self, job: Job, route: str) -> None:
        self.log.calls.append(f"placed {route}")

    def redispatched(self, job: Job, to: str) -> None:
        self.log.calls.append(f"redispatched to {to}")

    def computed(self, job: Job, cached: CachedTokens, decode: str, prefill: str | None) -> None:
        self.log.computed.append((decode, prefill, cached.total))


async def _run(decode: FakeDecode, paths: list[PrefillSide | None], log: Log) -> list[StepOutput]:
    got = []
    async for out in dispatch(JOB, decode, paths, NO_TRACE, Tally(log)):
        log.calls.append(f"yield {out.token_ids}")
        got.append(out)
    return got


def test_the_first_token_goes_out_before_the_pages_move() -> None:
    log = Log()
    got = asyncio.run(_run(FakeDecode(log), [FakePrefill("p0", log), None], log))
    assert [o.token_ids for o in got] == [(7,), (8,), (9,)]
    assert log.calls == ["reserve t1 for epoch 3", "prefill p0 t1", "placed disaggregated", "yield (7,)",
                         "hand over t1 from p0", "outputs of t1", "yield (8,)", "yield (9,)"]  # fmt: skip
    assert log.computed == [("decode-0", "p0", 0)]  # the context came from p0 once its pages arrived


def test_a_failed_prefill_gives_its_pages_back_and_the_next_worker_runs_it() -> None:
    log = Log()
    paths: list[PrefillSide | None] = [FakePrefill("p0", log, fails=True), FakePrefill("p1", log), None]
    got = asyncio.run(_run(FakeDecode(log), paths, log))
    assert [o.token_ids for o in got] == [(7,), (8,), (9,)]
    assert log.calls[:6] == ["reserve t1 for epoch 3", "prefill p0 t1", "cancel t1", "redispatched to prefill",
                             "reserve t2 for epoch 3", "prefill p1 t2"]  # fmt: skip
    assert "abort decode" not in log.calls and not any(c.startswith("abort prefill") for c in log.calls)


def test_a_failed_hand_over_reruns_locally_without_sending_the_first_token_twice() -> None:
    log = Log()
    got = asyncio.run(_run(FakeDecode(log, hand_over_fails=1), [FakePrefill("p0", log), None], log))
    assert [o.token_ids for o in got] == [(7,), (8,), (9,)]  # the local re-run's own first token is skipped
    assert log.calls == ["reserve t1 for epoch 3", "prefill p0 t1", "placed disaggregated", "yield (7,)",
                         "hand over t1 from p0", "redispatched to local", "start local", "placed local",
                         "outputs local", "yield (8,)", "yield (9,)"]  # fmt: skip
    assert log.computed == [("decode-0", None, 0)]  # p0's first token went out, but decode computed the context


def test_pages_damaged_in_flight_are_sent_again_by_the_same_worker_once() -> None:
    log = Log()
    got = asyncio.run(_run(FakeDecode(log, hand_over_fails=1, damaged=1), [FakePrefill("p0", log), None], log))
    assert [o.token_ids for o in got] == [(7,), (8,), (9,)]  # the re-run's first token is not sent again
    assert log.calls == ["reserve t1 for epoch 3", "prefill p0 t1", "placed disaggregated", "yield (7,)",
                         "hand over t1 from p0", "redispatched to same", "reserve t2 for epoch 3", "prefill p0 t2",
                         "placed disaggregated", "hand over t2 from p0", "outputs of t2", "yield (8,)",
                         "yield (9,)"]  # fmt: skip
    assert log.computed == [("decode-0", "p0", 0)]  # fetched from p0 after all

    log = Log()  # damaged twice: the same worker is not tried a third time
    asyncio.run(_run(FakeDecode(log, hand_over_fails=2, damaged=2), [FakePrefill("p0", log), None], log))
    assert [c for c in log.calls if c.startswith("redispatched")] == ["redispatched to same", "redispatched to local"]
    assert log.computed == [("decode-0", None, 0)]


def test_a_local_rerun_that_ends_at_its_first_token_sends_only_the_finish() -> None:
    log = Log()
    decode = FakeDecode(log, hand_over_fails=1, local_outputs=[_out((7,), 1, "stop")])
    got = asyncio.run(_run(decode, [FakePrefill("p0", log), None], log))
    assert [(o.token_ids, o.finish_reason) for o in got] == [((7,), None), ((), "stop")]


def test_a_first_token_that_ends_the_request_moves_nothing() -> None:
    log = Log()
    done = _out((7,), 1, "stop")
    got = asyncio.run(_run(FakeDecode(log), [FakePrefill("p0", log, first=done), None], log))
    assert got == [done]
    assert log.calls == ["reserve t1 for epoch 3", "prefill p0 t1", "placed disaggregated", "cancel t1",
                         "yield (7,)"]  # fmt: skip


def test_a_request_cancelled_mid_prefill_is_aborted_on_both_sides() -> None:
    log = Log()

    async def main() -> None:
        task = asyncio.ensure_future(_run(FakeDecode(log), [FakePrefill("p0", log, hang=True), None], log))
        for _ in range(100):  # a few turns of the loop: the fake records the call before it waits
            if "prefill p0 t1" in log.calls:
                break
            await asyncio.sleep(0)
        assert "prefill p0 t1" in log.calls
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log.calls[-2:] == ["abort decode", "abort prefill p0"]


def test_replayable_seeds_only_unseeded_sampling() -> None:
    greedy = JOB
    seeded = Job("s", (1,), SamplingParams(max_tokens=2, temperature=0.7, seed=11))
    unseeded = Job("u", (1,), SamplingParams(max_tokens=2, temperature=0.7))
    assert replayable(greedy) is greedy and replayable(seeded) is seeded
    assert replayable(unseeded).sampling.seed is not None


def test_paths_must_end_decode_local() -> None:
    """A failed path goes to the next one: the last must be decode-local, which cannot fail so."""
    log = Log()
    with pytest.raises(ValueError, match="end with None"):
        asyncio.run(_run(FakeDecode(log), [FakePrefill("p0", log)], log))
    assert log.calls == []
