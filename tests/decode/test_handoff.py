"""A drained decode worker hands a running request's whole context to another decode worker
(decode.handoff), on two real engines: the pages pushed are the drained worker's own -- prompt
and generated tokens, all reused from its prefix cache, only the partial last page computed --
and the survivor goes on token-exact; the drain waits for exactly the hand-offs that may come."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from decode.handoff import HAND_OFF_WAIT_S, HandOffs
from decode.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from kvtransfer.codec import CodecLimits
from kvtransfer.local import receive_all
from prefill.worker import PrefillDone
from tests.clock import Clock

OUT = 40
GREEDY = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)
PS = 16


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Engine, Engine, Engine]:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=96)
    return Engine(replace(cfg, enable_prefix_cache=False)), Engine(cfg), Engine(cfg)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(100, 16_384, size=n).tolist())


def _steps(engine: Engine, hand: HandOffs, until: int) -> tuple[list[StepOutput], list[tuple[str, PrefillDone | Exception]]]:
    """Step until `until` outputs or hand-offs came out (bounded); what `take` kept and handed."""
    kept: list[StepOutput] = []
    done: list[tuple[str, PrefillDone | Exception]] = []
    for _ in range(200):
        if len(kept) + len(done) >= until or not engine.has_unfinished():
            break
        outs, finished = hand.take(engine.step())
        kept += outs
        done += finished
    return kept, done


def test_a_moved_request_takes_its_whole_context_from_the_drained_worker(
    engines: tuple[Engine, Engine, Engine],
) -> None:
    single, drained, survivor = engines
    prompt = _prompt(1, 200)
    want = single.generate([list(prompt)], GREEDY)[0]
    hand, clock = HandOffs(drained, pages_per_chunk=4), Clock()
    hand.clock = clock

    drained.add(Job("r", prompt, GREEDY))
    kept, _ = _steps(drained, hand, 25)
    emitted = tuple(t for out in kept for t in out.token_ids)
    assert 20 <= len(emitted) < OUT and emitted == tuple(want[: len(emitted)])
    hand.expect(["r"])  # the drain starts with it running
    drained.abort("r")  # the gateway moved it: its pages stay cached here
    hand.abort("r")
    assert hand.is_waiting()

    context = prompt + emitted
    job = Job("r@1", context, replace(GREEDY, max_tokens=OUT - len(emitted)))
    to = DecodeWorker(survivor, address="decode-1")
    dest = to.reserve(job, sender_epoch=7)
    assert dest is not None
    hand.submit(job, dest, moved="r")
    kept, done = _steps(drained, hand, 1)
    assert kept == []  # nobody streams a hand-off's token from here
    [(req_id, result)] = done
    assert req_id == "r@1"
    assert isinstance(result, PrefillDone) and result.finish_reason is None
    # every whole page of the context, generated ones included, came from the cache
    assert result.output.cached.total == (len(context) - 1) // PS * PS
    assert all(c.header.sender_epoch == 7 for c in result.chunks) and len(result.chunks) > 1
    assert receive_all(to.receiver, result.chunks, CodecLimits()) == ""
    assert not hand.is_waiting() and not drained.has_unfinished()

    to.start_prefilled(job, dest, result.first_token)
    rest = [result.first_token]
    while survivor.has_unfinished():
        rest += [t for out in to.step() for t in out.token_ids]
    assert list(emitted) + rest == want  # token-exact across the move
    assert survivor.free_pages_at_idle() == survivor.pool.num_pages


def test_the_drain_waits_only_for_hand_offs_that_may_still_come(engines: tuple[Engine, Engine, Engine]) -> None:
    """A request that finishes on the drained worker is not waited for; one aborted there is,
    until its hand-off arrives or HAND_OFF_WAIT_S passes (its client went away: none comes)."""
    _, drained, _ = engines
    clock = Clock()
    hand = HandOffs(drained, pages_per_chunk=4, clock=clock)
    short = replace(GREEDY, max_tokens=2)
    drained.add(Job("ends-here", _prompt(2, 20), short))
    drained.add(Job("given-up", _prompt(3, 20), GREEDY))
    hand.expect(["ends-here", "given-up"])
    kept, _ = _steps(drained, hand, 3)
    assert any(out.req_id == "ends-here" and out.finished for out in kept)
    drained.abort("given-up")
    hand.abort("given-up")
    assert hand.is_waiting()  # its hand-off may still come
    clock.now += HAND_OFF_WAIT_S - 0.1
    assert hand.is_waiting()
    clock.now += 0.2
    assert not hand.is_waiting()  # none came: the drain goes on
