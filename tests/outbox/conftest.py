"""Settings of the outbox tests: a real broker (its own Valkey) and the relay on, with short leases."""

import pytest

from service.config import Settings
from tests.monolith.fixtures import Broker

LEASE_S = 3.0


def with_broker(settings: Settings, broker_url: str, **update: object) -> Settings:
    return settings.model_copy(update={
        "celery_broker_url": broker_url, "relay_enabled": True, "email_publisher": "celery",
        "relay_poll_interval_seconds": 0.5, "relay_lease_seconds": LEASE_S, "celery_publish_timeout_seconds": 2.0,
        "relay_max_backoff_seconds": 1.0, **update,
    })  # fmt: skip


@pytest.fixture
def relay_settings(settings: Settings, broker: Broker) -> Settings:
    return with_broker(settings, broker.url)
