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

Bounded: at most two writes per (user, content) and interval, at most MAX_CONTENTS_PER_USER contents
per user and MAX_ENTRIES in all between two writes; a refusal past those is shed and counted.
"""

import asyncio
import logging
from dataclasses import dataclass
from functools import partial

from service import metrics
from service.loops import every
from service.progress.content import ContentKind
from service.progress.sink import HeartbeatSink, Unavailable

log = logging.getLogger(__name__)

DEFER_INTERVAL_S = 0.5
# ~200 bytes an entry: 50k are ~10 MB, the rate limiter's own order; a user playing more contents at
# once than this is a script, not the app
MAX_ENTRIES = 50_000
MAX_CONTENTS_PER_USER = 100


@dataclass(slots=True)
class _Deferred:
    kind: ContentKind
    position: float  # the latest refused
    received_ms: float
    peak: float  # the furthest of the refused run
    peak_ms: float


_Key = tuple[str, int, int]  # content type, content id, user id


class DeferredHeartbeats:
    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_contents_per_user: int = MAX_CONTENTS_PER_USER) -> None:
        self._max_entries = max_entries
        self._max_contents_per_user = max_contents_per_user
        self._entries: dict[_Key, _Deferred] = {}
        self._contents_of: dict[int, int] = {}  # user id -> entries of that user
        # the loop's drain and the lifespan's last one must not write the same entries twice at once
        self._draining = asyncio.Lock()

    def keep(self, kind: ContentKind, *, content_id: int, user_id: int, position: float, received_ms: float) -> None:
        """A refused heartbeat: its position is written with the next drain (unless shed past a bound)."""
        self._merge((kind.name, content_id, user_id), _Deferred(kind, position, received_ms, position, received_ms))

    def _merge(self, key: _Key, new: _Deferred) -> None:
        entry = self._entries.get(key)
        if entry is None:
            user_id = key[2]
            contents = self._contents_of.get(user_id, 0)
            if len(self._entries) >= self._max_entries or contents >= self._max_contents_per_user:
                metrics.DEFERRED_SHED.inc()
                return
            self._entries[key] = new
            self._contents_of[user_id] = contents + 1
            return
        if new.received_ms > entry.received_ms:
            entry.position, entry.received_ms = new.position, new.received_ms
        if new.peak > entry.peak:
            entry.peak, entry.peak_ms = new.peak, new.peak_ms

    def __len__(self) -> int:
        return len(self._entries)

    async def drain(self, sink: HeartbeatSink) -> bool:
        """Write every entry kept so far; one that neither store took is kept again for the next drain (False)."""
        async with self._draining:
            entries, self._entries, self._contents_of = self._entries, {}, {}
            if not entries:
                return True
            keys = list(entries)
            results = await asyncio.gather(
                *(self._write(sink, key, entries[key]) for key in keys), return_exceptions=True
            )
            unavailable = 0
            for key, result in zip(keys, results, strict=True):
                if isinstance(result, Unavailable):
                    unavailable += 1
                    self._merge(key, entries[key])
                elif isinstance(result, BaseException):
                    raise result  # a bug: every write was awaited to its end first
            if unavailable:
                error = next(r for r in results if isinstance(r, Unavailable))
                log.warning(
                    "%d refused heartbeats not written (%s); kept for the next try",
                    unavailable,
                    error,
                    extra={"count": unavailable},
                )
            return not unavailable

    @staticmethod
    async def _write(sink: HeartbeatSink, key: _Key, entry: _Deferred) -> None:
        _, content_id, user_id = key
        if entry.peak > entry.position:
            # the furthest first, received earlier: the latest written after it stands, and the peak stays
            await sink.write(
                entry.kind, content_id=content_id, user_id=user_id, position=entry.peak, received_ms=entry.peak_ms
            )
        await sink.write(
            entry.kind, content_id=content_id, user_id=user_id, position=entry.position, received_ms=entry.received_ms
        )

    async def run(self, sink: HeartbeatSink, stop: asyncio.Event, interval_s: float = DEFER_INTERVAL_S) -> None:
        """Drain every interval until `stop` (the lifespan drains a last time before the sink closes)."""
        # the loop is the only way out for these positions: every() logs a bug loudly and goes on
        await every(
            interval_s,
            stop,
            partial(self.drain, sink),
            name="writing the refused heartbeats",
            wait_first=True,
            logger=log,
        )
