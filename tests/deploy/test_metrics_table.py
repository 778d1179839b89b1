"""The README's metrics table is what /metrics serves: every metric, its type and its labels."""

import re

import httpx

from tests.deploy.files import readme_metrics_table, service_metrics


async def test_readme_metrics_table_matches_what_metrics_serves(client: httpx.AsyncClient) -> None:
    table = readme_metrics_table()
    assert table, "README.md needs a `## Metrics` section with a table of `metric` | type | labels | alert"
    defined = service_metrics()
    assert sorted(table) == sorted(defined), "the README table and service/metrics.py list different metrics"
    served = (await client.get("/metrics")).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", served, re.MULTILINE))
    for name, row in table.items():
        assert types.get(name) == row.type, f"{name}: README says {row.type}, /metrics says {types.get(name)}"
        assert row.labels == defined[name].labels, f"{name}: README labels {row.labels}"
