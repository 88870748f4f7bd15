"""KV transfer against prefill (BENCHMARKS.md P8): how long moving a prompt's pages takes
next to computing them, per transport, and against the raw ceiling of each path here.

    python -m bench.transfer [--model baton-small] [--prompt-len 2000]

For one prompt: the prefill time (engine, export on), then for each transport the time of a
full push into a decode engine's reserved pages (encode, checksum, move, verify, write; nccl
runs over gloo between CPU pools, through the same channel and PushNccl headers), and for gRPC the raw grpc.aio ceiling: the same bytes streamed as opaque messages of the same
size through a trivial service on loopback; for shm the raw memcpy ceiling: the same bytes
copied chunk by chunk into a shared-memory region. Prints JSON lines and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np


def _prefill(model: str, prompt_len: int) -> tuple[Any, Any, float]:
    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from engine.sampling import SamplingParams

    cfg = EngineConfig(model=model, dtype="float32", max_prefill_chunk=4096, max_num_batched_tokens=4096,
                       enable_prefix_cache=False)
    prefill, decode = Engine(cfg), Engine(cfg)
    prompt = np.random.default_rng(0).integers(100, prefill.model_config.vocab_size, size=prompt_len).tolist()
    prefill.generate([prompt[:64]], SamplingParams(max_tokens=1))  # warm-up
    start = time.perf_counter()
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    seconds = time.perf_counter() - start
    return prefill.take_exported("p"), decode, seconds


async def _push(exported: Any, decode: Any, transport: str, pages_per_chunk: int) -> tuple[float, int]:
    from decode.worker import DecodeWorker
    from engine.job import Job
    from engine.sampling import SamplingParams
    from kvtransfer.grpc_transport import GrpcSender, start_kv_server
    from kvtransfer.local import LocalSender
    from kvtransfer.nccl import device_chunks
    from kvtransfer.nccl_link import NcclEndpoint, NcclSender, nccl_handler
    from kvtransfer.shm import ShmRegion, ShmSender, shm_handler
    from kvtransfer.transport import build_chunks

    worker = DecodeWorker(decode, address="decode-0")
    server = region = endpoint = None
    sender: Any = LocalSender({"decode-0": worker.receiver})
    if transport in ("grpc", "shm", "nccl"):
        extra: list[Any] = []
        if transport == "shm":  # a decode worker's region: 4 slots of one chunk each
            region = ShmRegion(num_slots=4, slot_bytes=_chunk_bytes(exported, pages_per_chunk))
            extra = [shm_handler(worker.receiver, region)]
        if transport == "nccl":  # the pair's channel (gloo between CPU pools)
            endpoint = NcclEndpoint(decode.device)
            extra = [nccl_handler(worker.receiver, endpoint)]
        server, port = await start_kv_server(worker.receiver, "127.0.0.1:0", extra_handlers=extra)
        worker.address = f"127.0.0.1:{port}"
        sender = {"grpc": GrpcSender, "shm": ShmSender}[transport]() if endpoint is None else NcclSender(decode.device)
        if endpoint is not None:
            await sender.connect(worker.address, *await endpoint.listen())

    try:
        job = Job("p", tuple(range(exported.num_tokens)), SamplingParams(max_tokens=1))
        dest = worker.reserve(job, sender_epoch=1)
        assert dest is not None
        pages = exported.kv  # page-major block, as the prefill worker sends it
        start = time.perf_counter()
        if endpoint is not None:  # chunks made where the pages live (a digest, no encoding)
            chunks: Any = device_chunks(dest, pages, 1, 0, pages_per_chunk)
        else:
            chunks = build_chunks(dest, pages, 1, pages_per_chunk)
        result = await sender.send(dest, chunks, 60.0)
        seconds = time.perf_counter() - start
        if not result.accepted:
            raise RuntimeError(f"the {transport} push failed: {result.error}")
        worker.cancel(dest)
    finally:  # a failed push too: no server outlives its event loop
        if server is not None:
            await sender.close()
            await server.stop(None)
        if region is not None:
            region.close()
        if endpoint is not None:
            endpoint.close()
    return seconds, exported.kv.numel() * exported.kv.element_size()


def _chunk_bytes(exported: Any, pages_per_chunk: int) -> int:
    page = exported.kv[0]
    return int(page.numel() * page.element_size() * min(pages_per_chunk, exported.kv.shape[0]))


def _raw_shm(exported: Any, chunk_bytes: int) -> float:
    """Copy the same bytes, chunk by chunk, into the slots of a (pre-faulted) shm region: one
    memcpy per chunk, no header, no checksum, no receiver."""
    import torch

    from kvtransfer.shm import ShmRegion

    block = memoryview(exported.kv.cpu().contiguous().view(-1).view(torch.uint8).numpy())
    with ShmRegion(num_slots=2, slot_bytes=chunk_bytes) as region:
        slots = [region.view(i * chunk_bytes, chunk_bytes) for i in range(2)]
        start = time.perf_counter()
        for i, offset in enumerate(range(0, len(block), chunk_bytes)):
            piece = block[offset : offset + chunk_bytes]
            slots[i % 2][: len(piece)] = piece
        seconds = time.perf_counter() - start
        for slot in slots:
            slot.release()
    return seconds


async def _raw_grpc(num_bytes: int, message_bytes: int) -> float:
    """Stream `num_bytes` as opaque messages through a bare grpc.aio client-streaming call."""
    import grpc

    async def sink(request_iterator: Any, context: Any) -> bytes:
        async for _ in request_iterator:
            pass
        return b""

    handler = grpc.method_handlers_generic_handler(
        "raw.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)}
    )
    opts = [("grpc.max_receive_message_length", message_bytes + (1 << 20)),
            ("grpc.max_send_message_length", message_bytes + (1 << 20))]
    server = grpc.aio.server(options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)
    call = channel.stream_unary("/raw.Sink/Push")
    payload = b"\x01" * message_bytes

    async def messages() -> Any:
        sent = 0
        while sent < num_bytes:
            yield payload
            sent += message_bytes

    start = time.perf_counter()
    await call(messages())
    seconds = time.perf_counter() - start
    await channel.close()
    await server.stop(None)
    return seconds


def _row(transport: str, seconds: float, nbytes: int, prefill_s: float) -> dict[str, Any]:
    return {"transport": transport, "seconds": round(seconds, 4), "bytes": nbytes,
            "gb_per_s": round(nbytes / seconds / 1e9, 3), "vs_prefill": round(seconds / prefill_s, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.transfer", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="baton-small")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--pages-per-chunk", type=int, default=None, help="default: the workers' (about 4 MiB chunks)")
    args = parser.parse_args(argv)
    from kvtransfer.codec import chunk_pages

    exported, decode, prefill_s = _prefill(args.model, args.prompt_len)
    page = exported.kv[0]
    args.pages_per_chunk = chunk_pages(page.numel() * page.element_size(), args.pages_per_chunk)
    rows = []
    # Both engines share this process and device: NCCL refuses two ranks on one GPU, so on CUDA
    # the nccl row is gpu_check's (send-to-self); between CPU pools it runs over gloo.
    transports = ("local", "grpc", "shm") + (("nccl",) if decode.device.type == "cpu" else ())
    for transport in transports:
        seconds, nbytes = asyncio.run(_push(exported, decode, transport, args.pages_per_chunk))
        rows.append(_row(transport, seconds, nbytes, prefill_s))
    chunk_bytes = _chunk_bytes(exported, args.pages_per_chunk)
    rows.append(_row("raw grpc.aio (ceiling)", asyncio.run(_raw_grpc(nbytes, chunk_bytes)), nbytes, prefill_s))
    rows.append(_row("raw shm memcpy (ceiling)", _raw_shm(exported, chunk_bytes), nbytes, prefill_s))
    print(json.dumps({"model": args.model, "prompt_len": args.prompt_len, "prefill_s": round(prefill_s, 3)}))
    for row in rows:
        print(json.dumps(row))
    print(f"prefill of {args.prompt_len} tokens on {args.model}: {prefill_s:.3f} s; KV {nbytes / 1e6:.1f} MB",
          file=sys.stderr)
    for row in rows:
        print(f"  {row['transport']:<24} {row['seconds']:8.4f} s  {row['gb_per_s']:6.3f} GB/s  "
              f"{row['vs_prefill']:6.3f}x prefill", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
