# One image for both services (CPU). Build: docker compose build
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libsndfile1 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. Point
# TORCH_INDEX_URL at PyTorch's CPU wheel index for a small CPU-only image.
ARG TORCH_INDEX_URL=""
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0 \
 && pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
EXPOSE 50051 50061
