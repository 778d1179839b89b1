"""Every Prometheus metric of the service, in one place (the README's metrics table lists them)."""

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# the *_created series double the output and no alert uses them
disable_created_metrics()  # type: ignore[no-untyped-call]

HTTP_REQUESTS = Counter(
    "progress_http_requests_total", "HTTP requests answered, by route and status.", ["route", "status"]
)
REDIS_WRITE_SECONDS = Histogram(
    "progress_redis_write_seconds",
    "Time of one pipelined Redis write (one or more heartbeats).",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
REDIS_WRITE_BATCH_SIZE = Histogram(
    "progress_redis_write_batch_size",
    "Heartbeats carried by one Redis pipeline.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REDIS_WRITE_ERRORS = Counter(
    "progress_redis_write_errors_total", "Heartbeats whose Redis write failed.", ["content_type"]
)


def render_latest() -> tuple[bytes, str]:
    """With several worker processes, PROMETHEUS_MULTIPROC_DIR makes every scrape see all of them."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


__all__ = ["Gauge"]
