"""Settings of the outbox tests: a real broker (its own Valkey) and the relay on, with short leases."""

import pytest

from service.config import Settings
from tests.helpers import with_broker
from tests.monolith.fixtures import Broker


@pytest.fixture
def relay_settings(settings: Settings, broker: Broker) -> Settings:
    return with_broker(settings, broker.url)
