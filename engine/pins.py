"""Pinned prefixes: a prefix an operator keeps resident on a worker until its TTL passes.

A pin holds its own reference on each full page of the prefix, as a running request does, so
the prefix cache can neither evict nor demote them (docs/architecture.md, Prefix pins):

    pin(pin_id, prompt, salt, ttl)   the prefix's pages already cached (any tier: promoted):
                                     held at once; else an internal request computes the
                                     prefix (one token sampled, never streamed) and its pages
                                     are held when it finishes; `on_done` is told either way
    unpin(pin_id) / TTL passed       the references go back; the pages stay cached, as any
                                     other, until eviction wants them
    purge of the tenant              its pins go too

Pins are bounded per worker (`max_pages`: a share of the pool, so requests always have
room); the edge bounds them per tenant. A pin is addressed by its id: pinning the same id
again replaces it (a new prefix or TTL).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import RequestError
from kvcache.hashing import tenant_of

if TYPE_CHECKING:  # the edges use pins without torch (a router imports none)
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine
    from kvcache.pool import PagePool
    from kvcache.radix import PrefixCache

PIN_REQUEST_PREFIX = "pin/"  # internal requests' ids: no edge mints one (theirs are hex)


@dataclass(slots=True)
class Pin:
    pin_id: str
    cache_salt: bytes
    num_tokens: int  # the prefix's tokens; its full pages are what is held
    hashes: tuple[bytes, ...]  # its full pages' hashes (the tenant's salt in them)
    expires_at: float  # on the engine's clock
    page_ids: list[int] = field(default_factory=list)  # held; empty while it computes
    waiters: list[Callable[[PinView | str], None]] = field(default_factory=list)  # told once it holds or ends

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    @property
    def is_held(self) -> bool:
        return len(self.page_ids) == self.num_pages


@dataclass(frozen=True, slots=True)
class PinView:
    """A pin as /status and the pin calls report it."""

    pin_id: str
    num_tokens: int
    num_pages: int
    state: str  # "held" or "computing"
    expires_in_s: float


PinAnswer = tuple[str, PinView | str]  # (worker, its pin or why it refused)


async def pin_on(
    engine: AsyncEngine, worker: str, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float,
    wait_s: float,
) -> PinAnswer:
    """Pin on an in-process engine (its step thread does it) and wait up to `wait_s` for its
    pages to be held: its answer ("computing" still, past the wait)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[PinView | str] = loop.create_future()

    def tell(result: PinView | str) -> None:  # on the step thread
        loop.call_soon_threadsafe(settle, done, result)

    try:
        first = await engine.call(lambda e: e.pin_prefix(pin_id, prompt_ids, cache_salt, ttl_s, tell))
    except RequestError as exc:
        return worker, str(exc)
    try:
        return worker, await asyncio.wait_for(asyncio.shield(done), wait_s)
    except TimeoutError:
        return worker, first


async def pin_in_loop(
    engine: Engine, wake: Callable[[], None], pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str,
    ttl_s: float, wait_s: float,
) -> PinView | str:
    """Pin on an engine this event loop steps (a worker actor's; `wake` starts its next step)
    and wait up to `wait_s` for its pages to be held: the pin ("computing" still, past the
    wait), or why it was refused."""
    done: asyncio.Future[PinView | str] = asyncio.get_running_loop().create_future()
    try:
        view = engine.pin_prefix(pin_id, prompt_ids, cache_salt, ttl_s, functools.partial(settle, done))
    except RequestError as exc:
        return str(exc)
    wake()  # a prefix not cached yet is computed by the step loop
    try:
        return await asyncio.wait_for(asyncio.shield(done), wait_s)
    except TimeoutError:
        return view


def settle(done: asyncio.Future[PinView | str], result: PinView | str) -> None:
    """A pin's waiter, on its event loop (a pin call that timed out no longer listens)."""
    if not done.done():
        done.set_result(result)


async def unpin_on(engine: AsyncEngine, pin_id: str) -> bool:
    return await engine.call(lambda e: e.unpin_prefix(pin_id))


class Pins:
    def __init__(
        self, cache: PrefixCache | None, pages: PagePool, max_pages: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.cache = cache
        self.pages = pages
        self.max_pages = max_pages
        self.clock = clock
        self._pins: dict[str, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_held_pages(self) -> int:
        """Pages the pins hold, each once however many pins hold it (a system prompt and a
        longer prefix that starts with it share their leading pages)."""
        return len(set(self.held_page_ids()))

    def held_page_ids(self) -> list[int]:
        """One entry per reference a pin holds (a page two pins hold: twice)."""
        return [page_id for pin in self._pins.values() for page_id in pin.page_ids]

    def views(self) -> list[PinView]:
        return [self.view(p) for p in self._pins.values()]

    def add(self, pin_id: str, num_tokens: int, hashes: Sequence[bytes], cache_salt: bytes, ttl_s: float) -> Pin:
        """Book a pin of the pages `hashes` names (not held yet); RequestError past the worker's
        bound, where a page other pins hold too (a prefix they share) counts once."""
        if self.cache is None:
            raise RequestError("pin", "this worker has no prefix cache to pin pages in")
        if not hashes:
            raise RequestError("prompt", f"a pin holds whole pages: at least {num_tokens + 1} more tokens needed")
        others = {h for p in self._pins.values() if p.pin_id != pin_id for h in p.hashes}
        more = len(set(hashes) - others)
        if len(others) + more > self.max_pages:
            raise RequestError("pin", f"pins may hold at most {self.max_pages} pages on this worker "
                                      f"({len(others)} held by other pins, {more} more asked)")  # fmt: skip
        self.release(pin_id)
        pin = Pin(pin_id, cache_salt, num_tokens, tuple(hashes), self.clock() + ttl_s)
        self._pins[pin_id] = pin
        return pin

    def hold(self, pin: Pin, hashes: Sequence[bytes]) -> bool:
        """Take references on the pin's pages where the cache has all of them (lower tiers
        promoted); True when held (its waiters are told). A partial match holds nothing."""
        assert self.cache is not None
        if self._pins.get(pin.pin_id) is not pin:
            return False  # released meanwhile
        found = self.cache.match(hashes, pin.num_pages)
        if len(found) < pin.num_pages:
            self.pages.free(found)
            return False
        pin.page_ids = found
        self._tell(pin, self.view(pin))
        return True

    def release(self, pin_id: str, why: str = "released before its pages were computed") -> Pin | None:
        pin = self._pins.pop(pin_id, None)
        if pin is not None:
            if pin.page_ids:
                self.pages.free(pin.page_ids)
                pin.page_ids = []
            self._tell(pin, why)
        return pin

    def view(self, pin: Pin) -> PinView:
        return PinView(pin.pin_id, pin.num_tokens, pin.num_pages, "held" if pin.is_held else "computing",
                       max(0.0, pin.expires_at - self.clock()))  # fmt: skip

    @staticmethod
    def _tell(pin: Pin, result: PinView | str) -> None:
        waiters, pin.waiters = pin.waiters, []
        for waiter in waiters:
            waiter(result)

    def expire(self) -> list[Pin]:
        """Release the pins whose TTL passed."""
        now = self.clock()
        done = [p.pin_id for p in self._pins.values() if p.expires_at <= now]
        return [pin for pin_id in done if (pin := self.release(pin_id)) is not None]

    def purge(self, tenant_salt: bytes) -> list[str]:
        """Release the tenant's pins; their ids."""
        doomed = [p.pin_id for p in self._pins.values() if tenant_of(p.cache_salt) == tenant_salt]
        for pin_id in doomed:
            self.release(pin_id)
        return doomed
