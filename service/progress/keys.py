"""Redis key names, kept from the monolith's design so both can read the same buffer.

The buffer of one content type is split into shards. A shard's value keys, pending set and in-flight
set share one hash tag, so every script touches one hash slot and runs on a Redis Cluster. With one
shard on a standalone server (the default) there is no tag and the names are exactly the monolith's:

    progress:latest_position:lesson:5:7   progress:pending_flush:lesson   progress:in_flight:lesson

With shards, the content type is replaced by the shard's tag, e.g. `{lesson:7~41}`:

    progress:latest_position:{lesson:7~41}:5:7   progress:pending_flush:{lesson:7~41}   ...

Every caller goes through KeyLayout (which shard, which keys): it is the one place that knows.
"""

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache, cached_property

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from service.config import RedisSettings

# the fleet's write budget (service/progress/flush/budget.py): one key, its own hash tag, so one slot on a cluster
FLUSH_BUDGET_KEY = "progress:flush_budget:{flush_budget}"

# 60 shards divide evenly over 3, 4, 5, 6, 10 and 12 masters (and within 7 % over 7-11): see _shard_tag
CLUSTER_DEFAULT_SHARDS = 60


def pending_member(content_id: int, user_id: int) -> str:
    return f"{content_id}:{user_id}"


def parse_member(member: str) -> tuple[int, int]:
    content_id, user_id = member.split(":")
    return int(content_id), int(user_id)


@dataclass(frozen=True, slots=True)
class Shard:
    """One pending set with its in-flight set and value keys: what one claim, settle or write touches."""

    content_type: str
    name: str  # what follows the prefixes: the content type, or its shard's `{tag}`

    @property
    def pending_key(self) -> str:
        return f"progress:pending_flush:{self.name}"

    @property
    def in_flight_key(self) -> str:
        return f"progress:in_flight:{self.name}"

    @property
    def value_prefix(self) -> str:
        """The claim script appends a pending member to this to find its value."""
        return f"progress:latest_position:{self.name}:"

    def value_key(self, content_id: int, user_id: int) -> str:
        return f"{self.value_prefix}{content_id}:{user_id}"


def _shard_tag(content_type: str, index: int, shards: int) -> str:
    """A tag whose slot lies in the index-th of `shards` equal slot ranges.

    A cluster's masters own contiguous, near-equal slot ranges, so shards spread over equal ranges
    spread evenly over the masters; tags of plain hashes would land ±20 % apart with a few dozen
    shards. The suffix is the first that lands in range: deterministic, so every pod finds the same.
    """
    low = index * REDIS_CLUSTER_HASH_SLOTS // shards
    high = (index + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
    suffix = 0
    while True:
        tag = f"{content_type}:{index}~{suffix}"
        if low <= key_slot(tag.encode()) < high:
            return tag
        suffix += 1


@cache  # the tag's search runs once per shard, not on every write
def _shard(content_type: str, index: int, shards: int, cluster: bool) -> Shard:
    # one shard on a standalone server keeps the monolith's names; a cluster needs tags always
    tagged = cluster or shards > 1
    return Shard(content_type, "{" + _shard_tag(content_type, index, shards) + "}" if tagged else content_type)


@dataclass(frozen=True)
class KeyLayout:
    """Which shard a (content, user) belongs to and the names of its keys.

    `previous_shards` is the shard count before a change: the flusher still drains those shards,
    so members pending under the old layout are persisted (writes use `shards` only), and the reads
    and the sync look at their values too (`previous`).
    """

    shards: int = 1
    cluster: bool = False
    previous_shards: int = 0

    @classmethod
    def from_settings(cls, settings: RedisSettings) -> "KeyLayout":
        """The layout PROGRESS_BUFFER_SHARDS, REDIS_CLUSTER and PROGRESS_BUFFER_PREVIOUS_SHARDS name; 0 shards is the
        default: 1 on a standalone server (the monolith's key names), CLUSTER_DEFAULT_SHARDS on a cluster."""
        shards = settings.shards or (CLUSTER_DEFAULT_SHARDS if settings.cluster else 1)
        return cls(shards=shards, cluster=settings.cluster, previous_shards=settings.previous_shards)

    @cached_property
    def previous(self) -> "KeyLayout | None":
        """The layout of `previous_shards`, whose values a pod still on the old count writes; None without one."""
        changed = self.previous_shards not in (0, self.shards)
        return KeyLayout(shards=self.previous_shards, cluster=self.cluster) if changed else None

    def shard(self, content_type: str, content_id: int, user_id: int) -> Shard:
        # crc32, not hash(): stable across processes, every pod picks the same shard; one shard (the standalone
        # default): no hash to work out on the request path
        index = zlib.crc32(pending_member(content_id, user_id).encode()) % self.shards if self.shards > 1 else 0
        return _shard(content_type, index, self.shards, self.cluster)

    def value_key(self, content_type: str, content_id: int, user_id: int) -> str:
        return self.shard(content_type, content_id, user_id).value_key(content_id, user_id)

    def value_keys(self, content_type: str, user_id: int, content_ids: Iterable[int]) -> list[str]:
        """value_key of each id, in order: with one shard, one prefix for them all (a read names 100), and
        Shard.value_key's format written out (tests/api/test_read_decoding.py holds the two equal)."""
        if self.shards > 1:
            return [self.value_key(content_type, content_id, user_id) for content_id in content_ids]
        prefix = _shard(content_type, 0, 1, self.cluster).value_prefix
        return [f"{prefix}{content_id}:{user_id}" for content_id in content_ids]

    def shards_of(self, content_type: str) -> list[Shard]:
        """Every shard writes go to."""
        return [_shard(content_type, index, self.shards, self.cluster) for index in range(self.shards)]

    def shards_to_flush(self, content_type: str) -> list[Shard]:
        """Every shard that can hold pending members: today's, then those of the previous count."""
        current = self.shards_of(content_type)
        previous = [] if self.previous is None else self.previous.shards_of(content_type)
        return current + [shard for shard in previous if shard not in current]


STANDALONE = KeyLayout()
