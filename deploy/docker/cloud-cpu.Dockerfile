# syntax=docker/dockerfile:1
# Ferry cloud node, CPU: ONNX Runtime and OpenVINO (the `cloud` extra).
#
#   docker build -f deploy/docker/cloud-cpu.Dockerfile -t ferry-cloud:cpu .
#   docker run --rm -p 8000:8000 -v "$PWD/examples/repository:/models:ro" ferry-cloud:cpu
#
# The build context is the repository root (see /.dockerignore).  The default
# command serves /models on 0.0.0.0:8000; pass other `ferry-cloud` arguments
# after the image name (`serve ... --controller`, `controller ...`, `tune ...`).
# Pin the base by digest too (python:3.11.11-slim-bookworm@sha256:...) where
# builds must be reproducible.

FROM python:3.11.11-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/ferry
COPY . /src
# The project from the build context; its dependencies are bounded in pyproject.toml.
RUN /opt/ferry/bin/pip install --no-cache-dir "/src[cloud]"

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="ferry-cloud (CPU)" \
      org.opencontainers.image.description="Ferry cloud node: KServe V2 HTTP + MQTT v5, ONNX Runtime and OpenVINO" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric user, so Kubernetes' runAsNonRoot can check it.
RUN groupadd --system --gid 10001 ferry \
    && useradd --system --no-log-init --uid 10001 --gid ferry --home-dir /nonexistent --shell /usr/sbin/nologin ferry \
    && mkdir -p /models \
    && chown ferry:ferry /models
COPY --from=build /opt/ferry /opt/ferry
ENV PATH=/opt/ferry/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /models
EXPOSE 8000
# Liveness only (the process answers HTTP); readiness (/v2/health/ready) is for
# the load balancer to ask.  The port must match --http-port.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/live', timeout=4)"]
# SIGTERM drains: intake stops, requests in flight finish within shutdown_grace_s
# (30 s by default): give `docker stop` at least that (`--stop-timeout 40`).
STOPSIGNAL SIGTERM
ENTRYPOINT ["ferry-cloud"]
CMD ["serve", "--repository", "/models", "--http-host", "0.0.0.0", "--http-port", "8000"]
