"""Which content ids exist, read from the monolith's content tables for the door's catalog.

The snapshot is read in pages by primary key, each page one array value: memory while loading stays
a page of Python ints, and the result is a sorted array of 8-byte integers (1M ids: 8 MB).
"""

from array import array

import asyncpg

from service.progress.content import ContentKind

_PAGE_SIZE = 100_000

# Keyset pagination on the primary key: each page is an index range scan, whatever the table size.
# array_agg of the page travels as one value (one row), not one Record per id.
_PAGE_SQL = """
SELECT coalesce(array_agg(id ORDER BY id), '{{}}')
FROM (SELECT id FROM {content_table} WHERE id > $1 ORDER BY id LIMIT $2) AS page
"""

# The catalog's size for `status`: an index-only scan of the primary key (content tables hold thousands of rows).
_COUNT_SQL = "SELECT count(*) FROM {content_table}"

# Ids not in the snapshot (content published since the last refresh, or made up), a batch in one query.
_EXISTING_SQL = "SELECT coalesce(array_agg(id), '{{}}') FROM {content_table} WHERE id = ANY($1::bigint[])"


async def load_ids(pool: asyncpg.Pool, kind: ContentKind, *, page_size: int = _PAGE_SIZE) -> "array[int]":
    """Every id of the kind's content table, ascending."""
    sql = _PAGE_SQL.format(content_table=kind.content_table)
    ids = array("q")
    after = -(2**63)
    while True:
        page = await pool.fetchval(sql, after, page_size)
        ids.extend(page)
        if len(page) < page_size:
            return ids
        after = page[-1]


async def existing(pool: asyncpg.Pool, kind: ContentKind, content_ids: list[int], *, timeout_s: float) -> set[int]:
    """Those of `content_ids` that exist."""
    sql = _EXISTING_SQL.format(content_table=kind.content_table)
    return set(await pool.fetchval(sql, content_ids, timeout=timeout_s))


async def count_ids(conn: asyncpg.Connection | asyncpg.Pool, kind: ContentKind) -> int:
    return int(await conn.fetchval(_COUNT_SQL.format(content_table=kind.content_table)))
