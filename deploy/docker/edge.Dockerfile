# syntax=docker/dockerfile:1
# Ferry edge agent: ONNX Runtime (the `edge` extra), for devices that run
# containers (arm64 and amd64 images come from the same file).
#
#   docker build -f deploy/docker/edge.Dockerfile -t ferry-edge .
#   docker run --rm -p 8080:8080 \
#       -v /etc/ferry:/etc/ferry:ro -v /opt/ferry/repository:/opt/ferry/repository:ro \
#       -v ferry-edge-state:/var/lib/ferry-edge ferry-edge
#
# The agent reads /etc/ferry/agent.toml (mount yours; deploy/README.md has one).
# Set in it `state_dir = "/var/lib/ferry-edge"` (the volume: estimates and the
# deferred-request store live there and must survive a restart),
# `[api] host = "0.0.0.0"` for the port to be reachable from outside the
# container, and `repository` to where the local models are mounted.  For
# LiteRT models build with EXTRAS=edge,litert.
#
# The build stage compiles the agent's decision core (ferry-edge build-native:
# mypyc and gcc, in that stage only; ~3x faster decisions); NATIVE=0 skips it
# and the agent runs the same core from its Python sources.

FROM python:3.11.11-slim-bookworm AS build
ARG EXTRAS=edge
ARG NATIVE=1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# gcc and libc6-dev follow the base image's Debian release (pinning them would break on
# every base image update), and stay in this stage: the runtime image has neither.
# hadolint ignore=DL3008
RUN if [ "$NATIVE" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python -m venv /opt/ferry
COPY . /src
RUN /opt/ferry/bin/pip install --no-cache-dir "/src[${EXTRAS}]"
# The compiled core lands in the installed package; mypy was only needed to build it.
RUN if [ "$NATIVE" = "1" ]; then \
        /opt/ferry/bin/pip install --no-cache-dir "/src[native]" \
        && /opt/ferry/bin/ferry-edge build-native \
        && /opt/ferry/bin/pip uninstall -y mypy; \
    fi

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="ferry-edge" \
      org.opencontainers.image.description="Ferry edge agent: local inference or offload to the cloud, by a cost policy" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 ferry \
    && useradd --system --no-log-init --uid 10001 --gid ferry --home-dir /nonexistent --shell /usr/sbin/nologin ferry \
    && mkdir -p /var/lib/ferry-edge /etc/ferry \
    && chown ferry:ferry /var/lib/ferry-edge
COPY --from=build /opt/ferry /opt/ferry
ENV PATH=/opt/ferry/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /var/lib/ferry-edge
VOLUME ["/var/lib/ferry-edge"]
EXPOSE 8080
# The agent's local V2 API ([api] port, 8080 by default); with the API disabled,
# run the container with --no-healthcheck.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/v2/health/live', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["ferry-edge"]
CMD ["run", "--config", "/etc/ferry/agent.toml"]
