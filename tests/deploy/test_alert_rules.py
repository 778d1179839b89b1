"""alerts.yml through Prometheus' own tool: `promtool check rules`, and `promtool test rules` on
alerts_test.yml, which must give every alert a history that fires it and one that must not."""

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.files import ALERTS_FILE, ALERTS_TEST_FILE, alert_rules


def _promtool(prometheus_bin: Path, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(prometheus_bin / "promtool"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_alert_has_a_history_that_fires_it_and_one_that_must_not() -> None:
    tests = yaml.safe_load(ALERTS_TEST_FILE.read_text())
    assert tests["rule_files"] == [ALERTS_FILE.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules()}
    assert len(alerts) >= 15
    assert not alerts - fires, f"no history fires {sorted(alerts - fires)}"
    assert not alerts - quiet, f"no history keeps {sorted(alerts - quiet)} quiet"
    assert fires | quiet <= alerts, f"tests of alerts that do not exist: {sorted((fires | quiet) - alerts)}"


def test_promtool_checks_the_rules(prometheus_bin: Path) -> None:
    done = _promtool(prometheus_bin, "check", "rules", ALERTS_FILE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass(prometheus_bin: Path) -> None:
    done = _promtool(prometheus_bin, "test", "rules", ALERTS_TEST_FILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_tests_catch_a_changed_threshold(prometheus_bin: Path, tmp_path: Path) -> None:
    """The unit tests pin the thresholds: 90 % instead of 80 % for Redis memory must fail them."""
    shutil.copy(ALERTS_TEST_FILE, tmp_path / ALERTS_TEST_FILE.name)
    rules = ALERTS_FILE.read_text()
    assert rules.count("> 0.8") == 1
    (tmp_path / ALERTS_FILE.name).write_text(rules.replace("> 0.8", "> 0.95"))
    done = _promtool(prometheus_bin, "test", "rules", ALERTS_TEST_FILE.name, cwd=tmp_path)
    assert done.returncode != 0
    assert "ProgressRedisMemoryHigh" in done.stdout + done.stderr
