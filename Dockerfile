# kvserve image. GPU (default): CUDA PyTorch base. CPU: docker build --build-arg VARIANT=cpu .
# Model weights are never baked in: mount a model directory and set KVSERVE_MODEL.
ARG VARIANT=gpu

FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime AS base-gpu

FROM python:3.11-slim-bookworm AS base-cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
# A C compiler builds kvserve's CPU decode-attention kernel on first use.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 kvserve
WORKDIR /app
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
# hadolint ignore=DL3013
RUN pip install --no-cache-dir .
USER 10001
ENV KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["kvserve", "serve"]
