"""The content tables' sizes for `status`: an index-only scan of each primary key (they hold thousands of rows)."""

import asyncpg

from service.progress.content import ContentKind


async def count_ids(conn: asyncpg.Connection | asyncpg.Pool, kind: ContentKind) -> int:
    return int(await conn.fetchval(f"SELECT count(*) FROM {kind.content_table}"))
