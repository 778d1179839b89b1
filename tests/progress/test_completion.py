"""The completion rule's two forms, the flush's SQL and the reads' Python, judge every edge alike on Postgres."""

import math

import asyncpg

from service.progress.completion import completes, completes_sql
from service.progress.content import CONTENT_KINDS
from service.progress.flush.store import upsert_sql

DURATIONS = [0, 1, 10, 600, 86_400]  # integer seconds, as the content tables keep them
MARGINS = [0.0, 1e-9, 0.1, 0.3, 10.0, 10.5, 700.0]  # 700: more than the content lasts


def edges(duration: int, margin: float) -> list[float]:
    threshold = duration - margin
    return [
        threshold,
        math.nextafter(threshold, -math.inf),
        math.nextafter(threshold, math.inf),
        threshold + 0.1 + 0.2,  # sums that do not land where decimal arithmetic would
        threshold - 0.1 - 0.2,
        0.0,
        float(duration),
        86_400.0,
    ]


async def test_the_sql_and_the_python_rule_agree_on_every_edge(db: asyncpg.Pool) -> None:
    cases = [(peak, d, m) for d in DURATIONS for m in MARGINS for peak in edges(d, m) if peak >= 0]
    judged = await db.fetch(
        f"SELECT {completes_sql('peak', 'duration', 'margin')} AS completes"
        " FROM unnest($1::float8[], $2::integer[], $3::float8[]) WITH ORDINALITY AS t(peak, duration, margin, i)"
        " ORDER BY i",
        *map(list, zip(*cases, strict=True)),
    )
    by_postgres = [row["completes"] for row in judged]
    by_python = [completes(peak, d, m) for peak, d, m in cases]
    assert by_postgres == by_python
    assert True in by_python and False in by_python


def test_the_flush_judges_with_the_one_rule() -> None:
    for kind in CONTENT_KINDS:
        assert completes_sql("h.peak", "c.duration", "$5::float8") in upsert_sql(kind)
