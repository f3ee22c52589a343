"""Fixtures shared by the integration tests of one protocol, registered here for all of them."""

from tests.integration.mqtt_clients import raw  # noqa: F401 (a fixture: registered by being imported here)
