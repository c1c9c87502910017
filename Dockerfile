# The engine's processes (scheduler, evaluator / capture workers, finalizer, tinylm).
# Build context: this repository. No GPU stack: the student and teacher run in SGLang's image.
#   docker compose build      python:3.11-slim; PyPI, and torch from PyTorch's CPU index
#   scripts/build-images      no registry: a Debian base made with debootstrap, and every
#                             wheel from build/docker-wheels in the context (offline)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# ps for operators (the local base image has it already).
RUN command -v ps >/dev/null || { apt-get update \
    && apt-get install -y --no-install-recommends procps && rm -rf /var/lib/apt/lists/*; }
RUN python3 -m venv /opt/rollout
ENV PATH=/opt/rollout/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The dependencies first, in a layer of their own: a change to the engine's code reuses it.
# torch is pinned by constraints.txt; the extra index serves its CPU build (a +cpu local
# version, which pip prefers to PyPI's CUDA build of the same release), so the image carries
# no CUDA libraries. The wheel folder matches nothing unless scripts/build-images filled it;
# when it has wheels, pip installs from them alone. Bytecode: compiling every module of
# torch and transformers takes longer than the install itself, so pip compiles none and one
# import of what the services use from them (the bulk of a process's start-up) compiles
# those; the rest compile on first import.
WORKDIR /install
COPY pyproject.toml constraints.txt build/docker-wheel[s] ./
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN if ls ./*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/install; fi \
    && python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"]))' \
    > requirements.txt \
    && pip install --no-compile -c constraints.txt -r requirements.txt \
    && python3 -c 'import torch; from transformers import AutoTokenizer, \
PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM'

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY tinylm ./tinylm
COPY workers ./workers
RUN pip install --no-deps --no-build-isolation . && rm -rf build ./*.egg-info
ENTRYPOINT ["rollout"]
