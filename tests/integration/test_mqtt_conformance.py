"""MQTT conformance of the gateway with exact packets: QoS 1 and 2 across a gateway killed mid-flow (the session
resumed through another replica), session expiry and clean start, MQTT 5 features, keep-alive, malformed input,
WebSocket framing, authentication and authorisation, and a slow subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tests.conftest import (
    CoreProcess,
    GatewayProcess,
    module_core,
    module_mqtt_gateway,
    start_core,
    start_gateway,
    stop_cleanly,
)
from tests.integration.blocking_sender import send_before_reading
from tests.integration.mqtt_clients import Paho, Raw, silent

from tridentmq_mqtt import convert
from tridentmq_mqtt.convert import session_queue, subscription_queue
from tridentmq_mqtt.protocol.packets import (
    V5,
    V31,
    V311,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketParser,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)
from tridentmq_mqtt.protocol.properties import Properties, encode_vbi
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.message import RoutingType, new_message

PERSISTENT = Properties(session_expiry_interval=300)

# One core and one gateway for the module: each test keeps to topics and client ids of its own (the gateways a
# test kills are its own: ``replicas``).
core = module_core
mqtt_gateway = module_mqtt_gateway


def _id() -> str:
    return uuid.uuid4().hex[:10]


def _kill(gateway: GatewayProcess) -> None:
    """SIGKILL: no goodbye to the clients or the core, whatever was in flight is lost with the process."""
    gateway.process.kill()
    gateway.process.wait()


@pytest.fixture
def paho() -> Iterator[Callable[..., Paho]]:
    """Paho clients, stopped at the end of the test."""
    made: list[Paho] = []

    def make(port: int, client_id: str = "", **options: object) -> Paho:
        made.append(Paho(port, client_id or f"p-{_id()}", **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for client in made:
        with contextlib.suppress(Exception):
            client.client.disconnect()
        client.stop()


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _subscription(core: CoreProcess, client_id: str, topic_filter: str) -> dict[str, Any] | None:
    """The core's view of the queue of ``client_id``'s subscription to ``topic_filter`` (None: it has none)."""
    return _queue(core, subscription_queue(client_id, topic_filter))


def _queue(core: CoreProcess, queue: str) -> dict[str, Any] | None:
    """The core's view of ``queue`` (None: there is none)."""
    name = urllib.parse.quote(queue, safe="")
    try:
        return _get_json(f"{core.management_url}/api/queues/{name}")  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            return None
        raise


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _connected(client: Raw, client_id: str, *, session_present: bool | None = None, **fields: object) -> Connack:
    connack = client.connect(client_id, **fields)
    assert isinstance(connack, Connack), connack
    assert connack.reason_code == 0, connack
    if session_present is not None:
        assert connack.session_present is session_present, connack
    return connack


def _publish_bytes(topic: bytes, payload: bytes, version: int, first: int = 0x30, props: bytes = b"\x00") -> bytes:
    """A PUBLISH written by hand (QoS 0), for what our encoder refuses to write."""
    body = len(topic).to_bytes(2, "big") + topic + (props if version == V5 else b"") + payload
    return bytes((first,)) + encode_vbi(len(body)) + body


# ---------------------------------------------------------------------------------------------------- QoS 2 in
@pytest.mark.parametrize("lost", ["pubcomp", "pubrec"])
def test_qos2_inbound_exactly_once_across_a_gateway_kill(
    replicas: tuple[GatewayProcess, GatewayProcess], raw: Callable[..., Raw], paho: Callable[..., Paho], lost: str
) -> None:
    a, b = replicas
    topic = f"eo/{_id()}"
    sub = paho(b.port)
    sub.connect()
    sub.subscribe(topic, 2)
    client_id = f"q2-{_id()}"
    first = raw(a.port)
    _connected(first, client_id, session_present=False, clean_start=False, properties=PERSISTENT)
    first.send(Publish(topic, b"once", 2, packet_id=1))
    if lost == "pubcomp":
        assert first.next() == Pubrec(1)
    _kill(a)
    again = raw(b.port)
    _connected(again, client_id, session_present=True, clean_start=False, properties=PERSISTENT)
    if lost == "pubrec":  # the PUBREC may never have been sent: the client sends the PUBLISH again
        again.send(Publish(topic, b"once", 2, dup=True, packet_id=1))
        assert again.next() == Pubrec(1)
    again.send(Pubrel(1))
    assert again.next() == Pubcomp(1, 0)
    assert [m.payload for m in sub.receive(1)] == [b"once"]
    assert sub.nothing_more(1.0), "the message was delivered twice"
    assert silent(again, 0.2) == []


# ---------------------------------------------------------------------------------------------------- QoS 2 out
@pytest.mark.parametrize("lost", ["pubrec", "pubcomp"])
def test_qos2_outbound_exactly_once_across_a_gateway_kill(
    replicas: tuple[GatewayProcess, GatewayProcess], raw: Callable[..., Raw], paho: Callable[..., Paho], lost: str
) -> None:
    a, b = replicas
    topic = f"eo/{_id()}"
    client_id = f"s2-{_id()}"
    first = raw(a.port)
    _connected(first, client_id, session_present=False, clean_start=False, properties=PERSISTENT)
    first.send(Subscribe(1, (Subscription(topic, 2),)))
    assert first.next() == Suback(1, (2,))
    pub = paho(b.port)
    pub.connect()
    pub.publish(topic, b"exactly once", 2)
    delivered = first.next()
    assert isinstance(delivered, Publish), delivered
    assert (delivered.topic, delivered.payload, delivered.qos, delivered.dup) == (topic, b"exactly once", 2, False)
    packet_id = delivered.packet_id
    assert packet_id is not None
    if lost == "pubcomp":
        first.send(Pubrec(packet_id))
        assert first.next() == Pubrel(packet_id)
    _kill(a)
    again = raw(b.port)
    _connected(again, client_id, session_present=True, clean_start=False, properties=PERSISTENT)
    if lost == "pubrec":  # nothing acknowledged: the same PUBLISH again, same packet id, DUP set
        resent = again.next()
        assert isinstance(resent, Publish), resent
        assert (resent.packet_id, resent.dup, resent.qos, resent.payload) == (packet_id, True, 2, b"exactly once")
        again.send(Pubrec(packet_id))
    assert again.next() == Pubrel(packet_id)  # after a PUBREC only the PUBREL, never the PUBLISH again
    again.send(Pubcomp(packet_id))
    assert silent(again, 1.0) == [], "a further copy arrived"


# ---------------------------------------------------------------------------------------------------- QoS 1
def test_qos1_nothing_lost_across_a_gateway_kill(
    replicas: tuple[GatewayProcess, GatewayProcess],
    raw: Callable[..., Raw],
    paho: Callable[..., Paho],
    core: CoreProcess,
) -> None:
    a, b = replicas
    topic = f"q1/{_id()}"
    client_id = f"s1-{_id()}"
    first = raw(a.port)
    _connected(first, client_id, clean_start=False, properties=PERSISTENT)
    first.send(Subscribe(1, (Subscription(topic, 1),)))
    assert first.next() == Suback(1, (1,))
    pub = paho(b.port)
    pub.connect()
    for i in range(6):
        pub.publish(topic, f"m{i}".encode(), 1)
    got = [first.next() for _ in range(6)]
    assert all(isinstance(p, Publish) and p.qos == 1 and not p.dup for p in got), got
    assert [p.payload for p in got] == [f"m{i}".encode() for i in range(6)]  # type: ignore[union-attr]
    ids = [p.packet_id for p in got]  # type: ignore[union-attr]
    first.send(Puback(ids[0]), Puback(ids[2]))  # the rest stays unacknowledged
    # The gateway passes the acknowledgements on to the core:
    _wait_for(lambda: (_subscription(core, client_id, topic) or {}).get("acked") == 2, "the PUBACKs in the core")
    _kill(a)
    again = raw(b.port)
    _connected(again, client_id, session_present=True, clean_start=False, properties=PERSISTENT)
    resent = [again.next() for _ in range(4)]
    assert all(isinstance(p, Publish) and p.dup and p.qos == 1 for p in resent), resent
    assert sorted((p.payload, p.packet_id) for p in resent) == [  # type: ignore[union-attr]
        (f"m{i}".encode(), ids[i]) for i in (1, 3, 4, 5)
    ]
    again.send(*(Puback(p.packet_id or 0) for p in resent))  # type: ignore[union-attr]
    assert silent(again, 0.5) == []


# ---------------------------------------------------------------------------------------------------- sessions
def test_session_expires_after_its_interval(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw], paho: Callable[..., Paho], core: CoreProcess
) -> None:
    topic = f"exp/{_id()}"
    client_id = f"e-{_id()}"
    first = raw(mqtt_gateway.port)
    _connected(first, client_id, properties=Properties(session_expiry_interval=1))
    first.send(Subscribe(1, (Subscription(topic, 1),)))
    assert first.next() == Suback(1, (1,))
    first.send(Disconnect())
    assert first.closed()
    pub = paho(mqtt_gateway.port)
    pub.connect()
    pub.publish(topic, b"queued, then expired with the session", 1)
    _wait_for(lambda: _subscription(core, client_id, topic) is None, "the session to expire with its queue")
    # Its record expires on its own clock, once the session's link has closed: a tick later, on a busy machine.
    _wait_for(lambda: _queue(core, session_queue(client_id)) is None, "the session's record to expire")
    pub.publish(topic, b"after the expiry", 1)
    again = raw(mqtt_gateway.port)
    _connected(again, client_id, session_present=False, clean_start=False, properties=PERSISTENT)
    assert silent(again, 0.7) == []


def test_disconnect_with_session_expiry_0_ends_the_session(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]
) -> None:
    client_id = f"z-{_id()}"
    first = raw(mqtt_gateway.port)
    _connected(first, client_id, properties=PERSISTENT)
    first.send(Subscribe(1, (Subscription(f"z/{_id()}", 1),)))
    assert first.next() == Suback(1, (1,))
    first.send(Disconnect(0, Properties(session_expiry_interval=0)))
    assert first.closed()
    again = raw(mqtt_gateway.port)
    _connected(again, client_id, session_present=False, clean_start=False, properties=PERSISTENT)


def test_a_disconnect_setting_an_expiry_after_a_connect_that_asked_for_0_is_no_disconnect(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw], paho: Callable[..., Paho]
) -> None:
    """5.0 3.14.2.2.2: a protocol error, so not a normal DISCONNECT: the will goes; a valid one keeps it back."""
    topic = f"dw/{_id()}"
    watcher = paho(mqtt_gateway.port)
    watcher.connect()
    watcher.subscribe(topic, 1)
    invalid = raw(mqtt_gateway.port)
    _connected(invalid, f"dw-{_id()}", will=Will(topic, b"invalid disconnect", 1))
    invalid.send(Disconnect(0, Properties(session_expiry_interval=60)))
    assert invalid.closed()
    assert [m.payload for m in watcher.receive(1)] == [b"invalid disconnect"]
    valid = raw(mqtt_gateway.port)
    _connected(valid, f"dw-{_id()}", will=Will(topic, b"valid disconnect", 1))
    valid.send(Disconnect(0, Properties(session_expiry_interval=0)))
    assert valid.closed()
    assert watcher.nothing_more()


def test_clean_start_discards_the_session(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw], paho: Callable[..., Paho]
) -> None:
    topic = f"cs/{_id()}"
    client_id = f"c-{_id()}"
    first = raw(mqtt_gateway.port)
    _connected(first, client_id, properties=PERSISTENT)
    first.send(Subscribe(1, (Subscription(topic, 1),)))
    assert first.next() == Suback(1, (1,))
    first.send(Disconnect())
    assert first.closed()
    pub = paho(mqtt_gateway.port)
    pub.connect()
    for i in range(3):
        pub.publish(topic, f"old {i}".encode(), 1)
    again = raw(mqtt_gateway.port)
    _connected(again, client_id, session_present=False, clean_start=True, properties=PERSISTENT)
    again.send(Subscribe(1, (Subscription(topic, 1),)))  # the same filter again: a new, empty queue
    assert again.next() == Suback(1, (1,))
    assert silent(again, 0.7) == []


def test_a_new_subscription_does_not_inherit_a_queue_no_session_lists(
    mqtt_gateway: GatewayProcess, core: CoreProcess, raw: Callable[..., Raw], paho: Callable[..., Paho]
) -> None:
    """paho's MQTT 5 offline queueing test once got 13 messages for 3 published: a subscription queue that no
    session record listed (a gateway gone between making it and saving the record) outlived the clean start,
    gathered what other tests published, and the same filter subscribed again took it over with its backlog."""
    client_id = f"off-{_id()}"
    topic_filter = f"off{_id()}/#"
    prefix = topic_filter[:-2]

    async def leave_an_orphan() -> None:  # what the lost record leaves behind: the queue, full
        async with LinkClient("127.0.0.1", core.link_port) as link:
            await link.create_queue(
                convert.subscription_queue(client_id, topic_filter),
                convert.filter_to_pattern(topic_filter),
                routing_type=RoutingType.MULTICAST,
            )
            for n in range(10):
                await link.publish(
                    new_message(
                        convert.topic_to_address(f"{prefix}/old"), f"old {n}".encode(), routing=RoutingType.MULTICAST
                    )
                )

    asyncio.run(leave_an_orphan())
    first = raw(mqtt_gateway.port)
    _connected(first, client_id, session_present=False, clean_start=True, properties=PERSISTENT)
    first.send(Subscribe(1, (Subscription(topic_filter, 2),)))
    assert first.next() == Suback(1, (2,))
    first.send(Disconnect())
    assert first.closed()
    publisher = paho(mqtt_gateway.port)
    publisher.connect()
    for qos in (0, 1, 2):
        publisher.publish(f"{prefix}/q{qos}", f"qos {qos}".encode(), qos)
    again = paho(mqtt_gateway.port, client_id, clean=False)
    assert again.connect(expiry=300)[0] is True  # session present
    assert [m.payload for m in again.receive(3)] == [b"qos 0", b"qos 1", b"qos 2"]
    publisher.publish(f"{prefix}/last", b"last", 1)
    assert [m.payload for m in again.receive(1)] == [b"last"]  # and nothing else came between


# ---------------------------------------------------------------------------------------------------- MQTT 5
def test_connack_properties(tmp_path: Path, core: CoreProcess, raw: Callable[..., Raw]) -> None:
    gateway = start_gateway(tmp_path, core, "mqtt", TRIDENTMQ_MQTT_MQTT_MAX_KEEP_ALIVE_S="10")
    empty = raw(gateway.port)
    connack = _connected(empty, "", keep_alive=0)
    assigned = connack.properties.assigned_client_identifier
    assert assigned, connack
    assert connack.properties.server_keep_alive == 10  # asked for none
    assert connack.properties.receive_maximum == 1000
    assert connack.properties.topic_alias_maximum == 64
    long = raw(gateway.port)
    assert _connected(long, f"k-{_id()}", keep_alive=60).properties.server_keep_alive == 10
    short = raw(gateway.port)
    granted = _connected(short, f"k-{_id()}", keep_alive=5).properties
    assert granted.server_keep_alive is None  # granted
    assert granted.response_information is None  # not asked for
    asking = raw(gateway.port)
    client_id = f"k-{_id()}"
    connack = _connected(asking, client_id, properties=Properties(request_response_information=True))
    assert connack.properties.response_information == f"reply/{client_id}"
    for client in (empty, long, short, asking):
        client.send(Disconnect())
    stop_cleanly(gateway)


def test_topic_aliases_subscription_ids_no_local_retain_as_published(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]
) -> None:
    base = f"f{_id()}"
    client = raw(mqtt_gateway.port)
    _connected(client, f"f-{_id()}")
    client.send(
        Subscribe(1, (Subscription(f"{base}/alias", 1),), Properties(subscription_identifiers=(7,))),
        Subscribe(2, (Subscription(f"{base}/mine", 1, no_local=True),)),
        Subscribe(3, (Subscription(f"{base}/rap", 1, retain_as_published=True), Subscription(f"{base}/plain", 1))),
    )
    assert [client.next() for _ in range(3)] == [Suback(1, (1,)), Suback(2, (1,)), Suback(3, (1, 1))]
    client.send(
        Publish(f"{base}/alias", b"set", 1, packet_id=1, properties=Properties(topic_alias=3)),
        Publish("", b"used", 1, packet_id=2, properties=Properties(topic_alias=3)),
        Publish(f"{base}/mine", b"own", 1, packet_id=3),
        Publish(f"{base}/rap", b"r1", 1, retain=True, packet_id=4),
        Publish(f"{base}/plain", b"r2", 1, retain=True, packet_id=5),
    )
    got = [client.next() for _ in range(9)]
    acks = [p for p in got if isinstance(p, Puback)]
    assert acks == [Puback(i) for i in range(1, 6)]
    delivered = {p.payload: p for p in got if isinstance(p, Publish)}
    assert set(delivered) == {b"set", b"used", b"r1", b"r2"}  # not b"own": no-local
    for payload in (b"set", b"used"):
        assert delivered[payload].topic == f"{base}/alias"
        assert delivered[payload].properties.subscription_identifiers == (7,)
    assert delivered[b"r1"].retain is True  # retain as published
    assert delivered[b"r2"].retain is False
    for packet in delivered.values():
        client.send(Puback(packet.packet_id or 0))
    assert silent(client, 0.3) == []
    client.send(Publish(f"{base}/x", b"", 0, retain=True))  # no retained messages left behind
    client.send(
        Publish(f"{base}/rap", b"", 1, retain=True, packet_id=6),
        Publish(f"{base}/plain", b"", 1, retain=True, packet_id=7),
    )


def test_retain_handling(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    topic = f"rh/{_id()}"
    client = raw(mqtt_gateway.port)
    _connected(client, f"r-{_id()}")
    client.send(Publish(topic, b"kept", 1, retain=True, packet_id=1))
    assert client.next() == Puback(1)

    def subscribe(packet_id: int, handling: int) -> list[Packet]:
        client.send(Subscribe(packet_id, (Subscription(topic, 0, retain_handling=handling),)))
        assert client.next() == Suback(packet_id, (0,))
        return silent(client, 0.5)

    assert subscribe(2, 2) == []  # 2: never
    client.send(Unsubscribe(3, (topic,)))
    assert client.next() == Unsuback(3, (0,))
    assert [(p.payload, p.retain) for p in subscribe(4, 1)] == [(b"kept", True)]  # type: ignore[union-attr]
    assert subscribe(5, 1) == []  # 1: only for a new subscription
    assert [(p.payload, p.retain) for p in subscribe(6, 0)] == [(b"kept", True)]  # type: ignore[union-attr]
    client.send(Publish(topic, b"", 1, retain=True, packet_id=7))
    assert Puback(7) in silent(client, 0.5)


def test_message_expiry_while_the_subscriber_is_offline(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw], core: CoreProcess
) -> None:
    topic = f"mx/{_id()}"
    client_id = f"m-{_id()}"
    sub = raw(mqtt_gateway.port)
    _connected(sub, client_id, properties=PERSISTENT)
    sub.send(Subscribe(1, (Subscription(topic, 1),)))
    assert sub.next() == Suback(1, (1,))
    sub.send(Disconnect())
    assert sub.closed()
    pub = raw(mqtt_gateway.port)
    _connected(pub, f"p-{_id()}")
    pub.send(
        Publish(topic, b"short-lived", 1, packet_id=1, properties=Properties(message_expiry_interval=1)),
        Publish(topic, b"long-lived", 1, packet_id=2, properties=Properties(message_expiry_interval=60)),
    )
    assert [pub.next(), pub.next()] == [Puback(1), Puback(2)]
    _wait_for(lambda: (_subscription(core, client_id, topic) or {}).get("expired") == 1, "the first to expire")
    again = raw(mqtt_gateway.port)
    _connected(again, client_id, session_present=True, clean_start=False, properties=PERSISTENT)
    got = silent(again, 1.0)
    assert [p.payload for p in got] == [b"long-lived"], got  # type: ignore[union-attr]
    remaining = got[0].properties.message_expiry_interval  # type: ignore[union-attr]
    assert remaining is not None
    assert 55 <= remaining <= 59


def test_unsuback_and_pubrel_for_unknown_ids(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    client = raw(mqtt_gateway.port)
    _connected(client, f"u-{_id()}", properties=Properties(request_problem_information=True))
    client.send(Unsubscribe(1, ("never/subscribed",)))
    assert client.next() == Unsuback(1, (0x11,))
    client.send(Pubrel(42))
    answer = client.next()
    assert answer == Pubcomp(42, 0x92, answer.properties), answer  # type: ignore[union-attr]
    # [MQTT-4.3.3-4]: a PUBREC is answered with a PUBREL, 0x92 Packet Identifier not found for an unknown id.
    client.send(Pubrec(43))
    assert client.next() == Pubrel(43, 0x92)
    client.send(Pubcomp(43), Pubrec(44, 0x80))  # an error PUBREC ends the flow: no PUBREL
    client.send(Subscribe(2, (Subscription("still/fine", 1),)))
    assert client.next() == Suback(2, (1,))
    old = raw(mqtt_gateway.port, V311)
    _connected(old, f"u-{_id()}")
    old.send(Pubrec(45))
    assert old.next() == Pubrel(45)


def test_an_empty_client_id_is_refused_in_3_1(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    """MQTT V3.1 (protocol name MQIsdp, level 3): the client id is 1 to 23 characters, else CONNACK 2."""
    refused = raw(mqtt_gateway.port, V31)
    assert refused.connect("") == Connack(session_present=False, reason_code=2)
    assert refused.closed()
    _connected(raw(mqtt_gateway.port, V31), f"v31-{_id()}")
    _connected(raw(mqtt_gateway.port, V311), "")  # 3.1.1 with clean session: one is assigned


def test_unsubscribe_of_an_invalid_topic_filter(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    """5.0: UNSUBACK 0x8F (Topic Filter invalid) for it, the packet's other filters as usual. 3.1.1 has no code
    for it: the filter breaks [MQTT-4.7.1-2] or [MQTT-4.7.3-1], a protocol violation, and the connection closes
    ([MQTT-4.8.0-1]) without unsubscribing any of the packet's filters."""
    topic = f"unsub/{_id()}"
    client = raw(mqtt_gateway.port)
    _connected(client, f"u-{_id()}")
    client.send(Subscribe(1, (Subscription(topic, 0),)))
    assert client.next() == Suback(1, (0,))
    client.send(Unsubscribe(2, ("a/#/b", "a+", "$share/g", topic, "never/subscribed")))
    assert client.next() == Unsuback(2, (0x8F, 0x8F, 0x8F, 0, 0x11))
    old = raw(mqtt_gateway.port, V311)
    _connected(old, f"u-{_id()}")
    old.send(Subscribe(1, (Subscription(topic, 0),)))
    assert old.next() == Suback(1, (0,))
    old.send(Unsubscribe(2, (topic, "a/#/b")))
    assert old.closed()
    assert old.pending == []
    old = raw(mqtt_gateway.port, V311)
    _connected(old, f"u-{_id()}")
    old.send(Unsubscribe(1, ("$share/g", "never/subscribed")))  # an ordinary filter before 5.0
    assert old.next() == Unsuback(1)


def test_pingreq_is_answered(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    for version in (V311, V5):
        client = raw(mqtt_gateway.port, version)
        _connected(client, f"ping-{_id()}", keep_alive=30)
        client.send(Pingreq())
        assert client.next(2) == Pingresp(), f"MQTT level {version}"


# ---------------------------------------------------------------------------------------------------- keep-alive
def test_keep_alive_timeout_disconnects_and_sends_the_will(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw], paho: Callable[..., Paho]
) -> None:
    topic = f"ka/{_id()}"
    watcher = paho(mqtt_gateway.port)
    watcher.connect()
    watcher.subscribe(topic, 1)
    silent = raw(mqtt_gateway.port)
    started = time.monotonic()
    _connected(silent, f"ka-{_id()}", keep_alive=1, will=Will(topic, b"timed out", 1))
    goodbye = silent.next(5)
    elapsed = time.monotonic() - started
    assert goodbye == Disconnect(0x8D, goodbye.properties), goodbye  # type: ignore[union-attr]
    assert 1.2 <= elapsed <= 3.0, elapsed
    assert silent.closed()
    assert [m.payload for m in watcher.receive(1)] == [b"timed out"]


# ---------------------------------------------------------------------------------------------------- bad input
def _outcome(client: Raw, wait: float = 5.0) -> tuple[list[Packet], bool]:
    """What the server sent before closing, and whether it closed."""
    closed = client.closed(wait)
    return list(client.pending), closed


def _works(port: int) -> str | None:
    """A fresh client connects, subscribes and gets its own message; the problem if it does not."""
    client = Raw(port)
    try:
        topic = f"ok/{_id()}"
        _connected(client, f"ok-{_id()}")
        client.send(Subscribe(1, (Subscription(topic, 1),)))
        assert client.next() == Suback(1, (1,))
        client.send(Publish(topic, b"fine", 1, packet_id=1))
        got = [client.next(), client.next()]
        assert Puback(1) in got, got
        assert any(isinstance(p, Publish) and p.payload == b"fine" for p in got), got
    except AssertionError as exc:
        return f"a fresh client failed: {exc}"
    finally:
        client.close()
    return None


def test_malformed_input(tmp_path: Path, core: CoreProcess) -> None:
    """Each bad input on its own connection: the right answer, then the connection closes; the gateway, other
    connections and new ones carry on."""
    gateway = start_gateway(tmp_path, core, "mqtt", TRIDENTMQ_MQTT_MQTT_MAX_PACKET_BYTES="1024")
    port = gateway.port
    bystander = Raw(port)
    _connected(bystander, f"by-{_id()}")
    subscribe = encode(Subscribe(1, (Subscription("a/b", 1),)), V5)
    connect = encode(Connect(f"x-{_id()}"), V5)
    too_large = encode(Publish("big", b"x" * 2000, 1, packet_id=1), V5)
    qos3 = b"\x00\x03a/b" + b"\x00\x01" + b"\x00" + b"x"  # topic, packet id, no properties, payload
    level_6 = bytearray(encode(Connect("six"), V5))
    level_6[8] = 6  # fixed header (2), protocol name (6), level
    # name, version, connect first, bytes, the acceptable reason codes of a 5.0 DISCONNECT (None: just closed)
    cases: list[tuple[str, int, bool, bytes, set[int] | None]] = [
        ("remaining length of five bytes", V5, True, b"\x30\xff\xff\xff\xff\x7f", {0x81}),
        ("remaining length of five bytes 3.1.1", V311, True, b"\x30\xff\xff\xff\xff\x7f", None),
        ("reserved packet type 0", V5, True, b"\x00\x00", {0x81, 0x82}),
        ("SUBSCRIBE with flags 0", V5, True, bytes((0x80,)) + subscribe[1:], {0x81}),
        ("PUBLISH with QoS 3", V5, True, bytes((0x36,)) + bytes((len(qos3),)) + qos3, {0x81}),
        (
            "session expiry in a PUBLISH",
            V5,
            True,
            _publish_bytes(b"a/b", b"x", V5, props=b"\x05\x11\x00\x00\x00\x0a"),
            {0x81},
        ),
        ("packet larger than the maximum", V5, True, too_large, {0x95}),
        ("wildcard in a topic name", V5, True, _publish_bytes(b"a/+", b"x", V5), {0x90}),
        ("topic alias 0", V5, True, _publish_bytes(b"a/b", b"x", V5, props=b"\x03\x23\x00\x00"), {0x94}),
        ("wildcard in a topic name 3.1.1", V311, True, _publish_bytes(b"a/#", b"x", V311), None),
        ("a second CONNECT", V5, True, connect, {0x82}),
        ("first packet not a CONNECT", V5, False, encode(Pingreq(), V5), None),
    ]
    problems: list[str] = []
    for name, version, connect_first, data, codes in cases:
        client = Raw(port, version)
        try:
            if connect_first:
                _connected(client, f"bad-{_id()}")
            client.send_bytes(data)
            got, closed = _outcome(client)
        finally:
            client.close()
        seen = [(type(p).__name__, getattr(p, "reason_code", None)) for p in got]
        if codes is None and (got or not closed):
            problems.append(f"{name}: expected a close and nothing else, got {seen}, closed={closed}")
        elif codes is not None and (
            len(got) != 1 or not isinstance(got[0], Disconnect) or got[0].reason_code not in codes or not closed
        ):
            problems.append(
                f"{name}: expected DISCONNECT {sorted(hex(c) for c in codes)} and a close, got {seen}, closed={closed}"
            )
        if problem := _works(port):
            problems.append(f"after {name}: {problem}")
    # A protocol level the gateway does not speak: a 3.1.1 CONNACK with return code 1, then the close.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(bytes(level_6))
        answer = b""
        while chunk := sock.recv(100):
            answer += chunk
        if answer != b"\x20\x02\x00\x01":
            problems.append(f"protocol level 6: expected CONNACK 1 and a close, got {answer!r}")
    # A TLS client hello on the plain port: closed at once, no hang.
    hello = bytes.fromhex("16030100a5010000a10303") + bytes(32) + b"\x00\x00\x02\x13\x01\x01\x00"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(hello)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(100):
                pass
        if time.monotonic() - started > 2:
            problems.append("a TLS client hello was not closed within 2 s")
    bystander.send(Subscribe(9, (Subscription("by/stander", 0),)))
    try:
        assert bystander.next() == Suback(9, (0,))
    except AssertionError as exc:
        problems.append(f"the bystander connection suffered: {exc}")
    bystander.close()
    log = gateway.log()
    stop_cleanly(gateway)
    assert not problems, "\n".join(problems) + "\n" + log[-3000:]


def test_no_connect_within_the_connect_timeout(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, "mqtt", TRIDENTMQ_MQTT_MQTT_CONNECT_TIMEOUT_MS="500")
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert 0.4 <= time.monotonic() - started <= 2.5
    assert _works(gateway.port) is None
    stop_cleanly(gateway)


# ---------------------------------------------------------------------------------------------------- WebSocket
def test_websocket_framing(mqtt_gateway: GatewayProcess) -> None:
    url = f"http://127.0.0.1:{mqtt_gateway.ports['websocket']}/mqtt"

    async def close_code(protocols: tuple[str, ...], text: str | None = None) -> int | None:
        async with aiohttp.ClientSession() as session, session.ws_connect(url, protocols=protocols) as ws:
            if text is not None:
                await ws.send_str(text)
            msg = await ws.receive(timeout=5)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
            return ws.close_code

    async def packets(ws: aiohttp.ClientWebSocketResponse, parser: PacketParser, count: int) -> list[Packet]:
        got: list[Packet] = []
        while len(got) < count:
            msg = await ws.receive(timeout=5)
            assert msg.type is aiohttp.WSMsgType.BINARY, msg
            got += parser.feed(msg.data)
        return got

    async def mqtt() -> None:
        topic = f"ws/{_id()}"
        parser = PacketParser(version=V5)
        async with aiohttp.ClientSession() as session, session.ws_connect(url, protocols=("mqtt",)) as ws:
            assert ws.protocol == "mqtt"
            # Several packets in one message.
            await ws.send_bytes(
                encode(Connect(f"ws-{_id()}"), V5) + encode(Subscribe(1, (Subscription(topic, 1),)), V5)
            )
            got = await packets(ws, parser, 2)
            assert isinstance(got[0], Connack)
            assert got[0].reason_code == 0
            assert got[1] == Suback(1, (1,))
            # One packet over two messages.
            publish = encode(Publish(topic, b"split", 1, packet_id=1), V5)
            await ws.send_bytes(publish[:4])
            await asyncio.sleep(0.1)
            await ws.send_bytes(publish[4:])
            got = await packets(ws, parser, 2)
            assert Puback(1) in got
            assert [p.payload for p in got if isinstance(p, Publish)] == [b"split"]
            await ws.send_bytes(encode(Disconnect(), V5))

    assert asyncio.run(close_code(())) == 1002
    assert asyncio.run(close_code(("foo",))) == 1002
    assert asyncio.run(close_code(("mqtt",), text="not binary")) == 1003
    asyncio.run(mqtt())


def test_a_web_page_of_another_site_cannot_use_the_websocket_port_as_a_loopback_client(
    mqtt_gateway: GatewayProcess,
) -> None:
    """A browser on the broker's host is a loopback client, trusted with every right under the embedded
    default. Any site's page could connect through it (cross-site WebSocket hijacking; ``Origin`` names the
    site), or point its own name at 127.0.0.1 (DNS rebinding; ``Host`` names it): both were upgraded and
    served. Also: no permessage-deflate (about 100 KB per connection), and Paho JavaScript's ``mqttv3.1``."""
    port = mqtt_gateway.ports["websocket"]
    url = f"http://127.0.0.1:{port}/mqtt"

    async def handshake(headers: dict[str, str], protocols: tuple[str, ...] = ("mqtt",)) -> tuple[int, Any]:
        async with aiohttp.ClientSession(skip_auto_headers=("Origin",)) as session:
            try:
                async with session.ws_connect(url, protocols=protocols, headers=headers, autoclose=False) as ws:
                    connack = None
                    if ws.protocol:
                        await ws.send_bytes(encode(Connect(f"ws-{_id()}"), V5))
                        msg = await ws.receive(timeout=5)
                        connack = (
                            PacketParser(version=V5).feed(msg.data) if msg.type is aiohttp.WSMsgType.BINARY else msg
                        )
                    return 101, (ws.protocol, ws.compress, connack)
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status, None

    assert asyncio.run(handshake({"Origin": "http://evil.example"}))[0] == 403
    assert asyncio.run(handshake({"Origin": "null"}))[0] == 403
    assert asyncio.run(handshake({"Host": f"evil.example:{port}"}))[0] == 421
    assert asyncio.run(handshake({"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}))[0] == 421
    status, (protocol, compress, connack) = asyncio.run(
        handshake({"Origin": f"http://localhost:{port}", "Sec-WebSocket-Extensions": "permessage-deflate"})
    )
    assert (status, protocol, compress) == (101, "mqtt", 0)  # a page of this host, uncompressed
    assert isinstance(connack[0], Connack), connack
    assert connack[0].reason_code == 0, connack
    status, (protocol, _, _) = asyncio.run(handshake({}, protocols=("mqttv3.1",)))  # no Origin: not a browser
    assert (status, protocol) == (101, "mqttv3.1")
    assert "WebSocket handshake refused: a web page of another site" in mqtt_gateway.log()


def test_the_packet_size_limit_over_websocket_is_per_packet(tmp_path: Path, core: CoreProcess) -> None:
    """[MQTT-6.0.0-2]: a WebSocket message may hold several packets. Each within the maximum packet size is
    taken, whatever they make together; one above it gets DISCONNECT 0x95, as over TCP."""
    gateway = start_gateway(tmp_path, core, "mqtt", TRIDENTMQ_MQTT_MQTT_MAX_PACKET_BYTES="1024")
    url = f"http://127.0.0.1:{gateway.ports['websocket']}/mqtt"

    async def exchange(data: bytes) -> tuple[list[Packet], int | None]:
        parser, got = PacketParser(version=V5), []
        async with aiohttp.ClientSession() as session, session.ws_connect(url, protocols=("mqtt",)) as ws:
            await ws.send_bytes(data)
            while (msg := await ws.receive(timeout=5)).type is aiohttp.WSMsgType.BINARY:
                got += parser.feed(msg.data)
                if any(isinstance(p, Puback) for p in got) and len(got) == 4:
                    await ws.send_bytes(encode(Disconnect(), V5))
            return got, ws.close_code

    topic = f"ws-big/{_id()}"
    connect = encode(Connect(f"ws-{_id()}"), V5)
    publishes = b"".join(encode(Publish(topic, b"x" * 600, 1, packet_id=n), V5) for n in (1, 2, 3))
    got, code = asyncio.run(exchange(connect + publishes))  # about 1900 bytes in one message: closed 1009 before
    assert code != 1009
    assert [type(p) for p in got] == [Connack, Puback, Puback, Puback], got
    assert [p.packet_id for p in got[1:]] == [1, 2, 3]  # type: ignore[union-attr]
    got, _ = asyncio.run(exchange(connect + encode(Publish(topic, b"x" * 2000, 1, packet_id=1), V5)))
    assert [type(p) for p in got] == [Connack, Disconnect], got
    assert got[1].reason_code == 0x95  # type: ignore[union-attr]
    stop_cleanly(gateway)


# ---------------------------------------------------------------------------------------------------- security
_PERMISSIONS = (
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


def _grant(match: str, permission: str, role: str) -> str:
    return f'[[permissions]]\nmatch = "{match}"\npermission = "{permission}"\nroles = ["{role}"]\n'


def test_authentication_and_authorisation(tmp_path: Path, raw: Callable[..., Raw]) -> None:
    config = (
        '[[users]]\nname = "gw"\npassword = "gw-secret"\nroles = ["gateway"]\n'
        '[[users]]\nname = "app"\npassword = "secret"\nroles = ["app"]\n'
        + "".join(_grant("#", p, "gateway") for p in _PERMISSIONS)
        + "".join(_grant("#", p, "app") for p in _PERMISSIONS if p not in ("send", "consume", "browse"))
        + _grant("open.#", "send", "app")
        + _grant("open.#", "consume", "app")
    )
    core = start_core(tmp_path, config=config)
    gateway = start_gateway(
        tmp_path, core, "mqtt", TRIDENTMQ_MQTT_CORE_USER="gw", TRIDENTMQ_MQTT_CORE_PASSWORD="gw-secret"
    )
    port = gateway.port
    bad5 = raw(port, V5).connect(f"a-{_id()}", username="app", password=b"wrong")
    assert bad5 == Connack(session_present=False, reason_code=0x86, properties=bad5.properties), bad5  # type: ignore[union-attr]
    assert raw(port, V311).connect(f"a-{_id()}", username="app", password=b"wrong") == Connack(
        session_present=False, reason_code=4
    )
    client5 = raw(port, V5)
    _connected(client5, f"a-{_id()}", username="app", password=b"secret")
    client5.send(Publish("secret/x", b"no", 1, packet_id=1), Publish("open/x", b"yes", 1, packet_id=2))
    refused, accepted = client5.next(), client5.next()
    assert refused == Puback(1, 0x87, refused.properties), refused  # type: ignore[union-attr]
    assert refused.properties.reason_string, refused  # type: ignore[union-attr]
    assert accepted == Puback(2)
    terse = raw(port, V5)  # Request Problem Information 0: no reason string on the PUBACK
    _connected(
        terse,
        f"t-{_id()}",
        username="app",
        password=b"secret",
        properties=Properties(request_problem_information=False),
    )
    terse.send(Publish("secret/x", b"no", 1, packet_id=1))
    assert terse.next() == Puback(1, 0x87)
    client5.send(Subscribe(3, (Subscription("secret/x", 1), Subscription("open/y", 1))))
    assert client5.next() == Suback(3, (0x87, 1))
    client311 = raw(port, V311)
    _connected(client311, f"b-{_id()}", username="app", password=b"secret")
    client311.send(Subscribe(1, (Subscription("secret/x", 1), Subscription("open/y", 1))))
    assert client311.next() == Suback(1, (0x80, 1))
    client311.send(Publish("secret/x", b"no", 1, packet_id=2))
    assert client311.closed(), "3.1.1 has no negative PUBACK: the connection must close"
    client5.send(Disconnect())
    stop_cleanly(gateway)
    assert core.stop() == 0


# ---------------------------------------------------------------------------------------------------- flow control
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_slow_subscriber_bounded_memory(mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]) -> None:
    count, size = 20_000, 1024
    topic = f"slow/{_id()}"
    sub = raw(mqtt_gateway.port)
    sub.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    _connected(sub, f"slow-{_id()}")
    sub.send(Subscribe(1, (Subscription(topic, 1),)))
    assert sub.next() == Suback(1, (1,))
    before = _rss_kib(mqtt_gateway.process.pid)
    pub = raw(mqtt_gateway.port)
    _connected(pub, f"fast-{_id()}")
    payload = b"x" * size
    acked = 0
    window = 500
    for start in range(0, count, window):  # within the gateway's receive maximum (1000)
        pub.send(*(Publish(topic, payload, 1, packet_id=i % 60_000 + 1) for i in range(start, start + window)))
        for _ in range(window):
            packet = pub.next(30)
            assert packet == Puback(packet.packet_id), packet  # type: ignore[union-attr]
            acked += 1
    peak = _rss_kib(mqtt_gateway.process.pid)
    assert peak - before < 100 * 1024, f"the gateway grew by {(peak - before) // 1024} MiB"
    received = 0
    while received < count:
        packet = sub.next(30)
        assert isinstance(packet, Publish), packet
        assert packet.payload == payload
        received += 1
        sub.send(Puback(packet.packet_id or 0))
    assert acked == count
    assert silent(sub, 0.3) == []


def test_a_one_thread_client_that_publishes_a_burst_before_reading_is_not_deadlocked(
    mqtt_gateway: GatewayProcess, raw: Callable[..., Raw]
) -> None:
    """A client with one thread and blocking writes (many embedded libraries) subscribes to a topic, then publishes
    a burst to it (QoS 0 and QoS 1, not waiting for PUBACKs) before it reads anything: its own deliveries fill its
    socket. The gateway goes on reading and handling its packets, so the burst is taken whole."""
    count, payload = 30_000, b"x" * 1024  # about 30 MiB each way: more than the sockets' buffers hold
    topic = f"echo/{_id()}"
    client = raw(mqtt_gateway.port, V311)
    _connected(client, f"echo-{_id()}")
    client.send(Subscribe(1, (Subscription(topic, 0),)))
    assert client.next() == Suback(1, (0,))
    burst = b"".join(
        encode(Publish(topic, payload, n % 2, packet_id=n % 60_000 + 1 if n % 2 else None), V311) for n in range(count)
    )
    sock = client.sock
    stalled_at, data = send_before_reading(sock, burst)
    assert stalled_at is None, f"deadlocked after {stalled_at} of {len(burst)} bytes"
    client.pending = client.parser.feed(bytes(data))
    acked, delivered = [], 0
    while len(acked) < count // 2:
        packet = client.next(30)
        if isinstance(packet, Puback):
            acked.append(packet.packet_id)
        else:
            assert isinstance(packet, Publish), packet
            delivered += 1
    assert acked == [n % 60_000 + 1 for n in range(1, count, 2)]
    assert delivered > 0
