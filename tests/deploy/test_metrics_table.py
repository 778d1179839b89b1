"""docs/metrics.md's table is what /metrics serves: every metric, its type and its labels."""

import re

import httpx

from tests.deploy.files import metrics_doc_table, service_metrics


async def test_the_metrics_doc_table_matches_what_metrics_serves(client: httpx.AsyncClient) -> None:
    table = metrics_doc_table()
    assert table, "docs/metrics.md needs a table of `metric` | type | labels | what it drives"
    defined = service_metrics()
    assert sorted(table) == sorted(defined), "docs/metrics.md and service/metrics.py list different metrics"
    served = (await client.get("/metrics")).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", served, re.MULTILINE))
    for name, row in table.items():
        assert types.get(name) == row.type, f"{name}: docs/metrics.md says {row.type}, /metrics says {types.get(name)}"
        assert row.labels == defined[name].labels, f"{name}: docs/metrics.md labels {row.labels}"
