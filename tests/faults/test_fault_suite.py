"""The short fault-and-load runs, a store down under load (the long one: `python -m tests.faults.suite`; pods killed
under load: the nemesis, tests/faults/test_nemesis.py)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.suite import SCENARIOS, SHORT, Cluster, run_scenario

pytestmark = pytest.mark.slow  # each scenario runs the service under load for ~10 s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One Valkey, Postgres and three pods for every scenario: each run empties the tables and the buffer first, and
    ends with its store back up, every pod ready and the buffer drained."""
    cluster = Cluster(tmp_path_factory.mktemp("fault-suite"), size=SHORT)
    try:
        cluster.start(users=SHORT.users, contents=SHORT.lessons)
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_acknowledged_heartbeat_survives(scenario: str, cluster: Cluster, tmp_path: Path) -> None:
    report = run_scenario(scenario, SHORT, tmp_path / scenario, cluster=cluster)
    assert report.acknowledged > 0
    assert report.lost == 0, report.stale
    assert report.persisted == SHORT.keys  # every key got at least one 201, and its row is right
    assert report.duplicate_events == 0
    assert report.missing_completions == 0
    assert report.events == report.completed_keys == SHORT.crossing  # every crossing key, once
    assert report.faults, "the fault was never injected"
