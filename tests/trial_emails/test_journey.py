"""When each email of the journey is due: the edges of every share, of the journey, and of sent keys."""

from datetime import UTC, datetime, timedelta

import pytest

from service.trial_emails.journey import JOURNEY, UserTrial, resolve_pending_emails
from service.trial_emails.reservations import pending_reservations

START = datetime(2025, 1, 1, tzinfo=UTC)
TICK = timedelta(microseconds=1)

# due offsets written out by hand (not computed with the module's arithmetic), for two lengths
TWENTY_DAYS = {
    "trial_welcome": timedelta(0),
    "trial_tips": timedelta(days=3),
    "trial_midpoint": timedelta(days=10),
    "trial_ending_soon": timedelta(days=15),
    "trial_last_day": timedelta(days=18),
    "trial_ended": timedelta(days=20),
}
SEVEN_DAYS = {
    "trial_welcome": timedelta(0),
    "trial_tips": timedelta(days=1, hours=1, minutes=12),  # 15 % of 7 days = 1.05 days
    "trial_midpoint": timedelta(days=3, hours=12),
    "trial_ending_soon": timedelta(days=5, hours=6),
    "trial_last_day": timedelta(days=6, hours=7, minutes=12),
    "trial_ended": timedelta(days=7),
}


def trial(length: timedelta) -> UserTrial:
    return UserTrial(id=1, user_id=10, started_at=START, ends_at=START + length)


def test_the_journey_is_six_steps_in_order() -> None:
    assert [(step.email_key, step.share_percent) for step in JOURNEY] == [
        ("trial_welcome", 0),
        ("trial_tips", 15),
        ("trial_midpoint", 50),
        ("trial_ending_soon", 75),
        ("trial_last_day", 90),
        ("trial_ended", 100),
    ]


@pytest.mark.parametrize(("length", "offsets"), [(timedelta(days=20), TWENTY_DAYS), (timedelta(days=7), SEVEN_DAYS)])
@pytest.mark.parametrize("key", list(TWENTY_DAYS))
@pytest.mark.parametrize(("shift", "due"), [(-TICK, False), (timedelta(0), True), (TICK, True)])
def test_each_email_is_due_from_its_share_on(
    length: timedelta, offsets: dict[str, timedelta], key: str, shift: timedelta, due: bool
) -> None:
    now = START + offsets[key] + shift
    assert (key in resolve_pending_emails(trial(length), set(), now)) is due


def test_every_step_reached_is_due_at_once_in_journey_order() -> None:
    now = START + timedelta(days=10)
    assert resolve_pending_emails(trial(timedelta(days=20)), set(), now) == [
        "trial_welcome",
        "trial_tips",
        "trial_midpoint",
    ]


def test_keys_already_dispatched_are_not_due_again() -> None:
    now = START + timedelta(days=10)
    pending = resolve_pending_emails(trial(timedelta(days=20)), {"trial_welcome", "trial_midpoint"}, now)
    assert pending == ["trial_tips"]


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (START - TICK, []),  # not started
        (START + timedelta(days=21) - TICK, ["trial_ended"]),  # the last instant of the day of grace
        (START + timedelta(days=21), []),  # one day past ends_at: out of the journey
    ],
)
def test_the_journey_runs_from_start_until_a_day_after_the_end(now: datetime, expected: list[str]) -> None:
    sent = {step.email_key for step in JOURNEY} - {"trial_ended"}
    assert resolve_pending_emails(trial(timedelta(days=20)), sent, now) == expected


def test_pending_pairs_are_per_user_deduplicated_and_sorted() -> None:
    now = START + timedelta(days=4)
    trials = [
        UserTrial(id=1, user_id=20, started_at=START, ends_at=START + timedelta(days=20)),
        UserTrial(id=2, user_id=10, started_at=START, ends_at=START + timedelta(days=20)),
        UserTrial(id=3, user_id=10, started_at=START + timedelta(days=1), ends_at=START + timedelta(days=30)),
    ]
    pairs = pending_reservations(trials, {20: {"trial_tips"}}, now)
    assert pairs == [(10, "trial_tips"), (10, "trial_welcome"), (20, "trial_welcome")]
