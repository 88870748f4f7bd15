"""`baton up --prefill 1`: prefill and decode engines apart (in one process), end to end through
the official openai client and baton's gRPC client; outputs equal the colocated server's."""

from __future__ import annotations

from typing import Any

import openai

from cluster.client import BatonClient, Sampling
from cluster.fleet.pd import PDFront
from tests.cluster.conftest import ServerHandle, free_port

MODEL = "baton-tiny"
LONG = "def fibonacci(n):\n    " * 20  # ~180 tokens: disaggregated
SHORT = "import os"  # a few tokens: prefilled on the decode side (so is a prompt cached there)


def test_disaggregated_server_matches_colocated(server: ServerHandle, make_server: Any) -> None:
    grpc_port = free_port()
    pd: ServerHandle = make_server(prefill_workers=1, grpc_port=grpc_port)
    front = pd.running.front
    assert isinstance(front, PDFront)
    colocated = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    disaggregated = openai.OpenAI(base_url=pd.url + "/v1", api_key="x")
    for prompt in (LONG, SHORT):
        want = colocated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        got = disaggregated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        stream = disaggregated.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    chat = disaggregated.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content
    # LONG's repeat was prefilled on the decode side: its pages were cached there by then.
    assert front.num_disaggregated >= 2 and front.num_local >= 3
    # The prefill side's prefix cache is reported through the decode side's stream: LONG's pages
    # are cached on both sides, but the 40-odd new tokens after them are moved.
    disaggregated_before = front.num_disaggregated
    longer = LONG + " x" * 40
    again = disaggregated.completions.create(model=MODEL, prompt=longer, max_tokens=2, temperature=0)
    assert front.num_disaggregated == disaggregated_before + 1
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0

    client = BatonClient(f"127.0.0.1:{grpc_port}", model=MODEL)
    try:
        done = client.complete(LONG, sampling=Sampling(max_tokens=12, temperature=0.0))
    finally:
        client.close()
    want = colocated.completions.create(model=MODEL, prompt=LONG, max_tokens=12, temperature=0)
    assert done.text == want.choices[0].text

    assert pd.wait_idle()
    assert front.worker.book.num_open == 0 and not front.worker.book.completed
    prefill = front.prefill.engine
    assert prefill.free_pages_at_idle() == prefill.pool.num_pages and not prefill._exported


def test_a_refused_local_transfer_is_prefilled_by_decode(server: ServerHandle, make_server: Any) -> None:
    """One dispatcher for both P/D flows (cluster.fleet.dispatch): a transfer the decode side
    refuses (a byte flipped after the checksum: the prefill engine's transfer_corrupt drill)
    sends the request down its next path, decode-local, instead of failing it; the client gets
    the colocated server's tokens once each and every page comes back."""
    pd: ServerHandle = make_server(prefill_workers=1)
    front = pd.running.front
    assert isinstance(front, PDFront)
    want = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
        model=MODEL, prompt=LONG + " y", max_tokens=12, temperature=0)  # fmt: skip
    front.prefill.engine.faults.arm("transfer_corrupt")
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x")
    stream = client.completions.create(model=MODEL, prompt=LONG + " y", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    assert not front.prefill.engine.faults.take("transfer_corrupt")  # the drill was used up
    assert front.counts.num_redispatched == 1 and front.num_local == 1 and front.num_disaggregated == 1
    assert front.worker.book.refused_bad_token == 0  # refused by its checksum, not as a forgery
    assert pd.wait_idle()
    assert front.worker.book.num_open == 0 and not front.worker.book.completed
    decode = front.decode.engine
    assert decode.free_pages_at_idle() == decode.pool.num_pages
