"""Starting a peer server: one process group, its output in a log, ready once /v1/models answers."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


def launch(name: str, args: Sequence[str], url: str, log: Path, timeout_s: float,
           env: Mapping[str, str] | None = None, poll_s: float = 0.5) -> subprocess.Popen[bytes]:  # fmt: skip
    """Start `args` in its own session (so `kill -- -PID` stops all it spawned), its output
    appended to `log`, and wait until `url`/v1/models answers 200. A process that exits, or
    does not answer within timeout_s (then its group is killed), raises with the log's path."""
    with open(log, "ab") as sink:
        proc = subprocess.Popen(list(args), stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{name} did not answer within {timeout_s:.0f} s; see {log}")
        time.sleep(poll_s)
