"""Every Prometheus metric of the service, in one place (the README's metrics table lists them)."""

import os
from collections.abc import Sequence

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


def _gauge(name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
    """A gauge of the pod, not of one process: with several worker processes, a scrape shows the highest value."""
    return Gauge(name, documentation, labels, multiprocess_mode="max")


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
DEGRADED_MODE = _gauge(
    "progress_degraded_mode", "1 while heartbeats go straight to Postgres because Redis is unreachable."
)
DEGRADED_WRITES = Counter(
    "progress_degraded_writes_total", "Heartbeats written straight to Postgres (degraded mode).", ["content_type"]
)

# the door: unknown content, slow bodies (service/api/catalog.py, ingest.py)
REFUSED = Counter(
    "progress_refused_total",
    "Heartbeats refused at the door before any write: unknown_content (404), body_timeout (408).",
    ["reason"],
)
AUTH_PREVIOUS_KEY = Counter(
    "progress_auth_previous_key_total",
    "Requests whose token a previous key verified (JWT_PREVIOUS_SECRETS, or a later PEM block of JWT_PUBLIC_KEY), "
    "cached tokens included: 0 for a day says the previous key can go.",
)
CATALOG_UNVERIFIED = Counter(
    "progress_catalog_unverified_total",
    "Heartbeats for an id not in the catalog snapshot, accepted unchecked because its lookup failed or timed out.",
    ["content_type"],
)
CATALOG_KNOWN_IDS = _gauge("progress_catalog_known_ids", "Content ids in the catalog snapshot.", ["content_type"])
CATALOG_LAST_REFRESH = _gauge(
    "progress_catalog_last_refresh_timestamp_seconds", "When the catalog snapshot was last loaded."
)
REDIS_USED_MEMORY = _gauge("progress_redis_used_memory_bytes", "Redis used_memory (INFO memory), sampled.")
REDIS_MAX_MEMORY = _gauge("progress_redis_maxmemory_bytes", "Redis maxmemory (0: no limit), sampled.")
REDIS_PERSISTENCE = _gauge(
    "progress_redis_persistence",
    "1 for the persistence Redis runs with, 0 for the others: aof, rdb, none (a restart loses everything not yet "
    "flushed), unknown (neither CONFIG GET nor INFO answered); the weakest master of a cluster. Sampled.",
    ["mode"],
)

# flusher
PENDING_ENTRIES = _gauge("progress_pending_entries", "Members waiting in a pending set.", ["content_type"])
IN_FLIGHT_ENTRIES = _gauge(
    "progress_in_flight_entries", "Members claimed by a flusher, not yet acked.", ["content_type"]
)
FLUSH_ROWS = Counter("progress_flush_rows_total", "Progress rows inserted or moved forward.", ["content_type"])
FLUSH_COMPLETIONS = Counter("progress_flush_completions_total", "Completion events created.", ["content_type"])
FLUSH_DROPPED = Counter(
    "progress_flush_dropped_total", "Heartbeats dropped: unknown user or content.", ["content_type"]
)
FLUSH_EXPIRED = Counter(
    "progress_flush_expired_total",
    "Pending entries whose value expired before a flush (lost positions).",
    ["content_type"],
)
FLUSH_REQUEUED = Counter(
    "progress_flush_requeued_total", "Entries put back in a pending set (database outage or expired lease)."
)
FLUSH_FAILURES = Counter(
    "progress_flush_failed_batches_total",
    "Batches not persisted because the database was unavailable.",
    ["content_type"],
)
FLUSH_CYCLE_ERRORS = Counter(
    "progress_flush_cycle_errors_total", "Flush cycles ended by an unexpected error (a bug: see the logs)."
)
FLUSH_BATCH_SECONDS = Histogram(
    "progress_flush_batch_seconds",
    "Time to persist one batch.",
    ["content_type"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
FLUSH_LAG_SECONDS = Histogram(
    "progress_flush_lag_seconds",
    "Per batch: flush time minus the receive time of its oldest heartbeat.",
    buckets=(1, 5, 15, 30, 60, 90, 120, 180, 300, 600, 1800, 3600),
)
FLUSH_BUDGET_WAIT_SECONDS = Counter(
    "progress_flush_budget_wait_seconds_total",
    "Seconds the flush and degraded mode spent waiting for the fleet's write budget.",
)
FLUSH_BUDGET_FALLBACK = Counter(
    "progress_flush_budget_fallback_total",
    "Batches (flush or degraded mode) kept to the pod's share of the budget: Redis could not take the fleet's.",
)
FLUSH_LOCKED = Counter(
    "progress_flush_locked_total",
    "Entries left pending because another session held a row they need (the rest of the batch was written).",
    ["content_type"],
)
FLUSH_DRAIN_SECONDS = _gauge(
    "progress_flush_drain_seconds", "Estimated time to write the backlog: pending entries / the rate they drain at."
)
FLUSH_LAST_SUCCESS = _gauge(
    "progress_flush_last_success_timestamp_seconds", "When a flush cycle last finished with no failed batch."
)
# the setting itself, so that alerts.yml counts in intervals and follows the setting (not a copy of its default)
FLUSH_INTERVAL = _gauge(
    "progress_flush_interval_seconds",
    "PROGRESS_FLUSH_INTERVAL_SECONDS of a running flusher (0: none runs in this process).",
)


def render_latest() -> tuple[bytes, str]:
    """With several worker processes, PROMETHEUS_MULTIPROC_DIR makes every scrape see all of them."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


TRIAL_EMAILS_RESERVED = Counter(
    "progress_trial_email_reservations_total",
    "Trial-journey emails reserved by this process (its INSERT won the unique constraint); the relay publishes them.",
)
TRIAL_JOURNEY_SWEEPS = Counter(
    "progress_trial_journey_sweeps_total",
    "Periodic trial-journey sweeps, by outcome (done, failed, locked: another pod was sweeping).",
    ["outcome"],
)

# outbox relay (service.outbox): label outbox = completion | email
OUTBOX_PUBLISHED = Counter(
    "progress_outbox_published_total", "Outbox messages the broker acknowledged (republishes included).", ["outbox"]
)
OUTBOX_REPUBLISHED = Counter(
    "progress_outbox_republished_total",
    "Outbox messages published again, same task id, after a relay or batch died before marking them.",
    ["outbox"],
)
OUTBOX_FAILED = Counter(
    "progress_outbox_failed_total",
    "Outbox messages parked with publish_failed_at after OUTBOX_MAX_ATTEMPTS refusals (the log names each row).",
    ["outbox"],
)
OUTBOX_RETRIED = Counter(
    "progress_outbox_retried_total",
    "Outbox messages the broker refused, to be retried after a backoff (not parked yet).",
    ["outbox"],
)
OUTBOX_BROKER_UNAVAILABLE = Counter(
    "progress_outbox_broker_unavailable_total", "Relay batches stopped because the broker was unreachable.", ["outbox"]
)
OUTBOX_RELAY_ERRORS = Counter(
    "progress_outbox_relay_errors_total", "Relay passes ended by an unexpected error (a bug: see the log)."
)
OUTBOX_OLDEST_AGE = _gauge(
    "progress_outbox_oldest_unpublished_age_seconds",
    "Age of the oldest outbox row still owed to the broker.",
    ["outbox"],
)
# counted by every relay pass, next to the age above; every pod counts the same rows: max, not sum
OUTBOX_OWED = _gauge(
    "progress_outbox_owed_messages", "Outbox rows still owed to the broker (not published, not parked).", ["outbox"]
)
OUTBOX_PARKED = _gauge(
    "progress_outbox_parked_messages",
    "Outbox rows parked after OUTBOX_MAX_ATTEMPTS refusals, waiting for a re-drive.",
    ["outbox"],
)
