"""preStop hooks of the head pod (mounted from ConfigMap baton-hooks; stdlib only).

    drain.py                     gateway container: POST /admin/drain, then wait until the
                                 gateway reports no request in flight (baton_inflight_requests)
    drain.py --wait-for-exit     ray-head container: wait until the gateway stops listening, so
                                 the head's Ray (GCS, raylet) outlives the requests it carries

Kubernetes runs each container's preStop and then sends it SIGTERM, all containers at once:
without the second hook the Ray head would stop under a gateway that is still draining. Both
waits are bounded by --deadline (keep it below the pod's terminationGracePeriodSeconds) and
every HTTP call by --timeout. Exit 0: drained (or the gateway is gone); 1: the deadline passed.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

INFLIGHT_METRIC = "baton_inflight_requests"


def _request(url: str, token: str | None, timeout: float, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (a fixed local URL)
            return resp.status, resp.read(1 << 22).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def inflight(text: str) -> float | None:
    """The value of baton_inflight_requests in a Prometheus text exposition, if present."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == INFLIGHT_METRIC:
            try:
                return float(value.split()[0])
            except (ValueError, IndexError):
                return None
    return None


def is_listening(base: str, timeout: float) -> bool:
    parts = urlsplit(base)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 80), timeout=timeout
        ):
            return True
    except OSError:
        return False


def drain(base: str, token: str | None, deadline: float, interval: float, timeout: float) -> bool:
    try:
        status, _ = _request(f"{base}/admin/drain", token, timeout, method="POST")
        print(f"drain: POST /admin/drain -> {status}", file=sys.stderr)
    except OSError as exc:
        if not is_listening(base, timeout):
            print(f"drain: the gateway is not listening ({exc}); nothing to drain", file=sys.stderr)
            return True
        print(f"drain: POST /admin/drain failed ({exc}); waiting anyway", file=sys.stderr)
    seen: float | None = None
    while time.monotonic() < deadline:
        try:
            status, body = _request(f"{base}/metrics", token, timeout)
        except OSError:
            if not is_listening(base, timeout):
                return True  # the gateway is gone
            status, body = 0, ""  # busy: a timeout is not an answer
        n = inflight(body) if status == 200 else None
        if n == 0:
            print("drain: no request in flight", file=sys.stderr)
            return True
        if n is not None and n != seen:  # what it waits for, once per change (the pod's events show it)
            print(f"drain: {n:g} request(s) in flight; waiting", file=sys.stderr, flush=True)
            seen = n
        time.sleep(interval)
    print("drain: deadline passed with requests in flight", file=sys.stderr)
    return False


def wait_for_exit(base: str, deadline: float, interval: float, timeout: float) -> bool:
    while time.monotonic() < deadline:
        if not is_listening(base, timeout):
            return True
        time.sleep(interval)
    print("drain: the gateway still listens at the deadline", file=sys.stderr)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway's HTTP port, in this pod"
    )
    p.add_argument(
        "--token-file", default="/etc/baton/ops/token", help="bearer token (absent: none)"
    )
    p.add_argument("--deadline", type=float, default=330.0, help="seconds to wait at most")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")
    p.add_argument(
        "--wait-for-exit", action="store_true", help="only wait until the gateway stops listening"
    )
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.deadline
    base = args.url.rstrip("/")
    if args.wait_for_exit:
        return 0 if wait_for_exit(base, deadline, args.interval, args.timeout) else 1
    token_path = Path(args.token_file)
    token = token_path.read_text().strip() if token_path.is_file() else None
    return 0 if drain(base, token, deadline, args.interval, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
