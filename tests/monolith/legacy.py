"""The monolith's legacy progress task, which its design note keeps running through the cutover (messages in flight).

`save_progress_*` does one UPDATE per heartbeat on the progress table (the row inserted if missing), with
`updated_at = now()`: Postgres's clock, at the task's run, not the heartbeat's receipt. The first time the position
reaches `duration - margin` it sets `completed_at` and, after its commit, calls its own `advance_user_journey`
(recorded here in `announced`, as "announced by legacy").

Written as the monolith's Django task would plausibly be, `select_for_update()` inside `transaction.atomic()`:
the row is locked from the read of `completed_at` to the write, so a completion the service's flush commits
meanwhile is seen, never overwritten nor announced twice. `lock_row=False` is the same task without the lock (a
plain `get()` then `save()` of every field): what it does when the flush commits between its read and its write
is tests/monolith/test_cutover.py's last test.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from service.config import Settings
from service.progress.completion import completes

# content type -> (progress table, id column, content table): the monolith's own tables
TABLES = {
    "lesson": ("engagements_lessonprogress", "lesson_id", "courses_lesson"),
    "audio": ("audios_audioprogress", "audio_id", "audios_audio"),
    "meditation": ("audios_meditationprogress", "meditation_id", "audios_meditation"),
    "live": ("lives_liveprogress", "live_id", "lives_live"),
}
# the monolith's near-end rule: the service's, with its default margin
MARGIN_S = Settings.model_fields["progress_completion_margin_seconds"].default


@dataclass(frozen=True)
class Announcement:
    content_type: str
    content_id: int
    user_id: int
    completed_at: datetime


@dataclass
class LegacyWriter:
    pool: asyncpg.Pool
    announced: list[Announcement] = field(default_factory=list)

    async def save_progress(
        self,
        content_type: str,
        *,
        content_id: int,
        user_id: int,
        position: float,
        lock_row: bool = True,
        after_read: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """One heartbeat, as the legacy task runs it. `after_read`: what another writer does between this task's
        read and its write (only without the row lock: with it, that writer would wait for this one)."""
        table, column, content_table = TABLES[content_type]
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                # get_or_create: the row, inserted if missing (the service's flush may insert it first)
                await conn.execute(
                    f"INSERT INTO {table} (user_id, {column}, position, created_at, updated_at) "
                    f"VALUES ($1, $2, $3, now(), now()) ON CONFLICT (user_id, {column}) DO NOTHING",
                    user_id,
                    content_id,
                    position,
                )
                read = await conn.fetchrow(
                    f"SELECT p.completed_at, c.duration FROM {table} p JOIN {content_table} c ON c.id = p.{column} "
                    f"WHERE p.user_id = $1 AND p.{column} = $2" + (" FOR UPDATE OF p" if lock_row else ""),
                    user_id,
                    content_id,
                )
                if after_read is not None:
                    await after_read()
                sets_completion = read["completed_at"] is None and completes(position, read["duration"], MARGIN_S)
                # save(): every field from what was read, updated_at = now() (auto_now)
                completed_at = await conn.fetchval(
                    f"UPDATE {table} SET position = $3, updated_at = now(), "
                    "completed_at = CASE WHEN $4 THEN now() ELSE $5::timestamptz END "
                    f"WHERE user_id = $1 AND {column} = $2 RETURNING completed_at",
                    user_id,
                    content_id,
                    position,
                    sets_completion,
                    read["completed_at"],
                )
            if sets_completion:  # advance_user_journey.delay(...) once the transaction committed
                self.announced.append(Announcement(content_type, content_id, user_id, completed_at))
