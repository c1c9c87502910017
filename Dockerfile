# The engine's processes (scheduler, evaluator / capture workers, finalizer, tinylm).
# Build context: this repository. No GPU stack: the student and teacher run in SGLang's image.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends procps \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY tinylm ./tinylm
COPY workers ./workers
# torch==2.13.0 is pinned by the project; point PIP_EXTRA_INDEX_URL at a CPU-wheel index
# at build time to keep the image free of the CUDA stack.
ARG PIP_EXTRA_INDEX_URL=""
RUN PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL}" pip install --no-cache-dir .
ENTRYPOINT ["rollout"]
