"""`baton bench`: registered through the `baton.commands` entry point, so no serving module
imports bench/.

    baton bench --offline ...          engine throughput without a server (bench.offline)
    baton bench --url URL ...          the serving benchmark against any OpenAI-compatible
                                       endpoint (bench.serving)
    baton bench --grpc HOST:PORT ...   the same benchmark over baton's gRPC API
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "bench", help="benchmarks: a serving endpoint (--url or --grpc) or the offline engine (--offline)"
    )
    p.add_argument("--offline", action="store_true", help="offline engine throughput (bench.offline)")
    from bench import offline, serving

    offline.add_arguments(p)
    serving.add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.offline:
        from bench import offline

        return offline.run(args)
    from bench import serving

    return serving.run(args)
