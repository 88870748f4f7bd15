"""The committed stubs in batonpb/ are exactly what proto/generate.py makes of proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIX = ".venv/bin/python proto/generate.py  (from the repository root), then commit batonpb/"


def _files(package: Path) -> dict[str, str]:
    return {
        str(p.relative_to(package)): p.read_text()
        for p in sorted(package.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, f"proto/generate.py failed:\n{done.stderr}"
    fresh, committed = _files(tmp_path / "batonpb"), _files(ROOT / "batonpb")
    assert fresh, "the generator wrote nothing"
    missing = sorted(fresh.keys() - committed.keys())
    extra = sorted(committed.keys() - fresh.keys())
    stale = sorted(n for n in fresh.keys() & committed.keys() if fresh[n] != committed[n])
    assert not (missing or extra or stale), (
        f"batonpb/ is out of date with proto/ (missing {missing}, extra {extra}, stale {stale}); "
        f"run: {FIX}"
    )


def test_stubs_import_as_the_batonpb_package() -> None:
    from batonpb.baton.kv.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
    from batonpb.baton.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "baton.v1"
    assert generation_pb2.DESCRIPTOR.name == "baton/v1/generation.proto"  # the wire contract's name
    # the service stubs use this very module (the rewritten import), not a second copy
    imported = generation_pb2_grpc.baton_dot_v1_dot_generation__pb2  # type: ignore[attr-defined]
    assert imported is generation_pb2
    # the workers' internal package, one level deeper
    assert kvtransfer_pb2.DESCRIPTOR.package == "baton.kv.v1"
    assert kvtransfer_pb2.DESCRIPTOR.name == "baton/kv/v1/kvtransfer.proto"
    assert kvtransfer_pb2_grpc.baton_dot_kv_dot_v1_dot_kvtransfer__pb2 is kvtransfer_pb2  # type: ignore[attr-defined]
