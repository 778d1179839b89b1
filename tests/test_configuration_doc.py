"""docs/configuration.md's table lists every setting the service reads, and nothing else; its list of removed
settings is the service's, and a deployment that still sets one starts, warned once for each."""

import logging
import re

import pytest
from redis.asyncio import Redis

from service.config import REMOVED_SETTINGS, Settings, load_settings
from tests.deploy.files import CONFIGURATION_DOC, table_rows
from tests.helpers import auth, running_app

# read outside Settings: by the CLI (HOST/PORT/WORKERS), the dev command, the metrics endpoint
OTHER_VARIABLES = {"HOST", "PORT", "WORKERS", "PROMETHEUS_MULTIPROC_DIR", "DEV_DATA_DIR", "MIGRATIONS_DIR"}
# read by service/tracing.py and the OpenTelemetry SDK
OTHER_VARIABLES |= {"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME",
                    "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED"}  # fmt: skip


def configuration_table() -> set[str]:
    rows = table_rows(CONFIGURATION_DOC, "| variable | default | meaning |")
    assert rows, f"{CONFIGURATION_DOC.name} needs a table of `VARIABLE` | default | meaning"
    names: set[str] = set()
    for cells in rows:
        names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0]))
    return names


def test_every_setting_is_documented_and_every_documented_variable_exists() -> None:
    settings = {name.upper() for name in Settings.model_fields}
    assert configuration_table() == settings | OTHER_VARIABLES


def test_the_removed_settings_are_documented_and_none_is_read() -> None:
    rows = table_rows(CONFIGURATION_DOC, "| removed variable | replaced by |")
    assert rows, f"{CONFIGURATION_DOC.name} needs a table of `VARIABLE` | replaced by"
    assert [re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0]) for cells in rows] == [[name] for name in REMOVED_SETTINGS]
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
