"""A service command that SIGKILLs itself at one named moment of its work (service/checkpoints.py).

    python -m tests.crash flush.after_claim flush --once

The crash tests start commands this way to die exactly where they claim to; the service itself reads
no setting that could kill it.
"""

import os
import signal
import sys

from service import checkpoints
from service.cli import main


def die_at(point: str) -> None:
    def hook(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoints.install(hook)


if __name__ == "__main__":
    die_at(sys.argv[1])
    raise SystemExit(main(sys.argv[2:]))
