"""Where a reserved email goes to be sent: the monolith's Celery email task (default), or a Redis stream."""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from service.config import Settings
from service.outbox.messages import Message, Publisher, PublishResult
from service.outbox.outboxes import email_kwargs, email_task_id
from service.redis_client import RedisClient, same_slot_prefix
from service.stores import REDIS_FAILED


@dataclass(frozen=True, slots=True)
class QueuedEmail:
    user_id: int
    email_key: str
    source: str
    reserved_at: datetime
    dispatch_id: int = 0  # the emails_emaildispatch row (and its outbox row)

    def fields(self) -> dict[str, str]:
        return {
            "user_id": str(self.user_id),
            "email_key": self.email_key,
            "source": self.source,
            "reserved_at": self.reserved_at.isoformat(),
        }


class EmailQueue(Protocol):
    async def publish(self, email: QueuedEmail) -> None:
        """Return only once the broker has the email; raise if that is not known."""


# KEYS: stream, guard key (in the stream's slot: the script runs on a cluster). ARGV: guard TTL (s), then field,
# value, ...
# The client retries a command once after a timeout (service.redis_client.connect_redis), and a timed-out
# XADD may have been applied: the guard, set in the same script, makes that retry a no-op instead
# of a second entry. The guard names one reservation (its reserved_at included), so a pair that is
# deliberately reserved again later is published again.
PUBLISH_ONCE_SCRIPT = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
  return 1
end
return 0
"""
# only has to outlive the retries of one publish, which take seconds
GUARD_TTL_S = 3600


def publish_guard_key(stream: str, email: QueuedEmail) -> str:
    return f"{same_slot_prefix(stream)}:published:{email.user_id}:{email.email_key}:{email.reserved_at.isoformat()}"


class RedisStreamQueue:
    """One XADD per email on `stream`. The stream is never trimmed: an entry is an email owed."""

    def __init__(self, redis: RedisClient, stream: str) -> None:
        self.stream = stream
        self._publish_once = redis.register_script(PUBLISH_ONCE_SCRIPT)

    async def publish(self, email: QueuedEmail) -> None:
        flat = [item for pair in email.fields().items() for item in pair]
        keys = [self.stream, publish_guard_key(self.stream, email)]
        await self._publish_once(keys=keys, args=[GUARD_TTL_S, *flat])


class BrokerUnavailableError(ConnectionError):
    """The broker could not be reached: the email stays in the outbox for the relay."""


class MessageRefusedError(Exception):
    """The broker will never take this message (e.g. too large): not retried by the batch."""


class CeleryEmailQueue:
    """EMAIL_PUBLISHER=celery: one EMAIL_TASK_NAME task per email, task id derived from its dispatch row."""

    def __init__(self, publisher: Publisher, settings: Settings) -> None:
        self._publisher = publisher
        self._task_name = settings.email_task_name
        self._queue = settings.email_task_queue

    def message(self, email: QueuedEmail) -> Message:
        kwargs = email_kwargs(email.dispatch_id, email.user_id, email.email_key, email.source)
        return Message(email.dispatch_id, self._task_name, self._queue, email_task_id(email.dispatch_id), kwargs)

    async def publish(self, email: QueuedEmail) -> None:
        result = await self._publisher.publish([self.message(email)])
        if result.unavailable is not None:
            raise BrokerUnavailableError(f"email {email.user_id}:{email.email_key} not published: {result.unavailable}")
        if result.refused:
            raise MessageRefusedError(result.refused[email.dispatch_id])


class StreamPublisher:
    """The relay's side of EMAIL_PUBLISHER=redis-stream: outbox messages to the stream, as the batch writes them."""

    def __init__(self, queue: RedisStreamQueue) -> None:
        self._queue = queue

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        result = PublishResult()
        for message in messages:
            kwargs = message.kwargs
            email = QueuedEmail(
                kwargs["user_id"],
                kwargs["email_key"],
                kwargs["source"],
                message.extra["reserved_at"],
                kwargs["dispatch_id"],
            )
            try:
                await self._queue.publish(email)
            except REDIS_FAILED as exc:  # the stream's Redis is this publisher's broker: down, full, failing over
                result.unavailable = repr(exc)
                break
            result.sent.append(message.row_id)
        return result


def build_email_queue(settings: Settings, redis: RedisClient, publisher: Publisher | None) -> EmailQueue:
    """The EMAIL_PUBLISHER the settings name; `publisher` is the Celery one (needed for celery)."""
    if settings.email_publisher == "redis-stream":
        return RedisStreamQueue(redis, settings.email_queue_stream)
    if publisher is None:
        raise ValueError("EMAIL_PUBLISHER=celery needs a Celery publisher (CELERY_BROKER_URL)")
    return CeleryEmailQueue(publisher, settings)


def email_relay_publisher(settings: Settings, redis: RedisClient, publisher: Publisher | None) -> Publisher:
    """What the relay sends the email outbox with: the same destination the batch publishes to."""
    if settings.email_publisher == "redis-stream":
        return StreamPublisher(RedisStreamQueue(redis, settings.email_queue_stream))
    if publisher is None:
        raise ValueError("EMAIL_PUBLISHER=celery needs a Celery publisher (CELERY_BROKER_URL)")
    return publisher
