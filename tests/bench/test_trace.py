"""Trace replay: the same hash id gives the same tokens, shared leading ids a shared prefix, and
the block size and lengths are honoured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ideal import IdealPrefixIndex
from bench.prompts import PromptMode, PromptRenderer
from bench.trace import TraceEntry, TraceWorkload, load_trace

TOKENS = PromptRenderer(PromptMode.TOKENS, vocab_size=16384)


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def ids(w: TraceWorkload, i: int, seed: str = "s") -> list[int]:
    prompt = TOKENS.render(w.session(i, seed).prompt_parts(0, []))
    assert isinstance(prompt, list)
    return prompt


def test_load_trace_reads_mooncake_rows_and_the_optional_tenant(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 250, "input_length": 10, "output_length": 1, "hash_ids": [1], "tenant": "acme"},
    ])
    entries = load_trace(path)
    assert entries == [
        TraceEntry(0.0, 600, 5, (1, 2), None),
        TraceEntry(250.0, 10, 1, (1,), "acme"),
    ]
    assert load_trace(path, limit=1) == entries[:1]
    bad = write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 5}])
    with pytest.raises(ValueError, match="line 1"):
        load_trace(bad)


def test_same_hash_id_same_tokens_and_shared_leading_ids_share_a_prefix() -> None:
    w = TraceWorkload((
        TraceEntry(0, 1024, 4, (7, 3)),
        TraceEntry(0, 1024, 4, (7, 9)),
        TraceEntry(0, 1200, 4, (7, 3, 9)),
        TraceEntry(0, 512, 4, (3,)),
    ), block_size=512)
    a, b, c, d = (ids(w, i) for i in range(4))
    assert [len(x) for x in (a, b, c, d)] == [1024, 1024, 1200, 512]
    assert a[:512] == b[:512] and a[512:] != b[512:]  # shared id 7, then 3 vs 9
    assert c[:1024] == a  # ids 7, 3 in the same order
    assert c[1024:] == b[512:688]  # block 9 cut short: a prefix of block 9
    assert d == a[512:]  # id 3 is the same tokens wherever it appears
    assert ids(w, 0) == ids(w, 0) and ids(w, 0, "other") != a


def test_block_size_is_honoured_and_long_prompts_are_padded_uniquely() -> None:
    w = TraceWorkload((TraceEntry(0, 40, 1, (1, 2)), TraceEntry(0, 40, 1, (1, 5)), TraceEntry(0, 50, 1, (1, 2))), block_size=16)
    a, b, c = ids(w, 0), ids(w, 1), ids(w, 2)
    assert len(a) == len(b) == 40 and len(c) == 50
    assert a[:16] == b[:16] and a[16:32] != b[16:32]  # one block is 16 tokens
    assert c[:32] == a[:32] and c[32:] != a[32:]  # 18 unique padding tokens, not shared
    index = IdealPrefixIndex(page_size=16)
    assert [index.match_and_add(x) for x in (a, b, c)] == [0, 16, 32]


def test_replay_offsets_follow_timestamps_and_speed_and_closed_loop_uses_file_order() -> None:
    entries = (TraceEntry(1000, 8, 1, (1,)), TraceEntry(1500, 8, 1, (2,)), TraceEntry(4000, 8, 1, (3,), "t"))
    replay = TraceWorkload(entries, block_size=8, speed=2.0)
    timed = list(replay.timed("s"))
    assert [t for t, _ in timed] == [0.0, 0.25, 1.5]
    assert timed[2][1].tenant == "t" and timed[2][1].tag == "t"
    assert list(replay.sessions("s")) == []
    loop = TraceWorkload(entries, block_size=8, replay=False)
    assert [s.session_id for s in loop.sessions("s")] == ["trace-0", "trace-1", "trace-2"]
    assert list(loop.timed("s")) == []
