"""bench.peers.transformers_server, the serial floor of the peer comparison, as a real
subprocess on the built-in tiny model: greedy output matches transformers' own generate(),
streamed and not; bad requests get OpenAI-shaped errors; /v1/models names the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench.server_proc import free_port

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny-floor"
PROMPT_IDS = [1, 5, 100, 200, 300, 400, 4000]


@dataclass
class Peer:
    pid: int
    url: str
    info: dict[str, Any]


@pytest.fixture(scope="module")
def peer(tiny_model_dir: Path) -> Iterator[Peer]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.peers.transformers_server", "--model", str(tiny_model_dir),
            "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port), "--threads", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it listens; "" if it died first
        assert line, f"the server exited ({proc.wait(timeout=10)}) before printing its line"
        info = json.loads(line)
        assert info["pid"] == proc.pid and info["url"] == f"http://127.0.0.1:{port}"
        assert set(info["versions"]) == {"python", "torch", "transformers"}
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{info['url']}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "/health did not answer within 60 s"
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            time.sleep(0.2)
        yield Peer(info["pid"], info["url"], info)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def reference_ids(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs: the same float32 sums, the same argmax
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    finally:
        torch.set_num_threads(threads)
    return [int(t) for t in out[0, len(prompt) :]]


def sse_events(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_greedy_parity_streamed_and_not(peer: Peer, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    want = reference_ids(tiny_model_dir, PROMPT_IDS, 8)
    assert len(want) == 8, "the reference stopped at EOS: pick another prompt"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    want_text = tokenizer.decode(want, skip_special_tokens=True)

    body = {"model": NAME, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{peer.url}/v1/completions", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    completion = plain.json()
    assert completion["object"] == "text_completion" and completion["model"] == NAME
    assert completion["choices"][0]["text"] == want_text
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 8,
                                   "total_tokens": len(PROMPT_IDS) + 8}  # fmt: skip

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{peer.url}/v1/completions", json=stream_body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert len(chunks) == 8
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 7 + ["length"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == completion["choices"][0]["text"] == want_text
    # per token: this tokenizer has no merges across tokens, so each chunk is its token alone
    assert [c["choices"][0]["text"] for c in chunks] == [tokenizer.decode([t]) for t in want]


def test_bad_requests_get_openai_errors(peer: Peer) -> None:
    url = f"{peer.url}/v1/completions"
    base = {"model": NAME, "prompt": "hello", "max_tokens": 4}

    def check(body: dict[str, Any], status: int) -> None:
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]

    check({**base, "temperature": 0.7}, 400)
    check({**base, "model": "no-such-model"}, 404)
    check({**base, "max_tokens": 0}, 400)
    check({**base, "max_tokens": 4097}, 400)
    check({**base, "prompt": [1, 10**9]}, 400)
    # the server still serves after the errors: a string prompt, greedy
    ok = httpx.post(url, json=base, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 4


def test_models_lists_the_served_name(peer: Peer) -> None:
    response = httpx.get(f"{peer.url}/v1/models", timeout=10)
    assert response.status_code == 200
    listing = response.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [NAME]
