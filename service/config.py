"""All configuration, read once from the environment and validated at start-up (meanings: docs/configuration.md)."""

import logging
import os
import socket
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

# Environment variables the service no longer reads -> what replaced each. A deployment that still sets
# one starts as before, with one warning line for it at start-up (load_settings).
REMOVED_SETTINGS: dict[str, str] = {
    "RATE_LIMIT_PER_USER_PER_SECOND": "a per-user or per-IP limit at the API gateway (docs/deploy.md)",
    "RATE_LIMIT_BURST": "a per-user or per-IP limit at the API gateway (docs/deploy.md)",
    "SYNC_ITEMS_PER_USER_PER_SECOND": "a per-user or per-IP limit at the API gateway (docs/deploy.md)",
    "SYNC_ITEMS_BURST": "a per-user or per-IP limit at the API gateway (docs/deploy.md)",
    "REDIS_WAIT_REPLICAS": "nothing: Redis durability is the deployment's (AOF on each master; docs/deploy.md)",
    "REDIS_WAIT_TIMEOUT_MS": "nothing: Redis durability is the deployment's (AOF on each master; docs/deploy.md)",
    "PROGRESS_MAX_CLOCK_SKEW_SECONDS": "nothing: Redis's TIME stamps heartbeats and leases, no pod's clock",
    "DEGRADED_MAX_WAITING": (
        "the write budget's per-pod share (PROGRESS_FLEET_MAX_PODS) within DEGRADED_WRITE_TIMEOUT_SECONDS"
    ),
    "REDIS_MAX_CONNECTIONS": "a constant (64 per process)",
    "DATABASE_POOL_MIN_SIZE": "a constant (0: a pod starts while Postgres is down)",
    "DATABASE_POOL_ACQUIRE_TIMEOUT_SECONDS": "a constant (5 s; reads and syncs 1 s, degraded mode its deadline)",
    "DATABASE_COMMAND_TIMEOUT_SECONDS": "DATABASE_STATEMENT_TIMEOUT_SECONDS (the client's own is a constant, 30 s)",
    "DATABASE_CONNECT_TIMEOUT_SECONDS": "a constant (10 s per new connection)",
    "MAX_BODY_BYTES": "a constant (4096: a heartbeat is under 200 bytes)",
    "BODY_READ_TIMEOUT_SECONDS": "a constant (10 s, then 408)",
    "CONTENT_CATALOG_REFRESH_SECONDS": "a constant (60 s)",
    "CONTENT_CATALOG_LOOKUP_TIMEOUT_SECONDS": "a constant (1 s)",
    "CONTENT_CATALOG_CACHE_SECONDS": "a constant (10 s)",
    "PROGRESS_READ_BATCHES_IN_FLIGHT": "a constant (one batch per content type; DATABASE_POOL_MAX_SIZE)",
    "SYNC_MAX_BODY_BYTES": "a constant (256 KiB: 500 items take about 60 KiB)",
    "SYNC_MAX_CLOCK_SKEW_SECONDS": "a constant (300 s)",
    "SYNC_MAX_BACKDATE_HOURS": "a constant (6 h)",
    "SYNC_MAX_CONCURRENCY": "a constant (2 per process; DATABASE_POOL_MAX_SIZE)",
    "DEGRADED_MAX_CONCURRENCY": "a constant (4 per process; DATABASE_POOL_MAX_SIZE)",
    "JOURNEY_BATCH_SIZE": "a constant (200)",
    "RESERVATION_BLOCK_SIZE": "a constant (200)",
    "RELAY_BATCH_SIZE": "a constant (500)",
    "OUTBOX_RETRY_BACKOFF_SECONDS": "a constant (45 s, doubling; OUTBOX_MAX_ATTEMPTS bounds the retries)",
}

# The pool's shares (check_can_serve), constants: the pool's size is the operator's one number.
# GET /progress reads each content type in a lane of its own, one connection each: a locked table holds one only
READ_LANES = 4
SYNC_CONNECTIONS = 2  # POST /progress/sync reading Postgres at once per process
DEGRADED_CONNECTIONS = 4  # direct-to-Postgres statements at once while Redis is down (the budget's rows either way)


class ConfigError(Exception):
    """The environment does not describe a service that can start; the message says what to set."""


G = TypeVar("G", bound="DataclassInstance")


class _Group(Generic[G]):
    """`Settings.<group>`: the dataclass `group`, each field read from the attribute of Settings its metadata names."""

    def __init__(self, group: type[G]) -> None:
        self.group = group

    def __get__(self, settings: object, owner: object = None) -> G:
        return self.group(**{f.name: getattr(settings, f.metadata["setting"]) for f in fields(self.group)})


# Each part is built from the group of its subsystem (Settings.redis, .database, ...), never from the whole
# Settings; the environment's names stay the flat fields of Settings, and each group field names the one it reads.
@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str = field(metadata={"setting": "redis_url"})
    cluster: bool = field(metadata={"setting": "redis_cluster"})
    socket_timeout_s: float = field(metadata={"setting": "redis_socket_timeout_seconds"})
    client_name: str = field(metadata={"setting": "redis_client_name"})
    shards: int = field(metadata={"setting": "progress_buffer_shards"})  # the buffer's layout (progress/keys.py)
    previous_shards: int = field(metadata={"setting": "progress_buffer_previous_shards"})


@dataclass(frozen=True, slots=True)
class DatabaseSettings:
    url: str = field(metadata={"setting": "database_url"})
    pool_max_size: int = field(metadata={"setting": "database_pool_max_size"})
    statement_cache_size: int = field(metadata={"setting": "database_statement_cache_size"})
    statement_timeout_s: float = field(metadata={"setting": "database_statement_timeout_seconds"})
    lock_timeout_s: float = field(metadata={"setting": "database_lock_timeout_seconds"})
    timeouts_at_connect: bool = field(metadata={"setting": "database_timeouts_at_connect"})


@dataclass(frozen=True, slots=True)
class AuthSettings:
    mode: str = field(metadata={"setting": "auth_mode"})
    gateway_header: str = field(metadata={"setting": "auth_gateway_header"})
    secret: str = field(metadata={"setting": "jwt_secret"})
    previous_secrets: str = field(metadata={"setting": "jwt_previous_secrets"})  # comma-separated
    public_key: str = field(metadata={"setting": "jwt_public_key"})  # PEM blocks, the current one first
    algorithms: str = field(metadata={"setting": "jwt_algorithms"})  # comma-separated
    user_id_claim: str = field(metadata={"setting": "jwt_user_id_claim"})
    audience: str = field(metadata={"setting": "jwt_audience"})
    issuer: str = field(metadata={"setting": "jwt_issuer"})


@dataclass(frozen=True, slots=True)
class FlushSettings:
    buffer: RedisSettings = field(metadata={"setting": "redis"})
    interval_s: float = field(metadata={"setting": "progress_flush_interval_seconds"})
    batch_size: int = field(metadata={"setting": "progress_flush_batch_size"})
    lease_s: float = field(metadata={"setting": "progress_flush_lease_seconds"})
    concurrency: int = field(metadata={"setting": "progress_flush_concurrency"})
    max_rows_per_second: int = field(metadata={"setting": "progress_flush_max_rows_per_second"})
    fleet_max_pods: int = field(metadata={"setting": "progress_fleet_max_pods"})
    margin_s: float = field(metadata={"setting": "progress_completion_margin_seconds"})
    shutdown_timeout_s: float = field(metadata={"setting": "progress_shutdown_timeout_seconds"})
    value_ttl_s: int = field(metadata={"setting": "progress_position_ttl_seconds"})
    statement_timeout_s: float = field(metadata={"setting": "database_statement_timeout_seconds"})
    lock_timeout_s: float = field(metadata={"setting": "database_lock_timeout_seconds"})


@dataclass(frozen=True, slots=True)
class DegradedSettings:
    write_timeout_s: float = field(metadata={"setting": "degraded_write_timeout_seconds"})
    redis_retry_s: float = field(metadata={"setting": "degraded_redis_retry_seconds"})
    margin_s: float = field(metadata={"setting": "progress_completion_margin_seconds"})


@dataclass(frozen=True, slots=True)
class RelaySettings:
    broker_url: str = field(metadata={"setting": "celery_broker_url"})
    broker_transport_options: dict[str, Any] = field(metadata={"setting": "celery_broker_transport_options"})
    publish_timeout_s: float = field(metadata={"setting": "celery_publish_timeout_seconds"})
    lease_s: float = field(metadata={"setting": "relay_lease_seconds"})
    poll_s: float = field(metadata={"setting": "relay_poll_interval_seconds"})
    max_backoff_s: float = field(metadata={"setting": "relay_max_backoff_seconds"})
    max_attempts: int = field(metadata={"setting": "outbox_max_attempts"})
    listen_dsn: str = field(metadata={"setting": "relay_listen_dsn"})  # empty: poll only
    statement_timeout_s: float = field(metadata={"setting": "database_statement_timeout_seconds"})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=None, extra="ignore", case_sensitive=False)

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_socket_timeout_seconds: float = Field(2.0, gt=0)
    redis_cluster: bool = False
    progress_buffer_shards: int = Field(0, ge=0, le=256)  # 0: 1 on a standalone server, 60 on a cluster
    progress_buffer_previous_shards: int = Field(0, ge=0, le=256)
    database_url: str = ""
    database_pool_max_size: int = Field(20, ge=1)
    database_statement_cache_size: int = Field(100, ge=0)  # 0 behind PgBouncer in transaction mode
    # a statement queued behind a migration's lock gives up instead of queueing the monolith's behind it
    database_statement_timeout_seconds: float = Field(10.0, ge=0)
    database_lock_timeout_seconds: float = Field(2.0, ge=0)
    # PgBouncer refuses startup parameters: set on the role there; the flush's statement sets them either way
    database_timeouts_at_connect: bool = True

    auth_mode: Literal["jwt", "gateway"] = "jwt"
    auth_gateway_header: str = "X-User-Id"
    jwt_secret: str = ""
    jwt_previous_secrets: str = ""
    jwt_public_key: str = ""
    jwt_algorithms: str = "HS256"
    jwt_user_id_claim: str = "user_id"
    jwt_audience: str = ""
    jwt_issuer: str = ""

    # at least the time the load balancer takes to see the pod down (service/serving.py)
    shutdown_drain_seconds: float = Field(5.0, ge=0, le=300)
    # above every proxy's idle timeout (ALB and nginx 60 s): the proxy closes first, never sends on a closing one
    http_keep_alive_timeout_seconds: int = Field(75, ge=1, le=3600)

    content_catalog_enabled: bool = True
    progress_position_ttl_seconds: int = Field(3600, ge=60)
    progress_flusher_enabled: bool = True
    progress_flush_interval_seconds: float = Field(60.0, gt=0)
    progress_flush_batch_size: int = Field(500, ge=1, le=10_000)
    progress_flush_lease_seconds: float = Field(120.0, gt=0)
    progress_flush_concurrency: int = Field(4, ge=1)
    progress_flush_max_rows_per_second: int = Field(5000, ge=0)  # the whole fleet's, shared through Redis
    # the HPA's maxReplicas: while Redis cannot be reached, each pod keeps to the budget / this
    progress_fleet_max_pods: int = Field(10, ge=1)
    progress_completion_margin_seconds: float = Field(10.0, ge=0)
    progress_shutdown_timeout_seconds: float = Field(20.0, gt=0)

    degraded_redis_retry_seconds: float = Field(1.0, gt=0)
    degraded_write_timeout_seconds: float = Field(5.0, gt=0)

    send_email: bool = True
    email_queue_stream: str = "emails:trial_journey"
    trial_journey_interval_seconds: float = Field(3600.0, ge=0)
    email_publisher: Literal["celery", "redis-stream"] = "celery"

    celery_broker_url: str = ""
    celery_broker_transport_options: dict[str, Any] = Field(default_factory=dict)  # JSON
    completion_task_name: str = "apps.engagements.tasks.advance_user_journey"
    completion_task_queue: str = "onion-progress"
    email_task_name: str = "apps.emails.tasks.send_email"
    email_task_queue: str = "emails"
    celery_publish_timeout_seconds: float = Field(10.0, gt=0)

    relay_enabled: bool = True
    relay_poll_interval_seconds: float = Field(5.0, gt=0)
    relay_lease_seconds: float = Field(60.0, gt=0)
    relay_max_backoff_seconds: float = Field(30.0, gt=0)
    # retried after 45 s, 90 s, 3 min, ... (doubling): 12 refusals span about 25 h, Sidekiq's retry-then-dead
    outbox_max_attempts: int = Field(12, ge=1, le=40)
    # LISTEN needs a real session: behind PgBouncer in transaction mode name the primary here
    relay_listen: bool = True
    relay_listen_database_url: str = ""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    pod_name: str = Field(default_factory=socket.gethostname)

    @model_validator(mode="after")
    def _durations_agree(self) -> "Settings":
        if self.relay_lease_seconds <= self.celery_publish_timeout_seconds:
            # a lease shorter than a publish would let a second relay republish a batch in flight
            raise ValueError("RELAY_LEASE_SECONDS must be > CELERY_PUBLISH_TIMEOUT_SECONDS")
        # A pending value has no TTL, but an older release's pods (a rolling deploy) write values that expire from
        # their write: one waits up to an interval for its claim, and a lease if its flusher is killed holding it.
        floor_s = max(self.progress_flush_lease_seconds, self.progress_flush_interval_seconds)
        if self.progress_position_ttl_seconds < floor_s:
            raise ValueError(
                f"PROGRESS_POSITION_TTL_SECONDS ({self.progress_position_ttl_seconds}) must be at least "
                f"PROGRESS_FLUSH_LEASE_SECONDS ({self.progress_flush_lease_seconds:g}) and "
                f"PROGRESS_FLUSH_INTERVAL_SECONDS ({self.progress_flush_interval_seconds:g}): a position "
                "buffered under a shorter TTL (by a pod of an older release) would expire before a flush "
                "reached it, or before a flusher that died holding it is replaced"
            )
        return self

    redis: ClassVar[_Group[RedisSettings]] = _Group(RedisSettings)
    database: ClassVar[_Group[DatabaseSettings]] = _Group(DatabaseSettings)
    auth: ClassVar[_Group[AuthSettings]] = _Group(AuthSettings)
    flush: ClassVar[_Group[FlushSettings]] = _Group(FlushSettings)
    degraded: ClassVar[_Group[DegradedSettings]] = _Group(DegradedSettings)
    relay: ClassVar[_Group[RelaySettings]] = _Group(RelaySettings)

    @property
    def redis_client_name(self) -> str:
        return f"progress-service:{self.pod_name}"

    @property
    def relay_listen_dsn(self) -> str:
        return (self.relay_listen_database_url or self.database_url) if self.relay_listen else ""

    def check_can_serve(self) -> None:
        """Refuse a configuration that would start but answer every heartbeat wrongly. The token keys and the
        broker's transport are checked beside their parts (service/compose.py check_startup)."""
        if self.redis_cluster and urlsplit(self.redis_url).path.strip("/") not in ("", "0"):
            raise ConfigError("REDIS_CLUSTER=true: a cluster has only database 0; end REDIS_URL with /0 or nothing")
        if self.progress_flusher_enabled and not self.database_url:
            raise ConfigError(
                "the flusher needs DATABASE_URL (postgresql://...); "
                "for an API-only pod set PROGRESS_FLUSHER_ENABLED=false"
            )
        if self.content_catalog_enabled and not self.database_url:
            raise ConfigError(
                "the content catalog (404 for unknown content) needs DATABASE_URL; "
                "for an API-only pod without a database set CONTENT_CATALOG_ENABLED=false"
            )
        # a process that would owe the monolith messages it has no broker to send
        owes_messages = self.database_url and (self.relay_enabled or self.trial_journey_interval_seconds > 0)
        no_broker = owes_messages and not self.celery_broker_url
        if no_broker and self.email_publisher == "celery":
            raise ConfigError(
                "EMAIL_PUBLISHER=celery needs CELERY_BROKER_URL (the monolith's broker: sqs://, redis:// or "
                "amqp://); or set EMAIL_PUBLISHER=redis-stream"
            )
        if no_broker and self.relay_enabled:
            raise ConfigError(
                "RELAY_ENABLED=true needs CELERY_BROKER_URL (the monolith's broker: sqs://, redis:// or amqp://) "
                "to deliver completions; or set RELAY_ENABLED=false where another process runs the relay"
            )
        if not self.database_url:
            return
        # The pool holds every part's connections at once, so none waits on another's: the reads and the
        # syncs (bounded in-process) can never take the connections the flush and degraded mode need.
        shares = {
            "PROGRESS_FLUSH_CONCURRENCY": self.progress_flush_concurrency if self.progress_flusher_enabled else 0,
            "degraded mode": DEGRADED_CONNECTIONS,
            "the reads": READ_LANES,
            "the syncs": SYNC_CONNECTIONS,
            "the catalog's lookups (one per type)": READ_LANES if self.content_catalog_enabled else 0,
        }
        # the relay, the trial-journey sweep, the catalog's snapshot and the probes share what is left
        needed = sum(shares.values()) + 1
        if self.database_pool_max_size < needed:
            parts = " + ".join(f"{name} ({count})" for name, count in shares.items() if count)
            raise ConfigError(
                f"DATABASE_POOL_MAX_SIZE={self.database_pool_max_size} is too small: {parts} connections may be "
                f"held at once, and the relay, the email sweep, the catalog and the probes need at least one more; "
                f"set DATABASE_POOL_MAX_SIZE to {needed} or more, or lower PROGRESS_FLUSH_CONCURRENCY"
            )


# what this process has warned of already: `serve` loads the settings twice (its own, then the app's)
_warned_removed: set[str] = set()


def load_settings() -> Settings:
    """The settings of the environment, and one warning per removed variable it still sets."""
    set_names = {name.upper() for name in os.environ}
    for name, replacement in REMOVED_SETTINGS.items():
        if name in set_names and name not in _warned_removed:
            _warned_removed.add(name)
            log.warning("%s is no longer read (ignored): %s replaces it", name, replacement)
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']).upper() or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None
