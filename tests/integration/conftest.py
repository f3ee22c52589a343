"""Fixtures shared by the integration tests of one protocol, registered here for all of them."""

from tests.integration.mqtt_clients import raw, replicas  # noqa: F401 (fixtures: registered by being imported here)
