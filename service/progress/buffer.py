"""The request path's only write: the latest position of one (user, content) and its pending mark.

Every heartbeat is one call of WRITE_SCRIPT, so the value and the pending-set member appear together
or not at all: a flusher can never pop a member whose value is not written yet. The heartbeats of
concurrent requests that arrive in the same event-loop turn travel in one pipeline, so under load
a Redis round trip carries many heartbeats instead of one.
"""

import asyncio
import hashlib
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from service import metrics
from service.progress.keys import latest_position_key, pending_flush_key, pending_member

# KEYS: latest-position key, pending set. ARGV: value, receive time (ms), TTL (s), pending member.
# A value received earlier than the one stored never replaces it (two pods, a retried request),
# and the member is added either way: the flusher reads whatever value is newest.
WRITE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current then
  local current_ms = tonumber(string.match(current, ':(%d+)$'))
  if current_ms and current_ms > tonumber(ARGV[2]) then
    redis.call('SADD', KEYS[2], ARGV[4])
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""
WRITE_SCRIPT_SHA = hashlib.sha1(WRITE_SCRIPT.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredPosition:
    position: float
    received_ms: int


def encode_value(position: float, received_ms: int) -> str:
    return f"{position!r}:{received_ms}"


def decode_value(raw: bytes | str) -> StoredPosition:
    text = raw.decode() if isinstance(raw, bytes) else raw
    position, received_ms = text.rsplit(":", 1)
    return StoredPosition(float(position), int(received_ms))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def write_args(
    content_type: str, content_id: int, user_id: int, position: float, received_ms: int, ttl_s: int
) -> tuple[object, ...]:
    return (
        "EVALSHA", WRITE_SCRIPT_SHA, 2,
        latest_position_key(content_type, content_id, user_id), pending_flush_key(content_type),
        encode_value(position, received_ms), received_ms, ttl_s, pending_member(content_id, user_id),
    )  # fmt: skip


class PositionWriter:
    """Coalesces the writes of one event-loop turn into one pipeline; each caller awaits its own result."""

    def __init__(self, redis: Redis, *, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._queue: list[tuple[tuple[object, ...], asyncio.Future[None]]] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def write(self, *, content_type: str, content_id: int, user_id: int, position: float,
                    received_ms: int) -> None:  # fmt: skip
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if not self._queue:
            # runs after every callback already ready in this turn: those requests join the batch
            loop.call_soon(self._send_queued)
        self._queue.append((write_args(content_type, content_id, user_id, position, received_ms, self._ttl_s),
                            future))  # fmt: skip
        await future

    def _send_queued(self) -> None:
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        # keep a handle: an unreferenced task can be garbage-collected mid-flight
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[tuple[object, ...], asyncio.Future[None]]]) -> None:
        started = time.perf_counter()
        error: BaseException = RedisError("the write was interrupted before Redis answered")
        try:
            results = await self._execute([args for args, _ in batch])
            if any(isinstance(result, NoScriptError) for result in results):
                # Redis restarted or flushed its script cache since we loaded it
                await self._redis.script_load(WRITE_SCRIPT)
                results = await self._execute([args for args, _ in batch])
            metrics.REDIS_WRITE_SECONDS.observe(time.perf_counter() - started)
            metrics.REDIS_WRITE_BATCH_SIZE.observe(len(batch))
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # its request was cancelled (client went away)
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(None)
        except (RedisError, OSError) as exc:
            error = exc
        finally:
            # whatever happened, no request is left waiting for an answer that will not come
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)

    async def _execute(self, commands: list[tuple[object, ...]]) -> list[object]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for args in commands:
                pipe.execute_command(*args)
            return await pipe.execute(raise_on_error=False)

    async def aclose(self) -> None:
        """Let the writes already sent finish, so no request that got its 201 is cut short."""
        if self._queue:
            self._send_queued()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
