"""The `baton` command line.

    baton run                         offline generation with the built-in baton-tiny
    baton up [--prefill P --decode D] serve on one machine: colocated, or P prefill and D decode
                                      actors on a private loopback Ray (--no-ray: in-process)
    baton serve --ray-address ADDR    the same on an existing Ray cluster
    baton serve --config cluster.yaml everything from one file (cluster.cluster_config); also `up`
    baton status [--url URL] [--json] a running gateway's workers: role, health, load, cache by tier
    baton scale prefill=N decode=M    resize its worker pools (KubeRay on Kubernetes), draining first
    baton generate --model M --prompt P
    baton model create {tiny,small} DIR
    baton dev hosts N                 N network-namespaced hosts, each its own Ray node, until Ctrl-C (root)
    baton bench ...                   from the `baton.commands` entry point (bench/)

Errors meant for the user (BatonError) print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from engine.env import api_key
from engine.errors import BatonError

logger = logging.getLogger("baton")

DEMO_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Request:\n    def __init__(self",
    "# Parse the command line arguments",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BatonError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(metavar="COMMAND")

    run = sub.add_parser("run", help="start baton on its embedded defaults (built-in model)")
    _add_engine_args(run)
    run.set_defaults(func=_cmd_run)

    up = sub.add_parser("up", help="serve the OpenAI HTTP API and gRPC on one machine (embedded defaults)")
    _add_server_args(up, default_prefill=0)
    up.set_defaults(func=_cmd_up)

    serve = sub.add_parser("serve", help="serve on an existing Ray cluster (prefill and decode actors on it)")
    _add_server_args(serve, default_prefill=1)
    serve.add_argument("--ray-address", default=None,
                       help="the cluster's GCS address (host:port); token auth: RAY_AUTH_TOKEN or ~/.ray/auth_token")
    serve.set_defaults(func=_cmd_serve)

    status = sub.add_parser("status", help="a running gateway's nodes: role, health, load, cache by tier")
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP address")
    status.add_argument("--json", action="store_true", help="print the raw GET /status JSON")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    status.set_defaults(func=_cmd_status)

    scale = sub.add_parser("scale", help="bring a running gateway's worker pools to a size, one worker at a "
                           "time (scale-in drains first); an operator key in BATON_API_KEY")
    scale.add_argument("targets", nargs="+", metavar="ROLE=N", help="prefill=N and/or decode=M")
    scale.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP address")
    scale.add_argument("--timeout", type=float, default=1800.0,
                       help="seconds to wait (a pod per worker: image, model load)")
    scale.set_defaults(func=_cmd_scale)

    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)

    model = sub.add_parser("model", help="built-in models")
    model_sub = model.add_subparsers(metavar="ACTION")
    create = model_sub.add_parser("create", help="write baton-tiny or baton-small in Hugging Face layout")
    create.add_argument("name", choices=["tiny", "small"])
    create.add_argument("dir", type=Path)
    create.set_defaults(func=_cmd_model_create)

    dev = sub.add_parser("dev", help="developer tools")
    dev_sub = dev.add_subparsers(metavar="ACTION")
    hosts = dev_sub.add_parser("hosts", help="N network-namespaced hosts on this machine, each its own Ray node, "
                                             "until Ctrl-C (root; cluster.devhosts)")
    hosts.add_argument("n", type=int, nargs="?", default=3, help="how many hosts (default 3)")
    hosts.add_argument("--prefill-host", type=int, default=None,
                       help="the host with the baton_prefill resource (default 1 when N >= 3)")
    hosts.add_argument("--decode-host", type=int, default=None,
                       help="the host with the baton_decode resource (default 2 when N >= 3)")
    hosts.add_argument("--write-config", type=Path, default=None, metavar="PATH",
                       help="also write the hosts' cluster.yaml to PATH (replaced if there), for `baton serve --config`")
    hosts.add_argument("--sweep", action="store_true", help="only remove what killed runs left behind")
    hosts.set_defaults(func=_cmd_dev_hosts)

    for ep in entry_points(group="baton.commands"):
        ep.load()(sub)
    return parser


def _add_server_args(p: argparse.ArgumentParser, default_prefill: int) -> None:
    _add_engine_args(p)
    p.add_argument("--config", type=Path, default=None,
                   help="cluster.yaml: the whole deployment from one file (the other flags are then not allowed)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port; 0 disables gRPC")
    p.add_argument("--api-keys", type=Path, default=None, help="API key file (or BATON_API_KEYS)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients call the model by; answers carry the first (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool budget (per engine)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn KV prefix reuse off")
    p.add_argument("--prefill", type=int, default=default_prefill,
                   help="prefill workers: 0 colocated (one engine); P > 0 prefill actors on Ray")
    p.add_argument("--decode", type=int, default=1, help="decode workers (Ray actors) when --prefill > 0")
    p.add_argument("--no-ray", action="store_true",
                   help="with --prefill 1 --decode 1: both engines in this process, no Ray")
    p.add_argument("--local-prefill-tokens", type=int, default=32,
                   help="decode prefills a prompt itself when its uncached part is at most this long")
    p.add_argument("--transfer-deadline", type=float, default=10.0,
                   help="seconds a KV transfer may take before the request is re-dispatched")
    p.add_argument("--kv-transport", choices=["auto", "grpc", "shm", "nccl"], default="auto",
                   help="how pages move between actors: auto (nccl between CUDA pools, shm on one host, else gRPC); "
                        "nccl between CPU pools runs over gloo")
    p.add_argument("--kv-bind-host", default="auto",
                   help="the decode workers' KV listener: auto (loopback on a one-node Ray, the node's address on "
                        "more), node, or an IP")
    p.add_argument("--placement", choices=["cache", "round_robin"], default="cache",
                   help="where requests go: cache (cache-aware cost model) or round_robin (for comparison)")
    p.add_argument("--shared-prefix", action="append", default=[],
                   help="text (e.g. a public system prompt) whose cached pages every tenant may share")
    p.add_argument("--kv-pages", type=int, default=None, help="device KV pool size in pages (overrides --kv-memory-gb)")
    p.add_argument("--host-cache-pages", type=int, default=0, help="host-RAM tier size in pages (0: off)")
    p.add_argument("--disk-cache-pages", type=int, default=0, help="disk tier size in pages (0: off)")
    p.add_argument("--disk-cache-dir", default=None, help="disk tier directory (kept across restarts)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS and gRPC over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--max-prefill-chunk", type=int, default=None,
                   help="longest piece of one prompt in an engine step that also decodes (chunked prefill; "
                        "default 512; a step without decode rows is capped by --max-batched-tokens alone); "
                        "with --max-batched-tokens at least the prompt length, prompts are not chunked")
    p.add_argument("--max-batched-tokens", type=int, default=None, help="token budget of one engine step (default 2048)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "triton"], default="auto",
                   help="decode attention: auto (triton on CUDA, the compiled cpu kernel on CPU float32), "
                        "torch (the reference), cpu, triton")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="while requests decode, size prompt chunks so a step takes about this long "
                        "(measured per-token costs; default: off, the static token budget)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the KV pool's element type: auto (the model's dtype, the parity reference) or bfloat16/"
                        "float16: twice the pages in the same memory, attended on the torch path")
    p.add_argument("--scheduler-policy", choices=["least-uncached", "fcfs"], default="least-uncached",
                   help="prompt work within a priority class: least-uncached (the prompts nearest their first "
                        "token first, aged by work done so none starves) or fcfs (arrival order)")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="launch a step before reading the last one back (auto: on with CUDA graphs)")
    p.add_argument("--pin-cores", action="store_true",
                   help="each engine on its own core with one torch thread (unless --threads): Ray actors "
                        "round robin over the cores, prefill first; colocated: the engine's step thread")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="baton-tiny", help="baton-tiny, baton-small or a checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the engine")


def _engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine.engine import Engine
    from engine.engine_config import EngineConfig

    return Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_threads=args.threads))


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.sampling import SamplingParams

    engine = _engine(args)
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    # A chat template writes its own BOS; encoding must not add a second one.
    _stream(engine, engine.tokenizer.encode(text, add_special_tokens=not args.chat), params)
    return 0


def _stream(engine, prompt_ids: list[int], params) -> None:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    engine.add_request("cli", prompt_ids, params)
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            n = out.num_output_tokens
    elapsed = time.perf_counter() - start
    print(f"\n[{len(prompt_ids)} prompt tokens, {n} generated in {elapsed:.2f} s]", file=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    from engine.sampling import SamplingParams

    print(f"baton: loading {args.model} (created on first use) ...", file=sys.stderr)
    engine = _engine(args)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    if sys.stdin.isatty():
        print("baton: offline generation; type a prompt, an empty line to quit.", file=sys.stderr)
        while True:
            try:
                line = input("prompt> ")
            except EOFError:
                break
            if not line.strip():
                break
            _stream(engine, engine.tokenizer.encode(line), params)
        return 0
    # Not interactive: a short demo batch through continuous batching.
    start = time.perf_counter()
    prompts = [engine.tokenizer.encode(p) for p in DEMO_PROMPTS]
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outputs, strict=True):
        print(f"--- {prompt!r}\n{engine.tokenizer.decode(out)}")
    total = sum(len(o) for o in outputs)
    print(f"[{len(prompts)} requests, {total} tokens in {elapsed:.2f} s]", file=sys.stderr)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from cluster.server import run

    if args.config is not None:
        return run(_config_file(args, "up"))
    return run(_server_config(args, ray_address=None))


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    if args.config is not None:
        cfg = _config_file(args, "serve")
        if cfg.disagg is None or cfg.disagg.ray_address is None:
            raise BatonError(f"{args.config}: baton serve attaches to a Ray cluster: set ray.address "
                             "and workers.prefill.count >= 1 (baton up --config runs a private one)")
    else:
        if args.ray_address is None:
            raise BatonError("baton serve needs --ray-address (or --config cluster.yaml with ray.address)")
        if args.prefill < 1 or args.no_ray:
            raise BatonError("baton serve runs prefill and decode actors on Ray: use --prefill >= 1, not --no-ray")
        cfg = _server_config(args, ray_address=args.ray_address)
    # A driver attaching to a token-auth cluster must say so before `ray` is imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from cluster.server import run

    return run(cfg)


def _config_file(args: argparse.Namespace, command: str):  # type: ignore[no-untyped-def]
    """The ServerConfig of --config; a flag given beside it would be silently ignored, so it is an error."""
    from cluster.cluster_config import load_cluster_config

    parser = _build_parser()
    defaults = vars(parser.parse_args([command]))
    ignored = sorted(k for k, v in vars(args).items()
                     if k not in ("config", "func", "verbose", "ray_address") and defaults.get(k) != v)
    if getattr(args, "ray_address", None) is not None:
        ignored.append("ray_address")
    if ignored:
        flags = ", ".join("--" + k.replace("_", "-") for k in ignored)
        raise BatonError(f"{flags}: not allowed with --config (set it in {args.config})")
    return load_cluster_config(args.config)


def _server_config(args: argparse.Namespace, ray_address: str | None):  # type: ignore[no-untyped-def]
    from cluster.cluster_config import ASYNC_SCHEDULING
    from cluster.disagg_config import DisaggConfig
    from cluster.edge.http_api import HttpConfig
    from cluster.server import ServerConfig
    from engine.engine_config import EngineConfig
    from kvcache.tiers import TierConfig

    if args.no_ray and (args.prefill != 1 or args.decode != 1):
        raise BatonError("--no-ray runs exactly one prefill and one decode engine: use --prefill 1 --decode 1")
    disagg = None
    if args.prefill > 0 and not args.no_ray:
        disagg = DisaggConfig(num_prefill=args.prefill, num_decode=args.decode, ray_address=ray_address,
                              local_prefill_tokens=args.local_prefill_tokens,
                              transfer_deadline_s=args.transfer_deadline, num_threads=args.threads or 1,
                              transport=args.kv_transport, pin_cores=args.pin_cores, placement=args.placement,
                              bind_host=args.kv_bind_host)
    kv = int(args.kv_memory_gb * (1 << 30)) if args.kv_memory_gb else None
    threads = args.threads or (1 if args.pin_cores else None)  # a pinned engine: one core, one thread
    chunking = {k: v for k, v in (("max_prefill_chunk", args.max_prefill_chunk),
                                  ("max_num_batched_tokens", args.max_batched_tokens)) if v is not None}
    engine = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_threads=threads,
                          max_model_len=args.max_model_len, kv_memory_bytes=kv,
                          enable_prefix_cache=not args.no_prefix_cache, num_pages=args.kv_pages,
                          tiers=TierConfig(args.host_cache_pages, args.disk_cache_pages, args.disk_cache_dir),
                          async_scheduling=ASYNC_SCHEDULING[args.async_scheduling],
                          attention_backend=args.attention_backend, itl_target_ms=args.itl_target_ms,
                          scheduler_policy=args.scheduler_policy, kv_cache_dtype=args.kv_cache_dtype, **chunking)
    return ServerConfig(
        engine=engine,
        http=HttpConfig(host=args.host, port=args.port, tls_certfile=args.tls_cert, tls_keyfile=args.tls_key),
        grpc_port=args.grpc_port or None,
        api_keys_file=args.api_keys,
        served_model_name=tuple(args.served_model_name) if args.served_model_name else None,
        shared_prefix_texts=tuple(args.shared_prefix),
        prefill_workers=args.prefill,
        local_prefill_tokens=args.local_prefill_tokens,
        disagg=disagg,
        pin_cores=args.pin_cores,
    )


def _cmd_status(args: argparse.Namespace) -> int:
    """GET /status, printed as a table; the key (if the gateway has keys) from BATON_API_KEY."""
    import json

    from cluster.ops.status_view import render_status

    body = _call_gateway(args.url, "/status", None, args.timeout)
    print(json.dumps(body, indent=2) if args.json else render_status(body))
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    """POST /admin/scale {"prefill": N, "decode": M}; prints what was added and drained."""
    targets: dict[str, int] = {}
    for item in args.targets:
        role, _, count = item.partition("=")
        if role not in ("prefill", "decode") or not (count.isascii() and count.isdigit()):
            raise BatonError(f"{item!r}: use prefill=N or decode=M")
        targets[role] = int(count)
    report = _call_gateway(args.url, "/admin/scale", targets, args.timeout)
    for role, done in report.items():
        changes = [*(f"+{n}" for n in done.get("added", []) if n), *(f"-{n}" for n in done.get("drained", []))]
        print(f"{role}: {done['before']} -> {done['after']}" + (f"  ({', '.join(changes)})" if changes else ""))
    return 0


def _call_gateway(base: str, path: str, body: dict[str, int] | None, timeout_s: float) -> dict[str, Any]:
    """GET (or POST `body` as JSON) a gateway route -> its JSON answer; BatonError with the
    gateway's own message otherwise. The key (if the gateway has keys) from BATON_API_KEY."""
    import json
    import urllib.error
    import urllib.request

    url = base.rstrip("/") + path
    if not url.startswith(("http://", "https://")):
        raise BatonError(f"--url {base!r}: use http://host:port or https://host:port")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Accept": "application/json",
                                                              "Content-Type": "application/json"})  # fmt: skip
    if key := api_key():
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:  # noqa: S310  (http(s) only, above)
            answer: dict[str, Any] = json.loads(reply.read(8 << 20))
            return answer
    except urllib.error.HTTPError as exc:
        hint = {401: " (set BATON_API_KEY)", 403: " (BATON_API_KEY must be an operator key: role=operator)"}.get(
            exc.code, "")
        raise BatonError(f"{url}: HTTP {exc.code}{hint}{_message(exc)}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise BatonError(f"{url}: cannot reach the gateway ({getattr(exc, 'reason', exc)})") from None
    except ValueError:
        raise BatonError(f"{url}: the answer is not JSON") from None


def _message(exc: Any) -> str:
    """The OpenAI-shaped error body's message, if the answer has one."""
    import json

    try:
        return ": " + str(json.loads(exc.read(1 << 16))["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return ""


def _cmd_model_create(args: argparse.Namespace) -> int:
    from engine.builtin import BUILTIN_SPECS, create_model

    start = time.perf_counter()
    path = create_model(BUILTIN_SPECS[f"baton-{args.name}"], args.dir)
    print(f"wrote baton-{args.name} to {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_dev_hosts(args: argparse.Namespace) -> int:
    """Bring the hosts up, say how to use them, and hold them until Ctrl-C or SIGTERM."""
    import signal

    from cluster import devhosts

    if reason := devhosts.available():
        raise BatonError(reason)
    if args.sweep:
        print(f"removed: {', '.join(devhosts.sweep_stale()) or 'nothing'}")
        return 0
    given = {r: i for r, i in (("prefill", args.prefill_host), ("decode", args.decode_host)) if i is not None}
    roles = {**({"prefill": 1, "decode": 2} if args.n >= 3 else {}), **given}
    if any(not 0 <= i < args.n for i in roles.values()):
        raise BatonError(f"--prefill-host and --decode-host name a host in 0..{args.n - 1}")
    resources: dict[int, dict[str, float]] = {}
    for role, i in roles.items():
        resources.setdefault(i, {})[f"baton_{role}"] = 100.0

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"baton: starting {args.n} hosts ...", file=sys.stderr)
    with devhosts.DevHosts(args.n, resources=resources) as hosts:
        written = None
        if args.write_config is not None:  # the addresses change from run to run: written anew
            args.write_config.write_text(devhosts.cluster_yaml(hosts, roles))
            written = str(args.write_config)
        print(devhosts.describe(hosts, roles, str(Path(sys.executable).parent / "baton"), written), flush=True)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            print("baton: stopping the hosts ...", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
