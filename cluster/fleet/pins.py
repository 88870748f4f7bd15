"""Pins on Ray workers, kept across joins: a prefix pinned through the gateway (cluster.edge.pins)
stands until its TTL, and each worker of its role that starts serving later with an empty
engine gets it too, for what is left of the TTL.

    RayFront.pin_prefix(role, ...)   pin_worker on every routable worker of the role; the pin
                                     stands when one of them took it
    Fleet.on_join(handle)            a worker adopted (the planner's, `baton scale`'s, another
                                     gateway's) or restarted by Ray -> reapply: every standing
                                     pin whose role it serves, its answer to the gateway's book
    RayFront.unpin_prefix            the pin stands no more

A role of "" means where prompts are computed: the prefill workers, or the decode workers when
no prefill worker is routable (judged when the worker joins, as at pin time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from cluster.fleet.calls import abandonable, ray_await
from cluster.fleet.workers import DecodeHandle, PrefillHandle
from engine.pins import PinAnswer, PinView

logger = logging.getLogger(__name__)

PIN_CALL_S = 10.0  # a worker's answer to a pin call, past the wait for its pages it was given
MIN_REAPPLY_TTL_S = 1.0  # cluster.edge.pins.MIN_TTL_S: a pin with less left is not re-applied


async def pin_worker(
    handle: PrefillHandle | DecodeHandle, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float,
    wait_s: float,
) -> PinAnswer:
    """One worker's answer to a pin (a worker that fails to answer says why)."""
    try:
        call = handle.actor.pin_prefix.remote(pin_id, prompt_ids, cache_salt, ttl_s, wait_s)
        return handle.name, await asyncio.wait_for(abandonable(ray_await(call)), wait_s + PIN_CALL_S)
    except Exception as exc:  # noqa: BLE001 -- one worker's failure is its answer, not the call's
        return handle.name, f"the worker did not answer: {type(exc).__name__}"


async def unpin_worker(handle: PrefillHandle | DecodeHandle, pin_id: str) -> bool:
    """Whether the worker had the pin (a dead worker holds nothing; the TTL ends it anyway)."""
    try:
        return bool(await asyncio.wait_for(abandonable(ray_await(handle.actor.unpin_prefix.remote(pin_id))), PIN_CALL_S))
    except Exception:  # noqa: BLE001
        return False


def pins_decode(role: str, has_prefill: bool) -> bool:
    """Whether a pin of `role` goes to the decode workers."""
    return role == "decode" or (role == "" and not has_prefill)


@dataclass(frozen=True, slots=True)
class StandingPin:
    role: str  # "", "prefill" or "decode" (cluster.edge.pins.ROLES)
    prompt_ids: tuple[int, ...]
    cache_salt: str
    expires_at: float  # time.monotonic()
    wait_s: float  # how long a worker's pin call waits for its pages (the gateway's PIN_WAIT_S)


class StandingPins:
    def __init__(self, reapplied: Counter) -> None:
        self._pins: dict[str, StandingPin] = {}  # worker pin id (cluster.edge.pins.worker_pin_id) -> pin
        self._reapplied = reapplied  # baton_pins_reapplied_total{role, outcome}
        # The gateway's book (cluster.edge.pins.PinBook.answered): what a joined worker said.
        self.on_answer: Callable[[str, PinAnswer], None] = lambda pin_id, answer: None

    def __len__(self) -> int:
        return len(self._pins)

    def stand(self, pin_id: str, pin: StandingPin, answers: Sequence[PinAnswer]) -> None:
        """After a pin call: it stands when some worker took it (else an earlier pin of this
        id, now replaced by a refused one, stands no more)."""
        if any(isinstance(a, PinView) for _, a in answers):
            self._pins[pin_id] = pin
        else:
            self._pins.pop(pin_id, None)

    def drop(self, pin_id: str) -> None:
        self._pins.pop(pin_id, None)

    def _live(self) -> list[tuple[str, StandingPin, float]]:
        """(pin id, pin, seconds left) of each pin whose TTL has not run out; forgets the rest."""
        now = time.monotonic()
        for pin_id in [k for k, p in self._pins.items() if p.expires_at - now < MIN_REAPPLY_TTL_S]:
            del self._pins[pin_id]
        return [(k, p, p.expires_at - now) for k, p in self._pins.items()]

    async def reapply(self, handle: PrefillHandle | DecodeHandle, has_prefill: bool) -> None:
        """Pin on a worker that joined every standing pin of the role it serves; each answer
        goes to the gateway's book and baton_pins_reapplied_total."""
        is_decode = isinstance(handle, DecodeHandle)
        role = "decode" if is_decode else "prefill"
        mine = [(k, p, left) for k, p, left in self._live() if pins_decode(p.role, has_prefill) == is_decode]
        for pin_id, pin, left in mine:  # one at a time: a worker bounds what its pins hold
            answer = await pin_worker(handle, pin_id, pin.prompt_ids, pin.cache_salt, left, pin.wait_s)
            _, said = answer
            if pin_id not in self._pins and isinstance(said, PinView):  # unpinned meanwhile
                await unpin_worker(handle, pin_id)
                continue
            outcome = said.state if isinstance(said, PinView) else "refused"
            self._reapplied.labels(role, outcome).inc()
            if not isinstance(said, PinView):
                logger.warning("pin %s not re-applied on %s: %s", pin_id, handle.name, said)
            self.on_answer(pin_id, answer)
