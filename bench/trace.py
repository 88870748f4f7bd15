"""Trace replay: Mooncake-format JSONL, one request a line.

    {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2], "tenant": "a"}

`timestamp` is in ms from the first request; each hash id is one block of `block_size` tokens
(512 in Mooncake's traces), the same id always the same tokens, so requests that share leading
ids share a prefix. A prompt shorter than its blocks cuts the last block short (a prefix of
that block's tokens); a longer one is padded with tokens unique to the request:

    hash_ids [7, 3, 9], block 512, input_length 1200:
    | block 7 (512) | block 3 (512) | block 9, first 176 |

Replayed on its timestamps (open loop, scaled by `speed`), or driven as a closed loop in file
order when the run gives a concurrency.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from bench.prompts import Segment
from bench.workloads import Session, Turn, Workload

MAX_TRACE_LINES = 10_000_000  # a bound on the reading loop, far above any real trace


@dataclass(frozen=True, slots=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None


def parse_entry(line: str, lineno: int) -> TraceEntry:
    try:
        raw = json.loads(line)
        tenant = raw.get("tenant")
        entry = TraceEntry(
            timestamp_ms=float(raw["timestamp"]),
            input_length=int(raw["input_length"]),
            output_length=int(raw["output_length"]),
            hash_ids=tuple(int(h) for h in raw.get("hash_ids", ())),
            tenant=None if tenant is None else str(tenant),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"trace line {lineno}: {exc!r}") from None
    if entry.input_length < 1 or entry.output_length < 1:
        raise ValueError(f"trace line {lineno}: input_length and output_length must be >= 1")
    return entry


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceEntry]:
    """The first `limit` entries (all when None), blank lines skipped."""
    entries: list[TraceEntry] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if lineno > MAX_TRACE_LINES or (limit is not None and len(entries) >= limit):
                break
            if line.strip():
                entries.append(parse_entry(line, lineno))
    return entries


def entry_segments(entry: TraceEntry, index: int, seed: str, block_size: int) -> tuple[Segment, ...]:
    """The prompt of one trace request as blocks (see the module diagram)."""
    segments: list[Segment] = []
    left = entry.input_length
    for hash_id in entry.hash_ids:
        if left <= 0:
            break
        n = min(block_size, left)
        segments.append(Segment(f"{seed}/trace/block/{hash_id}", n))
        left -= n
    if left > 0:
        segments.append(Segment(f"{seed}/trace/pad/{index}", left))
    return tuple(segments)


@dataclass(frozen=True, slots=True)
class TraceWorkload(Workload):
    name: ClassVar[str] = "trace"
    entries: tuple[TraceEntry, ...]
    block_size: int = 512
    replay: bool = True  # on the timestamps; False: in file order through the closed loop
    speed: float = 1.0  # 2.0 replays twice as fast

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.speed <= 0:
            raise ValueError("trace block_size must be >= 1 and speed > 0")

    def session(self, index: int, seed: str) -> Session:
        entry = self.entries[index]
        turn = Turn(entry_segments(entry, index, seed, self.block_size), entry.output_length)
        return Session(f"trace-{index}", (turn,), tag=entry.tenant or "", tenant=entry.tenant)

    def sessions(self, seed: str) -> Iterator[Session]:
        if not self.replay:
            for i in range(len(self.entries)):
                yield self.session(i, seed)

    def timed(self, seed: str) -> Iterator[tuple[float, Session]]:
        if not self.replay or not self.entries:
            return
        start = self.entries[0].timestamp_ms
        for i, entry in enumerate(self.entries):
            yield max(0.0, (entry.timestamp_ms - start) / 1000 / self.speed), self.session(i, seed)
