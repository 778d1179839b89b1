"""docs/configuration.md's table lists every setting the service reads, and nothing else; its list of removed
settings is the service's, and a deployment that still sets one starts, warned once for each."""

import logging
import re

import pytest
from redis.asyncio import Redis

from service.config import REMOVED_SETTINGS, Settings, load_settings
from tests.deploy.files import CONFIGURATION_DOC
from tests.helpers import auth, running_app

# read outside Settings: by the CLI (HOST/PORT/WORKERS), the dev command, the metrics endpoint
OTHER_VARIABLES = {"HOST", "PORT", "WORKERS", "PROMETHEUS_MULTIPROC_DIR", "DEV_DATA_DIR", "MIGRATIONS_DIR"}
# read by service/tracing.py and the OpenTelemetry SDK: one row, `OTEL_*`
OTHER_VARIABLES.add("OTEL_")
MOST_ROWS = 55  # a setting no operator turns is a constant of its part


def configuration_rows() -> list[str]:
    """The first cell of each row of the doc's tables (one per subsystem) of `VARIABLE` | default | meaning."""
    lines = CONFIGURATION_DOC.read_text().splitlines()
    cells = []
    in_table = False
    for line in lines:
        if line.startswith("| variable | default | meaning |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and line.startswith("| `"):
            cells.append(line.split("|")[1])
    assert cells, f"{CONFIGURATION_DOC.name} needs tables of `VARIABLE` | default | meaning"
    return cells


def configuration_table() -> set[str]:
    names: set[str] = set()
    for cell in configuration_rows():
        names.update(re.findall(r"`([A-Z][A-Z0-9_]+)\*?`", cell))
    return names


def test_the_configuration_stays_small() -> None:
    assert len(configuration_rows()) <= MOST_ROWS


def test_every_setting_is_documented_and_every_documented_variable_exists() -> None:
    settings = {name.upper() for name in Settings.model_fields}
    assert configuration_table() == settings | OTHER_VARIABLES


def test_the_removed_settings_are_documented_and_none_is_read() -> None:
    removed = CONFIGURATION_DOC.read_text().split("\n## Removed settings\n", 1)[-1]
    listed = re.findall(r"^- `([A-Z][A-Z0-9_]+)`: \S", removed, re.MULTILINE)
    assert listed == list(REMOVED_SETTINGS), f"{CONFIGURATION_DOC.name} needs a list of - `VARIABLE`: replaced by"
    assert not set(REMOVED_SETTINGS) & {name.upper() for name in Settings.model_fields}


async def test_a_deployment_that_still_sets_a_removed_setting_starts_with_one_warning_naming_its_replacement(
    settings: Settings, redis: Redis, token: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    removed = next(iter(REMOVED_SETTINGS))
    for name, value in settings.model_dump(mode="json").items():
        if isinstance(value, str | int | float | bool):
            monkeypatch.setenv(name.upper(), str(value).lower() if isinstance(value, bool) else str(value))
    monkeypatch.setenv(removed, "2")
    with caplog.at_level(logging.WARNING, logger="service.config"):
        loaded = load_settings()
        load_settings()  # as `serve` does: its own, then the app's
    warnings = [r.getMessage() for r in caplog.records if r.name == "service.config"]
    assert len(warnings) == 1 and removed in warnings[0] and REMOVED_SETTINGS[removed] in warnings[0]
    async with running_app(loaded) as (_, client):
        response = await client.post("/audios/progress", json={"audio_id": 1, "position": 3}, headers=auth(token))
        assert response.status_code == 201
