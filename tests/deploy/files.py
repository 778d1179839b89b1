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
ALERTS_TEST_FILE = REPO / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD_FILE = REPO / "deploy" / "grafana" / "progress-service.json"
DASHBOARD_SCRIPT = REPO / "deploy" / "grafana" / "dashboard.py"
RUNBOOK = REPO / "docs" / "runbook.md"
# every alert's annotations.runbook_url is this plus `#<section slug>` (a fork changes it in one sed)
RUNBOOK_BASE_URL = "https://github.com/onion/progress-service/blob/main/docs/runbook.md"
CONFIGURATION_DOC = REPO / "docs" / "configuration.md"
METRICS_DOC = REPO / "docs" / "metrics.md"
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
            stage.healthcheck = json.loads(rest[rest.index("CMD") + len("CMD") :])
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


def table_rows(path: Path, header: str) -> list[list[str]] | None:
    """The cells of each row of the Markdown table whose header row starts with `header` (None: no such table).
    An escaped pipe (`\\|`) stays inside its cell."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    if start is None:
        return None
    rows = []
    for line in lines[start + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows


def metrics_doc_table() -> dict[str, MetricInfo] | None:
    """docs/metrics.md's table: `name` | type | `label`, ... | what it drives."""
    rows = table_rows(METRICS_DOC, "| metric | type | labels |")
    if rows is None:
        return None
    found = {}
    for cells in rows:
        name = re.fullmatch(r"`(\w+)`", cells[0])
        if name:
            found[name.group(1)] = MetricInfo(cells[1], tuple(re.findall(r"`(\w+)`", cells[2])))
    return found


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@dataclass
class PanelQuery:
    row: str
    panel: str
    expr: str


# Grafana's built-in variables, as a query for the last few minutes would see them
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard_queries(rate_interval: str = GRAFANA_VARIABLES["$__rate_interval"]) -> list[PanelQuery]:
    """Every target of every panel, in order, with Grafana's variables replaced by durations."""
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    queries, row = [], ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval)
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append(PanelQuery(row, panel["title"], expr))
    return queries


def served_metric_names(exposition: str) -> set[str]:
    """Every series name a /metrics text can carry: each family of its TYPE lines (histograms with their
    _bucket/_sum/_count, summaries with _sum/_count) and each sample's name."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "summary":
            names |= {f"{name}_sum", f"{name}_count"}
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", exposition, re.MULTILINE))
    return names


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lowercase, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_slugs() -> list[str]:
    """The anchor of every heading of docs/runbook.md (lines in fenced code blocks are no headings)."""
    text = re.sub(r"^```.*?^```", "", RUNBOOK.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [github_slug(title) for title in re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE)]
