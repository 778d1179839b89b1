"""Named moments of the work that a process must be able to die at without losing anything.

The crash tests kill a process at one of them on purpose, from their own entry point
(`python -m tests.crash POINT ...` installs the hook, then runs the command); a production process
has no hook, so no setting or environment variable of a pod can stop it here. The moments:

    flush.after_claim     a batch is claimed (under lease), nothing is written
    flush.after_commit    its rows are committed, the claim is not acked
    relay.after_claim     outbox rows are claimed, nothing is published
    relay.after_publish   the broker has the batch, the rows are not marked published
    trial_emails.after_reserve   a block of emails is reserved with its outbox rows (committed)
"""

from collections.abc import Callable

_hook: Callable[[str], None] | None = None


def reached(point: str) -> None:
    if _hook is not None:
        _hook(point)


def install(hook: Callable[[str], None] | None) -> None:
    global _hook
    _hook = hook
