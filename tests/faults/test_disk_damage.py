"""Fault 8 of issue 8: the disk tier damaged under a serving engine -- bytes flipped, a file
truncated, a file deleted, the disk full -- while requests keep coming. 0 wrong outputs (every
answer equals the no-fault reference), 0 crashes (the server answers /live and /ready, the tier's
index stays consistent), and the counters match: what /metrics reports is what the tier
counted, and each kind of damage was counted.

A colocated server over a small device pool (24 pages), a 4-page host tier and a disk tier of
small segments (four records each), so that cached prefixes end up on disk in many files.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_config import EngineConfig
from kvcache.disk import DiskTier
from kvcache.disk_record import HEADER_SIZE
from kvcache.tiers import TierConfig
from tests.cluster.conftest import ServerHandle
from tests.cluster.test_ray_serving import metric
from tests.faults.conftest import MODEL, on_loop

pytestmark = pytest.mark.timeout(180)

RECORD_BYTES = HEADER_SIZE + 4 * 2 * 16 * 2 * 64 * 4  # one baton-tiny page, float32
CACHED = [f"# cached {i}\n" + "def fibonacci(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3
          for i in range(6)]  # fmt: skip
LOAD = [f"# load {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(8)]


@pytest.fixture
def tiered(make_server: Callable[..., ServerHandle], tiny_engine_config: EngineConfig,
           tmp_path: Path) -> Iterator[ServerHandle]:  # fmt: skip
    tiers = TierConfig(host_pages=4, disk_pages=256, disk_dir=str(tmp_path / "kv"), disk_segment_bytes=4 * RECORD_BYTES)
    yield make_server(engine=replace(tiny_engine_config, num_pages=24, tiers=tiers))


def _disk(handle: ServerHandle) -> DiskTier:
    cache = handle.engine.prefix_cache
    assert cache is not None and cache.disk is not None
    return cache.disk


def _complete(url: str, prompt: str, max_tokens: int = 8) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def _on_step_thread(handle: ServerHandle, fn: Callable[[Engine], Any]) -> Any:
    front = handle.running.front
    assert isinstance(front, AsyncEngine)
    return on_loop(handle, front.call(fn))


def _damage(directory: Path) -> dict[str, Path]:
    """Flip a payload byte in one closed segment, cut another short, delete a third."""
    segments = sorted(directory.glob("seg-*.bkv"), key=lambda p: int(p.stem.split("-")[1]))[:-1]  # closed ones
    assert len(segments) >= 3, f"need three closed segments, have {len(segments)}"
    flipped, cut, gone = segments[0], segments[1], segments[2]
    with flipped.open("r+b") as f:
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(cut, cut.stat().st_size // 2)
    gone.unlink()
    assert flipped.read_bytes()[HEADER_SIZE + 100] == byte[0] ^ 0xFF and not gone.exists()  # it took effect
    return {"flipped": flipped, "cut": cut, "gone": gone}


def test_a_damaged_or_full_disk_tier_never_serves_a_wrong_token(
    tiered: ServerHandle, server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = {p: _complete(server.url, p) for p in CACHED + LOAD}
    for p in CACHED:  # their prefixes fill the device pool, spill to host, then to disk
        assert _complete(tiered.url, p) == want[p]
    _on_step_thread(tiered, lambda e: e.prefix_cache.clear())  # every cached page goes down to disk
    disk = _disk(tiered)
    disk.flush()
    assert disk.stats().records >= 12
    before = disk.stats()

    # Under load: damage the files, then fill the disk, while requests keep coming.
    errors: list[str] = []
    wrong: list[str] = []
    stop = threading.Event()

    def load() -> None:
        for i in range(200):  # bounded
            if stop.is_set():
                return
            p = LOAD[i % len(LOAD)]
            try:
                if _complete(tiered.url, p) != want[p]:
                    wrong.append(p)
            except Exception as exc:
                errors.append(repr(exc))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    _damage(tiered_dir(tiered))

    def full(record: bytes) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    log = disk._log  # noqa: SLF001 -- the one place writes reach the file system
    assert log is not None
    monkeypatch.setattr(log, "append", full)
    got = {p: _complete(tiered.url, p) for p in CACHED}  # their pages come back up from a damaged disk
    full_errors = disk.stats().io_errors - before.io_errors
    monkeypatch.undo()  # the disk has room again
    written = disk.stats().bytes_written
    _on_step_thread(tiered, lambda e: e.prefix_cache.clear())  # what was recomputed goes down again
    disk.flush()
    stop.set()
    loader.join(120)

    assert not loader.is_alive() and errors == [] and wrong == []  # 0 failed, 0 wrong under the damage
    assert got == {p: want[p] for p in got}  # 0 wrong outputs from the damaged tier
    assert httpx.get(tiered.url + "/live", timeout=10).status_code == 200  # 0 crashes
    assert httpx.get(tiered.url + "/ready", timeout=10).status_code == 200
    after = disk.stats()
    assert after.corrupt > before.corrupt  # the flipped, cut and deleted records were found out
    assert full_errors >= 1  # the full disk was hit and counted (those pages were not stored)
    assert after.bytes_written > written  # and once it had room, writes went on
    disk.check_integrity()
    cache = tiered.engine.prefix_cache
    assert cache is not None and cache.stats.failed_reads >= 1
    # the counters match: /metrics reports what the tier counted
    assert metric(tiered, "baton_node_kv_corrupt_records_total", node="engine-0", role="colocated") == after.corrupt
    assert tiered.wait_idle(5.0), "pages still held after the last request"


def tiered_dir(handle: ServerHandle) -> Path:
    dirname = handle.engine.cfg.tiers.disk_dir
    assert dirname is not None
    return Path(dirname)
