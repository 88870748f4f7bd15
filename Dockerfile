# baton's images: one for every pod of k8s/ (the gateway, the Ray head, the prefill and decode
# workers: KubeRay runs `ray start` in it), in two builds. No model inside: the model volume
# carries it (or the built-in baton-tiny is generated at run time).
#
#   docker build -t baton:0.1.0 .                    (--target gpu, the default) torch on CUDA 13 with
#                                                    CuPy and NCCL (transport: nccl)
#   docker build --target cpu --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t baton:0.1.0-cpu .
#                                                    a CPU-only torch: a much smaller image (the cpu demo)
#
# Every Python package comes from a lock file with hashes (requirements/image-{gpu,cpu}.lock,
# made from pyproject.toml's extras by `make lock`; requirements/README.md), installed with
# --require-hashes and without resolving anything; the base image is pinned by digest.
# k8s/README.md, "The image".
ARG BASE_IMAGE=python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1

FROM ${BASE_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# wget: KubeRay's default probes on the Ray containers call it (and the dashboard agent that
# ray[default] brings, on port 52365). gcc and libc6-dev: the CPU decode attention kernel
# (engine/csrc) is compiled on the node it runs on, at first use (-march=native: an image
# built elsewhere cannot carry a build for every CPU); without them the torch path runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid 1000 baton \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/baton --shell /bin/bash baton

WORKDIR /opt/baton
COPY requirements/ requirements/
COPY pyproject.toml README.md ./
COPY batonpb/ batonpb/
COPY bench/ bench/
COPY cluster/ cluster/
COPY decode/ decode/
COPY engine/ engine/
COPY kvcache/ kvcache/
COPY kvtransfer/ kvtransfer/
COPY prefill/ prefill/

# The CPU build: the same lock set without CUDA; torch's CPU wheel, which PyPI does not carry,
# from PyTorch's CPU index (TORCH_INDEX_URL) at the model extra's version.
FROM base AS cpu
ARG TORCH_INDEX_URL
RUN test -n "${TORCH_INDEX_URL}" || { echo "--build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index>" >&2; exit 1; } \
 && pip install --no-deps --index-url "${TORCH_INDEX_URL}" "torch==2.13.0" \
 && pip install --require-hashes --no-deps -r requirements/image-cpu.lock \
 && pip install --no-deps .
USER 1000:1000
ENV HOME=/home/baton
EXPOSE 8000 50051
CMD ["baton", "--help"]

# The GPU build: torch's own CUDA 13 wheel and its NVIDIA libraries, CuPy and NCCL at the version
# torch pins (pyproject.toml's gpu extra), everything else a pod runs (the model, serve, cluster,
# trace and k8s extras; ray[default]: KubeRay's probes need its dashboard agent); then baton itself.
FROM base AS gpu
RUN pip install --require-hashes --no-deps -r requirements/image-gpu.lock \
 && pip install --no-deps .
USER 1000:1000
ENV HOME=/home/baton
EXPOSE 8000 50051
CMD ["baton", "--help"]
