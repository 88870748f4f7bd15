"""llama.cpp's C++ `llama-server` as a peer (issue 10; ../shared/PEERS.md has the findings).

    python -m bench.peers.llama_cpp build              # ~20 min on 2 cores, once: cached
    python -m bench.peers.llama_cpp convert --model DIR             # -> DIR's GGUF, cached
    python -m bench.peers.llama_cpp start --model DIR --name NAME --port P [--slots 32]
    kill PID                                           # the PID `start` printed

build: the llama.cpp source vendored in the `llama-cpp-python` source distribution (pinned
below, fetched with pip), built with cmake (Release, native CPU, no BLAS/CUDA/curl/OpenSSL,
no tests or examples) into <BATON_CACHE_DIR>/peers/llama.cpp-<version>/. A build that
finished (its `llama-server` exists) is not redone.

convert: the vendored `convert_hf_to_gguf.py` in f32 (the other peers' precision). It refuses
a tokenizer whose pre-tokenizer hash it does not know; baton's built-in tokenizer splits like
GPT-2, so the converter is told so (`--pre-tokenizer`, default gpt-2) by answering its hash
lookup with that name.

start: `llama-server` on 127.0.0.1 with parallel slots, continuous batching and per-slot KV
(`--no-kv-unified`: the unified buffer collapses at 32 slots x 2k context), 2 threads. Each slot
holds the model's context up to SLOT_CTX tokens (`--ctx` sets the total instead): with 3,072 a
slot, llama-server refused every 4,400-token prompt of the bursty traces. Prints one JSON line
(pid, url, versions, how to stop it) once the server answers /v1/models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.peers.launch import launch
from engine.env import cache_dir

VERSION = "0.3.36"  # llama-cpp-python's source distribution (it vendors llama.cpp)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
)  # fmt: skip


def home() -> Path:
    return cache_dir() / "peers" / f"llama.cpp-{VERSION}"


def source_dir() -> Path:
    return home() / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def server_binary() -> Path:
    return home() / "build" / "bin" / "llama-server"


def fetch_source() -> Path:
    """The sdist, by pip (the registry is the only source reachable), unpacked once."""
    src = source_dir()
    if (src / "CMakeLists.txt").exists():
        return src
    download = home() / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-binary", ":all:",
                    "--no-deps", "-d", str(download)], check=True)  # fmt: skip
    archive = download / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(home() / "src", filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise RuntimeError(f"{archive} holds no vendored llama.cpp at {src}")
    return src


def build(jobs: int = 2) -> Path:
    binary = server_binary()
    if binary.exists():
        return binary
    src = fetch_source()
    out = home() / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs)], check=True)
    if not binary.exists():
        raise RuntimeError(f"the build finished without {binary}")
    return binary


def gguf_path(model_dir: Path) -> Path:
    return home() / "models" / f"{model_dir.resolve().name}-f32.gguf"


_CONVERT = """
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as c
pre = sys.argv[2]
def get_vocab_base_pre(self, tokenizer):  # baton's tokenizer is unknown to the hash table
    return pre
try:  # where TextModel lives moved between llama.cpp versions
    from conversion.base import TextModel
except ImportError:
    TextModel = c.TextModel
TextModel.get_vocab_base_pre = get_vocab_base_pre
sentencepiece_vocab = TextModel._set_vocab_sentencepiece
def set_vocab_sentencepiece(self, *args, **kwargs):  # no tokenizer.model: a BPE tokenizer.json
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")  # the converter then tries the HF vocab
    return sentencepiece_vocab(self, *args, **kwargs)
TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
c.main()
"""


def convert(model_dir: Path, pre_tokenizer: str = "gpt-2") -> Path:
    """The model in GGUF (f32), made once per model directory."""
    out = gguf_path(model_dir)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = fetch_source()
    partial = out.with_suffix(".partial")
    subprocess.run([sys.executable, "-c", _CONVERT, str(src), pre_tokenizer, str(model_dir), "--outtype", "f32",
                    "--outfile", str(partial)], check=True)  # fmt: skip
    partial.rename(out)
    return out


SLOT_CTX = 8192  # tokens a slot holds at most: the built-in models' context, the bursty traces' 4.4k prompts


def slot_context(model_dir: Path) -> int:
    """A slot's context: the model's (config.json's max_position_embeddings), at most SLOT_CTX."""
    config = json.loads((model_dir / "config.json").read_text())
    return min(int(config.get("max_position_embeddings", SLOT_CTX)), SLOT_CTX)


def server_args(binary: Path, gguf: Path, name: str, port: int, slots: int = 32, ctx: int = 32 * SLOT_CTX,
                threads: int = 2) -> list[str]:  # fmt: skip
    """Parallel slots sharing `ctx` (each gets ctx // slots), per-slot KV, continuous batching."""
    if slots < 1 or ctx < slots:
        raise ValueError(f"need slots >= 1 and ctx >= slots, got slots={slots} ctx={ctx}")
    return [str(binary), "-m", str(gguf), "-a", name, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(ctx), "--no-kv-unified", "--cont-batching"]  # fmt: skip


def start(model_dir: Path, name: str, port: int, slots: int = 32, ctx: int | None = None, threads: int = 2,
          timeout_s: float = 300.0) -> dict[str, object]:  # fmt: skip
    """`ctx`: the total context (None: `slots` x the model's `slot_context`)."""
    ctx = slots * slot_context(model_dir) if ctx is None else ctx
    binary = build()
    model = convert(model_dir)
    url = f"http://127.0.0.1:{port}"
    log = home() / f"server-{port}.log"
    args = server_args(binary, model, name, port, slots, ctx, threads)
    proc = launch("llama-server", args, url, log, timeout_s)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    return {"peer": "llama-server", "pid": proc.pid, "url": url, "model": name, "gguf": str(model), "log": str(log),
            "versions": {"llama-cpp-python": VERSION, "llama-server": (version.stdout + version.stderr).strip()},
            "stop": f"kill {proc.pid}", "args": args}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.peers.llama_cpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    c = sub.add_parser("convert")
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--pre-tokenizer", default="gpt-2")
    s = sub.add_parser("start")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--slots", type=int, default=32)
    s.add_argument("--ctx", type=int, default=None, help="total context: slots x per-slot context (default: "
                   f"slots x the model's context, at most {SLOT_CTX} a slot)")
    s.add_argument("--threads", type=int, default=2, help="llama-server's -t and -tb")
    args = ap.parse_args(argv)
    if shutil.which("cmake") is None:
        ap.error("cmake is not on PATH (Debian/Ubuntu: apt-get install cmake ninja-build g++)")
    if args.cmd == "build":
        print(json.dumps({"llama-server": str(build(args.jobs))}))
    elif args.cmd == "convert":
        print(json.dumps({"gguf": str(convert(args.model, args.pre_tokenizer))}))
    else:
        print(json.dumps(start(args.model, args.name, args.port, args.slots, args.ctx, args.threads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
