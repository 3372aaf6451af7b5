# syntax=docker/dockerfile:1
# rewa for GPU nodes (default) or CPU nodes:
#   docker build -t rewa:gpu .
#   docker build --build-arg VARIANT=cpu -t rewa:cpu .
# The Python environment is installed by `make deps` and `make install`, the targets (and so
# the pyproject.toml requirements and torch pin) that `make serve` uses; only the torch index
# and the FAISS extra differ between the variants.
ARG VARIANT=gpu

# CUDA 12 runtime: torch's CUDA 12 wheels and faiss-gpu-cu12 bring their own CUDA libraries;
# the host needs an NVIDIA driver and the NVIDIA container toolkit.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-gpu
ENV REWA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM ubuntu:24.04 AS base-cpu
ENV REWA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM base-${VARIANT}
ARG VARIANT
# Where the pinned torch comes from; empty: the variant's index above. It must carry the
# version that the Makefile pins (TORCH_REQUIREMENT).
ARG TORCH_INDEX_URL=
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# g++ and the Python headers: torch.compile builds dense attention's CPU tiles with them
# (attention/cpu_kernel.py; without them it warns once and runs uncompiled).
RUN apt-get update \
    && apt-get install --yes --no-install-recommends \
        ca-certificates curl g++ make python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/rewa
# The requirements first, in a layer of their own: editing the sources does not reinstall torch.
COPY Makefile pyproject.toml ./
RUN make deps VENV=/opt/rewa/.venv VARIANT=${VARIANT} \
        TORCH_INDEX_URL=${TORCH_INDEX_URL:-$REWA_TORCH_INDEX_URL}
COPY README.md ./
COPY attention/ attention/
COPY index/ index/
COPY service/ service/
COPY clients/ clients/
COPY llm/ llm/
COPY research/ research/
# Numba's cache of the compiled loops (tail attention's, index/tail/kernel.py and decode.py; the
# IVF shortlist's, index/largest.py; attention over LSH candidates, index/lsh_attention.py),
# filled here so that a server's first call compiles none.
ENV NUMBA_CACHE_DIR=/opt/rewa/.numba-cache
RUN make install VENV=/opt/rewa/.venv VARIANT=${VARIANT} \
        TORCH_INDEX_URL=${TORCH_INDEX_URL:-$REWA_TORCH_INDEX_URL} \
    && .venv/bin/python -m compileall -q attention index service clients llm research \
    && .venv/bin/python -c "from rewa.index.tail.decode import compile_ahead; compile_ahead()" \
    && .venv/bin/python -c "from rewa.index.largest import compile_ahead; compile_ahead()" \
    && .venv/bin/python -c "from rewa.index.lsh_attention import compile_ahead; compile_ahead()"

# A non-root user; the embedded store persists under /data (a volume) unless REWA_REDIS_URL
# is set.
RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin rewa \
    && mkdir /data && chown rewa /data && chown -R rewa "$NUMBA_CACHE_DIR"
USER 10001
ENV PATH=/opt/rewa/.venv/bin:$PATH \
    REWA_HOST=0.0.0.0 \
    REWA_PORT=8000 \
    REWA_DATA_DIR=/data
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD curl --fail --silent --show-error "http://127.0.0.1:${REWA_PORT}/livez" || exit 1

ENTRYPOINT ["rewa", "serve"]
