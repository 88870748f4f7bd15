"""`baton serve --config` on host 0 of a DevHosts cluster, as a user runs it across hosts.

    with Gateway.start(hosts, tmp_path, model_dir, decode=2) as gw:
        gw.complete(prompt_ids, max_tokens)     token ids (greedy), over HTTP across the bridge
        gw.metrics()                            {(name, labels): value} from /metrics
        gw.status()                             /status JSON

The gateway process runs inside host 0's namespace; this process reaches it over the bridge,
at host 0's address. Its actors go where the hosts' resources say: prefill to `baton_prefill`,
decode to `baton_decode` (tests/multihost/conftest.py gives the hosts those).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import baton_command
from cluster.devhosts import DevHosts

HTTP_PORT = 28000  # inside host 0's own namespace: nothing else binds there but Ray
READY_S = 240.0
STOP_S = 60.0

Labels = tuple[tuple[str, str], ...]


def cluster_yaml(hosts: DevHosts, model_dir: Path, *, decode: int, extra: dict[str, Any] | None = None) -> str:
    """A cluster.yaml for the hosts: every request disaggregated (no local prefill), decode
    workers in turn (round robin, so each gets work), short deadlines and leases."""
    cfg: dict[str, Any] = {
        "model": {"path": str(model_dir), "max_model_len": 512},
        "ray": {"address": hosts.ray_address},
        "workers": {"prefill": {"count": 1, "resources": {"baton_prefill": 1}},
                    "decode": {"count": decode, "resources": {"baton_decode": 1}}},
        "kv_cache": {"prefix_cache": False},
        "transfer": {"deadline_s": 5.0, "pair_failures": 2, "pair_retry_s": 2.0},
        "placement": {"policy": "round_robin", "local_prefill_tokens": 0},
        "membership": {"backend": "ray", "lease_ttl_s": 3},
        "recovery": {"watchdog_s": 5.0},
        "api": {"host": hosts.hosts[0].ip, "port": HTTP_PORT, "grpc_port": 0},
    }
    for section, values in (extra or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return json.dumps(cfg)  # JSON is YAML


class Gateway:
    def __init__(self, hosts: DevHosts, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.hosts = hosts
        self.proc = proc
        self.log_path = log_path
        self.url = f"http://{hosts.hosts[0].ip}:{HTTP_PORT}"
        self.http = httpx.Client(base_url=self.url, timeout=60.0, trust_env=False)

    @classmethod
    def start(cls, hosts: DevHosts, tmp_path: Path, model_dir: Path, *, decode: int = 2,
              extra: dict[str, Any] | None = None) -> Gateway:  # fmt: skip
        config = tmp_path / "cluster.yaml"
        config.write_text(cluster_yaml(hosts, model_dir, decode=decode, extra=extra))
        log_path = tmp_path / "gateway.log"
        env = {**hosts.env, "BATON_CACHE_DIR": os.environ["BATON_CACHE_DIR"], "PYTHONUNBUFFERED": "1"}
        with log_path.open("wb") as log:
            proc = hosts.popen(0, [*baton_command(), "serve", "--config", str(config)], stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        gw = cls(hosts, proc, log_path)
        try:
            gw.wait_ready()
        except BaseException:
            gw.stop()
            raise
        return gw

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"baton serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.http.get("/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"baton serve not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGINT (baton's own shutdown: its actors end with it), then SIGKILL."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_S)

    def complete(self, prompt_ids: list[int], max_tokens: int, timeout_s: float = 60.0) -> list[int]:
        body = {"model": self.model(), "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        r = self.http.post("/v1/completions", json=body, timeout=timeout_s)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    def stream(self, prompt_ids: list[int], max_tokens: int, timeout_s: float = 120.0) -> Iterator[list[int]]:
        """A streamed greedy completion: each SSE chunk's token ids, as they arrive (the caller
        reads it partly, breaks something, and reads the rest)."""
        body = {"model": self.model(), "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
        with self.http.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as r:
            assert r.status_code == 200, r.read().decode()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(f"stream failed: {chunk['error']}")
                ids = [t for c in chunk.get("choices", []) for t in c.get("token_ids") or []]
                if ids:
                    yield ids

    def model(self) -> str:
        return str(self.http.get("/v1/models").json()["data"][0]["id"])

    def status(self) -> dict[str, Any]:
        return dict(self.http.get("/status").json())

    def metrics(self) -> dict[tuple[str, Labels], float]:
        out: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.metrics().items() if n == name and want <= set(ls))

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""
