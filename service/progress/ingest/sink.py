"""Where a heartbeat goes: Redis normally; straight into Postgres while Redis cannot be reached.

Degraded mode keeps the 201's promise through a Redis outage: the flush's own statement (monotonic upsert,
completion, one event), dated by the database, within the write budget (budget.py) and DEGRADED_CONNECTIONS of the
pool. On a Redis Cluster only an unreachable master's slots come here.

A 503 means nothing was written, then or later: a heartbeat whose deadline passed before its statement starts is
left out, and the statement's deadline is its server-side statement_timeout (Postgres rolls it back). Once it runs,
the answer is its commit's outcome: late (a synchronous standby slow to confirm) is 201 late; a connection lost
during the commit is 201 or 503 as the database says (txid_status). Nothing is kept to be written later.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial

import asyncpg

from service import metrics
from service.config import DEGRADED_CONNECTIONS, DegradedSettings
from service.progress.batching import TurnBatcher, close_all
from service.progress.content import CONTENT_KINDS, ContentKind
from service.progress.flush.budget import FlushBudget
from service.progress.flush.store import Heartbeat, persist_batch, report_batch
from service.progress.ingest.buffer import PositionWriter
from service.progress.keys import pending_member
from service.stores import POSTGRES_FAILED, POSTGRES_UNAVAILABLE, REDIS_FAILED, pooled_connection

log = logging.getLogger(__name__)


# the client's wait for what the server bounds (statement_timeout) or only the database ends (a commit a standby
# holds): a client timeout would answer "not written" for a commit under way
_WAIT_S = 24 * 3600.0
_ASK_S = 2.0  # txid_status of a commit whose connection ended; past it (or unreachable) 503: see Known limits


class Unavailable(Exception):
    """Neither store can take the heartbeat now; the message says why (sent back with the 503)."""


@dataclass(slots=True)
class _Queued:
    heartbeat: Heartbeat
    deadline: float  # event-loop time past which its request answers 503: never written after it
    abandoned: bool = False  # its request went away (client gone): not written either


def _refused(why: str) -> Unavailable:
    return Unavailable(f"progress buffer unavailable and {why}, retry later")


_LATE = "the database did not take the write in time"


class DirectWriter:
    def __init__(self, pool: asyncpg.Pool, *, budget: FlushBudget, margin_s: float) -> None:
        self._pool = pool
        self._budget = budget
        self._margin_s = margin_s
        # the pool's share of degraded mode, per content type: a table a migration holds holds only its own type
        per_type = max(1, DEGRADED_CONNECTIONS // len(CONTENT_KINDS))
        self._statements = {kind.name: asyncio.Semaphore(per_type) for kind in CONTENT_KINDS}
        # a statement writes at most a batch of the budget (a second's worth), like the flush's: a turn of many
        # requests is not one burst of rows
        self._batchers: dict[str, TurnBatcher[_Queued]] = {
            kind.name: TurnBatcher(
                partial(self._send, kind),
                interrupted=lambda: Unavailable("write interrupted"),
                max_batch=budget.batch_rows,
            )
            for kind in CONTENT_KINDS
        }

    async def write(self, kind: ContentKind, heartbeat: Heartbeat, *, deadline: float) -> None:
        """Written when this returns; raises Unavailable (or a database error) when it was not, and never will be."""
        entry = _Queued(heartbeat, deadline)
        try:
            await self._batchers[kind.name].submit(entry)
        except asyncio.CancelledError:
            entry.abandoned = True
            raise

    async def _send(self, kind: ContentKind, entries: list[_Queued]) -> list[BaseException | None]:
        loop = asyncio.get_running_loop()
        deadline = min(entry.deadline for entry in entries)
        # the budget's rows within the deadline, or 503 at once: what waits is bounded by the budget itself
        reservation = await self._budget.reserve(len(entries), max_wait_s=deadline - loop.time())
        if reservation is None:
            return [_refused("the database's write budget is spent") for _ in entries]
        rows_written = 0
        try:
            async with asyncio.timeout_at(deadline):
                await self._statements[kind.name].acquire()
        except TimeoutError:
            await self._budget.refund(reservation, reservation.rows)
            return [_refused(_LATE) for _ in entries]
        try:
            # left out before the statement runs: their requests were (or are being) answered 503
            live = [i for i, entry in enumerate(entries) if not entry.abandoned and entry.deadline > loop.time()]
            if not live:
                return [_refused(_LATE) for _ in entries]
            # the deadline is the server's (statement_timeout, see _WAIT_S): past it Postgres rolls back
            async with pooled_connection(self._pool, timeout_s=max(deadline - loop.time(), 0.001)) as conn:
                timeout_ms = max(1, round((deadline - loop.time()) * 1000))
                await conn.execute(f"BEGIN; SET LOCAL statement_timeout = {timeout_ms}")
                try:
                    txid = await conn.fetchval("SELECT txid_current()")
                    heartbeats = [entries[i].heartbeat for i in live]
                    result = await persist_batch(conn, kind, heartbeats, margin_s=self._margin_s, timeout_s=_WAIT_S)
                except BaseException:
                    await asyncio.shield(conn.execute("ROLLBACK"))
                    raise
                try:
                    await conn.execute("COMMIT", timeout=_WAIT_S)
                except POSTGRES_UNAVAILABLE:  # the connection ended in the commit: did the database keep it?
                    async with pooled_connection(self._pool, timeout_s=_ASK_S) as asked:
                        if not await asked.fetchval("SELECT txid_status($1) = 'committed'", txid, timeout=_ASK_S):
                            raise
            # a row another session holds (progress, user or content row): that heartbeat alone is refused (503)
            rows_written, locked = result.written, set(result.locked)
            members = {i: pending_member(entries[i].heartbeat.content_id, entries[i].heartbeat.user_id) for i in live}
            written = {i for i, member in members.items() if member not in locked}
        finally:
            self._statements[kind.name].release()
            await asyncio.shield(self._budget.refund(reservation, reservation.rows - rows_written))
        metrics.DEGRADED_WRITES.labels(kind.name).inc(len(written))
        report_batch(kind, result)
        results: list[BaseException | None] = [_refused(_LATE) for _ in entries]
        for i in live:
            results[i] = _refused("a row of this heartbeat is locked by another session") if i not in written else None
        return results

    async def aclose(self) -> None:
        await close_all(self._batchers.values())


class HeartbeatSink:
    def __init__(
        self, settings: DegradedSettings, writer: PositionWriter, pool: asyncpg.Pool | None, budget: FlushBudget
    ) -> None:
        """Redis through `writer`; without a database (`pool` None), no degraded mode."""
        self._writer = writer
        self._direct = None if pool is None else DirectWriter(pool, budget=budget, margin_s=settings.margin_s)
        self._settings = settings
        # per Redis node ("" for a standalone server), monotonic; while in the future, skip that node
        # instead of waiting on it
        self._redis_down_until: dict[str, float] = {}
        self.degraded = False

    async def write(self, kind: ContentKind, *, content_id: int, user_id: int, position: float) -> None:
        node = self._writer.node_of(kind.name, content_id, user_id)
        if time.monotonic() >= self._redis_down_until.get(node, 0.0):
            try:
                await self._writer.write(
                    content_type=kind.name, content_id=content_id, user_id=user_id, position=position
                )
                if self._redis_down_until:
                    # a node whose retry time passed unused gets no heartbeats any more (its slots failed over to
                    # a replica under another name): it no longer holds the pod in degraded mode either
                    now = time.monotonic()
                    down = self._redis_down_until
                    self._redis_down_until = {name: t for name, t in down.items() if t > now and name != node}
                    if not self._redis_down_until and self.degraded:
                        self._set_degraded(False, "Redis answers again: normal mode")
                return
            except REDIS_FAILED as exc:
                metrics.REDIS_WRITE_ERRORS.labels(kind.name).inc()
                self._redis_down_until[node] = time.monotonic() + self._settings.redis_retry_s
                if not self.degraded:
                    self._set_degraded(
                        True,
                        f"Redis write failed ({type(exc).__name__}: {exc}): degraded mode, "
                        f"heartbeats {f'of node {node} ' if node else ''}go straight to Postgres",
                    )
        if self._direct is None:
            raise Unavailable("progress buffer unavailable and no database configured for degraded mode")
        # a deadline: a slow database must not hold the app's requests (and their sockets) open
        deadline = asyncio.get_running_loop().time() + self._settings.write_timeout_s
        try:
            await self._direct.write(
                kind, Heartbeat(content_id, user_id, position, None, peak=position), deadline=deadline
            )
        except POSTGRES_FAILED as exc:  # TimeoutError (the request's deadline) is among them
            raise Unavailable("progress buffer and database both unavailable, retry later") from exc

    @property
    def redis_writes_failing(self) -> bool:
        """A write to some Redis node failed within the retry interval. Not the sticky `degraded` flag:
        with no traffic that would never clear, and a pod reported unready gets no traffic to clear it."""
        now = time.monotonic()
        return any(until > now for until in self._redis_down_until.values())

    def _set_degraded(self, degraded: bool, message: str) -> None:
        self.degraded = degraded
        metrics.DEGRADED_MODE.set(1 if degraded else 0)
        log.log(logging.WARNING if degraded else logging.INFO, message)

    async def aclose(self) -> None:
        await self._writer.aclose()
        if self._direct is not None:
            await self._direct.aclose()
