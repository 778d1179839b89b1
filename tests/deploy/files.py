"""The deployment files as data: the Dockerfile's final stage, the compose file, the manifests."""

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from service.config import Settings

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE_FILE = REPO / "docker-compose.yml"
K8S_DIR = REPO / "deploy" / "k8s"
ALERTS_FILE = REPO / "deploy" / "prometheus" / "alerts.yml"
README = REPO / "README.md"
# the console script and the tools of the `test` extra live next to the interpreter running the tests
VENV_BIN = Path(sys.executable).parent

# read by `progress-service serve` (service/cli.py) and by prometheus_client, not by Settings
SERVE_VARIABLES = {"HOST", "PORT", "WORKERS", "PROMETHEUS_MULTIPROC_DIR"}


def settings_variables() -> set[str]:
    return {name.upper() for name in Settings.model_fields}


@dataclass
class Stage:
    """What `docker run` uses from the last stage: its ENV, CMD, HEALTHCHECK and friends."""

    base: str
    env: dict[str, str] = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    user: str = ""
    stop_signal: str = ""
    expose: list[str] = field(default_factory=list)
    run: list[str] = field(default_factory=list)


def _instructions(text: str) -> list[tuple[str, str]]:
    logical = re.sub(r"\\\n", " ", text)  # line continuations
    found = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def dockerfile_stages(path: Path = DOCKERFILE) -> list[Stage]:
    stages: list[Stage] = []
    for keyword, rest in _instructions(path.read_text()):
        if keyword == "FROM":
            stages.append(Stage(base=rest.split()[0]))
            continue
        stage = stages[-1]
        if keyword == "ENV":
            for pair in shlex.split(rest, posix=True):
                name, _, value = pair.partition("=")
                stage.env[name] = value
        elif keyword == "CMD":
            stage.cmd = json.loads(rest)  # exec form only: a shell form would not get SIGTERM
        elif keyword == "HEALTHCHECK":
            stage.healthcheck = json.loads(rest[rest.index("CMD") + len("CMD"):])
        elif keyword == "USER":
            stage.user = rest
        elif keyword == "STOPSIGNAL":
            stage.stop_signal = rest
        elif keyword == "EXPOSE":
            stage.expose += rest.split()
        elif keyword == "RUN":
            stage.run.append(rest)
    return stages


def image() -> Stage:
    return dockerfile_stages()[-1]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return loaded


def k8s(path: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S_DIR / path).read_text())
    return loaded


@dataclass
class MetricInfo:
    type: str
    labels: tuple[str, ...]


def service_metrics() -> dict[str, MetricInfo]:
    """Every metric of service/metrics.py by the name its samples carry (counters end in _total)."""
    from service import metrics

    found = {}
    for value in vars(metrics).values():
        if hasattr(value, "_labelnames") and hasattr(value, "describe"):
            family = value.describe()[0]
            name = family.name + ("_total" if family.type == "counter" else "")
            found[name] = MetricInfo(family.type, tuple(value._labelnames))
    return found


def readme_metrics_table() -> dict[str, MetricInfo] | None:
    """The table under README.md's `## Metrics` heading: `name` | type | `label`, ... | alert."""
    match = re.search(r"^## Metrics\s*$(.*?)(?=^## |\Z)", README.read_text(), re.MULTILINE | re.DOTALL)
    if match is None:
        return None
    rows = {}
    for line in match.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        name = re.fullmatch(r"`(\w+)`", cells[0]) if cells else None
        if name:
            rows[name.group(1)] = MetricInfo(cells[1], tuple(re.findall(r"`(\w+)`", cells[2])))
    return rows
