"""Positions listened offline, uploaded later: through the same buffer, with the time they were heard.

Each accepted item is written by the buffer's script with `listened_at` as its receive time, so an offline
position and a live heartbeat settle as two heartbeats do: the later one stands whichever arrives last, in
Redis and in the upsert, however old the listen, and the furthest position heard still raises the peak that
decides completion. The request is one Redis round trip (one WRITE_MANY_SCRIPT call per shard) after one
query per content type present; while the shard count changes, the previous layout's values are read beside
that query.

`applied` is true only when the item's position is the one that now stands: no older than the buffered value
(the script says so), than the row's `updated_at` (the value may have expired after its flush), and than a
value of the previous shard layout (the same time counts as applied: a retried request gets the same
answer). An older item is still written, so its peak can complete the content, but reported `applied: false`.

A client's clock is not evidence of a completion's date: an item heard more than MAX_BACKDATE_S before its
receipt carries a completion floor (see buffer.py), so one request cannot fill a month of the monolith's
journey; the order stays the listen's. The receipt and the bound on items heard in the future are Redis's
clock, read by the write script: no pod's clock decides what is refused, stored as now or floored.
"""

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal, NamedTuple, get_args

import asyncpg
import msgspec
from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field

from service.config import SYNC_CONNECTIONS
from service.progress.content import (
    CONTENT_KINDS,
    KIND_BY_NAME,
    MAX_ID,
    MAX_POSITION_S,
    ContentId,
    ContentKind,
    Position,
)
from service.progress.ingest.buffer import TOO_FAR_AHEAD, PositionWriter
from service.progress.read.reads import MAX_WAIT_S, alongside, as_ms, decode_values, fetch_rows

SYNC_MAX_ITEMS = 500
# No listen is older than the app: a date before this is a broken clock, not a position to order by. It also keeps
# every stored time a positive whole number of ms (the write script's pattern) and a date Postgres and Python both
# read back (a year 0 would fail every read of its content, a 1960 one would not be ordered in Redis).
EARLIEST_LISTEN_MS = 946_684_800_000  # 2000-01-01T00:00:00Z

# an item further in the future than Redis's time is refused (within it, it is stored at Redis's time)
MAX_CLOCK_SKEW_S = 300.0
# a completion an item brings is dated no earlier than its receipt minus this (see the module's docstring)
MAX_BACKDATE_S = 6 * 3600.0

ContentType = Literal["lesson", "audio", "meditation", "live"]
assert set(get_args(ContentType)) == {kind.name for kind in CONTENT_KINDS}

SUPERSEDED = "superseded by a later item for the same content in this request"
OLDER_THAN_STORED = "older than the stored position"
UNKNOWN_CONTENT = "unknown content or user"


_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]")


def _iso_8601(value: object) -> object:
    # pydantic would also read "1796034445" or 1796034445 as a Unix time: the contract says ISO-8601
    if isinstance(value, datetime):  # built in Python, not parsed from a request
        return value
    if not isinstance(value, str) or not _ISO_DATE.match(value):
        raise ValueError("listened_at must be an ISO-8601 date and time with a time zone")
    return value


class SyncItem(BaseModel):
    # strict like the heartbeats: "12" or true is not an id; unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    content_type: ContentType
    content_id: ContentId
    position: Position
    listened_at: Annotated[
        AwareDatetime,
        BeforeValidator(_iso_8601),
        # lax after the check above: past a before-validator, strict mode would refuse any string
        Field(strict=False, description="When the position was heard, ISO-8601 with a time zone."),
    ]


class SyncRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    items: list[SyncItem] = Field(min_length=1, max_length=SYNC_MAX_ITEMS)


class OfflineItem(NamedTuple):
    """A valid item, as the sync settles it: `listened_ms` is `listened_at` in ms (with its microseconds)."""

    content_type: str
    content_id: int
    position: float
    listened_ms: float

    @classmethod
    def of(cls, item: SyncItem) -> "OfflineItem":
        return cls(item.content_type, item.content_id, item.position, as_ms(item.listened_at))


class _PlainItem(msgspec.Struct, gc=False):  # strings and numbers only: nothing for the collector to follow
    content_type: str
    content_id: int
    position: float
    listened_at: str


class _PlainRequest(msgspec.Struct, gc=False):
    items: list[_PlainItem]


_PLAIN_REQUEST = msgspec.json.Decoder(_PlainRequest)
# The common spelling of an aware ISO-8601 time (JavaScript's toISOString, Python's isoformat), which
# datetime.fromisoformat reads exactly as pydantic does; any other spelling is pydantic's to judge.
_PLAIN_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?(?:Z|[+-]\d{2}:\d{2})")


def plain_items(body: bytes) -> list[OfflineItem] | None:
    """The items of a sync body in the shape every app build sends, in one typed decode; None otherwise.

    Only ever what SyncRequest would accept, with the same values (tests/api/test_sync_decoding.py
    holds the two side by side); for anything else, valid or not, None: SyncRequest decides, with
    its own error answers.
    """
    try:
        body.decode()  # msgspec skips the unknown fields without checking their UTF-8; pydantic refuses it
        request = _PLAIN_REQUEST.decode(body)
    # msgspec.ValidationError is a DecodeError; RecursionError: a body nested past the C stack it allows,
    # which pydantic refuses with its own 400 (recursion limit exceeded)
    except (UnicodeDecodeError, msgspec.DecodeError, RecursionError):
        return None
    if not 1 <= len(request.items) <= SYNC_MAX_ITEMS:
        return None
    items: list[OfflineItem] = []
    for item in request.items:
        if item.content_type not in KIND_BY_NAME or not 1 <= item.content_id <= MAX_ID:
            return None
        if not 0 <= item.position <= MAX_POSITION_S or not _PLAIN_TIME.fullmatch(item.listened_at):
            return None
        try:
            listened_at = datetime.fromisoformat(item.listened_at)
        except ValueError:
            return None
        items.append(OfflineItem(item.content_type, item.content_id, item.position, as_ms(listened_at)))
    return items


def parse_request(body: bytes) -> list[OfflineItem]:
    """The items of a sync body; pydantic's ValidationError when SyncRequest refuses it."""
    items = plain_items(body)
    if items is None:
        items = [OfflineItem.of(item) for item in SyncRequest.model_validate_json(body).items]
    return items


@dataclass(frozen=True, slots=True)
class SyncOutcome:
    applied: bool
    reason: str | None = None


_APPLIED = SyncOutcome(True)
_SUPERSEDED = SyncOutcome(False, SUPERSEDED)
_OLDER = SyncOutcome(False, OLDER_THAN_STORED)
_UNKNOWN = SyncOutcome(False, UNKNOWN_CONTENT)
_TOO_EARLY = SyncOutcome(False, "listened_at is before 2000-01-01T00:00:00Z")
_TOO_FAR_AHEAD = SyncOutcome(False, f"listened_at is more than {MAX_CLOCK_SKEW_S:g} s in the future")


class SyncsWaiting(Exception):
    """The syncs at the database do not come back: this one is refused before anything is written."""


class OfflineSync:
    """Applies a user's offline items; at most SYNC_CONNECTIONS syncs of the process hold a connection at
    once, so syncs stalled on a locked table leave the rest of the pool to the reads, the flush and degraded
    mode. A sync that waited MAX_WAIT_S for its turn, as a read waits for its batch, raises SyncsWaiting."""

    def __init__(self, writer: PositionWriter, pool: asyncpg.Pool) -> None:
        self._writer = writer
        self._pool = pool
        self._connections = asyncio.Semaphore(SYNC_CONNECTIONS)

    async def apply(self, user_id: int, items: Sequence[OfflineItem]) -> list[SyncOutcome]:
        outcomes = {at: _TOO_EARLY for at, item in enumerate(items) if item.listened_ms < EARLIEST_LISTEN_MS}
        accepted = [at for at in range(len(items)) if at not in outcomes]
        if not accepted:
            return [_TOO_EARLY] * len(items)
        updated_us, previous_us = await self._rows_and_previous(user_id, [items[at] for at in accepted])
        # Oldest first: for one content the later item is written last and stands, the script keeps the
        # furthest position of all of them as the peak (an offline listen to the end completes). Items of
        # one content heard at the same time are one write: the last in the request, with the furthest
        # position of them as its peak.
        writes: dict[tuple[str, int, float], list[int]] = {}
        for at in sorted(accepted, key=lambda at: items[at].listened_ms):  # stable: in request order on a tie
            item = items[at]
            if (item.content_type, item.content_id) in updated_us:
                writes.setdefault((item.content_type, item.content_id, item.listened_ms), []).append(at)
            else:
                outcomes[at] = _UNKNOWN  # the flush would drop it
        answers = await self._writer.write_all(
            [
                (name, content_id, user_id, items[ats[-1]].position, heard_ms, max(items[at].position for at in ats))
                for (name, content_id, heard_ms), ats in writes.items()
            ],
            max_skew_ms=round(MAX_CLOCK_SKEW_S * 1000),
            max_backdate_ms=round(MAX_BACKDATE_S * 1000),
        )
        # per content, the item that stands: the last written
        latest = {
            (content_type, content_id): group[-1]
            for (content_type, content_id, _), group, answer in zip(writes, writes.values(), answers, strict=True)
            if answer != TOO_FAR_AHEAD
        }
        for group, answer in zip(writes.values(), answers, strict=True):
            for at in group:
                item = items[at]
                key = (item.content_type, item.content_id)
                row_us = updated_us[key]
                # 0: a later value stands; or the row is later (the value may have expired after its flush), or a
                # pod still on the previous shard count buffered a later one
                older = answer == 0 or (row_us is not None and row_us / 1000 > item.listened_ms)
                older = older or previous_us.get(key, -1) > round(item.listened_ms * 1000)
                if answer == TOO_FAR_AHEAD:
                    outcomes[at] = _TOO_FAR_AHEAD
                else:
                    outcomes[at] = _SUPERSEDED if latest[key] != at else _OLDER if older else _APPLIED
        return [outcomes[at] for at in range(len(items))]  # a KeyError if an item got no outcome

    async def _rows_and_previous(
        self, user_id: int, accepted: list[OfflineItem]
    ) -> tuple[dict[tuple[str, int], int | None], dict[tuple[str, int], int]]:
        """The rows (as _rows), and while the shard count changes the receive times (µs) of the previous layout's
        values, read at the same time."""
        previous = self._writer.layout.previous
        if previous is None:
            return await self._rows(user_id, accepted), {}
        items = list({(item.content_type, item.content_id): None for item in accepted})
        keys = [previous.value_key(content_type, content_id, user_id) for content_type, content_id in items]
        rows, raw_values = await alongside(self._rows(user_id, accepted), self._writer.read_values(keys))
        return rows, {item: value[1] for item, value in zip(items, decode_values(raw_values), strict=True) if value}

    async def _rows(self, user_id: int, accepted: list[OfflineItem]) -> dict[tuple[str, int], int | None]:
        """(content_type, content_id) -> the row's updated_at (µs), or None without a row, for each content of
        the items that exists, its user too."""
        ids_by_kind: dict[ContentKind, set[int]] = {}
        for item in accepted:
            ids_by_kind.setdefault(KIND_BY_NAME[item.content_type], set()).add(item.content_id)
        try:
            async with asyncio.timeout(MAX_WAIT_S):
                await self._connections.acquire()
        except TimeoutError:
            raise SyncsWaiting(
                f"{SYNC_CONNECTIONS} syncs at the database did not come back in {MAX_WAIT_S:g} s"
            ) from None
        asked = {kind: sorted(ids) for kind, ids in ids_by_kind.items()}
        try:
            rows = await fetch_rows(self._pool, {kind: ([user_id] * len(ids), ids) for kind, ids in asked.items()})
        finally:
            self._connections.release()
        found: dict[tuple[str, int], int | None] = {}
        for kind, ids in asked.items():
            durations, _, updated, _ = rows[kind]
            for content_id, duration_s, updated_us in zip(ids, durations, updated, strict=True):
                if duration_s is not None:
                    found[(kind.name, content_id)] = updated_us
        return found
