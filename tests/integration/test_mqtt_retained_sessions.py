"""Retained messages a SUBSCRIBE sends at QoS 1 and 2 are part of a persistent session like any other delivery
(MQTT 3.1.1 and 5.0, 4.4): unacknowledged when the connection ends (closed, or its gateway killed), they come
again to the session's next connection, with DUP set, the same packet id and the RETAIN flag; a QoS 2 one whose
PUBREC came continues with the PUBREL. A session that ends with its connection gets nothing again."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from tests.conftest import GatewayProcess, module_core
from tests.integration.mqtt_clients import Paho, Raw, silent

from tridentmq_mqtt.protocol.packets import (
    V5,
    V311,
    Connack,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Subscription,
)
from tridentmq_mqtt.protocol.properties import Properties

PERSISTENT = Properties(session_expiry_interval=300)

core = module_core


def _id() -> str:
    return uuid.uuid4().hex[:10]


def _retain(port: int, topic: str, payload: bytes) -> None:
    """Make ``payload`` the retained message of ``topic`` (published at QoS 2 by a paho client)."""
    publisher = Paho(port, f"p-{_id()}")
    try:
        publisher.connect()
        publisher.publish(topic, payload, 2, retain=True)
        publisher.disconnect()
    finally:
        publisher.stop()


def _connect(client: Raw, client_id: str, version: int, *, persistent: bool) -> Connack:
    if version == V5:
        connack = client.connect(client_id, clean_start=False, properties=PERSISTENT if persistent else Properties())
    else:  # 3.1.1: clean session 0 is a persistent session, 1 one that ends with the connection
        connack = client.connect(client_id, clean_start=not persistent)
    assert isinstance(connack, Connack), connack
    assert connack.reason_code == 0, connack
    return connack


def _end(client: Raw, gateway: GatewayProcess, how: str) -> None:
    """The connection ends without the client acknowledging anything: its socket closes, or its gateway dies."""
    if how == "kill":
        gateway.process.kill()
        gateway.process.wait()
    client.sock.close()


def _subscribed_to_retained(
    client: Raw, client_id: str, version: int, topic: str, qos: int, *, persistent: bool = True
) -> Publish:
    _connect(client, client_id, version, persistent=persistent)
    client.send(Subscribe(1, (Subscription(topic, qos),)))
    assert client.next() == Suback(1, (qos,))
    delivered = client.next()
    assert isinstance(delivered, Publish), delivered
    assert (delivered.topic, delivered.qos, delivered.retain, delivered.dup) == (topic, qos, True, False), delivered
    assert delivered.packet_id is not None
    return delivered


@pytest.mark.parametrize("version", [V311, V5])
@pytest.mark.parametrize("how", ["close", "kill"])
def test_a_retained_qos1_delivery_comes_again_until_acknowledged(
    replicas: tuple[GatewayProcess, GatewayProcess], raw: Callable[..., Raw], version: int, how: str
) -> None:
    a, b = replicas
    topic = f"rs1/{_id()}"
    client_id = f"rs1-{_id()}"
    _retain(b.port, topic, b"kept")
    first = raw(a.port, version)
    delivered = _subscribed_to_retained(first, client_id, version, topic, 1)
    assert delivered.payload == b"kept"
    _end(first, a, how)  # no PUBACK
    again = raw(b.port if how == "kill" else a.port, version)
    assert _connect(again, client_id, version, persistent=True).session_present
    resent = again.next()
    assert isinstance(resent, Publish), resent
    assert (resent.topic, resent.payload, resent.qos, resent.retain, resent.dup, resent.packet_id) == (
        topic,
        b"kept",
        1,
        True,
        True,
        delivered.packet_id,
    )
    again.send(Puback(delivered.packet_id or 0))
    assert silent(again, 0.5) == []
    # Acknowledged now: the next connection of the session gets it no more.
    again.sock.close()
    third = raw(b.port, version)
    assert _connect(third, client_id, version, persistent=True).session_present
    assert silent(third, 1.0) == [], "an acknowledged retained message came again"


@pytest.mark.parametrize("lost", ["pubrec", "pubcomp"])
@pytest.mark.parametrize("how", ["close", "kill"])
def test_a_retained_qos2_delivery_completes_across_connections(
    replicas: tuple[GatewayProcess, GatewayProcess], raw: Callable[..., Raw], lost: str, how: str
) -> None:
    a, b = replicas
    topic = f"rs2/{_id()}"
    client_id = f"rs2-{_id()}"
    _retain(b.port, topic, b"exactly once")
    first = raw(a.port)
    delivered = _subscribed_to_retained(first, client_id, V5, topic, 2)
    packet_id = delivered.packet_id or 0
    if lost == "pubcomp":  # the client has it: after the reconnect only the PUBREL may come
        first.send(Pubrec(packet_id))
        assert first.next() == Pubrel(packet_id)
    _end(first, a, how)
    again = raw(b.port if how == "kill" else a.port)
    assert _connect(again, client_id, V5, persistent=True).session_present
    if lost == "pubrec":  # nothing acknowledged: the same PUBLISH again, same packet id, DUP and RETAIN set
        resent = again.next()
        assert isinstance(resent, Publish), resent
        assert (resent.payload, resent.qos, resent.retain, resent.dup, resent.packet_id) == (
            b"exactly once",
            2,
            True,
            True,
            packet_id,
        )
        again.send(Pubrec(packet_id))
    assert again.next() == Pubrel(packet_id)
    again.send(Pubcomp(packet_id))
    assert silent(again, 1.0) == [], "a further copy arrived"


@pytest.mark.parametrize("version", [V311, V5])
def test_a_session_that_ends_with_its_connection_gets_no_retained_message_again(
    replicas: tuple[GatewayProcess, GatewayProcess], raw: Callable[..., Raw], version: int
) -> None:
    a, _ = replicas
    topic = f"rs0/{_id()}"
    client_id = f"rs0-{_id()}"
    _retain(a.port, topic, b"once")
    first = raw(a.port, version)
    _subscribed_to_retained(first, client_id, version, topic, 1, persistent=False)
    first.sock.close()  # no PUBACK
    again = raw(a.port, version)
    assert not _connect(again, client_id, version, persistent=False).session_present
    assert silent(again, 1.0) == []
