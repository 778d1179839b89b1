"""Progress of a long one-shot command (a re-drive, a drain, a backfill), for whoever waits on it.

    with progress_meter("outbox redrive", total=rows, unit="rows") as meter:
        for chunk in chunks:
            ...
            meter.advance(len(chunk))

On a terminal (stderr is a TTY) it draws a `rich` progress bar with the counts, the rate and the time
left. Elsewhere (a pod, CI) it logs one line every `interval_s` while the work advances, and a
summary at the end, through `logging` (JSON lines once the command has configured logging). It
writes to stderr only: stdout stays the command's result (JSON). It knows no feature of the service.
"""

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


class ProgressMeter:
    """Counts the work done: `advance` after each step. Made by `progress_meter`, not directly."""

    def __init__(self, description: str, total: int | None, unit: str, interval_s: float,
                 bar: "Progress | None" = None) -> None:  # fmt: skip
        self.description = description
        self.total = total  # None: not known (yet); `set_total` may say it later
        self.unit = unit
        self.done = 0
        self._interval_s = interval_s
        self._started = self._last_line = time.monotonic()
        self._bar = bar  # rich's, on a terminal; otherwise log lines
        self._task: TaskID | None = bar.add_task(description, total=total, rate="") if bar is not None else None

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done, rate=f"{self.rate():,.0f} {self.unit}/s")
            return
        now = time.monotonic()
        if now - self._last_line >= self._interval_s:
            self._last_line = now
            log.info("%s: %s so far", self.description, self._counts(), extra={"count": self.done})

    def set_total(self, total: int | None) -> None:
        self.total = total
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, total=total)

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def rate(self) -> float:
        """Units per second since the start."""
        elapsed = self.elapsed_s()
        return self.done / elapsed if elapsed > 0 else 0.0

    def summary(self) -> str:
        """`<description>: 1,200/5,000 rows in 3.2s (375 rows/s)`"""
        return f"{self.description}: {self._counts()}"

    def _counts(self) -> str:
        of = f"/{self.total:,}" if self.total is not None else ""
        return f"{self.done:,}{of} {self.unit} in {self.elapsed_s():.1f}s ({self.rate():,.0f} {self.unit}/s)"


@contextmanager
def progress_meter(description: str, *, total: int | None = None, unit: str = "items",
                   interval_s: float = DEFAULT_INTERVAL_S, stream: TextIO | None = None,
                   terminal: bool | None = None) -> Iterator[ProgressMeter]:  # fmt: skip
    """A meter for one long piece of work, shown on `stream` (stderr) while the block runs.

    `terminal`: force the bar (True) or the log lines (False) instead of asking whether `stream` is a
    TTY. Off a terminal the summary is logged when the block ends, normally or not (then it says
    "stopped"), so a command stopped half-way still tells how far it got.
    """
    stream = stream if stream is not None else sys.stderr
    if not (terminal if terminal is not None else _is_tty(stream)):
        meter = ProgressMeter(description, total, unit, interval_s)
        finished = False
        try:
            yield meter
            finished = True
        finally:
            log.info("%s%s", meter.summary(), "" if finished else " (stopped)", extra={"count": meter.done})
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("left"),
                   TimeRemainingColumn(), console=Console(file=stream), refresh_per_second=4)  # fmt: skip
    with bar:
        yield ProgressMeter(description, total, unit, interval_s, bar)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
