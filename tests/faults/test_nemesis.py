"""The nemesis run at its CI size (the larger one: `python -m tests.faults.nemesis --long`).

A new seed every run, printed with the report; NEMESIS_SEED=<seed> replays one.
"""

from pathlib import Path

import pytest

from tests.faults.nemesis import CI, FAULT_KINDS, run, seed_from_environment

pytestmark = pytest.mark.slow  # two pods, three servers and a load process, about 70 s


@pytest.mark.regression  # issue 23: its findings 1-5, composed with the faults of production
def test_composed_faults_lose_no_acknowledged_position_and_every_wait_stays_bounded(tmp_path: Path) -> None:
    report = run(CI, seed_from_environment(), FAULT_KINDS, tmp_path / "nemesis")
    if not report.ok():
        pytest.fail(report.text(), pytrace=False)
