# syntax=docker/dockerfile:1

# Build stage: the project and its runtime dependencies, at the versions of uv.lock (no dev or test
# groups; the sqs extra, for the monolith's broker in production; the otel extra, for the traces the
# OTEL_* variables may ask for), in a virtualenv that the runtime stage copies whole. Every dependency
# ships manylinux wheels: no compiler needed.
FROM python:3.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy

# uv installs from the lockfile; it stays in this stage (the runtime copies /opt/venv only)
RUN pip install --no-cache-dir uv==0.13.9

WORKDIR /src
# dependencies first, from the lockfile alone, so a change of the code alone reuses this layer
COPY pyproject.toml uv.lock ./
RUN uv sync --frozen --no-install-project --no-cache --extra sqs --extra otel
COPY service ./service
RUN uv sync --frozen --no-editable --no-cache --extra sqs --extra otel


# Runtime stage: the virtualenv and nothing else, run by an unprivileged user.
FROM python:3.11-slim-bookworm

# numeric ids, so Kubernetes can check runAsNonRoot without reading /etc/passwd
RUN groupadd --system --gid 10001 progress \
    && useradd --system --uid 10001 --gid progress --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin progress

COPY --from=build /opt/venv /opt/venv

# HOST, PORT and WORKERS are read by `progress-service serve`; everything else is in
# docs/configuration.md. One worker per container: scale with replicas, not processes.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOST=0.0.0.0 \
    PORT=8000 \
    WORKERS=1

WORKDIR /app
USER 10001:10001
EXPOSE 8000

# liveness only: readiness (Redis reachable) is the load balancer's business, not a restart reason
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health/live' % os.environ.get('PORT', '8000'), timeout=2)"]

# uvicorn drains connections, then the lifespan runs the final flush (PROGRESS_SHUTDOWN_TIMEOUT_SECONDS)
STOPSIGNAL SIGTERM
CMD ["progress-service", "serve"]
