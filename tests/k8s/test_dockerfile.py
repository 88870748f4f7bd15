"""The Dockerfile, read statically (there is no Docker engine here): a pinned base image, a
non-root user, nothing fetched by ADD, baton installed with the extras a pod needs and Ray at
the project's version, every package copied, and a .dockerignore that keeps the context small."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.k8s.manifests import ROOT

pytestmark = pytest.mark.timeout(120)

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends in a continuation"
    return out


def pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pinned(extra: str, package: str) -> str:
    deps = pyproject()["project"]["optional-dependencies"][extra]  # type: ignore[index]
    for dep in deps:
        name, sep, version = str(dep).partition("==")
        if sep and name.split("[")[0] == package:
            return version.split(";")[0].strip()
    raise AssertionError(f"pyproject.toml's {extra} extra pins no {package}")


def test_base_image_is_python_311_slim_pinned_by_tag() -> None:
    froms = [args for ins, args in instructions() if ins == "FROM"]
    assert len(froms) == 1
    image = froms[0].split()[0]
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-[a-z]+)?", image), image


def test_runs_as_a_non_root_user() -> None:
    users = [args for ins, args in instructions() if ins == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "a numeric UID lets runAsNonRoot verify it"


def test_nothing_is_fetched_by_add() -> None:
    for ins, args in instructions():
        if ins == "ADD":
            assert not re.search(r"(https?|git)://|git@", args), f"ADD {args}"


def test_pip_installs_baton_with_the_pod_extras_and_rays_version() -> None:
    runs = " ".join(args for ins, args in instructions() if ins == "RUN")
    m = re.search(r'pip install "?\.\[([a-z0-9,]+)\]"?', runs)
    assert m, "no `pip install .[extras]`"
    # k8s: the planner scales the RayCluster with the kubernetes client (cluster/ops/planner_k8s.py)
    assert {"model", "serve", "cluster", "k8s"} <= set(m.group(1).split(","))
    assert f'"ray[default]=={pinned("cluster", "ray")}"' in runs, (
        "ray[default] at the project's Ray version"
    )
    assert f'"torch=={pinned("model", "torch")}"' in runs, "torch at the model extra's pin"
    assert re.search(r"apt-get install[^&]*\bwget\b", runs), "KubeRay's default probes run wget"


def test_every_package_is_copied() -> None:
    copied = {args.split()[0].rstrip("/") for ins, args in instructions() if ins == "COPY"}
    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]  # type: ignore[index]
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    wanted = {
        p for p in packages if any(re.fullmatch(pat.replace("*", ".*"), p) for pat in include)
    }
    assert wanted and wanted <= copied, f"not copied: {sorted(wanted - copied)}"
    assert {"pyproject.toml", "README.md"} <= {
        w for ins, args in instructions() if ins == "COPY" for w in args.split()
    }


def test_dockerignore_keeps_the_context_small_and_the_sources_in() -> None:
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}  # fmt: skip
    assert {".git", ".venv", "tests", "k8s"} <= ignored
    copied = {args.split()[0].rstrip("/") for ins, args in instructions() if ins == "COPY"}
    assert not ignored & (copied | {"pyproject.toml", "README.md"})
