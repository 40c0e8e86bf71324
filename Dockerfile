# kvserve image. GPU (default): PyPI's CUDA build of the pinned torch. CPU:
#   docker build --build-arg VARIANT=cpu .
# TORCH_INDEX_URL replaces the index torch comes from (a mirror, an air-gapped index);
# empty: the variant's own (PyPI for gpu, download.pytorch.org's CPU index for cpu). The
# build fails if the torch it got is not the variant's build (CUDA for gpu, none for cpu).
# The GPU image needs an NVIDIA driver for CUDA 13.0 (torch 2.13.0's PyPI build: driver
# 580 or newer) and the NVIDIA container runtime. Model weights are never baked in: mount
# a model directory or a Hugging Face cache and set KVSERVE_MODEL.
#
# Three stages, each one needed by the image of either variant, so the legacy builder
# (which builds every stage up to the target) does no more than BuildKit.

FROM python:3.11-slim-bookworm AS base
# A C compiler at run time: the CPU kernels compile on first use, and Triton builds its
# launcher for the GPU kernels the first time they run.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 kvserve \
    && mkdir /hf && chown 10001:10001 /hf
WORKDIR /app
COPY constraints.txt ./

# The wheel users install: built from the sources, with its package data (the kernels'
# C sources, the chat page); tests/deploy/test_wheel.py serves from the same wheel.
FROM base AS wheel
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM base AS runtime
ARG VARIANT=gpu
ARG TORCH_INDEX_URL=
# PyPI's torch for Linux x86-64 is the CUDA build: it brings the CUDA libraries and
# Triton as wheels, so the base needs no CUDA toolkit. The CPU build is pinned by its
# local version (+cpu), so no index that also has the CUDA build can hand that one over.
RUN case "$VARIANT" in \
      gpu) spec=torch==2.13.0; index=${TORCH_INDEX_URL:-https://pypi.org/simple} ;; \
      cpu) spec=torch==2.13.0+cpu; index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu} ;; \
      *) echo "VARIANT must be gpu or cpu, got '$VARIANT'" >&2; exit 1 ;; \
    esac \
    && pip install --no-cache-dir -c constraints.txt "$spec" --index-url "$index" \
    && python -c "import sys, torch; cuda = torch.version.cuda; want = sys.argv[1] == 'gpu'; \
sys.exit(0 if bool(cuda) == want else f'VARIANT={sys.argv[1]} got torch {torch.__version__} (CUDA: {cuda})')" "$VARIANT"
COPY --from=wheel /wheels /wheels
# constraints.txt keeps the torch installed above
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c constraints.txt /wheels/kvserve-*.whl && rm -rf /wheels
COPY deploy/docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint
# Non-root by default (Kubernetes runs it as 10001); docker compose starts it as root so
# the entrypoint can take the mounted Hugging Face cache's owner (entrypoint.sh).
USER 10001
ENV KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    HF_HOME=/hf \
    PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["kvserve-entrypoint"]
