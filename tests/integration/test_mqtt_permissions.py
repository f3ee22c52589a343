"""MQTT clients against a core with users: wildcard subscriptions and deny rules, session and will ownership."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.conftest import CoreProcess, GatewayProcess, start_core, start_gateway, stop_cleanly
from tests.integration.cluster_nodes import wait_until
from tests.integration.mqtt_clients import Paho, Raw

from tridentmq_mqtt.protocol.packets import V5, V311, Connack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NOT_AUTHORIZED_5 = 0x87
FAILURE_311 = 0x80
ALL = (
    "send",
    "consume",
    "browse",
    "createAddress",
    "deleteAddress",
    "createDurableQueue",
    "deleteDurableQueue",
    "createNonDurableQueue",
    "deleteNonDurableQueue",
    "manage",
)


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
    + _rule("readonly.#", "send", "app", deny=True)
)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    core = start_core(tmp_path, config=CONFIG)
    gateway = start_gateway(
        tmp_path, core, "mqtt", TRIDENTMQ_MQTT_CORE_USER="gw", TRIDENTMQ_MQTT_CORE_PASSWORD="gw-secret"
    )
    yield gateway
    stop_cleanly(gateway)
    assert core.stop() == 0
    assert "Traceback" not in core.log()


def _codes(granted: list[object]) -> list[int]:
    return [int(getattr(code, "value", code)) for code in granted]  # type: ignore[call-overload]


@pytest.mark.parametrize(("version", "refused"), [(5, NOT_AUTHORIZED_5), (4, FAILURE_311)])
def test_a_wildcard_subscription_needs_every_topic_it_can_match(
    gateway: GatewayProcess, version: int, refused: int
) -> None:
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


@pytest.mark.parametrize("version", [5, 4])
def test_a_refused_qos_0_message_is_dropped_and_logged_and_the_connection_goes_on(
    gateway: GatewayProcess, version: int
) -> None:
    """QoS 0 has no answer to carry a refusal: the core drops the message, the gateway logs it, and the
    publisher's next messages go through on the same connection."""
    watcher = Paho(gateway.port, f"watch-{version}", version=version, username="gw", password="gw-secret")
    watcher.connect()
    bob = Paho(gateway.port, f"bob-{version}", version=version, username="bob", password="bob-pw")
    bob.connect()
    try:
        assert _codes(watcher.subscribe("readonly/#", 0)) == [0]
        assert _codes(watcher.subscribe("test/after", 0)) == [0]
        bob.publish("readonly/a", b"refused", 0)
        bob.publish("test/after", b"qos 0", 0)
        bob.publish("test/after", b"qos 1", 1)  # its PUBACK: the connection is still up
        assert sorted(m.payload for m in watcher.receive(2)) == [b"qos 0", b"qos 1"]
        assert watcher.nothing_more()
        wait_until(lambda: "mqtt publish refused" in gateway.log(), what="the refusal logged")
    finally:
        watcher.disconnect()
        bob.disconnect()


# ---------------------------------------------------------------------------------------------- session ownership
OPEN = (
    '[[users]]\nname = "gw"\npassword = "gw-secret"\nroles = ["gateway"]\n'
    '[[users]]\nname = "alice"\npassword = "alice-pw"\nroles = ["app"]\n'
    '[[users]]\nname = "bob"\npassword = "bob-pw"\nroles = ["app"]\n'
    + "".join(_rule("#", p, role) for p in ALL for role in ("gateway", "app"))
)


def _open_gateway(tmp_path: Path, **env: str) -> tuple[CoreProcess, GatewayProcess]:
    core = start_core(tmp_path, config=OPEN)
    gateway = start_gateway(
        tmp_path, core, "mqtt", TRIDENTMQ_MQTT_CORE_USER="gw", TRIDENTMQ_MQTT_CORE_PASSWORD="gw-secret", **env
    )
    return core, gateway


def _stop(core: CoreProcess, gateway: GatewayProcess) -> None:
    stop_cleanly(gateway)
    assert core.stop() == 0
    assert "Traceback" not in core.log()


def test_another_user_can_neither_take_over_nor_discard_a_session(tmp_path: Path, raw: Callable[..., Raw]) -> None:
    """Issue 22: alice connected with bob's client id and clean start, and bob's queued message was lost."""
    core, gateway = _open_gateway(tmp_path)
    topic = f"inbox/{uuid.uuid4().hex[:8]}"
    bob = Paho(gateway.port, "bob-phone", version=4, clean=False, username="bob", password="bob-pw")
    assert bob.connect()[1] == 0
    assert _codes(bob.subscribe(topic, 1)) == [1]
    publisher = Paho(gateway.port, "publisher", username="alice", password="alice-pw")
    publisher.connect()
    # bob is online: alice's CONNECT with his client id must not end his connection
    assert raw(gateway.port, V311).connect("bob-phone", username="alice", password=b"alice-pw") == Connack(
        session_present=False, reason_code=5
    )
    v5 = raw(gateway.port, V5).connect("bob-phone", username="alice", password=b"alice-pw", clean_start=True)
    assert isinstance(v5, Connack)
    assert v5.reason_code == NOT_AUTHORIZED_5
    publisher.publish(topic, b"while online", 1)
    assert [m.payload for m in bob.receive(1)] == [b"while online"]
    assert bob.disconnects.empty()
    bob.disconnect()
    publisher.publish(topic, b"queued", 1)
    # bob is away: alice's clean start must not discard his session and its queued message
    assert raw(gateway.port, V311).connect("bob-phone", username="alice", password=b"alice-pw") == Connack(
        session_present=False, reason_code=5
    )
    anonymous = raw(gateway.port, V311).connect("bob-phone")  # the core refuses it anyway: users are configured
    assert isinstance(anonymous, Connack)
    assert anonymous.reason_code != 0
    back = Paho(gateway.port, "bob-phone", version=4, clean=False, username="bob", password="bob-pw")
    assert back.connect()[0] is True  # session present
    assert [m.payload for m in back.receive(1)] == [b"queued"]
    back.disconnect()
    publisher.disconnect()
    assert "client id belongs to another user" in gateway.log()
    _stop(core, gateway)


def test_another_user_cannot_take_over_a_live_session_that_keeps_nothing(
    tmp_path: Path, raw: Callable[..., Raw]
) -> None:
    core, gateway = _open_gateway(tmp_path)
    topic = f"live/{uuid.uuid4().hex[:8]}"
    # no record; taken over below, it must not come back by itself (paho would) and take the client id again
    bob = Paho(gateway.port, "bob-laptop", version=4, clean=True, username="bob", password="bob-pw", reconnect=False)
    assert bob.connect()[1] == 0
    assert _codes(bob.subscribe(topic, 0)) == [0]
    assert raw(gateway.port, V311).connect("bob-laptop", username="alice", password=b"alice-pw") == Connack(
        session_present=False, reason_code=5
    )
    bob.publish(topic, b"still here", 1)
    assert [m.payload for m in bob.receive(1)] == [b"still here"]
    assert bob.disconnects.empty()
    again = Paho(gateway.port, "bob-laptop", version=4, clean=True, username="bob", password="bob-pw")
    assert again.connect()[1] == 0  # bob himself takes his client id over
    assert bob.disconnects.get(timeout=10) is not None
    again.disconnect()

    # bob's session ended with his connection: once the gateway has seen it go, the client id is free (his
    # idle lock queue, left until the core's next tick, does not count)
    def alice_gets_in() -> bool:
        alice = Paho(gateway.port, "bob-laptop", version=4, clean=True, username="alice", password="alice-pw")
        accepted = alice.connect()[1] == 0
        alice.disconnect()
        return accepted

    wait_until(alice_gets_in, what="bob's client id to be free")
    bob.disconnect()  # (its thread ended with its connection)
    _stop(core, gateway)


def test_with_binding_off_any_user_takes_over_but_wills_stay_their_owners(
    tmp_path: Path, raw: Callable[..., Raw]
) -> None:
    core, gateway = _open_gateway(tmp_path, TRIDENTMQ_MQTT_MQTT_BIND_SESSIONS_TO_USERS="false")
    topic = f"status/{uuid.uuid4().hex[:8]}"
    watcher = Paho(gateway.port, "watcher", username="alice", password="alice-pw")
    watcher.connect()
    assert _codes(watcher.subscribe(topic, 1)) == [1]
    bob = Paho(gateway.port, "bob-sensor", username="bob", password="bob-pw")
    bob.connect(expiry=300, will=(topic, b"bob is gone", 1, False), will_delay=2)
    bob.drop()  # his will is pending (2 s) on the core
    # alice may take over the client id, but cancelling bob's pending will is refused
    refused = raw(gateway.port, V5).connect("bob-sensor", username="alice", password=b"alice-pw", clean_start=True)
    assert isinstance(refused, Connack)
    assert refused.reason_code == NOT_AUTHORIZED_5
    assert [m.payload for m in watcher.receive(1)] == [b"bob is gone"]  # still published, after its delay
    # with no will in the way, a takeover by another user is accepted (the binding is off)
    bob = Paho(gateway.port, "bob-sensor", username="bob", password="bob-pw", clean=False)
    bob.connect(expiry=300)
    alice = Paho(gateway.port, "bob-sensor", username="alice", password="alice-pw")
    assert alice.connect()[1] == 0
    alice.disconnect()
    watcher.disconnect()
    _stop(core, gateway)
