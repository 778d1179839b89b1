"""Redis key names, kept from the monolith's design so both can read the same buffer."""

LATEST_POSITION_PREFIX = "progress:latest_position:"
PENDING_FLUSH_PREFIX = "progress:pending_flush:"
IN_FLIGHT_PREFIX = "progress:in_flight:"


def latest_position_key(content_type: str, content_id: int, user_id: int) -> str:
    return f"{LATEST_POSITION_PREFIX}{content_type}:{content_id}:{user_id}"


def pending_flush_key(content_type: str) -> str:
    return f"{PENDING_FLUSH_PREFIX}{content_type}"


def in_flight_key(content_type: str) -> str:
    """Sorted set of members claimed by a flusher, scored by lease deadline (ms)."""
    return f"{IN_FLIGHT_PREFIX}{content_type}"


def pending_member(content_id: int, user_id: int) -> str:
    return f"{content_id}:{user_id}"


def parse_member(member: str) -> tuple[int, int]:
    content_id, user_id = member.split(":")
    return int(content_id), int(user_id)
