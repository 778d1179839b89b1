"""Where a reserved email goes to be sent: any broker behind EmailQueue; a Redis stream by default."""

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from service.clients import RedisClient, same_slot_prefix


@dataclass(frozen=True, slots=True)
class QueuedEmail:
    user_id: int
    email_key: str
    source: str
    reserved_at: datetime

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
# The client retries a command once after a timeout (service.clients.connect_redis), and a timed-out
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
