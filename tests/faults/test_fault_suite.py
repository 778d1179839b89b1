"""The short fault-and-load runs, a store down under load (the long one: `python -m tests.faults.suite`; pods killed
under load: the nemesis, tests/faults/test_nemesis.py)."""

from pathlib import Path

import pytest

from tests.faults.suite import SCENARIOS, SHORT, run_scenario

pytestmark = pytest.mark.slow  # each scenario runs the service under load for ~10 s


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_acknowledged_heartbeat_survives(scenario: str, tmp_path: Path) -> None:
    report = run_scenario(scenario, SHORT, tmp_path / scenario)
    assert report.acknowledged > 0
    assert report.lost == 0, report.stale
    assert report.persisted == SHORT.keys  # every key got at least one 201, and its row is right
    assert report.duplicate_events == 0
    assert report.missing_completions == 0
    assert report.events == report.completed_keys == SHORT.crossing  # every crossing key, once
    assert report.faults, "the fault was never injected"
