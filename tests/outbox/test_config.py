"""Configuration that would owe the monolith messages it cannot send refuses to start, saying what to set."""

import re
import subprocess
import sys

import pytest

from service.app import create_app
from service.config import ConfigError, Settings
from service.outbox import stream_publisher
from service.outbox.celery_publisher import check_transport


@pytest.mark.parametrize(
    ("update", "names"),
    [
        ({"relay_enabled": True}, "RELAY_ENABLED=true needs CELERY_BROKER_URL"),
        (
            {"trial_journey_interval_seconds": 3600, "email_publisher": "celery"},
            "EMAIL_PUBLISHER=celery needs CELERY_BROKER_URL",
        ),
        ({"relay_enabled": True, "celery_broker_url": "kafka://broker:9092"}, "unsupported transport 'kafka'"),
    ],
)
def test_a_service_that_could_not_deliver_refuses_to_start(
    settings: Settings, update: dict[str, object], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        create_app(settings.model_copy(update=update))


def test_with_a_broker_url_or_without_the_relay_it_starts(settings: Settings) -> None:
    create_app(settings.model_copy(update={"relay_enabled": True, "celery_broker_url": "redis://127.0.0.1:1/0"}))
    create_app(
        settings.model_copy(
            update={"relay_enabled": False, "email_publisher": "redis-stream", "trial_journey_interval_seconds": 3600}
        )
    )


def test_sqs_without_its_extra_names_the_extra_to_install() -> None:
    # boto3 is installed here (the tests use SQS): hide it, as in an image built without the extra
    code = (
        "import sys; sys.modules['boto3'] = None\n"
        "from service.outbox.celery_publisher import check_transport\ncheck_transport('sqs://')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "pip install 'progress-service[sqs]'" in result.stderr
    check_transport("sqs://")  # with the extra: accepted


def test_serve_refuses_a_relay_without_a_broker_with_a_clear_message(settings: Settings) -> None:
    env = {
        "DATABASE_URL": settings.database_url,
        "REDIS_URL": settings.redis_url,
        "JWT_SECRET": "x" * 40,
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "CELERY_BROKER_URL" in result.stderr


def test_emails_go_to_celery_by_default_as_the_package_says() -> None:
    assert Settings.model_fields["email_publisher"].default == "celery"
    assert stream_publisher.__doc__ is not None
    stated = re.search(r"([^.]*) is the default", stream_publisher.__doc__)
    assert stated is not None and "Celery" in stated.group(0) and "Redis" not in stated.group(0)
