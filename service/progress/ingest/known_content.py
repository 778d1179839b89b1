"""The size of the monolith's content tables, for `status` (the door's catalog reads their ids: service/api/catalog.py).

An index-only scan of the primary key: content tables hold thousands of rows.
"""

import asyncpg

from service.progress.content import ContentKind


async def count_ids(conn: asyncpg.Connection | asyncpg.Pool, kind: ContentKind) -> int:
    return int(await conn.fetchval(f"SELECT count(*) FROM {kind.content_table}"))
