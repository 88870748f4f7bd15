"""Host and disk tiers under the prefix cache: hits from every tier give exactly the tokens of
a cache-off run; a restarted process serves disk hits; corrupt records are counted misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.request import CachedTokens
from engine.sampling import SamplingParams
from kvcache.events import Tier
from kvcache.tiers import TierConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def _prompts(n: int, seed: int = 21) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 16_384, size=70).tolist() for _ in range(n)]  # 4 full pages + 6


def _engine(model_dir: Path, cache: bool = True, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", enable_prefix_cache=cache, **kw))  # type: ignore[arg-type]


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    tokens, hits = _run_tiers(engine, prompts)
    return tokens, [hit.total for hit in hits]


def _run_tiers(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[CachedTokens]]:
    tokens, hits = [], []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, GREEDY)
        out: list[int] = []
        while engine.has_unfinished():
            for step in engine.step():
                out.extend(step.token_ids)
                hit = step.cached
            engine.check_integrity()
        engine.flush_cache()
        tokens.append(out)
        hits.append(hit)
    return tokens, hits


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    engine = _engine(tiny_model_dir, cache=False)
    prompts = _prompts(6)
    outs, _ = _run(engine, prompts)
    return {tuple(p): o for p, o in zip(prompts, outs, strict=True)}


def test_hits_from_device_host_and_disk_match_cache_off(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    # 12 device pages hold one request (5 pages) plus a little; host holds 8 pages; disk the rest.
    tiers = TierConfig(host_pages=8, disk_pages=64, disk_dir=str(tmp_path / "kv"))
    engine = _engine(tiny_model_dir, num_pages=12, tiers=tiers)
    prompts = _prompts(6)
    outs, hits = _run_tiers(engine, prompts + prompts[::-1])
    assert outs == [reference[tuple(p)] for p in prompts + prompts[::-1]]
    cache = engine.prefix_cache
    assert cache is not None
    by_tier = cache.stats.hit_pages_by_tier
    assert by_tier[Tier.DEVICE] > 0 and by_tier[Tier.HOST] > 0 and by_tier[Tier.DISK] > 0, by_tier
    assert [hit.total for hit in hits[6:]] == [64] * 6  # every second-round prompt reused its 4 full pages
    # Each request's usage says where its pages were found: summed, the cache's own counts.
    page = engine.cfg.page_size
    assert [sum(hit[tier] for hit in hits) for tier in Tier] == [n * page for n in by_tier]
    assert all(hit.remote == 0 for hit in hits)  # one engine: nothing came from another worker
    assert cache.stats.demoted_pages > 0 and cache.stats.promoted_pages > 0


SCRIPT = """
import json, sys
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from kvcache.tiers import TierConfig
model, disk, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = Engine(EngineConfig(model=model, dtype="float32", num_pages=64,
                             tiers=TierConfig(disk_pages=256, disk_dir=disk)))
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
result = []
for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params)
    out, cached = [], 0
    while engine.has_unfinished():
        for step in engine.step():
            out += step.token_ids
            cached = step.num_cached_tokens
    result.append({"tokens": out, "cached": cached})
engine.prefix_cache.clear()  # write every cached device page back to disk
engine.flush_cache()
stats = engine.prefix_cache.disk.stats()
print(json.dumps({"result": result, "corrupt": stats.corrupt}))
"""


def _process(model_dir: Path, disk: Path, prompts: list[list[int]]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), str(disk), json.dumps(prompts)],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_restarted_process_serves_hits_from_disk(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    prompts = _prompts(3)
    first = _process(tiny_model_dir, tmp_path / "kv", prompts)
    assert [r["cached"] for r in first["result"]] == [0, 0, 0]  # type: ignore[index]
    second = _process(tiny_model_dir, tmp_path / "kv", prompts)
    assert [r["cached"] for r in second["result"]] == [64, 64, 64]  # type: ignore[index]
    assert [r["tokens"] for r in second["result"]] == [reference[tuple(p)] for p in prompts]  # type: ignore[index]


CRASH = """
import json, os, sys
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from kvcache.tiers import TierConfig
model, disk, prompt, write_back = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
engine = Engine(EngineConfig(model=model, dtype="float32", num_pages=64,
                             tiers=TierConfig(disk_pages=256, disk_dir=disk, write_back_pages=write_back)))
engine.add_request("long", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
out = []
while engine.has_unfinished():
    for step in engine.step():
        out += step.token_ids
engine.flush_cache()  # what an idle worker does between requests
print(json.dumps({"tokens": out, "written": engine.prefix_cache.stats.written_back_pages}), flush=True)
os._exit(0)  # then it dies: no close, nothing demoted, the device pages gone with it
"""


@pytest.mark.parametrize("write_back", [0, 2])
def test_a_dead_workers_written_back_pages_serve_its_restarted_self(
    tiny_model_dir: Path, tmp_path: Path, write_back: int
) -> None:
    """recovery.write_back_pages: a long sequence's pages (prompt and generated) are written to
    the disk tier as they are cached, so a worker that dies leaves them behind; the process
    that replaces it serves the sequence's next turn from them. Without write-back only
    eviction writes pages down, and a death leaves nothing."""
    prompt = _prompts(1, seed=31)[0]  # 70 tokens
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CRASH, str(tiny_model_dir), str(tmp_path / "kv"), json.dumps(prompt),
                           str(write_back)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["written"] == (6 if write_back else 0)  # 110 tokens: 6 whole pages, in blocks of 2
    turn = prompt + first["tokens"]  # the conversation's next turn starts with all of it
    second = _process(tiny_model_dir, tmp_path / "kv", [turn])["result"][0]  # type: ignore[index]
    assert second["cached"] == (6 * 16 if write_back else 0)
    engine = _engine(tiny_model_dir, cache=False, num_pages=64)
    assert second["tokens"] == engine.generate([turn], GREEDY)[0]


def _records(directory: Path, record_len: int) -> dict[bytes, tuple[Path, int]]:
    """page hash -> (segment file, offset), read straight from the record headers."""
    found = {}
    for seg in sorted(directory.glob("seg-*.bkv")):
        data = seg.read_bytes()
        for offset in range(0, len(data) - record_len + 1, record_len):
            found[data[offset + 24 : offset + 40]] = (seg, offset)
    return found


def test_corrupt_truncated_and_deleted_records_are_counted_misses(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    from kvcache.disk_record import HEADER_SIZE
    from kvcache.hashing import page_hashes

    prompts = _prompts(3)
    tiers = TierConfig(disk_pages=256, disk_dir=str(tmp_path / "kv"), disk_segment_bytes=200_000)
    writer = _engine(tiny_model_dir, num_pages=64, tiers=tiers)
    _run(writer, prompts)
    assert writer.prefix_cache is not None
    writer.prefix_cache.clear()  # every cached page goes to disk
    writer.close()

    reader = _engine(tiny_model_dir, num_pages=64, tiers=tiers)  # re-indexes the directory
    assert reader.prefix_cache is not None and reader.prefix_cache.disk is not None
    record_len = HEADER_SIZE + 4 * 2 * 16 * 2 * 64 * 4
    where = _records(tmp_path / "kv", record_len)
    chains = [page_hashes(p, 16, b"", reader.fingerprint) for p in prompts]
    assert all(h in where for chain in chains for h in chain)
    first = [where[chain[0]] for chain in chains]
    assert len({seg for seg, _ in first}) == 3, "each prompt's first page should sit in its own segment"
    # Inject, under a running engine: a flipped payload byte, a truncated file, a deleted file.
    (seg0, off0), (seg1, off1), (seg2, _) = first
    with seg0.open("r+b") as f:
        f.seek(off0 + HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(off0 + HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(seg1, off1 + 50)
    seg2.unlink()
    damaged = {h for h, (seg, off) in where.items()
               if (seg == seg0 and off == off0) or (seg == seg1 and off >= off1) or seg == seg2}
    expected = 0
    for chain in chains:  # a match reads pages in order and stops at the first bad one
        for page_hash in chain:
            if page_hash in damaged:
                expected += 1
                break
    assert expected == 3

    outs, hits = _run(reader, prompts)
    assert outs == [reference[tuple(p)] for p in prompts]  # 0 wrong outputs
    assert hits == [0, 0, 0]  # each prompt's first page was damaged: nothing reused, all recomputed
    assert 1 <= reader.prefix_cache.stats.failed_reads <= expected
    disk = reader.prefix_cache.disk
    for page_hash in damaged:  # every damaged record is found out and dropped, none served
        assert disk.get(page_hash) is None
    assert disk.stats().corrupt == len(damaged)  # the counter equals the records damaged
    disk.check_integrity()
    reader.close()


def test_disk_reads_start_when_a_request_is_queued(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    prompts = _prompts(2, seed=21)
    tiers = TierConfig(disk_pages=64, disk_dir=str(tmp_path / "kv"))
    writer = _engine(tiny_model_dir, num_pages=64, tiers=tiers)
    _run(writer, prompts)
    assert writer.prefix_cache is not None
    writer.prefix_cache.clear()
    writer.close()
    reader = _engine(tiny_model_dir, num_pages=64, tiers=tiers)
    cache = reader.prefix_cache
    assert cache is not None
    reader.add_request("p", prompts[1], GREEDY)
    assert len(cache._staged) == 4  # all 4 full pages are being read before admission
    out: list[int] = []
    while reader.has_unfinished():
        for step in reader.step():
            out.extend(step.token_ids)
            assert step.num_cached_tokens == 64
    assert out == reference[tuple(prompts[1])]
    assert not cache._staged and cache.stats.hit_pages_by_tier[Tier.DISK] == 4
    reader.close()


def test_tenants_stay_apart_in_the_lower_tiers(tiny_model_dir: Path, tmp_path: Path) -> None:
    tiers = TierConfig(host_pages=4, disk_pages=32, disk_dir=str(tmp_path / "kv"))
    engine = _engine(tiny_model_dir, num_pages=64, tiers=tiers)
    cache = engine.prefix_cache
    assert cache is not None
    prompt = _prompts(1, seed=99)[0]

    def cached(tenant: str) -> int:
        engine.add_request(tenant + str(engine.scheduler.num_requests), prompt, GREEDY, cache_salt=tenant)
        hit = -1
        while engine.has_unfinished():
            for step in engine.step():
                hit = step.num_cached_tokens
        engine.flush_cache()
        return hit

    assert cached("acme") == 0
    cache.clear()  # acme's pages: device -> host (4 pages) and disk (the 5th)
    engine.flush_cache()
    tiers_before = list(cache.stats.hit_pages_by_tier)
    assert cached("globex") == 0  # not from host, not from disk
    assert cache.stats.hit_pages_by_tier == tiers_before
    cache.clear()
    engine.flush_cache()
    assert cached("acme") == 64  # acme's own pages come back up from the lower tiers
    assert sum(cache.stats.hit_pages_by_tier[1:]) > sum(tiers_before[1:])
    engine.close()
