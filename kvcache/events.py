"""KV events: how the cluster-wide index learns what each worker caches, and in which tier."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


class EventKind(enum.IntEnum):
    STORED = 0
    REMOVED = 1
    TIER_CHANGED = 2


@dataclass(frozen=True, slots=True)
class KVEvent:
    worker_id: str
    epoch: int
    seq: int  # increases by one per event of this worker; a gap means events were lost
    kind: EventKind
    page_hashes: tuple[bytes, ...]
    tier: Tier  # where the pages are now (for REMOVED: where they were)
