"""The fleet in CI, small: three `serve` pods behind a real HAProxy, rolled under a ledgered load (the larger run:
bench/bench_fleet.py)."""

from pathlib import Path

import pytest

from tests.faults.suite import FLEET, FLEET_SHORT, run_scenario

pytestmark = pytest.mark.slow  # three pods, HAProxy and a load generator for ~30 s


@pytest.mark.regression
def test_a_rolling_restart_behind_haproxy_drops_no_request_and_loses_no_position(tmp_path: Path) -> None:
    """Found by a fleet test: without a drain, a plain HAProxy (no redispatch, no retries) answered 503s and a
    client saw an EOF on a reused connection while pods were rolled."""
    report = run_scenario(FLEET, FLEET_SHORT, tmp_path)
    assert len(report.exit_codes) == 2 * 3 and set(report.exit_codes) == {0}, report.faults  # rolled, then stopped
    assert report.sent > 0 and report.acknowledged == report.sent, (
        f"{report.refused_503} answered 503, {report.other} other non-2xx, {report.no_answer} client errors"
    )
    assert report.lost == 0, report.stale  # every final position acknowledged is in Postgres
    assert report.persisted == FLEET_SHORT.keys
    # one event per completed key, none missing (every key completes after 25 rounds: positions climb 40 s a round)
    assert report.duplicate_events == report.missing_completions == 0
    assert report.events == report.completed_keys > 0
