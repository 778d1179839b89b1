"""How much the buffer holds: pending and in-flight members per content type, summed over every shard.

Cheap on any backlog: SCARD and ZCARD are O(1); with `leases`, the head of each in-flight set
(ZRANGE 0 0: the earliest lease deadline, so the oldest claim) and a ZCOUNT of the leases already
past (O(log n)). Every shard's commands travel in one round trip per node. A pending set keeps no
order, so the age of its oldest member is not known without a scan: progress_flush_lag_seconds says
how late positions reach the database.
"""

from dataclasses import dataclass, field

from service.progress.content import CONTENT_KINDS
from service.progress.keys import KeyLayout, Shard
from service.redis_client import RedisClient, execute_by_node


@dataclass
class TypeBacklog:
    pending: int = 0
    in_flight: int = 0
    expired_leases: int = 0  # in flight past their lease: a flusher died or stalled; the next cycle requeues them
    earliest_lease_ms: float | None = None  # the oldest claim's lease deadline
    unread: int = 0  # replies of its shards that failed (their node did not answer): the counts are partial


@dataclass
class Backlog:
    by_type: dict[str, TypeBacklog]
    # what the nodes that did not answer raised; their shards are counted as empty
    errors: list[Exception] = field(default_factory=list)
    answered: int = 0  # replies that came back
    # pending + in flight of each shard; None where its node did not answer
    by_shard: dict[Shard, int | None] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return sum(sizes.pending for sizes in self.by_type.values())


async def measure_backlog(redis: RedisClient, layout: KeyLayout, *, leases_at_ms: int | None = None) -> Backlog:
    """The sizes of every shard's sets; with `leases_at_ms` (now), the oldest lease and those expired by then."""
    per_shard: list[tuple[object, ...]] = []
    for kind in CONTENT_KINDS:
        for shard in layout.shards_to_flush(kind.name):
            per_shard += [("SCARD", shard.pending_key), ("ZCARD", shard.in_flight_key)]
            if leases_at_ms is not None:
                per_shard += [
                    ("ZRANGE", shard.in_flight_key, 0, 0, "WITHSCORES"),
                    ("ZCOUNT", shard.in_flight_key, "-inf", leases_at_ms),
                ]
    replies = iter(await execute_by_node(redis, per_shard, key_index=1))
    backlog = Backlog({})
    for kind in CONTENT_KINDS:
        sizes = backlog.by_type[kind.name] = TypeBacklog()
        for shard in layout.shards_to_flush(kind.name):
            read = [next(replies) for _ in range(2 if leases_at_ms is None else 4)]
            failed = [reply for reply in read if isinstance(reply, Exception)]
            backlog.errors += failed
            backlog.answered += len(read) - len(failed)
            sizes.unread += len(failed)
            pending, in_flight = (reply if isinstance(reply, int) else 0 for reply in read[:2])
            sizes.pending += pending
            sizes.in_flight += in_flight
            backlog.by_shard[shard] = pending + in_flight if all(isinstance(reply, int) for reply in read[:2]) else None
            if leases_at_ms is None:
                continue
            head, expired = read[2:]
            sizes.expired_leases += expired if isinstance(expired, int) else 0
            if isinstance(head, list) and head:  # [member, score] (RESP2) or [[member, score]]
                score = float((head[0] if isinstance(head[0], list | tuple) else head)[1])
                if sizes.earliest_lease_ms is None or score < sizes.earliest_lease_ms:
                    sizes.earliest_lease_ms = score
    return backlog
