"""The peer set-up scripts (bench/peers/llama_cpp.py, bench/peers/vllm_cpu.py): the command lines
they start, where they cache, and the converter patch. Building llama.cpp (~20 min) and
installing vLLM (~3.4 GB) are not in `make test`; `python -m bench.peers.<peer>` does them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import llama_cpp, vllm_cpu

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    return tmp_path


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_llama_server_listens_on_loopback_with_parallel_slots_and_per_slot_kv() -> None:
    args = llama_cpp.server_args(Path("/b/llama-server"), Path("/m/x.gguf"), "baton-tiny", 8123, slots=32, ctx=65536)
    assert args[0] == "/b/llama-server"
    assert _flag(args, "-m") == "/m/x.gguf"
    assert _flag(args, "-a") == "baton-tiny"
    assert _flag(args, "--host") == "127.0.0.1"
    assert _flag(args, "--port") == "8123"
    assert _flag(args, "-np") == "32"
    assert _flag(args, "-c") == "65536"
    assert _flag(args, "-t") == _flag(args, "-tb") == "2"
    assert "--no-kv-unified" in args and "--cont-batching" in args


@pytest.mark.parametrize(("model_ctx", "slot"), [(4096, 4096), (8192, 8192), (131072, llama_cpp.SLOT_CTX)])
def test_a_llama_slot_holds_the_models_context_up_to_a_bound(tmp_path: Path, model_ctx: int, slot: int) -> None:
    """The bursty traces' 4.4k-token prompts fit a slot of the built-in models (3,072 refused them);
    a 128k-context model does not get 32 x 128k."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": model_ctx}))
    assert llama_cpp.slot_context(tmp_path) == slot


@pytest.mark.parametrize(("slots", "ctx"), [(0, 4096), (32, 16)])
def test_llama_server_refuses_slots_it_cannot_give_context(slots: int, ctx: int) -> None:
    with pytest.raises(ValueError, match="slots"):
        llama_cpp.server_args(Path("b"), Path("m"), "n", 1, slots=slots, ctx=ctx)


def test_llama_cpp_caches_under_baton_cache_dir(cache: Path) -> None:
    assert llama_cpp.home() == cache / "peers" / f"llama.cpp-{llama_cpp.VERSION}"
    assert llama_cpp.server_binary().is_relative_to(llama_cpp.home())
    assert llama_cpp.gguf_path(Path("/x/baton-tiny-v2")) == llama_cpp.home() / "models" / "baton-tiny-v2-f32.gguf"


def test_llama_cpp_build_is_not_redone_once_the_binary_exists(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = llama_cpp.server_binary()
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"")

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing should run")

    monkeypatch.setattr(subprocess, "run", no_run)
    assert llama_cpp.build() == binary


def test_llama_cpp_says_why_without_cmake(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as exc:
        llama_cpp.main(["build"])
    assert exc.value.code == 2
    assert "cmake is not on PATH" in capsys.readouterr().err


_FAKE_CONVERTER = '''
import json, sys
from pathlib import Path
class TextModel:
    def __init__(self, dir_model):
        self.dir_model = Path(dir_model)
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
    def _set_vocab_sentencepiece(self):
        raise RuntimeError("sentencepiece path taken without tokenizer.model")
    def set_vocab(self):
        try:
            self._set_vocab_sentencepiece()
            return "sentencepiece"
        except FileNotFoundError:
            return "hf-bpe"
def main():
    model = TextModel(sys.argv[1])
    out = sys.argv[sys.argv.index("--outfile") + 1]
    Path(out).write_text(json.dumps({"pre": model.get_vocab_base_pre(None), "vocab": model.set_vocab(),
                                     "outtype": sys.argv[sys.argv.index("--outtype") + 1]}))
'''


def test_the_converter_is_told_the_pre_tokenizer_and_skips_sentencepiece_without_its_model(tmp_path: Path) -> None:
    src = tmp_path / "llama.cpp"
    (src / "gguf-py").mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text(_FAKE_CONVERTER)
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "out.gguf"
    subprocess.run([sys.executable, "-c", llama_cpp._CONVERT, str(src), "gpt-2", str(model), "--outtype", "f32",
                    "--outfile", str(out)], check=True)  # fmt: skip
    assert json.loads(out.read_text()) == {"pre": "gpt-2", "vocab": "hf-bpe", "outtype": "f32"}


def test_vllm_serves_float32_on_loopback_with_prefix_caching_on_or_off() -> None:
    on = vllm_cpu.server_args(Path("/v/python"), Path("/m"), "baton-tiny", 8124)
    off = vllm_cpu.server_args(Path("/v/python"), Path("/m"), "baton-tiny", 8124, prefix_caching=False)
    assert on[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve`: see the module
    assert _flag(on, "--host") == "127.0.0.1"
    assert _flag(on, "--dtype") == "float32"
    assert _flag(on, "--served-model-name") == "baton-tiny"
    assert _flag(on, "--max-model-len") == "8192"
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" not in on
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off


def test_vllm_gets_its_kv_budget_and_stays_offline() -> None:
    env = vllm_cpu.server_env(3)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"


def test_vllm_setup_is_not_redone_once_its_import_check_passed(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    py = vllm_cpu.python()
    py.parent.mkdir(parents=True)
    py.write_text("")
    vllm_cpu._ready_marker().write_text('{"vllm": "0.32.0"}')

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing should run")

    monkeypatch.setattr(subprocess, "run", no_run)
    assert vllm_cpu.setup() == py
    assert vllm_cpu.recorded_versions() == {"vllm": "0.32.0"}  # read back, vLLM not imported again


def test_a_venv_where_vllm_does_not_import_is_reported_with_its_error(cache: Path) -> None:
    py = vllm_cpu.python()
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    py.chmod(0o755)
    with pytest.raises(RuntimeError, match="No module named 'vllm'"):
        vllm_cpu.versions()


_SERVER = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": []}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launch_waits_until_the_server_answers(tmp_path: Path) -> None:
    from bench.peers.launch import launch
    from tests.cluster.conftest import free_port

    port = free_port()
    proc = launch("peer", [sys.executable, "-c", _SERVER, str(port), "0.5"], f"http://127.0.0.1:{port}",
                  tmp_path / "peer.log", timeout_s=30, poll_s=0.1)  # fmt: skip
    try:
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_launch_reports_a_server_that_exits_or_never_answers(tmp_path: Path) -> None:
    from bench.peers.launch import launch
    from tests.cluster.conftest import free_port

    log = tmp_path / "peer.log"
    with pytest.raises(RuntimeError, match=r"peer exited with 3; see .*peer\.log"):
        launch("peer", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], "http://127.0.0.1:9",
               log, timeout_s=30, poll_s=0.1)  # fmt: skip
    assert "bad flag" in log.read_text()
    port = free_port()
    with pytest.raises(RuntimeError, match="did not answer within 1 s"):
        launch("peer", [sys.executable, "-c", _SERVER, str(port), "60"], f"http://127.0.0.1:{port}", log,
               timeout_s=1, poll_s=0.1)  # fmt: skip
