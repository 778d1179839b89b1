"""docs/configuration.md's table lists every setting the service reads, and nothing else."""

import re

from service.config import Settings
from tests.deploy.files import CONFIGURATION_DOC, table_rows

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
