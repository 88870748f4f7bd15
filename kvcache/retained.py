"""Retained copies: a prefill worker's references on the cached pages of prompts it pushed, so
that a decode worker lost after the hand-over leaves the context behind (docs/architecture.md,
KV-preserving failover).

    hold(key, hashes, lease_s)   reference the prompt's pages the cache has, as a running
                                 request does (neither evicted nor demoted while held); the
                                 oldest copies go first when the budget would be passed
    lease(key, lease_s)          the copy's lease from now (the push was acknowledged)
    expire()                     each step: the copies whose lease ended go
    release(key, why)            one copy goes now

A released copy's pages stay cached as any other page and leave by LRU (written back to the
host and disk tiers on their way out), so a copy usually outlives its lease; the lease only
guarantees it for the window a hand-over is likeliest to fail in. Budget: at most `max_pages`
held at once, so prompts always have room; a page several copies hold (the system prompt or
document header their prompts share) counts once. Each release is counted by why
(RELEASE_REASONS).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.pool import PagePool
from kvcache.radix import PrefixCache

# lease: its lease ended; budget: newer copies needed the room; released: let go on purpose
# (the worker's caller asked, or it closed)
RELEASE_REASONS = ("lease", "budget", "released")


@dataclass(slots=True)
class _Copy:
    page_ids: list[int]
    hashes: list[bytes]  # page_ids[i] is the cache's page of hashes[i]
    expires_at: float


class RetainedCopies:
    def __init__(
        self, cache: PrefixCache | None, pages: PagePool, max_pages: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_pages < 0:
            raise ValueError("max_pages must be >= 0")
        self.cache = cache
        self.pages = pages
        self.max_pages = max_pages if cache is not None else 0  # no cache: nothing to hold pages in
        self.clock = clock
        self._copies: OrderedDict[str, _Copy] = OrderedDict()  # oldest first
        self._held: Counter[bytes] = Counter()  # page hash -> the copies holding its page
        self.released: Counter[str] = Counter()  # copies, by RELEASE_REASONS

    @property
    def num_held_pages(self) -> int:
        """Pages the copies hold, each once however many copies hold it."""
        return len(self._held)

    def __len__(self) -> int:
        return len(self._copies)

    def __contains__(self, key: str) -> bool:
        return key in self._copies

    def hold(self, key: str, hashes: Sequence[bytes], lease_s: float) -> int:
        """Reference the leading pages of `hashes` the cache holds (lower tiers promoted), at
        most the budget, until `lease_s` from now; pages held. Holding a key again replaces it."""
        self.release(key)
        want = min(len(hashes), self.max_pages)
        if self.cache is None or want == 0:
            return 0
        while self._copies and self.num_held_pages + self._unheld(hashes[:want]) > self.max_pages:
            self.release(next(iter(self._copies)), "budget")
        page_ids = self.cache.match(hashes, want)
        if page_ids:
            held = list(hashes[: len(page_ids)])
            self._copies[key] = _Copy(page_ids, held, self.clock() + lease_s)
            self._held.update(held)
        return len(page_ids)

    def _unheld(self, hashes: Sequence[bytes]) -> int:
        return sum(h not in self._held for h in hashes)

    def lease(self, key: str, lease_s: float) -> None:
        """The copy is kept `lease_s` from now (no copy: nothing happens)."""
        copy = self._copies.get(key)
        if copy is not None:
            copy.expires_at = self.clock() + lease_s

    def release(self, key: str, why: str | None = None) -> bool:
        """Let the copy go; `why` (RELEASE_REASONS) counts it. True when there was one."""
        copy = self._copies.pop(key, None)
        if copy is None:
            return False
        self.pages.free(copy.page_ids)
        for h in copy.hashes:
            if self._held[h] == 1:
                del self._held[h]
            else:
                self._held[h] -= 1
        if why is not None:
            self.released[why] += 1
        return True

    def expire(self) -> int:
        """Release the copies whose lease ended; how many."""
        now = self.clock()
        done = [key for key, copy in self._copies.items() if copy.expires_at <= now]
        for key in done:
            self.release(key, "lease")
        return len(done)

    def clear(self) -> None:
        for key in list(self._copies):
            self.release(key, "released")
