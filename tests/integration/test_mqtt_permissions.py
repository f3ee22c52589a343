"""Permissions of MQTT clients against a core with users: wildcard subscriptions and deny rules (paho)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import GatewayProcess, start_core, start_gateway, stop_cleanly
from tests.integration.mqtt_clients import Paho

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NOT_AUTHORIZED_5 = 0x87
FAILURE_311 = 0x80
ALL = ("send", "consume", "browse", "createAddress", "deleteAddress", "createDurableQueue", "deleteDurableQueue",
       "createNonDurableQueue", "deleteNonDurableQueue", "manage")  # fmt: skip


def _rule(match: str, permission: str, role: str, *, deny: bool = False) -> str:
    rule = f'[[permissions]]\nmatch = "{match}"\npermission = "{permission}"\nroles = ["{role}"]\n'
    return rule + ("deny = true\n" if deny else "")


CONFIG = (
    '[[users]]\nname = "gw"\npassword = "gw-secret"\nroles = ["gateway"]\n'
    '[[users]]\nname = "alice"\npassword = "alice-pw"\nroles = ["app"]\n'
    '[[users]]\nname = "bob"\npassword = "bob-pw"\nroles = ["app"]\n'
    + "".join(_rule("#", p, "gateway") for p in ALL)
    + "".join(_rule("#", p, "app") for p in ALL if p not in ("consume", "browse"))
    + _rule("sensors.*", "consume", "app")  # one level under sensors, nothing deeper
    + _rule("test.#", "consume", "app")
    + _rule("test.nosubscribe", "consume", "app", deny=True)  # paho's test: refused inside a granted test/#
)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    core = start_core(tmp_path, config=CONFIG)
    gateway = start_gateway(tmp_path, core, "mqtt", TRIDENTMQ_MQTT_CORE_USER="gw",
                            TRIDENTMQ_MQTT_CORE_PASSWORD="gw-secret")  # fmt: skip
    yield gateway
    stop_cleanly(gateway)
    assert core.stop() == 0
    assert "Traceback" not in core.log()


def _codes(granted: list[object]) -> list[int]:
    return [int(getattr(code, "value", code)) for code in granted]  # type: ignore[call-overload]


@pytest.mark.parametrize(("version", "refused"), [(5, NOT_AUTHORIZED_5), (4, FAILURE_311)])
def test_a_wildcard_subscription_needs_every_topic_it_can_match(gateway: GatewayProcess, version: int,
                                                                refused: int) -> None:  # fmt: skip
    alice = Paho(gateway.port, f"alice-{version}", version=version, username="alice", password="alice-pw")
    alice.connect()
    publisher = Paho(gateway.port, f"pub-{version}", username="bob", password="bob-pw")
    publisher.connect()
    try:
        assert _codes(alice.subscribe("sensors/#", 1)) == [refused]  # issue 22: was granted, and got sensors/a/b
        assert _codes(alice.subscribe("sensors/+/+", 1)) == [refused]
        assert _codes(alice.subscribe("#", 1)) == [refused]
        assert _codes(alice.subscribe("test/nosubscribe", 1)) == [refused]  # the deny rule
        assert _codes(alice.subscribe("test/#", 1)) == [refused]  # it would match test/nosubscribe
        assert _codes(alice.subscribe("sensors/+", 1)) == [1]
        assert _codes(alice.subscribe("test/ok/#", 1)) == [1]
        for topic in ("sensors/a/b", "sensors/a/b/c", "test/nosubscribe", "sensors/a", "test/ok/x"):
            publisher.publish(topic, topic.encode(), 1)
        got = sorted(m.topic for m in alice.receive(2))
        assert got == ["sensors/a", "test/ok/x"]
        assert alice.nothing_more()
    finally:
        alice.disconnect()
        publisher.disconnect()
