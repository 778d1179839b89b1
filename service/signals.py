"""The one-off commands that run until stopped (flush, relay, trial-emails run-once) stop the same way."""

import asyncio
import signal


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or Ctrl-C: the loop finishes the work in hand, then returns."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
