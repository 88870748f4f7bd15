"""`baton bench --url ...` end to end against the conftest's FakeOpenAIServer (a test double
for the client side): JSON per run on stdout, the combined file, the plot, and errors meant
for the user. `--offline` keeps its own path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import cli
from engine.errors import BatonError
from tests.bench.conftest import FAKE_MODEL, FakeOpenAIServer


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baton")
    cli.register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def bench(argv: list[str]) -> int:
    args = parse(argv)
    return int(args.func(args))


def test_grid_writes_json_lines_a_combined_file_and_a_plot(
    fake_server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench([
        "--url", fake_server.url, "--workload", "rag", "--param", "system_len=32", "--param", "question_len=4",
        "--param", "output_len=3", "--concurrency", "1,2", "--requests", "4", "--out", str(out), "--plot", str(png),
    ])
    assert rc == 0
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.splitlines()]
    assert [x["label"] for x in lines] == ["rag-c1", "rag-c2"]
    assert all(x["num_ok"] == 4 and x["output_tokens"] == 12 for x in lines)
    assert lines[0]["prefix_hit_rate"] > 0  # the double reports the shared 32-token prefix
    assert "rag-c1" in captured.err  # the table
    doc = json.loads(out.read_text())
    assert doc["model"] == FAKE_MODEL and [r["label"] for r in doc["runs"]] == ["rag-c1", "rag-c2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # fresh prompts per run, the same prompts for the same seed
    prompts = [tuple(r["prompt"]) for r in fake_server.state.requests]
    assert prompts[0][:32] != prompts[4][:32]
    fake_server.reset()
    assert bench(["--url", fake_server.url, "--workload", "rag", "--param", "system_len=32", "--param",
                  "question_len=4", "--param", "output_len=3", "--concurrency", "1", "--requests", "4"]) == 0
    assert [tuple(r["prompt"]) for r in fake_server.state.requests] == prompts[:4]


def test_trace_replay_and_text_mode(fake_server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 50, "input_length": 10, "output_length": 2, "hash_ids": [1], "tenant": "a"}\n'
    )
    assert bench(["--url", fake_server.url, "--trace", str(trace), "--block-size", "8", "--prompt-mode", "text"]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["label"] == "trace-replay" and line["num_ok"] == 2
    assert all(isinstance(r["prompt"], str) for r in fake_server.state.requests)


def test_user_errors_are_baton_errors(tmp_path: Path) -> None:
    with pytest.raises(BatonError, match="cannot list models"):
        bench(["--url", "http://127.0.0.1:9"])
    with pytest.raises(BatonError, match="--concurrency"):
        bench(["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "0"])
    with pytest.raises(BatonError, match="bad --param"):
        bench(["--url", "http://127.0.0.1:9", "--model", "m", "--param", "nope=1"])
    with pytest.raises(BatonError):
        bench(["--url", "http://127.0.0.1:9", "--model", "m", "--trace", str(tmp_path / "missing.jsonl")])


def test_offline_flag_still_routes_to_the_offline_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import offline

    seen: list[argparse.Namespace] = []

    def fake_run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(offline, "run", fake_run)
    assert bench(["--offline", "--batch-sizes", "1"]) == 0
    assert seen and seen[0].batch_sizes == "1"


@pytest.mark.parametrize("name", ["burst-agent", "tenant-rag"])
def test_bursty_workloads_replay_on_their_own_times_unless_a_loop_is_given(name: str) -> None:
    from bench.serving import build_grid

    replay = build_grid(parse(["--workload", name, "--requests", "16"]), FAKE_MODEL)
    assert [(p.label, p.concurrency, p.rate, p.num_requests) for p in replay.plans] == [
        (f"{name}-replay", None, None, 16)
    ]
    looped = build_grid(parse(["--workload", name, "--concurrency", "8"]), FAKE_MODEL)
    assert [(p.concurrency, p.rate) for p in looped.plans] == [(8, None)]
