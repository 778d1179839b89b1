"""What the relay and the writers hand a publisher, and what it answers: no broker, no Celery here."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Message:
    """One Celery task owed to the monolith; `row_id` is its outbox row."""

    row_id: int
    task_name: str
    queue: str
    task_id: str
    kwargs: dict[str, Any]
    # what a publisher other than Celery may need besides the kwargs (the email stream: reserved_at)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PublishResult:
    sent: list[int] = field(default_factory=list)  # row ids the broker acknowledged
    refused: dict[int, str] = field(default_factory=dict)  # row id -> why the broker will never take it
    # the broker could not be reached, or not in time: the rows neither sent nor refused were not published
    unavailable: str | None = None


class Publisher(Protocol):
    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        """Send in order; report what the broker took, refused, or could not be asked."""
