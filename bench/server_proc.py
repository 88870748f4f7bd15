"""`baton up` as a child process for a benchmark: start it on 127.0.0.1, wait until it is
ready, stop it by its PID.

    with BatonProcess(["--prefill", "1", "--decode", "1"], log_path) as server:
        server.wait_ready(timeout_s=180)          # GET /ready answers 200, or the child died
        ... drive server.url ...
                                                  # exit: SIGINT (baton's Ctrl-C path: actors
                                                  # and /dev/shm regions are released), then
                                                  # SIGKILL to its own process group if it hangs

`BatonProcess([], log_path, port, config=path)` runs `baton up --config path` instead: the file
says everything (its `api.port` must be `port`), since `--config` takes no other flag.

The child runs in its own session, so its process group id is its PID: the last resort kills
that group (the child and the local Ray it started), nothing else.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

STOP_WAIT_S = 60.0  # SIGINT -> exit: a Ray deployment needs ~5 s
POLL_S = 0.5


# Ports for servers a test or benchmark starts: outside the kernel's ephemeral range (the
# ports it hands to outgoing connections, of which a local Ray makes hundreds) and outside
# Ray's worker ports (10002-19999), so a port found free is still free when the server binds
# it. A port from bind(0) is an ephemeral one: an outgoing connection took it between the
# probe and the bind once in CI ("address already in use").
_PORTS = range(20000, 32000)
_rng = random.Random()


def _ephemeral_range() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on and no outgoing connection will take."""
    ephemeral = _ephemeral_range()
    for _ in range(200):
        port = _rng.choice(_PORTS)
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} on {host}")


def baton_command() -> list[str]:
    """The `baton` script of this interpreter's environment, else `python -m cluster.cli`."""
    script = Path(sys.executable).parent / "baton"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]


class BatonProcess:
    def __init__(self, up_args: list[str], log_path: Path, port: int | None = None,
                 config: Path | None = None) -> None:  # fmt: skip
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if config is not None:  # the file says everything; --config takes no other flag
            self.argv = [*baton_command(), "up", "--config", str(config), *up_args]
        else:
            self.argv = [*baton_command(), "up", "--host", "127.0.0.1", "--port", str(self.port),
                         "--grpc-port", "0", *up_args]  # fmt: skip
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    def __enter__(self) -> BatonProcess:
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)  # fmt: skip
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until GET /ready answered 200; raises if the child exits or time runs out."""
        assert self.proc is not None, "not started"
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"baton up exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2.0, trust_env=False).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
        raise TimeoutError(f"baton up not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGINT, then (after STOP_WAIT_S) SIGKILL to the child's own process group."""
        if self.proc is None or self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this child leads, by its id
                self.proc.wait(STOP_WAIT_S)
        self.returncode = self.proc.returncode
        return self.returncode

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""
