"""Progress of a long one-shot command (a backfill, a drain, a re-drive), for whoever watches it.

On a terminal: a rich progress bar with the count, the rate and the time left. Elsewhere (a pod, CI):
a log line every `interval_s`, from a timer of its own so that a run that stalls still says so, and
a summary at the end. Both go to stderr: stdout keeps the command's result.
"""

import logging
import threading
import time
from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


class _RateColumn(ProgressColumn):
    def __init__(self, unit: str) -> None:
        super().__init__()
        self._unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} {self._unit}/s" if speed else "", style="progress.data.speed")


class Progress:
    """`total` may be unknown at first (None: the bar pulses, the lines show no percentage) and given
    later with `set_total`. The bar goes to `console` (stderr) when it is a terminal; the summary is
    logged either way, with the count in `extra["count"]`."""

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        unit: str = "items",
        interval_s: float | None = None,
        console: Console | None = None,
    ) -> None:
        self.label = label
        self.unit = unit
        self.total = total
        self.done = 0
        self._interval_s = interval_s or LOG_INTERVAL_S
        self._console = console or Console(stderr=True)
        self._started = 0.0
        self._bar: RichProgress | None = None
        self._task = TaskID(0)
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._started = time.monotonic()
        if self._console.is_terminal:
            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TaskProgressColumn(),
                _RateColumn(self.unit),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("· left"),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._task = self._bar.add_task(self.label, total=self.total)
            self._bar.start()
        else:
            self._ticker = threading.Thread(target=self._tick, name=f"progress {self.label}", daemon=True)
            self._ticker.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stopped.set()
        if self._bar is not None:
            self._bar.stop()
        if self._ticker is not None:
            self._ticker.join()
        elapsed_s = time.monotonic() - self._started
        outcome = "done" if kind is None else f"stopped ({kind.__name__})"
        of = f" of {self.total}" if self.total is not None else ""
        summary = f"{self.done}{of} {self.unit} in {elapsed_s:.1f} s ({self._rate(elapsed_s)})"
        log.info("%s %s: %s", self.label, outcome, summary, extra={"count": self.done})

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def set_total(self, total: int | None) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def _tick(self) -> None:
        while not self._stopped.wait(self._interval_s):
            elapsed_s = time.monotonic() - self._started
            done, total = self.done, self.total
            of = left = ""
            if total:
                of = f"/{total} ({100 * done / total:.0f} %)"
                if 0 < done < total:
                    left = f", ~{(total - done) * elapsed_s / done:.0f} s left"
            log.info(
                "%s: %d%s %s, %s%s", self.label, done, of, self.unit, self._rate(elapsed_s), left, extra={"count": done}
            )

    def _rate(self, elapsed_s: float) -> str:
        return f"{self.done / elapsed_s:,.0f} {self.unit}/s" if elapsed_s > 0 else f"- {self.unit}/s"
