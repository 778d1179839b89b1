"""Reading progress back at its freshest: the buffered value when it is newer than the row.

A read costs one Redis MGET of the value keys and one query of the rows, whatever the number of ids; the reads
of one type in one event-loop turn share both (TurnBatcher). The answer is what the next flush will leave in
Postgres, before it runs:
- the position and `updated_at` of the buffered value when it was received after the row's `updated_at` (the
  upsert only moves forward the same way), else the row's;
- `completed_at`: the row's, or, when the buffered peak reached `duration - margin` and the row has none yet,
  the buffered value's receive time, or its completion floor when later;
- nothing for content or a user the database does not have: the flush drops those values.
While the shard count changes, the MGET names each value key of both layouts, and the newer value stands.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from itertools import islice
from typing import TypeAlias, TypeVar

import asyncpg
import msgspec
from redis.exceptions import RedisError

from service.postgres import fetch_on, fetch_stateless, release_stateless
from service.progress.batching import TurnBatcher, close_all
from service.progress.completion import completes
from service.progress.content import CONTENT_KINDS, EPOCH, ContentKind
from service.progress.ingest.buffer import decode_value
from service.progress.keys import STANDALONE, KeyLayout
from service.redis_client import RedisClient, get_many
from service.stores import give_back

_ONE_US = timedelta(microseconds=1)
Q = TypeVar("Q")
R = TypeVar("R")

# Plain tuples, not NamedTuples: a read of 100 ids builds 100 of each, and a NamedTuple's __new__ costs
# several times a tuple's. Times are whole microseconds since the epoch (exact: the rows and the buffer
# both keep microseconds), so comparing them costs nothing and the answer's text is made from them once.
StoredRows: TypeAlias = tuple[list[int | None], list[float | None], list[int | None], list[int | None]]
"""What Postgres knows of the asked (user, content) pairs, a list per field, an entry per pair in their order: the
content's duration (s), None when the user or the content does not exist; then the progress row's position,
updated_at and completed_at (µs since the epoch), or Nones when there is no row."""
Buffered: TypeAlias = tuple[float, int, float, int | None]
"""A buffered value as decode_value reads it: position, receive time (µs since the epoch), peak, and an offline
item's completion floor (µs) or None."""
Progress: TypeAlias = tuple[int, float, int, int | None]
"""What a read answers for one id: content_id, position, updated_at and completed_at (or None), the times
in µs since the epoch, UTC."""


# The rows of the asked (user, content) pairs as one row of four arrays, each in the order asked (a pair asked twice,
# twice): zipped with the buffered values of the same pairs, no lookup by key, and four lists asyncpg decodes in C
# rather than a Record per pair. A user or content that does not exist reads as a NULL duration (the column is NOT
# NULL): the flush drops a value for either, so it is not progress to show. The content's duration comes along to
# judge a completion not flushed yet. The times come as int8 µs since the epoch, exact (timestamptz keeps µs;
# extract() is numeric from PostgreSQL 14 on, and before it a float8 whose error the cast's rounding absorbs for
# any date this service writes): no datetime to build per field. The ids come as JSON arrays of digits ([1,2,3]).
_ROWS_SQL = """
SELECT array_agg(c.duration ORDER BY q.at), array_agg(p.position ORDER BY q.at),
       array_agg((extract(epoch FROM p.updated_at) * 1000000)::int8 ORDER BY q.at),
       array_agg((extract(epoch FROM p.completed_at) * 1000000)::int8 ORDER BY q.at)
FROM unnest(string_to_array(btrim($1, '[]'), ',')::bigint[], string_to_array(btrim($2, '[]'), ',')::bigint[])
     WITH ORDINALITY AS q(user_id, content_id, at)
LEFT JOIN users_user u ON u.id = q.user_id
LEFT JOIN {content_table} c ON c.id = q.content_id AND u.id IS NOT NULL
LEFT JOIN {progress_table} p ON p.user_id = q.user_id AND p.{id_column} = q.content_id
"""
_IDS = msgspec.json.Encoder()  # a list of ints as [1,2,3]: one C call, where str() of each costs 100 ns


def rows_sql(kind: ContentKind) -> str:
    return _ROWS_SQL.format(
        content_table=kind.content_table, progress_table=kind.progress_table, id_column=kind.id_column
    )


def as_us(moment: datetime) -> int:
    return (moment - EPOCH) // _ONE_US


def as_ms(moment: datetime) -> float:
    # with the microseconds: receive times are ms with a microsecond fraction (Redis's TIME, buffer.py); an
    # int's true division is correctly rounded, as timedelta's was, in a third of its time
    return as_us(moment) / 1000


def from_ms(ms: float) -> datetime:
    return EPOCH + timedelta(milliseconds=ms)


async def fetch_rows(
    pool: asyncpg.Pool, asked: Mapping[ContentKind, tuple[Sequence[int], Sequence[int]]]
) -> dict[ContentKind, StoredRows]:
    """Per type, what Postgres has of the pairs user_ids[i], content_ids[i] of its (user_ids, content_ids), as
    StoredRows: one query per type, in turn on one connection of the pool's, waited for MAX_WAIT_S at most."""
    answers = await fetch_stateless(
        pool, [rows_statement(kind, user_ids, content_ids) for kind, (user_ids, content_ids) in asked.items()],
        timeout_s=MAX_WAIT_S,
    )  # fmt: skip
    return {kind: _stored(rows) for kind, rows in zip(asked, answers, strict=True)}


def rows_statement(kind: ContentKind, user_ids: Sequence[int], content_ids: Sequence[int]) -> tuple[str, list[str]]:
    # the ids as text, one parameter each: asyncpg encodes a bigint[] through a Python type check per element
    return rows_sql(kind), [_IDS.encode(user_ids).decode(), _IDS.encode(content_ids).decode()]


def _stored(rows: list[asyncpg.Record]) -> StoredRows:
    (row,) = rows  # an aggregate's one row; NULL arrays when no pair was asked
    durations, positions, updated, completed = row
    if durations is None:
        return [], [], [], []
    return durations, positions, updated, completed


async def alongside(query: Awaitable[Q], read: Awaitable[R]) -> tuple[Q, R]:
    """Both stores at once: the query, the slower, started first, in this task, the Redis read in a task of its own
    (it starts after what is ready in this turn); both are awaited to their end before an error goes up (the
    query's first when both fail)."""
    values = asyncio.ensure_future(read)
    try:
        rows = await query
    finally:
        with contextlib.suppress(Exception):  # its error goes up below, or after the query's
            await values
    return rows, values.result()


def decode_values(raw_values: Sequence[bytes | str | None]) -> list[Buffered | None]:
    """Each value as decode_value reads it (None for one it refuses), without building a StoredPosition."""
    decoded: list[Buffered | None] = []
    for raw in raw_values:
        if raw is None:
            decoded.append(None)
            continue
        try:
            # what this service writes, position:ms:peak:µs, read from the bytes: float() and int() of bytes accept
            # a subset of what they accept of the decoded text, with the same values
            position, ms, peak, us = raw.split(b":") if isinstance(raw, bytes) else raw.split(":")
            decoded.append((float(position), int(ms) * 1000 + int(us), float(peak), None))
        except ValueError:
            try:  # anything else, by the flush's own decoder: an older release's value (two or three fields), an
                # offline item's floor, or a str
                value = decode_value(raw)
            except ValueError:
                decoded.append(None)  # not written by this service's script: the flush drops it too
                continue
            floor_ms = value.completion_floor_ms
            floor_us = None if floor_ms is None else floor_ms * 1000
            decoded.append((value.position, round(value.received_ms * 1000), value.peak, floor_us))
    return decoded


def _ended(connection: asyncpg.Connection) -> bool:
    try:
        return bool(connection.is_closed())
    except asyncpg.InterfaceError:  # asyncpg gave it back to the pool when it saw it end
        return True


# a batch names at most 2,000 ids (20 reads of 100): one MGET of that many keys, one query of that many pairs
MAX_LOOKUPS_PER_BATCH = 20
# reads of one type waiting for a batch to come back, past which a read is refused at once (ReadsWaiting)
MAX_WAITING_LOOKUPS = 1000
# how long a read waits for its batch to start before it is refused: ms under load, past this only when a store
# stalls, and a stalled store then holds its batches (up to its own timeouts), not every read behind them
MAX_WAIT_S = 1.0


class ReadsWaiting(Exception):
    """The batches out do not come back: this read is refused rather than left waiting behind them."""


@dataclass(slots=True)
class _Lookup:
    user_id: int
    content_ids: Sequence[int]
    found: list[Progress] = field(default_factory=list)


class ProgressReader:
    """Freshest progress of one user for some ids of one content type; concurrent reads share round trips.

    Per content type, at most `batches_in_flight` batches are out at once (TurnBatcher's group commit): a type
    whose table is locked (a migration's, say) holds its own reads only. While reads keep coming, a type's
    batches run on the Postgres connections its last ones used: one goes back to the pool when its query fails
    or Postgres ended it, and all of them when no batch is out and no read waits (TurnBatcher's `idle`).
    `batches_in_flight` is at least 1.
    """

    def __init__(
        self,
        redis: RedisClient,
        pool: asyncpg.Pool,
        *,
        margin_s: float,
        batches_in_flight: int = 1,
        layout: KeyLayout = STANDALONE,
    ) -> None:
        self._redis = redis
        # while the shard count changes, the same keys of the old count are read after the current ones
        self._layouts = [layout] if layout.previous is None else [layout, layout.previous]
        self._pool = pool
        self._margin_s = margin_s
        self._kept: dict[ContentKind, list[asyncpg.Connection]] = {kind: [] for kind in CONTENT_KINDS}
        self._releasing: set[asyncio.Task[None]] = set()
        self._batchers: dict[ContentKind, TurnBatcher[_Lookup]] = {
            kind: TurnBatcher(
                partial(self._send, kind),
                interrupted=lambda: RedisError("the read was interrupted before it finished"),
                max_in_flight=batches_in_flight,
                max_batch=MAX_LOOKUPS_PER_BATCH,
                max_waiting=MAX_WAITING_LOOKUPS,
                max_wait_s=MAX_WAIT_S,
                overloaded=lambda why: ReadsWaiting(f"the stores answer too slowly for the reads waiting: {why}"),
                idle=partial(self._give_back, kind),
            )
            for kind in CONTENT_KINDS
        }

    async def read(self, kind: ContentKind, user_id: int, content_ids: Sequence[int]) -> list[Progress]:
        """In the order of `content_ids`, one entry per id that has progress."""
        lookup = _Lookup(user_id, content_ids)
        await self._batchers[kind].submit(lookup)
        return lookup.found

    async def _send(self, kind: ContentKind, lookups: list[_Lookup]) -> list[BaseException | None]:
        keys = [
            key
            for layout in self._layouts
            for lookup in lookups
            for key in layout.value_keys(kind.name, lookup.user_id, lookup.content_ids)
        ]
        user_ids: list[int] = []
        content_ids: list[int] = []
        for lookup in lookups:
            user_ids += [lookup.user_id] * len(lookup.content_ids)
            content_ids += lookup.content_ids
        rows, raw_values = await alongside(self._rows(kind, user_ids, content_ids), get_many(self._redis, keys))
        decoded = decode_values(raw_values)
        if len(self._layouts) > 1:  # per key, the value received later (the current one's on a tie, as a flush of
            # both leaves it: the upsert's strict `<`)
            now, old = decoded[: len(content_ids)], decoded[len(content_ids) :]
            decoded = [b if a is None or (b is not None and b[1] > a[1]) else a for a, b in zip(now, old, strict=True)]
        margin_s = self._margin_s
        # per pair, in order: the freshest of the buffered value and the row, as the next flush will leave it
        pairs = zip(content_ids, decoded, *rows, strict=True)
        for lookup in lookups:
            found = lookup.found
            for content_id, buffered, duration_s, position, updated_us, completed_us in islice(
                pairs, len(lookup.content_ids)
            ):
                if duration_s is None:
                    continue  # unknown content or user: nothing the flush would keep
                if buffered is not None:
                    buffered_position, received_us, peak, floor_us = buffered
                    if completed_us is None and completes(peak, duration_s, margin_s):
                        # the time the flush will set
                        completed_us = received_us if floor_us is None or floor_us < received_us else floor_us
                    if updated_us is None or received_us > updated_us:
                        found.append((content_id, buffered_position, received_us, completed_us))
                        continue
                if updated_us is not None:
                    found.append((content_id, position, updated_us, completed_us))
        return [None] * len(lookups)

    async def _rows(self, kind: ContentKind, user_ids: list[int], content_ids: list[int]) -> StoredRows:
        """fetch_rows of one type, on a connection its last batch used, else one of the pool's (MAX_WAIT_S)."""
        kept = self._kept[kind]
        connection = kept.pop() if kept else None
        if connection is not None and _ended(connection):  # Postgres ended it meanwhile (a restart): a new one
            await give_back(self._pool, connection)  # nothing if asyncpg gave it back already
            connection = None
        if connection is None:
            connection = await self._pool.acquire(timeout=MAX_WAIT_S)
        (rows,) = await fetch_on(self._pool, connection, [rows_statement(kind, user_ids, content_ids)])
        kept.append(connection)  # (a failed query gave it back to the pool, with the reset: fetch_on)
        return _stored(rows)

    def _give_back(self, kind: ContentKind) -> None:
        """No batch of `kind` out, no read waiting (TurnBatcher's idle): its connections go back to the pool."""
        kept = self._kept[kind]
        while kept:
            task = asyncio.ensure_future(release_stateless(self._pool, kept.pop()))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)  # a failed release is logged there (give_back)

    async def aclose(self) -> None:
        try:
            await close_all(self._batchers.values())
        finally:
            for kind in CONTENT_KINDS:
                self._give_back(kind)
            await asyncio.gather(*self._releasing)
