"""The Dockerfile and its lock files, read statically (there is no Docker engine here): a base
image pinned by digest, a gpu and a cpu build, each installing every package from its lock file
with hashes (the locks agree with pyproject.toml's pins; the gpu one carries CuPy and NCCL on
torch's CUDA, which `transport: nccl` needs; the cpu one no CUDA at all), a non-root user,
nothing fetched by ADD, every package copied, and a .dockerignore that keeps the context small."""

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


IMAGE_EXTRAS = ("model", "serve", "cluster", "trace", "k8s")  # what a pod runs
LOCKS = {"gpu": ROOT / "requirements" / "image-gpu.lock", "cpu": ROOT / "requirements" / "image-cpu.lock"}


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each build stage's instructions, by its name (FROM ... AS name)."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for ins, args in instructions():
        if ins == "FROM":
            name = args.split()[-1] if " AS " in f" {args.upper()} " else args
            current = out.setdefault(name, [])
        elif current is not None:
            current.append((ins, args))
    return out


def locked(target: str) -> dict[str, tuple[str, list[str]]]:
    """The lock file's packages: name -> (version, its sha256 hashes)."""
    out: dict[str, tuple[str, list[str]]] = {}
    text = LOCKS[target].read_text().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)\s*(.*)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", m.group(3)))
    return out


def test_base_image_is_python_311_slim_pinned_by_digest() -> None:
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for ins, a in instructions() if ins == "ARG" and "=" in a}
    froms = [a.split()[0] for ins, a in instructions() if ins == "FROM"]
    assert froms[0] == "${BASE_IMAGE}" and all(f in ("${BASE_IMAGE}", "base") for f in froms), froms
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-[a-z]+)?@sha256:[0-9a-f]{64}", args["BASE_IMAGE"]), args


def test_a_gpu_and_a_cpu_build_install_only_from_their_locks() -> None:
    built = stages()
    assert {"base", "gpu", "cpu"} <= set(built)
    assert list(built)[-1] == "gpu", "`docker build .` without --target builds the last stage: the gpu image"
    for target in ("gpu", "cpu"):
        runs = " && ".join(a for ins, a in built[target] if ins == "RUN")
        installs = [c.strip() for c in runs.split("&&") if "pip install" in c]
        lock = f"requirements/{LOCKS[target].name}"
        assert any("--require-hashes" in c and "--no-deps" in c and f"-r {lock}" in c for c in installs), installs
        for c in installs:  # nothing resolved at build time: every install is --no-deps
            assert "--no-deps" in c, c
        assert installs[-1].endswith("pip install --no-deps ."), "baton itself, last"
        if target == "cpu":  # torch's CPU wheel by the model extra's version, from PyTorch's CPU index
            assert any(f'"torch=={pinned("model", "torch")}"' in c and "TORCH_INDEX_URL" in c for c in installs)
        assert ("USER", "1000:1000") in built[target]
    copied = [a for ins, a in built["base"] if ins == "COPY"]
    assert "requirements/ requirements/" in copied


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_the_locks_pin_what_pyproject_pins_with_hashes(target: str) -> None:
    lock = locked(target)
    assert lock and all(hashes for _, hashes in lock.values()), "every package with its hashes"
    extras = (*IMAGE_EXTRAS, "gpu") if target == "gpu" else IMAGE_EXTRAS
    deps = [*pyproject()["project"]["dependencies"],  # type: ignore[index]
            *(d for e in extras for d in pyproject()["project"]["optional-dependencies"][e])]  # type: ignore[index]
    for dep in deps:
        name, _, version = str(dep).split(";")[0].partition("==")
        name = name.split("[")[0].strip().lower().replace("_", "-")
        if name == "torch" and target == "cpu":
            assert name not in lock  # from PyTorch's CPU index, by version (the Dockerfile)
            continue
        assert name in lock, f"{name} is not in {LOCKS[target].name}: make lock (requirements/README.md)"
        assert lock[name][0] == version.strip(), f"{name}: pyproject {version}, locked {lock[name][0]}: make lock"
    assert lock["ray"][0] == pinned("cluster", "ray") and "aiohttp" in lock  # ray[default]: its dashboard agent


def test_the_gpu_image_has_what_the_nccl_transport_needs_on_torchs_cuda() -> None:
    lock = locked("gpu")
    torch = lock["torch"][0]
    assert "+" not in torch, "torch's own CUDA wheel, not a local (+cpu) build"
    # kvtransfer/nccl_comm.py: CuPy with NCCL (without the nccl wheel cupy.cuda.nccl is an empty stub)
    cupy = [n for n in lock if n.startswith("cupy-cuda")]
    nccl = [n for n in lock if n.startswith("nvidia-nccl-cu")]
    assert len(cupy) == 1 and len(nccl) == 1, (cupy, nccl)
    cuda = re.fullmatch(r"cupy-cuda(\d+)x", cupy[0])
    assert cuda and nccl[0] == f"nvidia-nccl-cu{cuda.group(1)}"
    runtime = lock["nvidia-cuda-runtime"][0] if "nvidia-cuda-runtime" in lock else ""
    assert runtime.split(".")[0] == cuda.group(1), f"torch's CUDA runtime {runtime} vs CuPy's CUDA {cuda.group(1)}"


def test_the_cpu_image_carries_no_cuda() -> None:
    lock = locked("cpu")
    cuda = [n for n in lock if n.startswith(("nvidia-", "cupy-", "cuda-", "triton"))]
    assert cuda == [], cuda


def test_runs_as_a_non_root_user() -> None:
    users = [args for ins, args in instructions() if ins == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "a numeric UID lets runAsNonRoot verify it"


def test_nothing_is_fetched_by_add() -> None:
    for ins, args in instructions():
        if ins == "ADD":
            assert not re.search(r"(https?|git)://|git@", args), f"ADD {args}"


def test_kuberays_probes_find_wget() -> None:
    runs = " ".join(args for ins, args in instructions() if ins == "RUN")
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
