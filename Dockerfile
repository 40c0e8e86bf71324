# kvserve image. GPU (default): PyPI's CUDA build of the pinned torch. CPU:
#   docker build --build-arg VARIANT=cpu .
# Both install torch from constraints.txt's pin. The GPU image needs an NVIDIA driver for
# CUDA 13.0 (torch 2.13.0's PyPI build: driver 580 or newer) and the NVIDIA container
# runtime. Model weights are never baked in: mount a model directory and set KVSERVE_MODEL.
ARG VARIANT=gpu

FROM python:3.11-slim-bookworm AS base
# A C compiler at run time: the CPU kernels compile on first use, and Triton builds its
# launcher for the GPU kernels the first time they run.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 kvserve
WORKDIR /app
COPY constraints.txt ./

# PyPI's torch for Linux x86-64 is the CUDA build: it brings the CUDA libraries and
# Triton as wheels, so the base needs no CUDA toolkit.
FROM base AS torch-gpu
RUN pip install --no-cache-dir -c constraints.txt torch==2.13.0

FROM base AS torch-cpu
RUN pip install --no-cache-dir -c constraints.txt torch==2.13.0 \
    --index-url https://download.pytorch.org/whl/cpu

# The wheel users install: built from the sources, with its package data (the kernels'
# C sources, the chat page); tests/deploy/test_wheel.py serves from the same wheel.
FROM base AS wheel
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

# hadolint ignore=DL3006
FROM torch-${VARIANT} AS runtime
WORKDIR /app
COPY --from=wheel /wheels /wheels
# constraints.txt keeps the torch installed above
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c constraints.txt /wheels/kvserve-*.whl && rm -rf /wheels
USER 10001
ENV KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["kvserve", "serve"]
