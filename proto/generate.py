"""Regenerate the committed gRPC stubs in batonpb/ from the .proto sources in proto/.

    .venv/bin/python proto/generate.py            # rewrite batonpb/ in this checkout
    .venv/bin/python proto/generate.py --out DIR  # write DIR/batonpb/ (the freshness test)

protoc runs with `-I proto`, so descriptors keep their wire-contract names
(`baton/v1/generation.proto`, package `baton.v1`; `baton/kv/v1/kvtransfer.proto`, package
`baton.kv.v1`) and reflection shows those. The Python modules live one level deeper, in the
`batonpb` package (no top-level package may be named `proto`, docs/architecture.md, Layers), so
the generated `from baton.<package> import ...` lines are rewritten to
`from batonpb.baton.<package> import ...`. Output depends only on the .proto files and the
pinned grpcio-tools / mypy-protobuf versions, so a rerun is byte-identical. buf lints the
.proto files (`make proto-lint`, buf.yaml).
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PACKAGE = "batonpb"
# `from baton.v1 import x` / `import baton.kv.v1.x`, at the start of a line of generated code.
_IMPORT = re.compile(r"^(from|import) (baton\.)", re.MULTILINE)
_INIT = '"""Generated protobuf / gRPC stubs (proto/generate.py); do not edit."""\n'


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def _protoc_command(out: Path) -> list[str]:
    import grpc_tools  # only the generator needs grpcio-tools, not the server

    bin_dir = Path(sys.executable).parent
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    return [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}", f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}", f"--grpc_python_out={out}",
        f"--mypy_out={out}", f"--mypy_grpc_out={out}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]


def generate(dest: Path) -> list[Path]:
    """Write the stubs under dest/batonpb/ (replacing what was there); return the files."""
    target = dest / PACKAGE
    with tempfile.TemporaryDirectory() as raw_dir:
        raw = Path(raw_dir)
        done = subprocess.run(
            _protoc_command(raw), cwd=PROTO_ROOT, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed:\n{done.stderr}")
        if target.exists():
            shutil.rmtree(target)
        written = [_write(target / "__init__.py", _INIT)]
        for path in sorted(raw.rglob("*")):
            if path.is_file():
                text = _IMPORT.sub(rf"\1 {PACKAGE}.\2", path.read_text())
                written.append(_write(target / path.relative_to(raw), text))
        packages = {d for p in written for d in p.parents if d.is_relative_to(target)}
        for package_dir in sorted(packages):
            init = package_dir / "__init__.py"
            if not init.exists():
                written.append(_write(init, _INIT))
    return sorted(written)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="the directory to write batonpb/ into"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(args.out):
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
