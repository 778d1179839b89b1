"""The progress of a long command: a rich bar on a terminal; elsewhere a log line per interval and a summary."""

import io
import logging
import time

import pytest
from rich.console import Console

from service.console import Progress


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "service.console"]


def test_off_a_terminal_a_line_per_interval_and_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    screen = io.StringIO()
    with caplog.at_level(logging.INFO, logger="service.console"):
        with Progress("drain", total=10, unit="rows", interval_s=0.05, console=Console(file=screen)) as progress:
            progress.advance(4)
            time.sleep(0.2)  # a stall still logs, once per interval
            progress.advance(6)

    lines = _lines(caplog)
    assert any(
        line.startswith("drain: 4/10 (40 %) rows, ") and "rows/s" in line and "s left" in line for line in lines
    ), lines
    assert lines[-1].startswith("drain done: 10 of 10 rows in ") and lines[-1].endswith("rows/s)")
    assert caplog.records[-1].__dict__["count"] == 10
    assert screen.getvalue() == ""  # no bar off a terminal


def test_a_total_learnt_later_and_an_error_say_so_in_the_summary(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="service.console"), pytest.raises(KeyError):
        with Progress("sweep", unit="trials", console=Console(file=io.StringIO())) as progress:
            progress.set_total(50)
            progress.advance(20)
            raise KeyError("boom")

    assert _lines(caplog)[-1].startswith("sweep stopped (KeyError): 20 of 50 trials in ")


def test_on_a_terminal_a_bar_with_the_counts_and_the_rate(caplog: pytest.LogCaptureFixture) -> None:
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=120)
    with caplog.at_level(logging.INFO, logger="service.console"):
        with Progress("flush --once", total=300, unit="entries", console=terminal) as progress:
            for _ in range(3):
                time.sleep(0.05)
                progress.advance(100)

    shown = screen.getvalue()
    assert "flush --once" in shown and "300/300" in shown and "100%" in shown and "entries/s" in shown
    assert [line for line in _lines(caplog) if "/300 (" in line] == []  # the bar, not interval lines
    assert _lines(caplog)[-1].startswith("flush --once done: 300 of 300 entries")
