"""An alert that counts in a setting's time takes it from the gauge the service exports, never from a
copy of its default: change PROGRESS_FLUSH_INTERVAL_SECONDS and the alerts follow, nothing else to edit."""

from typing import Any

import promql_parser as promql
import pytest

from service.config import Settings
from tests.deploy.files import alert_rules

# setting -> the gauge that exports it, and the metrics whose values move at its pace
OWNED = {
    "PROGRESS_FLUSH_INTERVAL_SECONDS": (
        "progress_flush_interval_seconds",
        {"progress_flush_last_success_timestamp_seconds", "progress_flush_lag_seconds_bucket"},
    ),
}
# a `for:` of an alert over a paced metric, that is a statistic's window and not the setting's time, and why
WINDOWS = {"ProgressFlushLagHigh": "the p99 of ten minutes' batches held for ten minutes, whatever the interval"}


def selectors(node: Any) -> set[str]:
    names: set[str] = set()

    def visit(child: object) -> None:
        if isinstance(child, promql.VectorSelector) and child.name:
            names.add(child.name)

    promql.walk(node, visit)
    return names


def constant(node: Any) -> float | None:
    """The value of a number or of arithmetic on numbers (`2 * 60` is 120); None for anything else."""
    if isinstance(node, promql.NumberLiteral):
        return float(node.val)
    if isinstance(node, promql.ParenExpr):
        return constant(node.expr)
    if isinstance(node, promql.UnaryExpr):
        value = constant(node.expr)
        return None if value is None else -value
    if isinstance(node, promql.BinaryExpr) and str(node.op) in {"+", "-", "*", "/"}:
        lhs, rhs = constant(node.lhs), constant(node.rhs)
        if lhs is not None and rhs is not None:
            return {"+": lhs + rhs, "-": lhs - rhs, "*": lhs * rhs, "/": lhs / rhs if rhs else None}[str(node.op)]
    return None


def constants(node: Any, gauge: str) -> list[float]:
    """Every constant of the expression, except a factor of the gauge itself (the 2 of `2 * max(gauge)`)."""
    value = constant(node)
    if value is not None:
        return [value]
    children = [getattr(node, name, None) for name in ("lhs", "rhs", "expr", "param")] + getattr(node, "args", [])
    children = [child for child in children if isinstance(child, promql.Expr)]
    if isinstance(node, promql.BinaryExpr) and str(node.op) == "*":
        children = [side for side in children if gauge in selectors(side)] or children
    return [n for child in children for n in constants(child, gauge)]


def copies(expr: str, setting: str) -> list[float]:
    """The constants of `expr` that are whole multiples of the setting's default (60 and 120 of a 60 s interval)."""
    gauge, _ = OWNED[setting]
    default = Settings.model_fields[setting.lower()].default
    assert isinstance(default, int | float) and default > 0
    return [n for n in constants(promql.parse(expr), gauge) if n >= default and n % default == 0]


def paced_alerts(setting: str) -> list[dict[str, Any]]:
    _, paced = OWNED[setting]
    return [rule for rule in alert_rules() if selectors(promql.parse(rule["expr"])) & paced]


@pytest.mark.parametrize("setting", OWNED)
def test_an_alert_over_a_paced_metric_reads_the_setting_from_its_gauge(setting: str) -> None:
    gauge, _ = OWNED[setting]
    alerts = paced_alerts(setting)
    assert alerts, f"no alert watches what {setting} paces: is the table above out of date?"
    for rule in alerts:
        assert gauge in selectors(promql.parse(rule["expr"])), f"{rule['alert']} does not read {gauge}"


@pytest.mark.parametrize("setting", OWNED)
def test_no_alert_over_a_paced_metric_hard_codes_the_setting(setting: str) -> None:
    gauge, _ = OWNED[setting]
    for rule in paced_alerts(setting):
        found = copies(rule["expr"], setting)
        assert not found, f"{rule['alert']}: {found} are multiples of {setting}'s default; use {gauge}"
        if "for" in rule:
            assert rule["alert"] in WINDOWS, f"{rule['alert']}: `for: {rule['for']}` does not follow {setting}"


def test_the_check_catches_the_forms_a_copy_takes() -> None:
    stale = "time() - max(progress_flush_last_success_timestamp_seconds)"
    setting = "PROGRESS_FLUSH_INTERVAL_SECONDS"
    for threshold in ("120", "2 * 60", "(2 * 60)", "60 * max(progress_pending_entries)", "120 - 0 * 1"):
        assert copies(f"{stale} > {threshold}", setting), threshold
    assert not copies(f"{stale} > 2 * max(progress_flush_interval_seconds)", setting)
    assert not copies(f"{stale} > 2 * (max(progress_flush_interval_seconds))", setting)
