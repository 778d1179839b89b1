"""Claiming pending members with a lease, so a flusher that dies mid-batch loses nothing.

A claimed member moves from the pending set to the in-flight sorted set, scored by its lease deadline, in the
script that reads its value. It leaves the in-flight set only when it is acked (after the Postgres commit, with
the values of the entries the batch dropped) or put back in the pending set. A flusher killed at any point
leaves its members in flight; once their lease is past, any flusher requeues them. Leases are scored and
expired by Redis's clock (TIME), never a pod's: a pod whose clock is an hour ahead neither takes another's
valid lease nor holds its own an hour too long. A value's TTL starts at the ack, so it cleans up what was
flushed and nothing else, however slow the drain; a value written again since the claim is pending and keeps
none. Every script works on one shard's keys (one hash slot), so they run on a Redis Cluster too.
"""

from collections.abc import Collection
from dataclasses import dataclass

from redis.commands.core import AsyncScript

from service.progress.keys import Shard
from service.redis_client import RedisClient

# KEYS: pending set, in-flight zset. ARGV: count, lease (ms), the shard's latest-position key prefix
# (it carries the shard's hash tag: the value keys built from it are in the slot of KEYS).
# The lease score is the deadline, Redis's now + lease, in ms with the microseconds as a fraction (built
# as a string: a Lua number prints 14 digits). It identifies this claim: a member is claimed again only
# once this deadline has passed (requeued: the next deadline is later) or once this claim released it.
# Returns {members, values, score} (a value is false when its TTL expired). Commands take the members in
# chunks: one ZADD and one MGET per chunk instead of one call per member, within Lua's stack limit.
_CLAIM = """
local clock = redis.call('TIME')
local micros = tonumber(clock[2])
local deadline_ms = tonumber(clock[1]) * 1000 + (micros - micros % 1000) / 1000 + tonumber(ARGV[2])
local score = string.format('%d.%03d', deadline_ms, micros % 1000)
local members = redis.call('SPOP', KEYS[1], ARGV[1])
local values = {}
for first = 1, #members, 1000 do
  local last = math.min(first + 999, #members)
  local scored, keys = {}, {}
  for i = first, last do
    scored[#scored + 1] = score
    scored[#scored + 1] = members[i]
    keys[#keys + 1] = ARGV[3] .. members[i]
  end
  redis.call('ZADD', KEYS[2], unpack(scored))
  local got = redis.call('MGET', unpack(keys))
  for i = 1, #got do values[first + i - 1] = got[i] end
end
return {members, values, score}
"""

# KEYS: in-flight zset, pending set. ARGV: lease score, 1 to put back in pending / 0 to drop, the shard's
# latest-position key prefix, the values' TTL once flushed (s), the number of members n, n members, then
# (member, value as claimed) pairs to forget. Only a lease that is still ours is touched: if it expired
# and another flusher claimed the member again, that flusher's lease must survive our late ack.
# Forgetting deletes the value of an entry the flush dropped (unknown user or content, unreadable), in
# the script that settles it, so a flood of made-up users does not hold Redis memory for the value's
# TTL. Only a value unchanged since the claim, of a member settled here and not pending again, goes:
# a heartbeat written since (which re-adds the member) is the next flush's to judge.
_SETTLE = """
local lease = tonumber(ARGV[1])
local last_member = 5 + tonumber(ARGV[5])
local settled = 0
local ours = {}
for first = 6, last_member, 1000 do
  local last = math.min(first + 999, last_member)
  local members = {unpack(ARGV, first, last)}
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(members))
  local chunk = {}
  for i = 1, #members do
    if scores[i] and tonumber(scores[i]) == lease then
      chunk[#chunk + 1] = members[i]
      ours[members[i]] = true
    end
  end
  if #chunk > 0 then
    redis.call('ZREM', KEYS[1], unpack(chunk))
    if ARGV[2] == '1' then
      redis.call('SADD', KEYS[2], unpack(chunk))
    else
      -- flushed: the value may go in its TTL, unless it was written again since (pending again)
      for _, member in ipairs(chunk) do
        if redis.call('SISMEMBER', KEYS[2], member) == 0 then redis.call('EXPIRE', ARGV[3] .. member, ARGV[4]) end
      end
    end
    settled = settled + #chunk
  end
end
for i = last_member + 1, #ARGV, 2 do
  local member, key = ARGV[i], ARGV[3] .. ARGV[i]
  if ours[member] and redis.call('GET', key) == ARGV[i + 1] and redis.call('SISMEMBER', KEYS[2], member) == 0 then
    redis.call('DEL', key)
  end
end
return settled
"""

# KEYS: in-flight zset, pending set. ARGV: max members, ms ahead of Redis's now (0 but in tests).
# Returns how many were requeued.
_REQUEUE_EXPIRED = """
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) + tonumber(ARGV[2])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now_ms), 'LIMIT', 0, ARGV[1])
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('SADD', KEYS[2], member)
end
return #expired
"""


@dataclass(frozen=True, slots=True)
class Claim:
    shard: Shard
    lease_score: str  # deadline in Redis's ms, its microseconds as a fraction: identifies this claim
    entries: list[tuple[str, bytes | None]]  # (member, raw value or None if expired)


class Leases:
    def __init__(self, redis: RedisClient, *, value_ttl_s: int = 3600) -> None:
        self._value_ttl_s = value_ttl_s
        self._claim: AsyncScript = redis.register_script(_CLAIM)
        self._settle: AsyncScript = redis.register_script(_SETTLE)
        self._requeue: AsyncScript = redis.register_script(_REQUEUE_EXPIRED)

    async def claim_batch(self, shard: Shard, *, count: int, lease_ms: int) -> Claim:
        members, values, lease_score = await self._claim(
            keys=[shard.pending_key, shard.in_flight_key], args=[count, lease_ms, shard.value_prefix]
        )
        entries = [
            (member.decode() if isinstance(member, bytes) else member, value or None)
            for member, value in zip(members, values, strict=True)
        ]
        return Claim(shard, lease_score.decode() if isinstance(lease_score, bytes) else lease_score, entries)

    async def ack(self, claim: Claim, *, dropped: Collection[str] = (), requeue: bool = False) -> int:
        """The batch is committed: forget it, and the values of its `dropped` members unless written since.
        `requeue`: it was not committed: it goes back to the pending set now, not after the lease."""
        drop = set(dropped)
        forget = [part for member, raw in claim.entries if member in drop and raw is not None for part in (member, raw)]
        return int(
            await self._settle(
                keys=[claim.shard.in_flight_key, claim.shard.pending_key],
                args=[
                    claim.lease_score,
                    "1" if requeue else "0",
                    claim.shard.value_prefix,
                    self._value_ttl_s,
                    len(claim.entries),
                    *(member for member, _ in claim.entries),
                    *forget,
                ],
            )
        )

    async def requeue_expired(self, shard: Shard, *, limit: int = 10_000, ahead_ms: int = 0) -> int:
        """Leases of flushers that died: their members go back to the pending set. `ahead_ms`: also the leases
        that end within that much of Redis's now (a test's way to move time forward)."""
        total = 0
        while True:
            moved: int = await self._requeue(keys=[shard.in_flight_key, shard.pending_key], args=[limit, ahead_ms])
            total += moved
            if moved < limit:
                return total
