"""The scripts the manifests run, run for real: the head's preStop (k8s/base/hooks/drain.py)
against a stand-in gateway on loopback, and the model-fetch init container's script
(k8s/overlays/gpu/optional/model-fetch/fetch-model.sh) with a stand-in `rclone` that copies a
local directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.k8s.manifests import K8S

pytestmark = pytest.mark.timeout(120)

DRAIN = K8S / "base" / "hooks" / "drain.py"
FETCH = K8S / "overlays" / "gpu" / "optional" / "model-fetch" / "fetch-model.sh"
RUN_TIMEOUT_S = 30


@dataclass
class Gateway:
    """A stand-in for the gateway's HTTP port: /admin/drain and /metrics."""

    inflight: list[int]  # what successive /metrics scrapes report (the last one repeats)
    calls: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, auth

    def handler(self) -> type[BaseHTTPRequestHandler]:
        gw = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                gw.calls.append((self.command, self.path, self.headers.get("Authorization")))

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                self._record()
                self.send_response(202 if self.path == "/admin/drain" else 404)
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                self._record()
                n = gw.inflight.pop(0) if len(gw.inflight) > 1 else gw.inflight[0]
                body = f"# TYPE baton_inflight_requests gauge\nbaton_inflight_requests {n}.0\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def serve() -> Iterator[Callable[[Gateway], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(gw: Gateway) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), gw.handler())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def drain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DRAIN), "--interval", "0.05", "--timeout", "2", *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)  # fmt: skip


def test_drain_posts_then_waits_until_nothing_is_in_flight(
    serve: Callable[[Gateway], str], tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("REPLACE_ME_ops_key_000000000000000000000\n")
    gw = Gateway(inflight=[3, 2, 1, 0])
    url = serve(gw)
    out = drain("--url", url, "--token-file", str(token), "--deadline", "20")
    assert out.returncode == 0, out.stderr
    assert gw.calls[0] == (
        "POST",
        "/admin/drain",
        "Bearer REPLACE_ME_ops_key_000000000000000000000",
    )
    scrapes = [c for c in gw.calls if c[1] == "/metrics"]
    assert len(scrapes) == 4 and all(c[2] for c in scrapes)


def test_drain_gives_up_at_its_deadline(serve: Callable[[Gateway], str], tmp_path: Path) -> None:
    gw = Gateway(inflight=[1])
    out = drain("--url", serve(gw), "--token-file", str(tmp_path / "absent"), "--deadline", "0.5")
    assert out.returncode == 1 and "deadline" in out.stderr
    assert gw.calls[0] == ("POST", "/admin/drain", None) and len(gw.calls) > 2


def test_drain_with_no_gateway_listening_returns_at_once() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = drain("--url", f"http://127.0.0.1:{port}", "--deadline", "20")
    assert out.returncode == 0 and "not listening" in out.stderr


def test_wait_for_exit_waits_for_the_gateway_to_stop_listening() -> None:
    import time

    gw = Gateway(inflight=[0])
    server = ThreadingHTTPServer(("127.0.0.1", 0), gw.handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    assert (
        drain("--url", url, "--wait-for-exit", "--deadline", "0.3").returncode == 1
    )  # still listening

    def stop_soon() -> None:
        time.sleep(0.5)
        server.shutdown()
        server.server_close()

    threading.Thread(target=stop_soon, daemon=True).start()
    started = time.monotonic()
    out = drain("--url", url, "--wait-for-exit", "--deadline", "20")
    assert out.returncode == 0 and 0.3 < time.monotonic() - started < 15
    assert not gw.calls, "--wait-for-exit only watches the port"


# --- model-fetch ------------------------------------------------------------------------------

FAKE_RCLONE = """#!/bin/sh
# stand-in for `rclone copy [flags] SRC DST`: copies a local directory; fails if asked to
[ -z "${RCLONE_FAIL:-}" ] || { echo "rclone: failing as asked" >&2; exit 1; }
for a in "$@"; do src="$dst"; dst="$a"; done
mkdir -p "$dst" && cp -R "$src/." "$dst/"
"""


def tree_sha256(directory: Path) -> str:
    """The content hash k8s/README.md documents, computed independently of the script."""
    lines = []
    for path in directory.rglob("*"):
        if path.is_file() and path.name != ".baton-sha256":
            rel = "./" + path.relative_to(directory).as_posix()
            lines.append(
                (rel.encode(), f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}\n")
            )
    return hashlib.sha256("".join(line for _, line in sorted(lines)).encode()).hexdigest()


@pytest.fixture
def model_store(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    if not all(shutil.which(t) for t in ("sh", "sha256sum", "find", "sort", "cut")):
        pytest.fail(
            "the model-fetch script needs sh, sha256sum, find, sort and cut (coreutils / busybox)"
        )
    source = tmp_path / "bucket" / "rev1"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "model.safetensors").write_bytes(os.urandom(4096))
    (source / "Tokenizer.json").write_text("{}")
    (source / "sub" / "b c.txt").write_text("spaces in names")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "rclone").write_text(FAKE_RCLONE)
    (bindir / "rclone").chmod(0o755)
    models = tmp_path / "models"
    models.mkdir()
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "MODELS_DIR": str(models), "HOSTNAME": "head-0",
           "MODEL_NAME": "tiny", "MODEL_REVISION": "rev1", "MODEL_SOURCE": str(source),
           "MODEL_SHA256": tree_sha256(source)}  # fmt: skip
    return source, models, env


def fetch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(FETCH)], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)  # fmt: skip


def test_fetch_verifies_and_points_current_at_the_revision(
    model_store: tuple[Path, Path, dict[str, str]],
) -> None:
    source, models, env = model_store
    out = fetch(env)
    assert out.returncode == 0, out.stderr
    assert os.readlink(models / "current") == "tiny@rev1"
    assert (models / "current" / "model.safetensors").read_bytes() == (
        source / "model.safetensors"
    ).read_bytes()
    assert (models / "tiny@rev1" / ".baton-sha256").read_text().strip() == env["MODEL_SHA256"]
    assert sorted(p.name for p in models.iterdir()) == ["current", "tiny@rev1"], (
        "no temporary left behind"
    )
    # a verified revision is not downloaded again (the store may even be unreachable)
    again = fetch(env | {"RCLONE_FAIL": "1"})
    assert again.returncode == 0 and "verified" in again.stdout


def test_fetch_refuses_content_that_does_not_match_the_hash(
    model_store: tuple[Path, Path, dict[str, str]],
) -> None:
    source, models, env = model_store
    (source / "model.safetensors").write_bytes(os.urandom(4096))  # the store now holds other bytes
    out = fetch(env)
    assert out.returncode == 1 and "refusing" in out.stderr
    assert list(models.iterdir()) == [], "nothing loadable is left behind"


def test_fetch_switches_revisions_and_rejects_bad_input(
    model_store: tuple[Path, Path, dict[str, str]],
) -> None:
    source, models, env = model_store
    assert fetch(env).returncode == 0
    rev2 = source.parent / "rev2"
    shutil.copytree(source, rev2)
    (rev2 / "config.json").write_text('{"model_type": "llama", "v": 2}')
    env2 = env | {
        "MODEL_REVISION": "rev2",
        "MODEL_SOURCE": str(rev2),
        "MODEL_SHA256": tree_sha256(rev2),
    }
    assert fetch(env2).returncode == 0, "a new pinned revision"
    assert os.readlink(models / "current") == "tiny@rev2" and (models / "tiny@rev1").is_dir()
    for bad in ({"MODEL_SHA256": "REPLACE_ME_64_hex_digits"}, {"MODEL_SHA256": "ab" * 31},
                {"MODEL_REVISION": "../etc"}, {"MODEL_SOURCE": ""}):  # fmt: skip
        out = fetch(env | bad)
        assert out.returncode != 0, bad
    assert os.readlink(models / "current") == "tiny@rev2", "a refused run changes nothing"
