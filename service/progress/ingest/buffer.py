"""The request path's only write: the latest position of one (user, content) and its pending mark.

Every heartbeat is one call of WRITE_SCRIPT, so the value and the pending-set member appear together
or not at all: a flusher can never pop a member whose value is not written yet. The heartbeats of
concurrent requests that arrive in the same event-loop turn travel in one pipeline (TurnBatcher),
so under load a Redis round trip carries many heartbeats instead of one.

Redis keeps the time, never a pod: the script stamps each heartbeat with the server's clock (TIME),
so two pods whose clocks differ by minutes still order one listener's heartbeats as Redis received them.
"""

import hashlib
import time
from collections.abc import Sequence
from typing import NamedTuple

from redis.exceptions import NoScriptError, RedisError

from service import metrics
from service.progress.batching import TurnBatcher
from service.progress.keys import STANDALONE, KeyLayout, Shard, pending_member
from service.redis_client import RedisClient, execute_by_node, get_many, node_name
from service.stores import REDIS_UNAVAILABLE

# The value is "{position}:{receive time ms}:{peak}:{microseconds}". The peak is the furthest position heard
# while the value lived, so a listener who reaches the end and restarts within one flush interval is still
# completed. The receive time is whole ms and its microseconds (0-999) come last, where the monolith's readers
# ignore them; values of two or three fields (a rolling deploy's older pods) still read. Only an offline item
# (service/progress/read/sync.py) heard longer ago than the backdate window writes a fifth field, its completion
# floor (whole ms): a completion of this value is dated max(receive time, floor).
# write(): `now` is Redis's TIME (µs); `us` the write's own time (µs), nil for a heartbeat. A heartbeat is
# stamped max(now, stored time + 1 µs): the last one Redis receives stands whichever pod sent it, and two in
# one microsecond never tie. A write with its own time earlier than the stored one (an older offline listen)
# only raises the peak (and the floor); an exact tie keeps what is stored (as persist_batch's dedupe and the
# upsert's strict `<`). The member is added either way: the flusher reads the newest value. A write that
# stands drops the stored floor: its own time (or floor) is later.
# No TTL: a value whose member is pending never expires before the flush has written it, however slow the
# drain; SET drops the TTL a flushed value had (service/progress/flush/leases.py: the ack sets it).
# Returns 1 when this write is now the stored position, 2 when the stored one is this very write
# already (same time and position: a retried offline sync), 0 when a later one stands.
_WRITE_FUNCTION = """
local function now_us()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000000 + tonumber(clock[2])
end
local function write(key, pending, member, position, peak, now, us, floor)
  local current = redis.call('GET', key)
  if current then
    local stored, ms, stored_peak, frac, stored_floor =
      string.match(current, '^([^:]*):(%d+):?([^:]*):?(%d*):?(%d*)$')
    if stored_peak == '' then stored_peak = stored end
    if ms then
      local stored_us = tonumber(ms) * 1000 + (tonumber(frac) or 0)
      if not us then
        us = math.max(now, stored_us + 1)
      elseif stored_us >= us then
        if tonumber(peak) > tonumber(stored_peak) then
          if floor and tonumber(floor) * 1000 > stored_us
             and (stored_floor == '' or tonumber(floor) > tonumber(stored_floor)) then
            stored_floor = floor
          end
          local kept = stored .. ':' .. ms .. ':' .. peak .. ':' .. (tonumber(frac) or 0)
          if stored_floor ~= '' then kept = kept .. ':' .. stored_floor end
          redis.call('SET', key, kept)
        end
        redis.call('SADD', pending, member)
        if stored_us == us and tonumber(stored) == tonumber(position) then return 2 end
        return 0
      end
      if tonumber(stored_peak) > tonumber(peak) then peak = stored_peak end
    end
  end
  us = us or now
  local micros = us % 1000
  local value = position .. ':' .. string.format('%d', (us - micros) / 1000) .. ':' .. peak .. ':' .. micros
  if floor then value = value .. ':' .. floor end
  redis.call('SET', key, value)
  redis.call('SADD', pending, member)
  return 1
end
"""

# KEYS: latest-position key, pending set. ARGV: position, pending member; a heartbeat sends nothing more.
# A write with a time of its own (tests place a value in the past with it) adds that time: whole ms, µs.
WRITE_SCRIPT = (
    _WRITE_FUNCTION
    + """local us = nil
if ARGV[3] then us = tonumber(ARGV[3]) * 1000 + tonumber(ARGV[4]) end
return write(KEYS[1], KEYS[2], ARGV[2], ARGV[1], ARGV[1], now_us(), us, nil)
"""
)
WRITE_SCRIPT_SHA = hashlib.sha1(WRITE_SCRIPT.encode()).hexdigest()

# Many offline items of one shard in one call (a sync), written in the order given, each bounded
# against Redis's clock, never the pod's or the device's: an item heard more than the skew (ARGV[2], ms)
# after Redis's now is refused (TOO_FAR_AHEAD, nothing written); one heard after now, within the skew (a device
# clock a little ahead), is written as a heartbeat is, so it is never dated in the future; one heard
# longer ago than the backdate window (ARGV[3], ms) carries the floor now - window.
# KEYS: the shard's pending set. ARGV: the shard's value key prefix (it carries the shard's hash tag:
# the value keys built from it are in the slot of KEYS), the skew, the window, then one line per write:
# "{pending member} {position} {heard ms} {microseconds} {peak}" (one argument: 500 writes cost the
# client one string to send, not 2,500 arguments to encode). Returns write()'s answer (or -1) per write.
WRITE_MANY_SCRIPT = (
    _WRITE_FUNCTION
    + """local now = now_us()
local floor_ms = (now - now % 1000) / 1000 - tonumber(ARGV[3])
local latest = now + tonumber(ARGV[2]) * 1000
local results = {}
for member, position, ms, us, peak in string.gmatch(ARGV[4], '(%S+) (%S+) (%d+) (%d+) (%S+)') do
  local heard = tonumber(ms) * 1000 + tonumber(us)
  local result = -1
  if heard <= latest then
    local floor = nil
    if heard < floor_ms * 1000 then floor = string.format('%d', floor_ms) end
    if heard > now then heard = nil end
    result = write(ARGV[1] .. member, KEYS[1], member, position, peak, now, heard, floor)
  end
  results[#results + 1] = result
end
return results
"""
)
WRITE_MANY_SCRIPT_SHA = hashlib.sha1(WRITE_MANY_SCRIPT.encode()).hexdigest()
TOO_FAR_AHEAD = -1


class StoredPosition(NamedTuple):  # a tuple: a read of 100 ids decodes 100 of them
    position: float
    received_ms: float
    peak: float
    completion_floor_ms: int | None = None  # an offline item's (see WRITE_SCRIPT); None: the receive time


def decode_value(raw: bytes | str) -> StoredPosition:
    """The stored value; ValueError when it is not one this service (or an older release) wrote."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        fields = text.split(":")
        if not 2 <= len(fields) <= 5:
            raise ValueError(f"{len(fields)} fields")
        position = float(fields[0])
        # older releases wrote two fields (no peak) or three (no microseconds); a fifth is an offline item's floor
        received_ms = int(fields[1]) + (int(fields[3]) / 1000 if len(fields) > 3 else 0)
        peak = float(fields[2]) if len(fields) > 2 else position
        return StoredPosition(position, received_ms, peak, int(fields[4]) if len(fields) > 4 else None)
    except (ValueError, UnicodeDecodeError) as exc:  # UnicodeDecodeError is a ValueError too; said for clarity
        raise ValueError(f"not a progress value: {raw[:100]!r} ({exc})") from None


def split_ms(received_ms: float) -> tuple[int, int]:
    """(whole ms, microseconds within it) of a receive time, exactly: both are below 2**53 as microseconds."""
    us = round(received_ms * 1000)
    return us // 1000, us % 1000


def write_args(
    content_type: str,
    content_id: int,
    user_id: int,
    position: float,
    received_ms: float | None = None,
    layout: KeyLayout = STANDALONE,
) -> tuple[object, ...]:
    """A heartbeat's WRITE_SCRIPT call (Redis stamps it); with `received_ms`, a write of that time instead."""
    shard = layout.shard(content_type, content_id, user_id)  # both keys in the shard's one slot
    at = () if received_ms is None else split_ms(received_ms)
    return (
        "EVALSHA",
        WRITE_SCRIPT_SHA,
        2,
        shard.value_key(content_id, user_id),
        shard.pending_key,
        repr(position),
        pending_member(content_id, user_id),
        *at,
    )


class PositionWriter:
    """The request path's Redis writes, one pipeline per event-loop turn."""

    def __init__(self, redis: RedisClient, *, layout: KeyLayout = STANDALONE) -> None:
        self._redis = redis
        self.layout = layout
        self._batcher: TurnBatcher[tuple[object, ...]] = TurnBatcher(
            self._send, interrupted=lambda: RedisError("the write was interrupted before Redis answered")
        )

    async def write(self, *, content_type: str, content_id: int, user_id: int, position: float) -> None:
        await self._batcher.submit(write_args(content_type, content_id, user_id, position, layout=self.layout))

    def node_of(self, content_type: str, content_id: int, user_id: int) -> str:
        """The Redis node this heartbeat's write goes to ("" on a standalone server; "?" if none is known)."""
        if not self.layout.cluster:
            return ""  # the request path: no key to work out for the one server there is
        try:
            return node_name(self._redis, self.layout.value_key(content_type, content_id, user_id))
        except REDIS_UNAVAILABLE:
            return "?"

    async def write_all(
        self, writes: Sequence[tuple[str, int, int, float, float, float]], *, max_skew_ms: int, max_backdate_ms: int
    ) -> list[int]:
        """(content type, content id, user id, position, heard ms, peak) writes, in order, in one round trip of
        their own (one WRITE_MANY_SCRIPT call per shard); for each, its answer (1, 2, 0 or TOO_FAR_AHEAD).
        An error of any call raises: the caller answers for the whole set, which is safe to send again."""
        by_shard: dict[Shard, tuple[list[int], list[str]]] = {}  # each write's index, and its line of the call
        for i, (content_type, content_id, user_id, position, heard_ms, peak) in enumerate(writes):
            indexes, lines = by_shard.setdefault(self.layout.shard(content_type, content_id, user_id), ([], []))
            ms, us = split_ms(heard_ms)
            indexes.append(i)
            lines.append(f"{content_id}:{user_id} {position!r} {ms} {us} {peak!r}")
        limits = (max_skew_ms, max_backdate_ms)
        commands: list[tuple[object, ...]] = [
            ("EVALSHA", WRITE_MANY_SCRIPT_SHA, 1, shard.pending_key, shard.value_prefix, *limits, "\n".join(lines))
            for shard, (_, lines) in by_shard.items()
        ]
        results = await self._send_pipeline(commands, len(writes))
        answers = [0] * len(writes)
        for (indexes, _), result in zip(by_shard.values(), results, strict=True):
            if isinstance(result, Exception):
                raise result
            assert isinstance(result, list) and len(result) == len(indexes), f"one answer per write: {result!r}"
            for i, answer in zip(indexes, result, strict=True):
                answers[i] = answer
        return answers

    async def read_values(self, keys: Sequence[str]) -> list[bytes | str | None]:
        """The values of `keys`, in order, in one round trip (the sync's look at the previous shard layout)."""
        return await get_many(self._redis, keys)

    async def _send(self, commands: list[tuple[object, ...]]) -> list[BaseException | None]:
        results = await self._send_pipeline(commands, len(commands))
        return [result if isinstance(result, Exception) else None for result in results]

    async def _send_pipeline(self, commands: list[tuple[object, ...]], heartbeats: int) -> list[object]:
        started = time.perf_counter()
        # the 4th argument is a key of the command's one slot: on a cluster, the node of that slot takes it
        results = await execute_by_node(self._redis, commands, key_index=3)
        if any(isinstance(result, NoScriptError) for result in results):
            # Redis restarted or flushed its script cache since we loaded it
            for script in (WRITE_SCRIPT, WRITE_MANY_SCRIPT):
                await self._redis.script_load(script)
            results = await execute_by_node(self._redis, commands, key_index=3)
        metrics.REDIS_WRITE_SECONDS.observe(time.perf_counter() - started)
        metrics.REDIS_WRITE_BATCH_SIZE.observe(heartbeats)
        return results

    async def aclose(self) -> None:
        await self._batcher.aclose()
