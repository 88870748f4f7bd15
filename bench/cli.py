"""`baton bench`: registered through the `baton.commands` entry point, so no serving module
imports bench/."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("bench", help="benchmarks (today: --offline engine throughput)")
    p.add_argument("--offline", action="store_true", help="offline engine throughput (bench.offline)")
    from bench import offline

    offline.add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bench import offline

    if not args.offline:
        print("baton bench: only --offline exists so far (the serving benchmark comes with the edge)")
        return 2
    return offline.run(args)
