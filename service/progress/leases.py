"""Claiming pending members with a lease, so a flusher that dies mid-batch loses nothing.

A claimed member moves from the pending set to the in-flight sorted set, scored by its lease
deadline, in the same script that reads its value. It leaves the in-flight set only when it is
acked (after the Postgres commit) or released/requeued back to the pending set. A flusher killed
at any point leaves its members in flight; once their lease is past, any flusher requeues them.
Every script works on one shard (service/progress/keys.py): its keys share one hash slot, so the
same scripts run on a Redis Cluster.
"""

import secrets
from dataclasses import dataclass

from redis.commands.core import AsyncScript

from service.clients import RedisClient
from service.progress.keys import Shard

# KEYS: pending set, in-flight zset. ARGV: count, lease score, the shard's latest-position key prefix
# (it carries the shard's hash tag: the value keys built from it are in the slot of KEYS).
# Returns {members, values} (a value is false when its TTL expired). Commands take the members in
# chunks: one ZADD and one MGET per chunk instead of one call per member, within Lua's stack limit.
_CLAIM = """
local members = redis.call('SPOP', KEYS[1], ARGV[1])
local values = {}
for first = 1, #members, 1000 do
  local last = math.min(first + 999, #members)
  local scored, keys = {}, {}
  for i = first, last do
    scored[#scored + 1] = ARGV[2]
    scored[#scored + 1] = members[i]
    keys[#keys + 1] = ARGV[3] .. members[i]
  end
  redis.call('ZADD', KEYS[2], unpack(scored))
  local got = redis.call('MGET', unpack(keys))
  for i = 1, #got do values[first + i - 1] = got[i] end
end
return {members, values}
"""

# KEYS: in-flight zset, pending set. ARGV: lease score, 1 to put back in pending / 0 to drop, members...
# Only a lease that is still ours is touched: if it expired and another flusher claimed the member
# again, that flusher's lease must survive our late ack.
_SETTLE = """
local lease = tonumber(ARGV[1])
local settled = 0
for first = 3, #ARGV, 1000 do
  local last = math.min(first + 999, #ARGV)
  local members = {unpack(ARGV, first, last)}
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(members))
  local ours = {}
  for i = 1, #members do
    if scores[i] and tonumber(scores[i]) == lease then ours[#ours + 1] = members[i] end
  end
  if #ours > 0 then
    redis.call('ZREM', KEYS[1], unpack(ours))
    if ARGV[2] == '1' then redis.call('SADD', KEYS[2], unpack(ours)) end
    settled = settled + #ours
  end
end
return settled
"""

# KEYS: in-flight zset, pending set. ARGV: now (ms), max members. Returns how many were requeued.
_REQUEUE_EXPIRED = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('SADD', KEYS[2], member)
end
return #expired
"""


@dataclass(frozen=True, slots=True)
class Claim:
    shard: Shard
    lease_score: str  # deadline in ms plus a random fraction: identifies this claim
    entries: list[tuple[str, bytes | None]]  # (member, raw value or None if expired)

    @property
    def content_type(self) -> str:
        return self.shard.content_type

    @property
    def members(self) -> list[str]:
        return [member for member, _ in self.entries]


class Leases:
    def __init__(self, redis: RedisClient) -> None:
        self._claim: AsyncScript = redis.register_script(_CLAIM)
        self._settle: AsyncScript = redis.register_script(_SETTLE)
        self._requeue: AsyncScript = redis.register_script(_REQUEUE_EXPIRED)

    async def claim_batch(self, shard: Shard, *, count: int, now_ms: int, lease_ms: int) -> Claim:
        # the random fraction makes two claims of the same member in the same millisecond distinct
        lease_score = f"{now_ms + lease_ms}.{secrets.randbelow(1000):03d}"
        flat = await self._claim(
            keys=[shard.pending_key, shard.in_flight_key], args=[count, lease_score, shard.value_prefix]
        )
        members, values = flat
        entries = [(member.decode() if isinstance(member, bytes) else member, value or None)
                   for member, value in zip(members, values, strict=True)]  # fmt: skip
        return Claim(shard, lease_score, entries)

    async def ack(self, claim: Claim) -> int:
        """The batch is committed: forget it."""
        return await self._settle_claim(claim, requeue=False)

    async def release(self, claim: Claim) -> int:
        """The batch was not committed: put it back in the pending set now, not after the lease."""
        return await self._settle_claim(claim, requeue=True)

    async def _settle_claim(self, claim: Claim, *, requeue: bool) -> int:
        if not claim.entries:
            return 0
        settled: int = await self._settle(
            keys=[claim.shard.in_flight_key, claim.shard.pending_key],
            args=[claim.lease_score, "1" if requeue else "0", *claim.members],
        )
        return settled

    async def requeue_expired(self, shard: Shard, *, now_ms: int, limit: int = 10_000) -> int:
        """Leases of flushers that died: their members go back to the pending set."""
        total = 0
        while True:
            moved: int = await self._requeue(
                keys=[shard.in_flight_key, shard.pending_key], args=[now_ms, limit]
            )
            total += moved
            if moved < limit:
                return total
