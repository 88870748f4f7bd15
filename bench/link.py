"""KV transfer across hosts (BENCHMARKS.md P8): a prompt's pages pushed over gRPC from one dev
host to another, against raw grpc.aio streaming over the same veth link, unshaped and shaped.

    python -m bench.link [--model baton-small] [--prompt-len 2000] [--rates 0,10000,1000] [--repeats 3]
                         [--kv-cache-dtype auto|float32|bfloat16|float16]

Two dev hosts (cluster.devhosts: network namespaces on a private bridge), one process on each:

    host 0 (sender)                          host 1 (receiver, --serve)
    Engine: prefill the prompt once  --->    Engine + DecodeWorker + start_kv_server (:50051)
      (timed: P8's prefill time)               Control.Reserve / Control.Release (same server)
    per rate, per repeat:                     raw.Sink/Push (:50052): reads and drops bytes
      Reserve -> KV push (GrpcSender) -> Release (the receiver checks every stored page
      against the sender's per-page sha256 and says how many matched)
      raw stream of the same bytes in messages of one KV chunk's size

This process drives both over stdin/stdout (one JSON object a line, never pickle) and shapes
host 1's veth (tc tbf, both directions) between rates; the bytes cross the bridge either way.
A KV push is timed from encoding its first chunk to the receiver's ack (as bench.transfer does);
each repeat has a fresh reservation, released after. Prints JSON lines and a table; medians of
the repeats. The dev hosts, and every process on them, go when this ends (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvtransfer.codec import WireChunk

KV_PORT, RAW_PORT = 50051, 50052  # inside host 1's own namespace: nothing else binds there
CONTROL = "bench.link.Control"
PUSH_DEADLINE_S = 120.0
START_TIMEOUT_S = 300.0  # import torch, load the model
STEP_TIMEOUT_S = 600.0  # a prefill of baton-small, or one rate's repeats at 1 Gbit/s


def _engine(model: str, kv_cache_dtype: str) -> Any:
    """Both roles' engine: float32 weights, KV pages in `kv_cache_dtype` (bfloat16: half the bytes
    on the wire, as a deployment on a slow link would choose)."""
    from engine.engine import Engine
    from engine.engine_config import EngineConfig

    return Engine(EngineConfig(model=model, dtype="float32", max_prefill_chunk=4096, max_num_batched_tokens=4096,
                               enable_prefix_cache=False, kv_cache_dtype=kv_cache_dtype))


def _message_options() -> list[tuple[str, int]]:
    """The KV server's message bounds (one chunk of CodecLimits and headroom), for the raw path too."""
    from kvtransfer.codec import CodecLimits

    size = CodecLimits().max_chunk_bytes + (1 << 20)
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]


def _page_digests(kv: Any) -> list[str]:
    """sha256 of each page's bytes; kv: [pages, layers, 2, page_size, kv_heads, head_dim]."""
    import torch

    return [hashlib.sha256(page.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for page in kv]


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def _next_command() -> dict[str, Any] | None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return json.loads(line) if line.strip() else None


# -- host 1: the receiver ---------------------------------------------------------------------


async def _serve(model: str, bind: str, kv_cache_dtype: str) -> None:
    import grpc

    from decode.worker import DecodeWorker
    from engine.job import Job
    from engine.sampling import SamplingParams
    from kvtransfer.grpc_transport import start_kv_server
    from kvtransfer.transport import KVDestination

    engine = _engine(model, kv_cache_dtype)
    worker = DecodeWorker(engine, reservation_ttl_s=PUSH_DEADLINE_S)
    dests: dict[str, KVDestination] = {}

    async def reserve(body: bytes, context: Any) -> bytes:
        ask = json.loads(body)
        job = Job(ask["req_id"], tuple(range(int(ask["num_tokens"]))), SamplingParams(max_tokens=1))
        dest = worker.reserve(job, sender_epoch=1)
        if dest is None:
            return json.dumps({"error": "no free pages"}).encode()
        dests[dest.transfer_id] = dest
        return json.dumps({"address": dest.address, "req_id": dest.req_id, "transfer_id": dest.transfer_id,
                           "token": dest.token.hex(), "epoch": dest.epoch,
                           "dest_page_ids": list(dest.dest_page_ids)}).encode()

    async def release(body: bytes, context: Any) -> bytes:
        ask = json.loads(body)
        dest = dests.pop(ask["transfer_id"])
        complete = worker.is_complete(dest)
        # what the pool holds now, page by page, against what the sender computed
        stored = engine.pool.kv[:, :, list(dest.dest_page_ids)].movedim(2, 0) if complete else []
        verified = sum(a == b for a, b in zip(_page_digests(stored), ask["page_digests"], strict=False))
        worker.cancel(dest)
        return json.dumps({"complete": complete, "pages_verified": verified}).encode()

    control = grpc.method_handlers_generic_handler(CONTROL, {
        "Reserve": grpc.unary_unary_rpc_method_handler(reserve),
        "Release": grpc.unary_unary_rpc_method_handler(release),
    })  # fmt: skip
    server, _ = await start_kv_server(worker.receiver, f"{bind}:{KV_PORT}", extra_handlers=[control])
    worker.address = f"{bind}:{KV_PORT}"

    async def sink(request_iterator: Any, context: Any) -> bytes:
        async for _ in request_iterator:
            pass
        return b""

    raw = grpc.aio.server(options=_message_options())
    raw.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "raw.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)}),))  # fmt: skip
    if raw.add_insecure_port(f"{bind}:{RAW_PORT}") == 0:
        raise RuntimeError(f"could not bind {bind}:{RAW_PORT}")
    await raw.start()
    _emit({"event": "ready", "kv": worker.address, "raw": f"{bind}:{RAW_PORT}"})
    while await _next_command() is not None:  # until this driver closes stdin
        pass
    await raw.stop(None)
    await server.stop(None)


# -- host 0: the sender -----------------------------------------------------------------------


class _Push(NamedTuple):
    seconds: float  # encode, stream, the receiver's decode/verify/store, its ack
    encode_s: float  # of which encoding chunks (layout + checksum), each while the one before moves
    pages_verified: int


class _Sender:
    """The prompt's pages and the channels to host 1, kept across rates and repeats."""

    def __init__(self, engine: Any, target: str, pages_per_chunk: int | None) -> None:
        import grpc

        from kvtransfer.codec import chunk_pages
        from kvtransfer.grpc_transport import GrpcSender

        self.engine = engine
        self.kv: Any = None  # the exported pages, page-major
        self.digests: list[str] = []
        self.pages_per_chunk: Any = pages_per_chunk  # None: the workers' default (chunk_pages)
        self.kv_sender = GrpcSender()
        self.control = grpc.aio.insecure_channel(f"{target}:{KV_PORT}")
        self.raw = grpc.aio.insecure_channel(f"{target}:{RAW_PORT}", options=_message_options())
        self._chunk_pages = chunk_pages

    def prefill(self, prompt_len: int) -> dict[str, Any]:
        import numpy as np

        from engine.sampling import SamplingParams

        vocab = self.engine.model_config.vocab_size
        prompt = np.random.default_rng(0).integers(100, vocab, size=prompt_len).tolist()
        self.engine.generate([prompt[:64]], SamplingParams(max_tokens=1))  # warm-up
        start = time.perf_counter()
        self.engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
        while self.engine.has_unfinished():
            self.engine.step()
        seconds = time.perf_counter() - start
        self.kv = self.engine.take_exported("p").kv
        self.digests = _page_digests(self.kv)
        page_bytes = self.kv[0].numel() * self.kv.element_size()
        self.pages_per_chunk = self._chunk_pages(page_bytes, self.pages_per_chunk)
        return {"event": "prefilled", "prefill_s": seconds, "bytes": len(self.kv) * page_bytes,
                "pages": len(self.kv), "chunk_bytes": self.pages_per_chunk * page_bytes}

    async def _call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(await self.control.unary_unary(f"/{CONTROL}/{method}")(
            json.dumps(body).encode(), timeout=60.0))  # fmt: skip
        return reply

    async def push(self, req_id: str) -> _Push:
        """One full KV push into a fresh reservation."""
        from kvtransfer.transport import KVDestination, iter_chunks

        got = await self._call("Reserve", {"req_id": req_id, "num_tokens": len(self.kv) * self.engine.cfg.page_size})
        if "error" in got:
            raise RuntimeError(f"reserve: {got['error']}")
        dest = KVDestination(got["address"], got["req_id"], got["transfer_id"], bytes.fromhex(got["token"]),
                             got["epoch"], tuple(got["dest_page_ids"]))
        encode_s = 0.0

        def chunks() -> Iterator[WireChunk]:  # as a prefill worker's push: encoded as they go
            nonlocal encode_s
            made = iter_chunks(dest, self.kv, 1, self.pages_per_chunk)
            while True:
                t = time.perf_counter()
                chunk = next(made, None)
                encode_s += time.perf_counter() - t
                if chunk is None:
                    return
                yield chunk

        start = time.perf_counter()
        result = await self.kv_sender.send(dest, chunks(), PUSH_DEADLINE_S)
        end = time.perf_counter()
        done = await self._call("Release", {"transfer_id": dest.transfer_id, "page_digests": self.digests})
        if not result.accepted or not done["complete"]:
            raise RuntimeError(f"push {req_id} failed: {result.error or 'incomplete'}")
        return _Push(end - start, encode_s, int(done["pages_verified"]))

    def raw_messages(self) -> list[bytes]:
        """The push's own framed chunks, made once: the raw path streams the very bytes a push
        carries, each message from its own memory (one buffer sent again and again would be
        read from cache, a speed no real payload has)."""
        from kvtransfer.codec import frame
        from kvtransfer.transport import KVDestination, iter_chunks

        dest = KVDestination("raw", "raw", "raw", b"raw", 1, tuple(range(len(self.kv))))
        return [frame(chunk) for chunk in iter_chunks(dest, self.kv, 1, self.pages_per_chunk)]

    async def stream_raw(self, payloads: list[bytes]) -> float:
        """The same bytes as opaque messages through a bare client-streaming call."""

        async def messages() -> Any:
            for payload in payloads:
                yield payload

        start = time.perf_counter()
        await self.raw.stream_unary("/raw.Sink/Push")(messages(), timeout=PUSH_DEADLINE_S)
        return time.perf_counter() - start

    async def measure(self, rate_mbit: float, repeats: int) -> dict[str, Any]:
        payloads = self.raw_messages()
        pushes, raw_s = [], []
        for i in range(repeats):
            pushes.append(await self.push(f"r{rate_mbit:g}-{i}"))
            raw_s.append(await self.stream_raw(payloads))
        return {"event": "measured", "kv_s": [p.seconds for p in pushes], "encode_s": [p.encode_s for p in pushes],
                "raw_s": raw_s, "pages_verified": [p.pages_verified for p in pushes]}

    async def close(self) -> None:
        await self.kv_sender.close()
        await self.control.close()
        await self.raw.close()


async def _send(model: str, target: str, pages_per_chunk: int | None, kv_cache_dtype: str) -> None:
    sender = _Sender(_engine(model, kv_cache_dtype), target, pages_per_chunk)
    _emit({"event": "ready"})
    try:
        while (cmd := await _next_command()) is not None:
            if cmd["cmd"] == "prefill":
                _emit(sender.prefill(int(cmd["prompt_len"])))
            elif cmd["cmd"] == "warm-up":  # channels connected, buffers grown: not measured
                await sender.measure(0, 1)
                _emit({"event": "warm"})
            else:
                _emit(await sender.measure(float(cmd["rate_mbit"]), int(cmd["repeats"])))
    finally:
        await sender.close()


# -- this host: the driver --------------------------------------------------------------------


class _Child:
    """A role process on a dev host, spoken to in JSON lines; a reader thread keeps its stdout
    from blocking it and lets every wait have a deadline."""

    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name = name
        self.proc = proc
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        for line in stream or ():
            self._lines.put(line)
        self._lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no {event!r} within {timeout_s:.0f} s") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}) before {event!r}; its stderr is above")
            if line.startswith("{"):
                msg: dict[str, Any] = json.loads(line)
                if msg.get("event") == event:
                    return msg

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()  # EOF: the role stops its servers and exits
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(model: str, prompt_len: int, rates: list[float], repeats: int, pages_per_chunk: int | None = None,
            kv_cache_dtype: str = "auto") -> list[dict[str, Any]]:  # fmt: skip
    """Run both roles on two dev hosts; the header and one row per (rate, path)."""
    from cluster.devhosts import DevHosts
    from engine.builtin import resolve_model_dir

    path = str(resolve_model_dir(model))  # a built-in model is made here, once, not by both roles at once
    children: list[_Child] = []
    with DevHosts(2, ray=False) as hosts:
        try:
            def role(i: int, name: str, *argv: str) -> _Child:
                proc = hosts.popen(i, [sys.executable, "-m", "bench.link", *argv, "--model", path,
                                       "--kv-cache-dtype", kv_cache_dtype], text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
                children.append(_Child(name, proc))
                return children[-1]

            target = hosts.hosts[1].ip
            server = role(1, "receiver (host 1)", "--serve", "--bind", target)
            chunking = ("--pages-per-chunk", str(pages_per_chunk)) if pages_per_chunk is not None else ()
            sender = role(0, "sender (host 0)", "--send", "--target", target, *chunking)
            server.expect("ready", START_TIMEOUT_S)
            sender.expect("ready", START_TIMEOUT_S)
            sender.send({"cmd": "prefill", "prompt_len": prompt_len})  # the receiver idles meanwhile
            head = sender.expect("prefilled", STEP_TIMEOUT_S)
            sender.send({"cmd": "warm-up"})
            sender.expect("warm", STEP_TIMEOUT_S)
            runs = []
            for rate in rates:
                if rate > 0:
                    hosts.shape(1, rate)
                else:
                    hosts.unshape(1)
                sender.send({"cmd": "measure", "rate_mbit": rate, "repeats": repeats})
                runs.append((rate, sender.expect("measured", STEP_TIMEOUT_S)))
            hosts.unshape(1)
        finally:
            for child in reversed(children):
                child.stop()
    header = {"model": model, "kv_cache_dtype": kv_cache_dtype, "prompt_len": prompt_len, "prefill_s": round(head["prefill_s"], 3),
              "bytes": head["bytes"], "pages": head["pages"], "chunk_bytes": head["chunk_bytes"], "repeats": repeats}
    return [header, *(row for rate, run in runs for row in _rows(rate, run, head))]


def _rows(rate: float, run: dict[str, Any], head: dict[str, Any]) -> list[dict[str, Any]]:
    kv_s, raw_s = statistics.median(run["kv_s"]), statistics.median(run["raw_s"])

    def row(path: str, seconds: float) -> dict[str, Any]:
        return {"rate_mbit": rate, "path": path, "seconds": round(seconds, 4),
                "gb_per_s": round(head["bytes"] / seconds / 1e9, 4),
                "vs_prefill": round(seconds / head["prefill_s"], 4)}

    kv = row("kv grpc", kv_s) | {"vs_raw": round(raw_s / kv_s, 3), "encode_s": round(statistics.median(run["encode_s"]), 4),
                                 "pages": head["pages"],
                                 "pages_verified": min(run["pages_verified"])}
    return [kv, row("raw grpc.aio", raw_s)]


def _print_table(rows: list[dict[str, Any]]) -> None:
    head, body = rows[0], rows[1:]
    print(f"prefill of {head['prompt_len']} tokens on {head['model']}: {head['prefill_s']:.3f} s; "
          f"KV ({head['kv_cache_dtype']}) {head['bytes'] / 1e6:.1f} MB in {head['pages']} pages, chunks of {head['chunk_bytes'] / 1e6:.1f} MB; "
          f"host 0 -> host 1 over veth, median of {head['repeats']}", file=sys.stderr)
    for r in body:
        link = f"{r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "unshaped"
        extra = (f"  {r['vs_raw']:5.2f}x raw  (encode {r['encode_s']:.4f} s)  {r['pages_verified']}/{r['pages']} pages verified"
                 if "vs_raw" in r else "")
        print(f"  {link:<14} {r['path']:<13} {r['seconds']:8.4f} s  {r['gb_per_s']:7.4f} GB/s  "
              f"{r['vs_prefill']:7.4f}x prefill{extra}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.link", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="baton-small")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--rates", default="0,10000,1000", help="Mbit/s on host 1's link, comma-separated; 0: unshaped")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pages-per-chunk", type=int, default=None, help="default: the workers' (about 4 MiB chunks)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the KV pages' precision on both hosts (auto: the weights')")
    role = parser.add_mutually_exclusive_group()  # the roles this command starts on the dev hosts
    role.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    role.add_argument("--send", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.model, args.bind, args.kv_cache_dtype))
        return 0
    if args.send:
        asyncio.run(_send(args.model, args.target, args.pages_per_chunk, args.kv_cache_dtype))
        return 0
    from cluster.devhosts import available

    if (why := available()) is not None:
        print(f"bench.link: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # tear down as on Ctrl-C
    rates = [int(r) if float(r).is_integer() else float(r) for r in args.rates.split(",")]
    if any(r < 0 for r in rates) or args.repeats < 1:
        parser.error("rates are Mbit/s (0: unshaped), repeats at least 1")
    try:
        rows = measure(args.model, args.prompt_len, rates, args.repeats, args.pages_per_chunk, args.kv_cache_dtype)
    except KeyboardInterrupt:  # the dev hosts and both roles are gone by now
        print("bench.link: interrupted", file=sys.stderr)
        return 130
    for row in rows:
        print(json.dumps(row))
    _print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
