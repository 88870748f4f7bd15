"""The gateway's request log: one JSON line per routed request, in the Mooncake trace format
that `baton analyze-prefix` reads (bench/trace.py), plus where the request went -- so the
workload the gateway actually served can be measured after the fact, per route key:

    {"timestamp": 1733490000123, "input_length": 4410, "output_length": 128,
     "hash_ids": [...], "tenant": "<route key>", "model": "...", "pool": "vllm", "reason": "rule"}

No prompt text is written: `hash_ids` are the prompt's chained page hashes (16-token pages,
cluster.gateway.router.OVERLAP_PAGE), cut to 63-bit integers, which tell requests that share a
prefix apart from those that do not and nothing more. The file is bounded: past `max_bytes`
it is renamed to `<path>.1` (replacing the previous one) and a new one begun.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import IO

logger = logging.getLogger(__name__)


def hash_id(page_hash: bytes) -> int:
    return int.from_bytes(page_hash[:8], "big") >> 1


class RouteLog:
    def __init__(self, path: str, max_bytes: int = 64 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._file: IO[str] | None = None
        self._size = 0
        self.num_errors = 0

    def write(
        self, route_key: str, model: str, pool: str, reason: str, page_hashes: Sequence[bytes], input_length: int,
        output_length: int,
    ) -> None:
        line = json.dumps({
            "timestamp": int(time.time() * 1000), "input_length": max(1, input_length),
            "output_length": max(1, output_length), "hash_ids": [hash_id(h) for h in page_hashes],
            "tenant": route_key, "model": model, "pool": pool, "reason": reason,
        }, separators=(",", ":")) + "\n"  # fmt: skip
        try:
            if self._file is None or self._size + len(line) > self.max_bytes:
                self._rotate()
            assert self._file is not None
            self._file.write(line)
            self._file.flush()
            self._size += len(line)
        except OSError as exc:  # a full disk costs the log, never a request
            self.num_errors += 1
            if self.num_errors == 1:
                logger.warning("route log %s: %s (further errors are counted, not logged)", self.path, exc)

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            os.replace(self.path, self.path + ".1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open; closed by close())
        self._size = self._file.tell()
        if self._size >= self.max_bytes:
            self._file.close()
            self._file = None
            os.replace(self.path, self.path + ".1")
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._size = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
