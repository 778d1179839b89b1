"""`progress-service status`: what the buffer, the outboxes and the stores hold now, on one screen.

Cheap to run against production and harmless to the service: Redis answers with set sizes (O(1)
each, one round trip per node); Postgres with counts over the outboxes' partial indexes and the
content tables' primary keys, each statement in a short read-only transaction of its own under a
statement_timeout and a lock_timeout, no row lock taken: neither the flush nor the relay ever
waits on it. A store that does not answer is reported, and whatever the other one says is still shown.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from service.config import Settings
from service.outbox.outboxes import COMPLETIONS, EMAILS, outbox_counts
from service.postgres import create_db_pool, local_timeouts_sql
from service.progress.content import CONTENT_KINDS
from service.progress.flush.backlog import measure_backlog
from service.progress.flush.redis_persistence import age_text, read_persistence, weakest
from service.progress.ingest.known_content import count_ids
from service.progress.ingest.redis_memory import memory_by_node, used_and_max
from service.progress.keys import KeyLayout
from service.redis_client import connect_redis
from service.stores import POSTGRES_BUSY, POSTGRES_FAILED, REDIS_FAILED

T = TypeVar("T")

STATEMENT_TIMEOUT_S = 5.0
# a migration holding a table's lock must not make status wait, nor queue the flush behind both
LOCK_TIMEOUT_S = 1.0
_LIMITS_SQL = local_timeouts_sql(statement_timeout_s=STATEMENT_TIMEOUT_S, lock_timeout_s=LOCK_TIMEOUT_S)

Report = dict[str, Any]


@dataclass
class Status:
    report: Report  # what `status --json` prints
    failures: list[str] = field(default_factory=list)  # one line per store that did not answer


async def gather_status(settings: Settings) -> Status:
    types = [kind.name for kind in CONTENT_KINDS]
    status = Status(
        {
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
            "buffer": {
                "pending": dict.fromkeys(types),
                "in_flight": dict.fromkeys(types),
                "in_flight_expired": dict.fromkeys(types),
                "oldest_claim_age_seconds": dict.fromkeys(types),
                "shards_per_type": KeyLayout.from_settings(settings.redis).shards,
            },
            "outbox": {
                outbox.name: {"owed": None, "parked": None, "oldest_owed_age_seconds": None}
                for outbox in (COMPLETIONS, EMAILS)
            },
            "redis": {"ok": False, "used_memory_bytes": None, "maxmemory_bytes": None, "persistence": None},
            "postgres": {"ok": False},
            "catalog": dict.fromkeys(types),
        }
    )
    await asyncio.gather(_read_redis(settings, status), _read_postgres(settings, status))
    return status


async def _read_redis(settings: Settings, status: Status) -> None:
    where = f"Redis{' Cluster' if settings.redis_cluster else ''} at {_address(settings.redis_url)}"
    buffer, memory = status.report["buffer"], status.report["redis"]
    redis = connect_redis(settings.redis)
    try:
        now_ms = time.time_ns() // 1_000_000
        backlog = await measure_backlog(redis, KeyLayout.from_settings(settings.redis), leases_at_ms=now_ms)
        if backlog.errors and not backlog.answered:
            raise backlog.errors[0]  # not one node answered: Redis is down, not partly
        lease_ms = settings.progress_flush_lease_seconds * 1000
        for content_type, sizes in backlog.by_type.items():
            if sizes.unread:
                continue  # unknown, not 0: the failure line says which store did not answer
            buffer["pending"][content_type] = sizes.pending
            buffer["in_flight"][content_type] = sizes.in_flight
            buffer["in_flight_expired"][content_type] = sizes.expired_leases
            if sizes.earliest_lease_ms is not None:
                claimed_ms = sizes.earliest_lease_ms - lease_ms
                buffer["oldest_claim_age_seconds"][content_type] = round(max(0.0, now_ms - claimed_ms) / 1000, 1)
        if backlog.errors:
            error = backlog.errors[0]
            status.failures.append(
                f"{where}: {len(backlog.errors)} of the buffer's reads failed, its counts are "
                f"partial ({type(error).__name__}: {error})"
            )
        nodes: dict[str, dict[str, Any]] = {
            name: dict(zip(("used_memory_bytes", "maxmemory_bytes"), used_and_max(info), strict=True))
            for name, info in (await memory_by_node(redis)).items()
        }
        memory["used_memory_bytes"] = sum(node["used_memory_bytes"] for node in nodes.values())
        memory["maxmemory_bytes"] = sum(node["maxmemory_bytes"] for node in nodes.values())
        # what a restart would lose: the weakest master's persistence, each master's mode beside its memory
        persistence = await read_persistence(redis)
        weakest_node, weakest_persistence = weakest(persistence)
        memory["persistence"] = weakest_persistence.as_json(settings.progress_flush_interval_seconds)
        if settings.redis_cluster:
            memory["persistence"]["node"] = weakest_node
            for name, node in nodes.items():
                node["persistence"] = persistence[name].mode if name in persistence else None
            memory["nodes"] = nodes
        memory["ok"] = not backlog.errors
    except REDIS_FAILED as exc:
        status.failures.append(f"{where} unavailable ({type(exc).__name__}: {exc})")
    finally:
        await redis.aclose()


async def _read_postgres(settings: Settings, status: Status) -> None:
    where = f"Postgres at {_address(settings.database_url)}"
    # one connection, whatever the pool size `serve` is given
    pool = await create_db_pool(settings.model_copy(update={"database_pool_max_size": 1}).database)
    try:
        async with pool.acquire() as conn:
            await conn.fetchval("SELECT 1")
            status.report["postgres"]["ok"] = True
            for outbox in (COMPLETIONS, EMAILS):
                counts = await _bounded(conn, status, f"the {outbox.name} outbox's counts", outbox_counts, outbox)
                if counts is not None:
                    age_s = counts.oldest_owed_age_s
                    status.report["outbox"][outbox.name] = {
                        "owed": counts.owed,
                        "parked": counts.parked,
                        "oldest_owed_age_seconds": None if age_s is None else round(age_s, 1),
                    }
            for kind in CONTENT_KINDS:
                status.report["catalog"][kind.name] = await _bounded(
                    conn, status, f"the {kind.name} catalog's size", count_ids, kind
                )
    except POSTGRES_FAILED as exc:
        reached = status.report["postgres"]["ok"]
        status.failures.append(
            f"{where} {'answered with an error' if reached else 'unavailable'} ({type(exc).__name__}: {exc})"
        )
    finally:
        await pool.close()


async def _bounded(
    conn: asyncpg.Connection, status: Status, what: str, read: Callable[..., Awaitable[T]], *args: object
) -> T | None:
    """`read` in a read-only transaction of its own, within the limits; None (and a failure) past them."""
    try:
        # SET LOCAL: the limits end with the transaction, so a pooled (PgBouncer) server connection keeps none
        async with conn.transaction(readonly=True):
            await conn.execute(_LIMITS_SQL)
            return await read(conn, *args)
    except POSTGRES_BUSY as exc:  # lock_timeout (a migration's lock?), statement_timeout, or an operator's cancel
        if isinstance(exc, asyncpg.LockNotAvailableError):
            why = f": waited {LOCK_TIMEOUT_S:g} s for a lock another session holds"
        else:
            why = f" within {STATEMENT_TIMEOUT_S:g} s"
        status.failures.append(f"Postgres: {what} not read{why} ({type(exc).__name__}: {exc})")
        return None


def _address(url: str) -> str:
    """host:port/db of a store's URL, never its password."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.hostname or '?'}{port}{parts.path if parts.path not in ('', '/') else ''}"


# --- the screen -----------------------------------------------------------------------------------------------


def render(report: Report) -> str:
    """The screen: aligned plain text; "?" where a store did not answer (the command says why on stderr)."""
    buffer, outboxes, redis = report["buffer"], report["outbox"], report["redis"]
    lines = [f"progress-service status at {report['time']}", ""]
    lines.append(f"{'Buffer':<14}{'pending':>12}{'in flight':>12}{'expired':>10}{'oldest claim':>15}")
    for content_type, pending in buffer["pending"].items():
        lines.append(
            f"  {content_type:<12}{_n(pending):>12}{_n(buffer['in_flight'][content_type]):>12}"
            f"{_n(buffer['in_flight_expired'][content_type]):>10}"
            f"{_age(buffer['oldest_claim_age_seconds'][content_type]):>15}"
        )
    lines.append(
        f"  {buffer['shards_per_type']} shard(s) per type; the oldest pending age is not known cheaply "
        "(a set keeps no order): see progress_flush_lag_seconds"
    )
    lines += ["", f"{'Outbox':<14}{'owed':>12}{'parked':>12}{'oldest owed':>15}"]
    for name, counts in outboxes.items():
        lines.append(
            f"  {name:<12}{_n(counts['owed']):>12}{_n(counts['parked']):>12}"
            f"{_age(counts['oldest_owed_age_seconds']):>15}"
        )
    memory = _memory(redis["used_memory_bytes"], redis["maxmemory_bytes"])
    if not redis["ok"]:
        memory = "NOT REACHABLE" if redis["used_memory_bytes"] is None else f"NOT OK (partly read): {memory}"
    lines += ["", f"{'Redis':<14}{memory}"]
    for name, node in redis.get("nodes", {}).items():
        lines.append(
            f"  {name:<22}{_memory(node['used_memory_bytes'], node['maxmemory_bytes'])}, {node['persistence']}"
        )
    persistence = redis["persistence"]
    if persistence is not None:
        where = f" on {persistence['node']}, the weakest master" if persistence.get("node") else ""
        read = " (INFO only: CONFIG refused)" if persistence["source"] == "info" else ""
        persistence = f"{persistence['mode']}{where}{read}: a restart loses {persistence['restart_loses']}"
    lines.append(f"{'Persistence':<14}{persistence or '?'}")
    lines.append(f"{'Postgres':<14}{'reachable' if report['postgres']['ok'] else 'NOT REACHABLE'}")
    catalog = "   ".join(f"{content_type} {_n(size)}" for content_type, size in report["catalog"].items())
    lines.append(f"{'Catalog':<14}{catalog}")
    return "\n".join(lines)


def _n(count: int | None) -> str:
    return "?" if count is None else f"{count:,}"


def _age(age_s: float | None) -> str:
    return "-" if age_s is None else age_text(age_s)


def _memory(used: int | None, maximum: int | None) -> str:
    if used is None:
        return "?"
    if not maximum:
        return f"used {_bytes(used)}, no maxmemory"
    return f"used {_bytes(used)} of {_bytes(maximum)} ({100 * used / maximum:.0f} %)"


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
