"""EMAIL_PUBLISHER=redis-stream: the relay sends the email outbox to a Redis stream, for a sender that reads one.

The monolith's Celery email task is the default destination (EMAIL_PUBLISHER=celery, celery_publisher).
"""

from collections.abc import Sequence

from service.outbox.messages import Message, PublishResult
from service.redis_client import RedisClient, same_slot_prefix
from service.stores import REDIS_FAILED

# KEYS: stream, guard key (in the stream's slot: the script runs on a cluster). ARGV: guard TTL (s), field, value, ...
# The client retries a command once after a timeout (service.redis_client.connect_redis), and a timed-out XADD may
# have been applied: the guard, set in the same script, makes that retry a no-op instead of a second entry. The guard
# names the dispatch row, so a relay that republishes it within the guard's TTL adds no second entry either.
PUBLISH_ONCE_SCRIPT = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
  return 1
end
return 0
"""
# outlives a client's retry (seconds) and a dead relay's lease (RELAY_LEASE_SECONDS, a minute by default)
GUARD_TTL_S = 3600


def publish_guard_key(stream: str, dispatch_id: int) -> str:
    return f"{same_slot_prefix(stream)}:published:{dispatch_id}"


class StreamPublisher:
    """One XADD per email on `stream`. The stream is never trimmed: an entry is an email owed."""

    def __init__(self, redis: RedisClient, stream: str) -> None:
        self.stream = stream
        self._publish_once = redis.register_script(PUBLISH_ONCE_SCRIPT)

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        result = PublishResult()
        for message in messages:
            kwargs = message.kwargs
            fields = {
                "user_id": str(kwargs["user_id"]),
                "email_key": kwargs["email_key"],
                "source": kwargs["source"],
                "reserved_at": message.extra["reserved_at"].isoformat(),
            }
            keys = [self.stream, publish_guard_key(self.stream, kwargs["dispatch_id"])]
            try:
                await self._publish_once(
                    keys=keys, args=[GUARD_TTL_S, *(item for pair in fields.items() for item in pair)]
                )
            except REDIS_FAILED as exc:  # the stream's Redis is this publisher's broker: down, full, failing over
                result.unavailable = repr(exc)
                break
            result.sent.append(message.row_id)
        return result
