"""What the rate limit refused, kept so that a burst still ends with the user's last position stored.

The limit may shed only intermediate heartbeats: a client back from offline replays minutes of them
at once, and the last one (maybe the one that completes the content) must not be lost. A refused
heartbeat is still answered 429 and acknowledged as nothing (a value held in memory is no 201's
promise: a SIGKILL loses it), but its (user, content) keeps the latest refused position and the
furthest one of the refused run. About every DEFER_INTERVAL_S the pod writes each entry through the
normal sink, the furthest first, then the latest, each with its own receive time: WRITE_SCRIPT keeps
the position received last and the highest peak, so the stored value ends as the last position the
user sent, a refused heartbeat that reached the end still completes, and a heartbeat allowed in the
meantime (received later) still stands.

Every real content, whether memory knows it or not: a refused heartbeat for an id outside the catalog's
snapshot and answers (content created since, or a pod that started with Postgres unreachable) is kept
unverified, and the drain asks the catalog about it before writing it, at the drain's own pace and never
on the request path: one lookup per id, shared with the door's lookups of the same id and cached like
them (ContentCatalog.is_known), at most LOOKUPS_AT_ONCE at a time. While Postgres cannot be asked, the
catalog accepts the id, as the door does.

Bounded: at most two writes per (user, content) and interval, at most MAX_CONTENTS_PER_USER contents
per user, MAX_ENTRIES in all and MAX_UNVERIFIED_IDS ids memory does not know between two writes, so a
flood of made-up ids costs the database at most MAX_UNVERIFIED_IDS lookups per interval and pod (a
made-up id answered unknown is refused from memory for the next second). Anything not kept is counted
in progress_deferred_shed_total: a refusal past those bounds, and one for content that does not exist.
"""

import asyncio
import logging
from dataclasses import dataclass
from functools import partial

from service import metrics
from service.api.catalog import ContentCatalog, LookupsSaturated
from service.loops import every
from service.progress.content import ContentKind
from service.progress.sink import HeartbeatSink, Unavailable

log = logging.getLogger(__name__)

DEFER_INTERVAL_S = 0.5
# ~200 bytes an entry: 50k are ~10 MB, the rate limiter's own order; a user playing more contents at
# once than this is a script, not the app
MAX_ENTRIES = 50_000
MAX_CONTENTS_PER_USER = 100
# ids outside what memory knows, kept between two writes: real ones are content published since the last
# snapshot (a handful), so past this it is a flood of made-up ids; a few lookups at once leave the door's
# lookups (CATALOG_MAX_LOOKUPS) and the pool's connections to the requests and the flush
MAX_UNVERIFIED_IDS = 32
LOOKUPS_AT_ONCE = 4


@dataclass(slots=True)
class _Deferred:
    kind: ContentKind
    position: float  # the latest refused
    received_ms: float
    peak: float  # the furthest of the refused run
    peak_ms: float
    verified: bool  # memory knew the content when one of its refusals came; else the drain asks first


_Key = tuple[str, int, int]  # content type, content id, user id
_Content = tuple[str, int]  # content type, content id


class _NotCheckedNow(Exception):
    """The catalog had no lookup to spare (LookupsSaturated): the entry waits for the next drain."""


class DeferredHeartbeats:
    def __init__(
        self,
        *,
        max_entries: int = MAX_ENTRIES,
        max_contents_per_user: int = MAX_CONTENTS_PER_USER,
        max_unverified_ids: int = MAX_UNVERIFIED_IDS,
    ) -> None:
        self._max_entries = max_entries
        self._max_contents_per_user = max_contents_per_user
        self._max_unverified_ids = max_unverified_ids
        self._entries: dict[_Key, _Deferred] = {}
        self._contents_of: dict[int, int] = {}  # user id -> entries of that user
        self._unverified: set[_Content] = set()  # the ids of the entries the drain must look up
        # the loop's drain and the lifespan's last one must not write the same entries twice at once
        self._draining = asyncio.Lock()
        self._lookups_at_once = asyncio.Semaphore(LOOKUPS_AT_ONCE)

    def keep(
        self,
        kind: ContentKind,
        *,
        content_id: int,
        user_id: int,
        position: float,
        received_ms: float,
        known: bool | None = True,
    ) -> None:
        """A refused heartbeat: its position is written with the next drain (unless shed past a bound).

        `known`: what memory knows of the content (ContentCatalog.known_in_memory): False, nothing to keep;
        None, the drain looks it up first.
        """
        if known is False:
            metrics.DEFERRED_SHED.inc()  # content that does not exist: the door would answer 404
            return
        new = _Deferred(kind, position, received_ms, position, received_ms, verified=known is True)
        self._merge((kind.name, content_id, user_id), new)

    def _merge(self, key: _Key, new: _Deferred) -> None:
        entry = self._entries.get(key)
        if entry is None:
            user_id = key[2]
            contents = self._contents_of.get(user_id, 0)
            content = key[:2]
            unverified_past_bound = (
                not new.verified
                and content not in self._unverified
                and len(self._unverified) >= self._max_unverified_ids
            )
            if (
                len(self._entries) >= self._max_entries
                or contents >= self._max_contents_per_user
                or unverified_past_bound
            ):
                metrics.DEFERRED_SHED.inc()
                return
            self._entries[key] = new
            self._contents_of[user_id] = contents + 1
            if not new.verified:
                self._unverified.add(content)
            return
        if new.received_ms > entry.received_ms:
            entry.position, entry.received_ms = new.position, new.received_ms
        if new.peak > entry.peak:
            entry.peak, entry.peak_ms = new.peak, new.peak_ms
        entry.verified = entry.verified or new.verified

    def __len__(self) -> int:
        return len(self._entries)

    async def drain(self, sink: HeartbeatSink, catalog: ContentCatalog | None = None) -> bool:
        """Write every entry kept so far, those memory did not know once `catalog` says they exist (without a
        catalog every id is accepted, as at the door); one that neither store took, or that could not be
        checked now, is kept again for the next drain (False)."""
        async with self._draining:
            entries, self._entries, self._contents_of, self._unverified = self._entries, {}, {}, set()
            if not entries:
                return True
            keys = list(entries)
            checks: dict[_Content, asyncio.Future[bool]] = {}  # one per id, whoever its users
            results = await asyncio.gather(
                *(self._check_and_write(sink, key, entries[key], catalog, checks) for key in keys),
                return_exceptions=True,
            )
            unavailable = 0
            for key, result in zip(keys, results, strict=True):
                if isinstance(result, (Unavailable, _NotCheckedNow)):
                    unavailable += 1
                    self._merge(key, entries[key])
                elif result is False:
                    metrics.DEFERRED_SHED.inc()  # the content does not exist
                elif isinstance(result, BaseException):
                    raise result  # a bug: every write was awaited to its end first
            if unavailable:
                error = next(r for r in results if isinstance(r, (Unavailable, _NotCheckedNow)))
                log.warning(
                    "%d refused heartbeats not written (%s); kept for the next try",
                    unavailable,
                    error,
                    extra={"count": unavailable},
                )
            return not unavailable

    async def _check_and_write(
        self,
        sink: HeartbeatSink,
        key: _Key,
        entry: _Deferred,
        catalog: ContentCatalog | None,
        checks: dict[_Content, asyncio.Future[bool]],
    ) -> bool:
        """False when the content does not exist (nothing written); raises Unavailable or _NotCheckedNow."""
        if not entry.verified and catalog is not None:
            check = checks.get(key[:2])
            if check is None:
                check = checks[key[:2]] = asyncio.ensure_future(self._exists(catalog, entry.kind, key[1]))
            if not await check:
                return False
        await self._write(sink, key, entry)
        return True

    async def _exists(self, catalog: ContentCatalog, kind: ContentKind, content_id: int) -> bool:
        async with self._lookups_at_once:
            known = catalog.is_known(kind, content_id)  # memory may know by now: a refresh, a request's lookup
            try:
                return known if isinstance(known, bool) else await known
            except LookupsSaturated as exc:
                raise _NotCheckedNow(f"cannot check {kind.id_column} {content_id} now ({exc})") from None

    @staticmethod
    async def _write(sink: HeartbeatSink, key: _Key, entry: _Deferred) -> None:
        _, content_id, user_id = key
        if entry.peak > entry.position:
            # the furthest first, received earlier: the latest written after it stands, and the peak stays
            await sink.write(entry.kind, content_id=content_id, user_id=user_id, position=entry.peak)
        await sink.write(entry.kind, content_id=content_id, user_id=user_id, position=entry.position)

    async def run(
        self,
        sink: HeartbeatSink,
        stop: asyncio.Event,
        interval_s: float = DEFER_INTERVAL_S,
        catalog: ContentCatalog | None = None,
    ) -> None:
        """Drain every interval until `stop` (the lifespan drains a last time before the sink closes)."""
        # the loop is the only way out for these positions: every() logs a bug loudly and goes on
        await every(
            interval_s,
            stop,
            partial(self.drain, sink, catalog),
            name="writing the refused heartbeats",
            wait_first=True,
            logger=log,
        )
