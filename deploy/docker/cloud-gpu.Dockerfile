# syntax=docker/dockerfile:1
# Ferry cloud node, GPU: TensorRT engines (model.plan) on NVIDIA's TensorRT
# image, plus ONNX Runtime and OpenVINO for models that stay on the CPU.
#
#   docker build -f deploy/docker/cloud-gpu.Dockerfile -t ferry-cloud:gpu .
#   docker run --rm --gpus all -p 8000:8000 -v "$PWD/repository:/models:ro" ferry-cloud:gpu
#
# nvcr.io/nvidia/tensorrt:25.01-py3 is Ubuntu 24.04 with Python 3.12, CUDA 12.8
# and TensorRT 10.8 (its Python bindings included); it needs an NVIDIA driver
# 570 or later on the host (or a data-center driver with forward compatibility)
# and the NVIDIA Container Toolkit.  Ferry needs Python >= 3.11: tags before
# 25.01 ship 3.10 and will not do.  A TensorRT engine is tied to the TensorRT
# version and GPU model that built it: build engines with this image's trtexec
# on the GPU model that will serve them.

FROM nvcr.io/nvidia/tensorrt:25.01-py3
LABEL org.opencontainers.image.title="ferry-cloud (GPU)" \
      org.opencontainers.image.description="Ferry cloud node: KServe V2 HTTP + MQTT v5, TensorRT, ONNX Runtime and OpenVINO" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The venv sees the image's own TensorRT bindings (--system-site-packages), so the
# `gpu` extra (tensorrt>=10.0) is already met and nothing of TensorRT is downloaded.
# python3-venv follows the base image's Ubuntu release; pinning it would break
# on every base image update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv --system-site-packages /opt/ferry
COPY . /src
# cuda-python moves tensors to and from the GPU for the TensorRT backend; its
# major version follows the image's CUDA (12.x here).
RUN /opt/ferry/bin/pip install --no-cache-dir "/src[cloud,gpu]" "cuda-python>=12.6,<13" \
    && rm -rf /src \
    && groupadd --system --gid 10001 ferry \
    && useradd --system --no-log-init --uid 10001 --gid ferry --home-dir /nonexistent --shell /usr/sbin/nologin ferry \
    && mkdir -p /models \
    && chown ferry:ferry /models
ENV PATH=/opt/ferry/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /models
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/live', timeout=4)"]
STOPSIGNAL SIGTERM
# The base image's entrypoint stays in front: besides its banner it turns on CUDA
# forward compatibility (/usr/local/cuda/compat) on a data-center driver older
# than the image's CUDA, then execs its arguments.  Replaced by ferry-cloud alone,
# such a host failed with CUDA error 803/804 (NVIDIA's advice for images that had
# dropped it: --entrypoint /opt/nvidia/nvidia_entrypoint.sh).
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "ferry-cloud"]
CMD ["serve", "--repository", "/models", "--http-host", "0.0.0.0", "--http-port", "8000"]
