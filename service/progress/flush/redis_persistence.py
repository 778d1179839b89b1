"""What a Redis restart would lose, said by Redis itself: at start (a log line), in `status`, as a metric.

Between two flushes the buffer holds the only copy of every position acknowledged since the last one. With AOF
and `appendfsync everysec`, a restart loses about the last second of them; with RDB snapshots only, whatever was
written since the last save; with neither, everything not yet flushed, the final positions of sessions included:
no next heartbeat brings those back. `CONFIG GET` says how Redis is set up. Managed Redis (ElastiCache,
Memorystore) refuses CONFIG, so `INFO persistence` is the fallback: it shows whether AOF is on and whether a save
ran since the server started, not the fsync policy nor a save schedule that has not fired yet. On a cluster every
master is read and the weakest is the one reported.
"""

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Literal, get_args

from redis.exceptions import ResponseError

from service import metrics
from service.loops import sample_every
from service.redis_client import RedisClient, on_each_master
from service.stores import REDIS_FAILED

log = logging.getLogger(__name__)

Mode = Literal["aof", "rdb", "none", "unknown"]
# weakest first: what one master forgets is lost whatever the others keep
_STRENGTH: dict[Mode, int] = {"none": 0, "unknown": 1, "rdb": 2, "aof": 3}


@dataclass(frozen=True, slots=True)
class Persistence:
    mode: Mode
    source: Literal["config", "info", "none"]  # what answered: CONFIG GET, INFO persistence only, or neither
    appendfsync: str | None = None  # AOF's fsync policy (CONFIG only)
    save: str | None = None  # the RDB schedule, e.g. "3600 1 300 100" (CONFIG only)
    last_save_age_s: float | None = None  # since the last successful RDB save
    changes_since_save: int | None = None

    def restart_loses(self, flush_interval_s: float) -> str:
        """What a restart of this Redis would lose, in words for an operator."""
        if self.mode == "aof":
            return {
                "always": "nothing acknowledged (AOF, appendfsync always)",
                "everysec": "about the last second of heartbeats (AOF, appendfsync everysec)",
                "no": "the heartbeats the OS had not written out yet, up to about 30 s (AOF, appendfsync no)",
            }.get(
                self.appendfsync or "",
                "about the last second of heartbeats if appendfsync is everysec (AOF on; its policy is unreadable)",
            )
        if self.mode == "rdb":
            since = "" if self.last_save_age_s is None else f" ({age_text(self.last_save_age_s)} ago"
            since += "" if self.changes_since_save is None else f", {self.changes_since_save:,} changes since)"
            schedule = f"; schedule: save {self.save}" if self.save else ""
            return f"every heartbeat written since the last RDB save{since}{schedule}"
        if self.mode == "none":
            return (
                f"every position not yet flushed to Postgres, up to one flush interval ({flush_interval_s:g} s), "
                "the final positions of sessions included (no persistence: no AOF, no RDB save)"
            )
        return "unknown: Redis answered neither CONFIG GET nor INFO persistence"

    def as_json(self, flush_interval_s: float) -> dict[str, Any]:
        return {**asdict(self), "restart_loses": self.restart_loses(flush_interval_s)}


async def read_persistence(redis: RedisClient) -> dict[str, Persistence]:
    """Each master's persistence by node name ("" on a standalone server)."""
    return await on_each_master(redis, partial(_read_node, redis))


def weakest(by_node: dict[str, Persistence]) -> tuple[str, Persistence]:
    return min(by_node.items(), key=lambda item: _STRENGTH[item[1].mode])


async def _read_node(redis: RedisClient, target: dict[str, Any]) -> Persistence:
    try:
        info: dict[str, Any] = await redis.info("persistence", **target)
    except ResponseError:
        info = {}
    try:
        config = {**await redis.config_get("append*", **target), **await redis.config_get("save", **target)}
    except ResponseError:  # CONFIG renamed away or refused by ACL (managed Redis): INFO is all there is
        if not info:
            return Persistence("unknown", "none")
        if int(info.get("aof_enabled", 0)):
            return Persistence("aof", "info")
        # a save since the server started (by a schedule or by the provider's backups); without CONFIG, a schedule
        # that has not fired yet cannot be told from none
        if int(info.get("rdb_saves", 0)) or int(info.get("rdb_last_bgsave_time_sec", -1)) >= 0:
            return Persistence("rdb", "info", **_rdb_facts(info))
        return Persistence("none", "info")
    settings = {_text(name): _text(value) for name, value in config.items()}
    if settings.get("appendonly") == "yes":
        return Persistence("aof", "config", appendfsync=settings.get("appendfsync"))
    if settings.get("save", "").strip():
        return Persistence("rdb", "config", save=settings["save"].strip(), **_rdb_facts(info))
    return Persistence("none", "config")


def _rdb_facts(info: dict[str, Any]) -> dict[str, Any]:
    if "rdb_last_save_time" not in info:
        return {}
    return {
        "last_save_age_s": round(max(0.0, time.time() - int(info["rdb_last_save_time"])), 1),
        "changes_since_save": int(info.get("rdb_changes_since_last_save", 0)),
    }


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def age_text(seconds: float) -> str:
    """An age as an operator reads it: seconds, minutes, then hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


async def run_redis_persistence_sampler(
    redis: RedisClient, stop: asyncio.Event, *, flush_interval_s: float, interval_s: float = 60.0
) -> None:
    """Off the request path: read at start and every interval until `stop`; a log line at the first reading and at
    every change, a warning when a restart would lose more than the last second."""
    told: list[tuple[object, ...]] = []  # what the last line said: mode, fsync policy, schedule, source

    async def sample() -> None:
        node, persistence = weakest(await read_persistence(redis))
        for mode in get_args(Mode):
            metrics.REDIS_PERSISTENCE.labels(mode).set(1 if mode == persistence.mode else 0)
        said = (persistence.mode, persistence.appendfsync, persistence.save, persistence.source)
        if said not in told:
            level = logging.INFO if persistence.mode == "aof" else logging.WARNING
            where = f" (master {node}, the weakest)" if node else ""
            log.log(
                level,
                "Redis persistence%s: %s, read from %s; a Redis restart would lose %s",
                where,
                persistence.mode,
                persistence.source,
                persistence.restart_loses(flush_interval_s),
            )
            told[:] = [said]

    await sample_every(interval_s, stop, sample, name="Redis persistence sample", unavailable=REDIS_FAILED, logger=log)
