# baton's image. One image for every pod of k8s/: the gateway, the Ray head and the prefill and
# decode workers (KubeRay runs `ray start` in it). No model inside: the model volume carries it
# (or the built-in baton-tiny is generated at run time).
#
#   docker build -t baton:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t baton:0.1.0-cpu .
#
# The default takes torch's PyPI wheel (CUDA on Linux, for the gpu overlay); the second a
# CPU-only torch, a much smaller image for the cpu demo. k8s/README.md, "The image".
FROM python:3.11.13-slim-bookworm

ARG TORCH_INDEX_URL=https://pypi.org/simple

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
COPY pyproject.toml README.md ./
COPY batonpb/ batonpb/
COPY bench/ bench/
COPY cluster/ cluster/
COPY decode/ decode/
COPY engine/ engine/
COPY kvcache/ kvcache/
COPY kvtransfer/ kvtransfer/
COPY prefill/ prefill/

# torch first, from the index chosen above, at the version pyproject.toml's model extra pins;
# then baton with what a pod runs (k8s: the planner's KubeRay client), and ray[default] at the
# project's Ray version (KubeRay's probes need its dashboard agent; the cluster extra has plain ray).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==2.13.0" \
 && pip install ".[model,serve,cluster,trace,k8s]" "ray[default]==2.60.0"

USER 1000:1000
ENV HOME=/home/baton
EXPOSE 8000 50051
CMD ["baton", "--help"]
