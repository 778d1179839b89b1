"""The README's configuration table lists every setting the service reads, and nothing else."""

import re
from pathlib import Path

from service.config import Settings

README = Path(__file__).resolve().parents[1] / "README.md"
# read outside Settings: by the CLI (HOST/PORT/WORKERS), the dev command, the metrics endpoint
OTHER_VARIABLES = {"HOST", "PORT", "WORKERS", "PROMETHEUS_MULTIPROC_DIR", "DEV_DATA_DIR", "MIGRATIONS_DIR"}


def configuration_table() -> set[str]:
    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_every_setting_is_documented_and_every_documented_variable_exists() -> None:
    settings = {name.upper() for name in Settings.model_fields}
    assert configuration_table() == settings | OTHER_VARIABLES
