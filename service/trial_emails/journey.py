"""The trial journey ("régua"): six emails, each due once its share of the trial has elapsed."""

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

SOURCE = "trial_journey"

# The journey runs on for a day after the trial ends, so `trial_ended` (due at 100 %) still goes
# out when the sweep that crosses ends_at runs late.
GRACE = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class JourneyStep:
    email_key: str
    share_percent: int  # of the trial's length; an integer keeps due times exact to the microsecond


JOURNEY = (
    JourneyStep("trial_welcome", 0),
    JourneyStep("trial_tips", 15),
    JourneyStep("trial_midpoint", 50),
    JourneyStep("trial_ending_soon", 75),
    JourneyStep("trial_last_day", 90),
    JourneyStep("trial_ended", 100),
)


@dataclass(frozen=True, slots=True)
class UserTrial:
    id: int
    user_id: int
    started_at: datetime
    ends_at: datetime


def resolve_pending_emails(trial: UserTrial, sent_keys: Collection[str], now: datetime) -> list[str]:
    """The keys due at `now` that the trial's user has not been dispatched yet, in journey order.

    Several steps may be due at once (a late first run, a backfill): all of them are returned.
    """
    if not trial.started_at <= now < trial.ends_at + GRACE:
        return []  # not in its journey
    length = trial.ends_at - trial.started_at
    due = [step.email_key for step in JOURNEY if now >= trial.started_at + length * step.share_percent // 100]
    return [key for key in due if key not in sent_keys]
