"""What a lookup in the cluster-wide KV index returns (cluster.placement.global_index): per worker, how
many of a prompt's leading pages it holds, and in which tiers.

The index answers with the places where groups of workers' runs enter or leave a tier, as
masks with bit 2s for the worker in slot s:

    changes  (page, tier, entered, left)    e.g. (0, DEVICE, {a, b}, {}) (20, DEVICE, {}, {b})
    ends     (page, workers whose run stops before it), in page order

so a worker's hit is a walk over `changes` (a handful), and holders are expanded one by one,
longest first, only as far as the caller reads.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import NamedTuple, Protocol


class Slots(Protocol):
    """The index's numbering of workers."""

    def bit_of(self, worker_id: str) -> int: ...

    def worker_of(self, bit: int) -> str: ...


class PrefixHit(NamedTuple):
    """How many leading pages of a prompt one worker holds, by tier."""

    num_device: int = 0
    num_host: int = 0
    num_disk: int = 0

    @property
    def num_pages(self) -> int:
        return self.num_device + self.num_host + self.num_disk


NO_HIT = PrefixHit()


class PrefixMatch:
    """One lookup's result, kept as the tier changes of groups of workers (workers that hold
    the same pages share every entry), so holders are expanded only when asked for: a prefix
    held by the whole fleet costs the lookup no more than one held by one worker."""

    def __init__(self, slots: Slots, changes: list[tuple[int, int, int, int]], ends: list[tuple[int, int]]) -> None:
        self._slots = slots
        self._changes = changes
        self._ends = ends

    def __bool__(self) -> bool:
        return bool(self._ends)

    def hit(self, worker_id: str) -> PrefixHit:
        bit = self._slots.bit_of(worker_id)
        counts, since = [0, 0, 0], [0, 0, 0]
        for page, tier, entered, left in self._changes:
            if entered & bit:
                since[tier] = page
            elif left & bit:
                counts[tier] += page - since[tier]
        return PrefixHit(*counts)

    def ranked(self, within: int = -1, rng: random.Random | None = None) -> Iterator[tuple[str, int]]:
        """(worker, pages held) for the holders among `within` (a GlobalIndex.mask_of), the
        longest runs first. Among equal runs the order starts at a random holder when `rng`
        is given, so equally good holders share the load (not the lowest slot every time)."""
        for length, mask in reversed(self._ends):
            mask &= within
            if not mask:
                continue
            cut = rng.randrange(mask.bit_length()) if rng is not None else 0
            high = (mask >> cut) << cut
            for part in (high, mask ^ high):
                while part:
                    bit = part & -part
                    part ^= bit
                    yield self._slots.worker_of(bit), length

    def to_dict(self) -> dict[str, PrefixHit]:
        return {w: self.hit(w) for w, _ in self.ranked()}
