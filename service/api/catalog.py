"""Known content at the door: a heartbeat for an id that does not exist is refused before any write.

A known id costs no round trip (a bisect in a sorted in-memory array). An unknown id is looked up once
per cache period, the lookup shared by every concurrent request naming it; a type's lookups go one query
at a time with every id waiting (a TurnBatcher), so a locked table holds one connection of its own type.
A lookup that fails or times out accepts its own id only (counted): an outage never costs a real heartbeat.
Content published since the last snapshot is found by its lookup at once; an "unknown" answer is kept at
most UNKNOWN_ANSWER_TTL_S, so content asked about just before it existed is found within about a second.
"""

import asyncio
import logging
import time
from array import array
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import asyncpg

from service import metrics
from service.loops import every
from service.progress.batching import TurnBatcher, close_all
from service.progress.content import CONTENT_KINDS, ContentKind
from service.stores import POSTGRES_FAILED

log = logging.getLogger(__name__)

# after a failed lookup, its id is accepted without asking for this long: an outage must not cost each of
# its heartbeats a connection attempt (other ids are still asked, a type's in one query at a time)
_DB_RETRY_S = 1.0
# a lesson asked about just before the monolith created it is not refused for the whole cache period
UNKNOWN_ANSWER_TTL_S = 1.0
# how often each pod reloads the known ids; a lesson created meanwhile is looked up on its first heartbeat
REFRESH_S = 60.0
# a lookup of an id outside the snapshot that takes longer accepts that id (only), unverified, for _DB_RETRY_S
LOOKUP_TIMEOUT_S = 1.0
# how long a "known" answer for an id outside the snapshot is reused (until the next snapshot has it)
ANSWER_TTL_S = 10.0


# The snapshot is read in pages by primary key (keyset pagination: each an index range scan, whatever the table's
# size), each page one array value, not one Record per id: memory while loading stays a page of Python ints, and
# the snapshot is a sorted array of 8-byte integers (1M ids: 8 MB).
_PAGE_SQL = """
SELECT coalesce(array_agg(id ORDER BY id), '{{}}')
FROM (SELECT id FROM {content_table} WHERE id > $1 ORDER BY id LIMIT $2) AS page
"""
# ids not in the snapshot (content published since the last refresh, or made up), a batch in one query
_EXISTING_SQL = "SELECT coalesce(array_agg(id), '{{}}') FROM {content_table} WHERE id = ANY($1::bigint[])"


async def load_ids(pool: asyncpg.Pool, kind: ContentKind, *, page_size: int = 100_000) -> "array[int]":
    """Every id of the kind's content table, ascending."""
    ids = array("q")
    after = -(2**63)
    while True:
        page = await pool.fetchval(_PAGE_SQL.format(content_table=kind.content_table), after, page_size)
        ids.extend(page)
        if len(page) < page_size:
            return ids
        after = page[-1]


async def existing(pool: asyncpg.Pool, kind: ContentKind, content_ids: list[int], *, timeout_s: float) -> set[int]:
    """Those of `content_ids` that exist."""
    return set(
        await pool.fetchval(_EXISTING_SQL.format(content_table=kind.content_table), content_ids, timeout=timeout_s)
    )


class LookupsSaturated(Exception):
    """Too many distinct unknown ids of a type wait for their lookup; the request may retry."""


@dataclass(slots=True)
class _Lookup:
    content_id: int
    known: bool = False


class ContentCatalog:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        # answers kept for ids outside the snapshot (~100 bytes each); distinct ids of a type waiting for (one) lookup
        max_answers: int = 100_000,
        max_lookups: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._max_answers = max_answers
        self._clock = clock
        self._known: dict[str, array[int]] = {}  # per content type, ascending; replaced whole by try_refresh()
        # recent answers for ids not in the snapshot: (known, valid until), known None when the lookup failed (the
        # id accepted unverified); the oldest inserted go first
        self._answers: dict[tuple[str, int], tuple[bool | None, float]] = {}
        self._lookups: dict[tuple[str, int], asyncio.Task[bool | None]] = {}
        self._batchers: dict[str, TurnBatcher[_Lookup]] = {
            kind.name: TurnBatcher(
                partial(self._send, kind),
                interrupted=lambda: ConnectionError("the lookup was interrupted"),
                max_in_flight=1,
                max_batch=max_lookups,
                max_waiting=max_lookups,
                # a backstop: each lookup's own deadline (_query) ends its wait first
                max_wait_s=2 * LOOKUP_TIMEOUT_S,
                overloaded=lambda why: LookupsSaturated(f"content lookups waiting: {why}"),
            )
            for kind in CONTENT_KINDS
        }
        self._failure_logged_until = 0.0  # one line per _DB_RETRY_S: an outage fails every unknown id's lookup

    def is_known(self, kind: ContentKind, content_id: int) -> bool | Awaitable[bool]:
        """A bool when memory knows the answer (the hot path: no await), else an awaitable lookup."""
        ids = self._known.get(kind.name)
        if ids is not None:
            i = bisect_left(ids, content_id)
            if i < len(ids) and ids[i] == content_id:
                return True
        answer = self._answers.get((kind.name, content_id))
        if answer is not None and answer[1] > self._clock():
            return self._accept_unverified(kind) if answer[0] is None else answer[0]
        return self._look_up(kind, content_id)

    async def _look_up(self, kind: ContentKind, content_id: int) -> bool:
        key = (kind.name, content_id)
        task = self._lookups.get(key)
        if task is None:
            task = asyncio.create_task(self._query(kind, content_id), name=f"catalog-lookup-{kind.name}")
            # the handle lives in _lookups until the query ends; every waiter awaits it
            self._lookups[key] = task
            task.add_done_callback(lambda _: self._lookups.pop(key, None))
        # shielded: a waiter whose client hung up must not cancel the query the others share
        known = await asyncio.shield(task)
        return self._accept_unverified(kind) if known is None else known

    async def _query(self, kind: ContentKind, content_id: int) -> bool | None:
        """The answer, cached; None when Postgres could not answer (that id is then accepted for _DB_RETRY_S)."""
        key = (kind.name, content_id)
        lookup = _Lookup(content_id)
        try:
            # the wait for the type's query included: a locked table holds no request longer than this
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                await self._batchers[kind.name].submit(lookup)
        except POSTGRES_FAILED as exc:
            self._remember(key, None, _DB_RETRY_S)
            if self._clock() >= self._failure_logged_until:
                self._failure_logged_until = self._clock() + _DB_RETRY_S
                log.warning(
                    "content lookup failed (%s: %s): %s %d accepted unverified",
                    type(exc).__name__,
                    exc,
                    kind.name,
                    content_id,
                    extra={"content_type": kind.name},
                )
            return None
        known = lookup.known
        self._remember(key, known, ANSWER_TTL_S if known else UNKNOWN_ANSWER_TTL_S)
        return known

    async def _send(self, kind: ContentKind, lookups: list[_Lookup]) -> list[BaseException | None]:
        found = await existing(self._pool, kind, [lookup.content_id for lookup in lookups], timeout_s=LOOKUP_TIMEOUT_S)
        for lookup in lookups:
            lookup.known = lookup.content_id in found
        return [None] * len(lookups)

    def _remember(self, key: tuple[str, int], known: bool | None, ttl_s: float) -> None:
        self._answers.pop(key, None)  # re-inserted at the end: the newest answer goes last
        while len(self._answers) >= self._max_answers:
            del self._answers[next(iter(self._answers))]
        self._answers[key] = (known, self._clock() + ttl_s)

    def _accept_unverified(self, kind: ContentKind) -> bool:
        metrics.CATALOG_UNVERIFIED.labels(kind.name).inc()
        return True

    def snapshot_bytes(self) -> int:
        return sum(ids.itemsize * len(ids) for ids in self._known.values())

    async def try_refresh(self) -> bool:
        """Replace the snapshot of every content type; on a database error the previous one stays."""
        try:
            known = {kind.name: await load_ids(self._pool, kind) for kind in CONTENT_KINDS}
        except POSTGRES_FAILED as exc:
            # until a load succeeds, ids outside the last snapshot are looked up one by one
            log.warning("content catalog refresh failed (%s: %s); keeping the last snapshot", type(exc).__name__, exc)
            return False
        self._known = known
        for name, ids in known.items():
            metrics.CATALOG_KNOWN_IDS.labels(name).set(len(ids))
        metrics.CATALOG_LAST_REFRESH.set_to_current_time()
        return True

    async def run_refresh(self, stop: asyncio.Event, interval_s: float) -> None:
        """Refresh every interval until `stop` (the lifespan did the first load)."""
        await every(interval_s, stop, self.try_refresh, name="content catalog refresh", wait_first=True, logger=log)

    async def aclose(self) -> None:
        for task in list(self._lookups.values()):
            task.cancel()
        await asyncio.gather(*self._lookups.values(), return_exceptions=True)
        await close_all(self._batchers.values())
