"""The sans-IO MQTT server connection: client bytes built with ``encode``, fed whole and byte by byte; the
server's answers read back with a client-side ``PacketParser``."""

from __future__ import annotations

import pytest

from tridentmq_mqtt.protocol import events as ev
from tridentmq_mqtt.protocol.connection import KEEP_ALIVE_TIMEOUT, MqttServerConnection, State
from tridentmq_mqtt.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_mqtt.protocol.packets import (
    V5,
    V31,
    V311,
    VERSIONS,
    Auth,
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
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties

PIECES = [None, 1]  # whole, byte by byte


def feed(conn: MqttServerConnection, data: bytes, piece: int | None = None, now: float = 1.0) -> list[ev.Event]:
    if piece is None:
        return conn.receive_data(data, now)
    events: list[ev.Event] = []
    for i in range(0, len(data), piece):
        events += conn.receive_data(data[i : i + piece], now)
    return events


def sent(conn: MqttServerConnection, version: int) -> list[Packet]:
    """What the server queued, parsed as a client would."""
    return PacketParser(version).feed(conn.data_to_send())


def connected(
    version: int = V5, *, props: Properties = NO_PROPERTIES, keep_alive: int = 0, **server: int
) -> MqttServerConnection:
    conn = MqttServerConnection(**server)
    events = conn.receive_data(encode(Connect("c1", keep_alive=keep_alive, properties=props), version), 0.0)
    assert [type(e) for e in events] == [ev.Connect]
    conn.accept(0.0)
    assert type(sent(conn, version)[0]) is Connack
    return conn


def state(conn: MqttServerConnection) -> State:
    """Read afresh each time (mypy would narrow ``conn.state`` across calls that change it)."""
    return conn.state


def pub(
    topic: str,
    payload: bytes,
    qos: int = 0,
    *,
    packet_id: int | None = None,
    retain: bool = False,
    dup: bool = False,
    duplicate: bool = False,
) -> ev.Publish:
    return ev.Publish(topic, payload, qos, retain=retain, dup=dup, packet_id=packet_id, duplicate=duplicate)


def violation(conn: MqttServerConnection, data: bytes, piece: int | None = None) -> ev.ProtocolViolation:
    events = feed(conn, data, piece)
    last = events[-1]
    assert isinstance(last, ev.ProtocolViolation), events
    return last


# ---------------------------------------------------------------------------------------------------- CONNECT
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_connect_event_carries_the_request(version: int, piece: int | None) -> None:
    props = Properties(session_expiry_interval=60, receive_maximum=10) if version == V5 else NO_PROPERTIES
    will = Will("last/words", b"bye", qos=1, retain=True)
    packet = Connect(
        "dev-1", clean_start=False, keep_alive=30, username="u", password=b"p", will=will, properties=props
    )
    conn = MqttServerConnection()
    assert feed(conn, encode(packet, version), piece) == [
        ev.Connect(
            version, "dev-1", clean_start=False, keep_alive=30, username="u", password=b"p", will=will, properties=props
        )
    ]
    assert state(conn) is State.CONNECTING
    assert conn.version == version
    assert conn.data_to_send() == b""
    conn.accept(1.0, session_present=True)
    expected = Connack(session_present=version != V31)
    assert conn.data_to_send() == encode(expected, version)
    assert state(conn) is State.CONNECTED


def test_accept_in_5_announces_the_server_limits_and_assignments() -> None:
    conn = MqttServerConnection(max_packet_size=1000, receive_maximum=20, topic_alias_maximum=8)
    conn.receive_data(encode(Connect("", keep_alive=100), V5), 0.0)
    conn.accept(0.0, assigned_client_id="auto-1", server_keep_alive=10, properties=Properties(retain_available=False))
    [connack] = sent(conn, V5)
    assert connack == Connack(
        properties=Properties(
            assigned_client_identifier="auto-1",
            server_keep_alive=10,
            receive_maximum=20,
            topic_alias_maximum=8,
            retain_available=False,
            maximum_packet_size=1000,
        )
    )
    assert conn.keep_alive == 10
    assert conn.next_deadline() == 15.0


def test_accept_in_5_with_default_limits_sends_no_properties() -> None:
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("c"), V5), 0.0)
    conn.accept(0.0)
    assert conn.data_to_send() == b"\x20\x03\x00\x00\x00"


def test_accept_before_3_1_1_sends_no_properties_and_ignores_server_keep_alive() -> None:
    conn = MqttServerConnection(receive_maximum=5, topic_alias_maximum=3)
    conn.receive_data(encode(Connect("c", keep_alive=20), V311), 0.0)
    conn.accept(0.0, assigned_client_id="x", server_keep_alive=5)
    assert conn.data_to_send() == b"\x20\x02\x00\x00"
    assert conn.keep_alive == 20


def test_accept_and_refuse_need_a_pending_connect() -> None:
    conn = MqttServerConnection()
    with pytest.raises(LocalProtocolError):
        conn.accept(0.0)
    conn = connected()
    with pytest.raises(LocalProtocolError):
        conn.refuse(0x87)
    with pytest.raises(LocalProtocolError):
        conn.accept(0.0)


@pytest.mark.parametrize(
    ("version", "reason", "wire"),
    [
        (V5, 0x86, b"\x20\x03\x00\x86\x00"),
        (V5, 0x87, b"\x20\x03\x00\x87\x00"),
        (V311, 0x84, b"\x20\x02\x00\x01"),
        (V311, 0x85, b"\x20\x02\x00\x02"),
        (V311, 0x89, b"\x20\x02\x00\x03"),
        (V311, 0x86, b"\x20\x02\x00\x04"),
        (V311, 0x87, b"\x20\x02\x00\x05"),
        (V311, 0x80, b"\x20\x02\x00\x03"),
        (V31, 0x85, b"\x20\x02\x00\x02"),
    ],
)
def test_refuse_answers_with_the_code_of_the_version_and_closes(version: int, reason: int, wire: bytes) -> None:
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("c"), version) + encode(Pingreq(), version), 0.0)
    conn.refuse(reason)
    assert conn.data_to_send() == wire  # the early PINGREQ is never answered
    assert conn.closed
    assert conn.receive_data(encode(Pingreq(), version), 1.0) == []
    assert conn.next_deadline() is None


def test_refuse_in_5_carries_properties_and_needs_an_error_code() -> None:
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("c"), V5), 0.0)
    with pytest.raises(LocalProtocolError):
        conn.refuse(0x00)
    conn.refuse(0x9C, Properties(server_reference="other:1883"))
    assert sent(conn, V5) == [Connack(reason_code=0x9C, properties=Properties(server_reference="other:1883"))]


@pytest.mark.parametrize("piece", PIECES)
def test_packets_pipelined_behind_connect_are_events_but_answers_wait_for_the_connack(piece: int | None) -> None:
    subscribe = Subscribe(1, (Subscription("a/#", 1),))
    data = encode(Connect("c"), V5) + encode(Pingreq(), V5) + encode(subscribe, V5)
    conn = MqttServerConnection()
    events = feed(conn, data, piece)
    assert [type(e) for e in events] == [ev.Connect, ev.Subscribe]
    assert events[1] == ev.Subscribe(1, subscribe.subscriptions)
    assert conn.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        conn.suback(1, (1,))
    with pytest.raises(LocalProtocolError):
        conn.publish("t", b"")
    conn.accept(1.0)
    conn.suback(1, (1,))
    assert sent(conn, V5) == [Connack(), Pingresp(), Suback(1, (1,))]


# ---------------------------------------------------------------------------------------------------- keep-alive
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_pingreq_is_answered_with_pingresp(version: int, piece: int | None) -> None:
    conn = connected(version)
    assert feed(conn, encode(Pingreq(), version) * 2, piece) == []
    assert sent(conn, version) == [Pingresp(), Pingresp()]


@pytest.mark.parametrize(("version", "wire"), [(V5, b"\xe0\x01\x8d"), (V311, b""), (V31, b"")])
def test_a_client_silent_for_one_and_a_half_keep_alives_is_closed(version: int, wire: bytes) -> None:
    conn = connected(version, keep_alive=10)
    assert conn.next_deadline() == 15.0
    conn.handle_timeout(14.9)
    assert state(conn) is State.CONNECTED
    feed(conn, encode(Pingreq(), version), now=5.0)
    sent(conn, version)
    assert conn.next_deadline() == 20.0
    conn.handle_timeout(19.0)
    with pytest.raises(RemoteProtocolError) as info:
        conn.handle_timeout(20.0)
    assert info.value.reason_code == KEEP_ALIVE_TIMEOUT
    assert conn.data_to_send() == wire
    assert conn.closed
    assert conn.next_deadline() is None


def test_keep_alive_zero_has_no_deadline_and_only_whole_packets_count_as_life() -> None:
    assert connected(V5).next_deadline() is None
    conn = connected(V311, keep_alive=2)
    publish = encode(Publish("t", b"x" * 20), V311)
    for i, byte in enumerate(publish[:-1]):  # a byte a second: no packet ends, so the deadline stays
        conn.receive_data(byte.to_bytes(1, "big"), 0.1 * (i + 1))
        assert conn.next_deadline() == 3.0
    assert conn.receive_data(publish[-1:], 2.5) == [pub("t", b"x" * 20)]
    assert conn.next_deadline() == 5.5  # the packet ended at 2.5
    conn.handle_timeout(5.0)
    conn.receive_data(encode(Pingreq(), V311)[:1], 5.2)
    with pytest.raises(RemoteProtocolError) as info:
        conn.handle_timeout(5.5)
    assert info.value.reason_code == KEEP_ALIVE_TIMEOUT
    assert conn.closed


def test_keep_alive_timeout_before_the_connack_just_closes() -> None:
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("c", keep_alive=4), V5), 0.0)
    with pytest.raises(RemoteProtocolError):
        conn.handle_timeout(6.0)
    assert conn.data_to_send() == b""
    assert conn.closed


def test_eof_is_connection_closed() -> None:
    conn = connected()
    assert conn.receive_data(b"", 1.0) == [ev.ConnectionClosed()]
    assert conn.closed
    assert conn.receive_data(b"", 2.0) == []
    conn.puback(1)  # answers after the close are no-ops
    conn.suback(1, (0,))
    assert conn.data_to_send() == b""


# ---------------------------------------------------------------------------------------------------- incoming
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_incoming_qos0_and_qos1(version: int, piece: int | None) -> None:
    conn = connected(version)
    data = encode(Publish("a/b", b"zero", retain=True), version) + encode(
        Publish("a/c", b"one", 1, packet_id=7), version
    )
    assert feed(conn, data, piece) == [
        pub("a/b", b"zero", 0, retain=True),
        pub("a/c", b"one", 1, packet_id=7),
    ]
    assert conn.data_to_send() == b""  # QoS 1 is acknowledged when the shell says so
    resent = feed(conn, encode(Publish("a/c", b"one", 1, dup=True, packet_id=7), version), piece)
    assert resent == [pub("a/c", b"one", 1, packet_id=7, dup=True, duplicate=True)]
    conn.puback(7, 0x10, Properties(reason_string="dropped before 5"))
    expected = Puback(7, 0x10, Properties(reason_string="dropped before 5")) if version == V5 else Puback(7)
    assert sent(conn, version) == [expected, expected]  # one for each PUBLISH ([MQTT-4.3.2-2])
    with pytest.raises(LocalProtocolError):
        conn.puback(7)  # answered already
    # the id is free again: a new message, not a duplicate
    assert feed(conn, encode(Publish("a/d", b"", 1, packet_id=7), version), piece) == [pub("a/d", b"", 1, packet_id=7)]


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_incoming_qos2_flow_delivers_once_and_frees_the_id(version: int, piece: int | None) -> None:
    conn = connected(version)
    publish = Publish("q/2", b"m", 2, packet_id=3)
    assert feed(conn, encode(publish, version), piece) == [pub("q/2", b"m", 2, packet_id=3)]
    assert conn.data_to_send() == b""  # no PUBREC until the shell says so
    # resent before the PUBREC, twice: flagged, nothing sent yet, and the pubrec answers each ([MQTT-4.3.3-2])
    again = feed(conn, encode(Publish("q/2", b"m", 2, dup=True, packet_id=3), version) * 2, piece)
    assert again == [pub("q/2", b"m", 2, packet_id=3, dup=True, duplicate=True)] * 2
    assert conn.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        conn.pubcomp(3)  # no PUBREL yet
    conn.pubrec(3)
    assert sent(conn, version) == [Pubrec(3)] * 3
    # resent after the PUBREC: flagged, and the PUBREC is repeated by the connection
    again = feed(conn, encode(Publish("q/2", b"m", 2, dup=True, packet_id=3), version), piece)
    assert again == [pub("q/2", b"m", 2, packet_id=3, dup=True, duplicate=True)]
    assert sent(conn, version) == [Pubrec(3)]
    assert feed(conn, encode(Pubrel(3), version), piece) == [ev.PubrelReceived(3)]
    assert conn.data_to_send() == b""
    conn.pubcomp(3)
    assert sent(conn, version) == [Pubcomp(3)]
    # id 3 is free: the next PUBLISH with it is a new message
    assert feed(conn, encode(publish, version), piece) == [pub("q/2", b"m", 2, packet_id=3)]


def test_an_error_pubrec_ends_the_incoming_flow() -> None:
    conn = connected(V5)
    feed(conn, encode(Publish("t", b"", 2, packet_id=9), V5))
    conn.pubrec(9, 0x97)
    assert sent(conn, V5) == [Pubrec(9, 0x97)]
    assert feed(conn, encode(Publish("t", b"", 2, packet_id=9), V5)) == [pub("t", b"", 2, packet_id=9)]


def test_a_pubrel_for_an_unknown_id_is_reported_and_answered_by_the_shell() -> None:
    conn = connected(V5)
    assert feed(conn, encode(Pubrel(44), V5)) == [ev.PubrelReceived(44, known=False)]
    conn.pubcomp(44, 0x92)
    assert sent(conn, V5) == [Pubcomp(44, 0x92)]


@pytest.mark.parametrize(
    "first",
    [Publish("t", b"", 2, packet_id=5), Publish("t", b"", 1, packet_id=5)],
)
def test_a_pubrel_before_the_pubrec_is_a_protocol_error(first: Publish) -> None:
    conn = connected(V5)
    feed(conn, encode(first, V5))
    v = violation(conn, encode(Pubrel(5), V5))
    assert v.reason_code == 0x82


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (Publish("t", b"", 1, packet_id=5), Publish("t", b"", 2, packet_id=5)),
        (Publish("t", b"", 2, packet_id=5), Publish("t", b"", 1, packet_id=5)),
    ],
)
def test_reusing_an_incoming_id_with_another_qos_is_a_protocol_error(first: Publish, second: Publish) -> None:
    conn = connected(V311)
    feed(conn, encode(first, V311))
    assert violation(conn, encode(second, V311)).reason_code == 0x82


def test_a_publish_reusing_an_id_awaiting_pubcomp_is_a_protocol_error() -> None:
    conn = connected(V5)
    feed(conn, encode(Publish("t", b"", 2, packet_id=5), V5))
    conn.pubrec(5)
    feed(conn, encode(Pubrel(5), V5))
    assert violation(conn, encode(Publish("t", b"", 2, packet_id=5), V5)).reason_code == 0x82


@pytest.mark.parametrize("piece", PIECES)
def test_more_unacknowledged_incoming_messages_than_the_receive_maximum_is_0x93(piece: int | None) -> None:
    conn = connected(V5, receive_maximum=2)
    data = b"".join(encode(Publish("t", b"", qos, packet_id=i), V5) for i, qos in ((1, 1), (2, 2)))
    assert len(feed(conn, data, piece)) == 2
    feed(conn, encode(Publish("t", b"", 0), V5), piece)  # QoS 0 does not count
    conn.puback(1)
    conn.pubrec(2)  # still counts until PUBCOMP
    assert len(feed(conn, encode(Publish("t", b"", 1, packet_id=3), V5), piece)) == 1
    v = violation(conn, encode(Publish("t", b"", 1, packet_id=4), V5), piece)
    assert v.reason_code == 0x93
    sent(conn, V5)
    conn.reject(v)
    assert sent(conn, V5) == [Disconnect(0x93)]
    assert conn.closed


def test_before_5_the_receive_maximum_is_not_enforced() -> None:
    conn = connected(V311, receive_maximum=1)
    data = b"".join(encode(Publish("t", b"", 1, packet_id=i), V311) for i in (1, 2, 3))
    assert [type(e) for e in feed(conn, data)] == [ev.Publish] * 3


# ---------------------------------------------------------------------------------------------------- topic aliases
@pytest.mark.parametrize("piece", PIECES)
def test_topic_aliases_are_resolved_and_can_be_remapped(piece: int | None) -> None:
    conn = connected(V5, topic_alias_maximum=5)
    data = b"".join(
        encode(p, V5)
        for p in (
            Publish("a/b", b"1", properties=Properties(topic_alias=1, content_type="x")),
            Publish("", b"2", properties=Properties(topic_alias=1)),
            Publish("c", b"3", properties=Properties(topic_alias=1)),
            Publish("", b"4", 1, packet_id=1, properties=Properties(topic_alias=1)),
            Publish("d", b"5", properties=Properties(topic_alias=5)),
        )
    )
    events = feed(conn, data, piece)
    assert [(e.topic, e.payload) for e in events if isinstance(e, ev.Publish)] == [
        ("a/b", b"1"),
        ("a/b", b"2"),
        ("c", b"3"),
        ("c", b"4"),
        ("d", b"5"),
    ]
    assert isinstance(events[0], ev.Publish)
    assert events[0].properties == Properties(content_type="x")  # the alias is not passed on
    assert all(isinstance(e, ev.Publish) and e.properties.topic_alias is None for e in events)


@pytest.mark.parametrize(("maximum", "alias"), [(0, 1), (5, 6), (5, 0xFFFF)])
def test_an_alias_above_the_maximum_is_0x94(maximum: int, alias: int) -> None:
    conn = connected(V5, topic_alias_maximum=maximum)
    data = encode(Publish("ok", b""), V5) + encode(Publish("t", b"", properties=Properties(topic_alias=alias)), V5)
    events = feed(conn, data)
    assert [type(e) for e in events] == [ev.Publish, ev.ProtocolViolation]
    assert isinstance(events[1], ev.ProtocolViolation)
    assert events[1].reason_code == 0x94
    conn.reject(events[1])
    assert conn.data_to_send() == b"\xe0\x01\x94"


def test_an_unknown_alias_with_an_empty_topic_is_a_protocol_error() -> None:
    conn = connected(V5, topic_alias_maximum=5)
    assert violation(conn, encode(Publish("", b"", properties=Properties(topic_alias=2)), V5)).reason_code == 0x82


def test_a_client_publish_holding_a_subscription_identifier_is_a_protocol_error() -> None:
    """5.0, 3.3.4: "A PUBLISH packet sent from a Client to a Server MUST NOT contain a Subscription Identifier"
    [MQTT-3.3.4-6]: it was dropped, and the message published (PUBACK 0)."""
    conn = connected(V5)
    publish = Publish("t", b"", 1, packet_id=1, properties=Properties(subscription_identifiers=(3,)))
    assert violation(conn, encode(publish, V5)).reason_code == 0x82


def test_alias_zero_is_refused_by_the_parser_as_topic_alias_invalid() -> None:
    """5.0, 3.3.4: "A Topic Alias value of 0 or greater than the Maximum Topic Alias is a Protocol Error, the
    receiver uses DISCONNECT with Reason Code of 0x94 (Topic Alias invalid)"."""
    conn = connected(V5, topic_alias_maximum=5)
    # PUBLISH QoS 0, topic "t", properties: length 3, topic alias (0x23) = 0
    event = violation(conn, b"\x30\x07\x00\x01t\x03\x23\x00\x00")
    assert event.reason_code == 0x94
    conn.reject(event)
    assert conn.data_to_send() == b"\xe0\x01\x94"


# ---------------------------------------------------------------------------------------------------- outgoing
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_outgoing_qos1(version: int, piece: int | None) -> None:
    conn = connected(version)
    assert conn.publish("t", b"zero") == 0
    assert conn.publish("t", b"one", 1, retain=True) == 1
    assert sent(conn, version) == [Publish("t", b"zero"), Publish("t", b"one", 1, retain=True, packet_id=1)]
    assert feed(conn, encode(Puback(1), version), piece) == [ev.PubackReceived(1)]
    assert feed(conn, encode(Puback(1), version), piece) == []  # unknown now: ignored
    assert conn.publish("t", b"again", 1) == 2


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_outgoing_qos2(version: int, piece: int | None) -> None:
    conn = connected(version)
    assert conn.publish("t", b"two", 2) == 1
    assert sent(conn, version) == [Publish("t", b"two", 2, packet_id=1)]
    assert feed(conn, encode(Puback(1), version), piece) == []  # wrong acknowledgement: ignored
    assert feed(conn, encode(Pubcomp(1), version), piece) == []  # too early: ignored
    assert feed(conn, encode(Pubrec(1), version), piece) == [ev.PubrecReceived(1)]
    assert conn.data_to_send() == b""  # the shell records the release first
    assert feed(conn, encode(Pubrec(1), version), piece) == []  # repeated before pubrel(): nothing new
    conn.pubrel(1)
    assert sent(conn, version) == [Pubrel(1)]
    assert feed(conn, encode(Pubrec(1), version), piece) == []  # repeated after it: PUBREL repeated
    assert sent(conn, version) == [Pubrel(1)]
    assert conn.send_window == 65_534
    assert feed(conn, encode(Pubcomp(1), version), piece) == [ev.PubcompReceived(1)]
    assert conn.send_window == 65_535
    assert conn.data_to_send() == b""


def test_an_error_pubrec_ends_the_outgoing_flow_without_pubrel() -> None:
    conn = connected(V5, props=Properties(receive_maximum=1))
    assert conn.publish("t", b"", 2) == 1
    sent(conn, V5)
    assert conn.publish("t", b"", 1) is None
    assert feed(conn, encode(Pubrec(1, 0x80), V5)) == [ev.PubrecReceived(1, 0x80)]
    assert conn.data_to_send() == b""
    assert conn.publish("t", b"", 1) == 2


@pytest.mark.parametrize("piece", PIECES)
def test_the_clients_receive_maximum_bounds_messages_in_flight(piece: int | None) -> None:
    conn = connected(V5, props=Properties(receive_maximum=2))
    assert conn.client_receive_maximum == 2
    assert [conn.publish("t", b"", q) for q in (1, 2)] == [1, 2]
    assert conn.send_window == 0
    sent(conn, V5)
    assert conn.publish("t", b"full", 1) is None
    assert conn.data_to_send() == b""  # nothing queued
    assert conn.publish("t", b"qos 0 is not counted") == 0
    sent(conn, V5)
    feed(conn, encode(Puback(1), V5), piece)
    assert conn.publish("t", b"", 1) == 3
    assert conn.publish("t", b"", 1) is None
    feed(conn, encode(Pubrec(2), V5), piece)
    conn.pubrel(2)
    feed(conn, encode(Pubcomp(2), V5), piece)
    feed(conn, encode(Puback(3), V5), piece)
    assert [conn.publish("t", b"", 1) for _ in range(3)] == [4, 5, None]


def test_packet_ids_wrap_and_skip_ids_in_flight() -> None:
    conn = connected(V5)
    first = conn.publish("t", b"", 1)
    assert first == 1
    for expected in range(2, 0x10000):
        assert conn.publish("t", b"", 1) == expected
        assert isinstance(feed(conn, encode(Puback(expected), V5))[0], ev.PubackReceived)
    sent(conn, V5)
    assert conn.publish("t", b"", 1) == 2  # 1 is still in flight


@pytest.mark.parametrize("unknown", [Puback(9), Pubcomp(9)])
def test_acknowledgements_for_unknown_ids_are_ignored(unknown: Puback | Pubcomp) -> None:
    conn = connected(V311)
    assert feed(conn, encode(unknown, V311)) == []
    assert conn.data_to_send() == b""
    assert not conn.closed


@pytest.mark.parametrize("version", VERSIONS)
def test_a_pubrec_for_an_unknown_id_is_answered_with_a_pubrel(version: int) -> None:
    """[MQTT-4.3.3-4]: the sender MUST send a PUBREL when it receives a PUBREC with a reason code below 0x80; 5.0
    says 0x92, Packet Identifier not found, for an id it does not know. An error PUBREC ends the flow: none."""
    conn = connected(version)
    assert feed(conn, encode(Pubrec(9), version)) == []
    assert sent(conn, version) == [Pubrel(9, 0x92 if version == V5 else 0)]
    assert feed(conn, encode(Pubrec(9), version)) == []  # each gets its own
    assert sent(conn, version) == [Pubrel(9, 0x92 if version == V5 else 0)]
    assert feed(conn, encode(Pubcomp(9), version)) == []  # its PUBCOMP: ignored
    assert conn.send_window == 65_535  # nothing in flight
    if version == V5:
        assert feed(conn, encode(Pubrec(9, 0x80), V5)) == []
        assert conn.data_to_send() == b""
    assert conn.publish("t", b"", 1) == 1  # the id is free as it was
    assert not conn.closed


def test_a_connack_over_the_clients_maximum_drops_its_problem_properties_then_closes() -> None:
    problems = Properties(reason_string="r" * 30, user_properties=(("k", "v" * 30),))
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("", properties=Properties(maximum_packet_size=20)), V5), 0.0)
    conn.accept(0.0, assigned_client_id="auto-1", properties=problems)  # 14 bytes without the problems
    slim = Properties(assigned_client_identifier="auto-1")
    assert sent(conn, V5) == [Connack(session_present=False, reason_code=0, properties=slim)]
    assert state(conn) is State.CONNECTED
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("", properties=Properties(maximum_packet_size=20)), V5), 0.0)
    conn.receive_data(encode(Pingreq(), V5), 0.0)  # its answer waits for the CONNACK
    assert not conn.accept(0.0, assigned_client_id="auto-12345678", properties=problems)  # 21 bytes: too large
    assert conn.data_to_send() == b""  # neither the CONNACK nor the PINGRESP: the client waits for none
    assert conn.closed
    assert conn.next_deadline() is None


def test_outgoing_packets_larger_than_the_clients_maximum_are_discarded() -> None:
    conn = connected(V5, props=Properties(maximum_packet_size=40))
    assert conn.client_max_packet_size == 40
    assert conn.publish("t", b"x" * 40, 1) == 0  # as if sent: no ack will come, no id used
    assert conn.publish("t", b"x" * 40) == 0
    assert conn.discarded == 2
    assert conn.data_to_send() == b""
    assert conn.send_window == 65_535
    assert conn.publish("t", b"x" * 10, 1) == 1
    assert len(conn.data_to_send()) <= 40
    # the reason string and user properties go first, the rest is kept
    conn.suback(1, (0,), Properties(reason_string="r" * 50))
    assert sent(conn, V5) == [Suback(1, (0,))]
    conn.suback(2, tuple(range(3)) * 20)  # still too large: dropped
    assert conn.data_to_send() == b""
    assert conn.discarded == 3


# ---------------------------------------------------------------------------------------------------- subscriptions
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("version", VERSIONS)
def test_subscribe_and_unsubscribe(version: int, piece: int | None) -> None:
    conn = connected(version)
    subscribe = Subscribe(5, (Subscription("a/+", 2), Subscription("b", 0), Subscription("#", 1)))
    unsubscribe = Unsubscribe(6, ("a/+", "b"))
    events = feed(conn, encode(subscribe, version) + encode(unsubscribe, version), piece)
    assert events == [ev.Subscribe(5, subscribe.subscriptions), ev.Unsubscribe(6, ("a/+", "b"))]
    conn.suback(5, (2, 0, 0x87))
    conn.unsuback(6, (0, 0x11))
    if version == V5:
        assert sent(conn, version) == [Suback(5, (2, 0, 0x87)), Unsuback(6, (0, 0x11))]
    else:  # failure codes collapse to 0x80; UNSUBACK has no codes
        assert sent(conn, version) == [Suback(5, (2, 0, 0x80)), Unsuback(6)]


def test_subscribe_properties_are_passed_on() -> None:
    conn = connected(V5)
    props = Properties(subscription_identifiers=(7,), user_properties=(("k", "v"),))
    packet = Subscribe(1, (Subscription("x", 1, no_local=True, retain_handling=2),), props)
    assert feed(conn, encode(packet, V5)) == [ev.Subscribe(1, packet.subscriptions, props)]


# ---------------------------------------------------------------------------------------------------- DISCONNECT
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize(
    ("version", "packet", "event"),
    [
        (V5, Disconnect(0x04), ev.Disconnect(0x04, with_will=True)),
        (V5, Disconnect(), ev.Disconnect()),
        (V5, Disconnect(0x81, Properties(reason_string="bye")), ev.Disconnect(0x81, Properties(reason_string="bye"))),
        (V311, Disconnect(), ev.Disconnect()),
        (V31, Disconnect(), ev.Disconnect()),
    ],
)
def test_client_disconnect_ends_the_input(
    version: int, packet: Disconnect, event: ev.Disconnect, piece: int | None
) -> None:
    conn = connected(version)
    data = encode(Publish("t", b""), version) + encode(packet, version) + encode(Pingreq(), version)
    assert feed(conn, data, piece) == [pub("t", b"", 0), event]
    assert conn.closed
    assert conn.data_to_send() == b""  # the PINGREQ behind it was not read


def test_a_disconnect_setting_an_expiry_after_a_connect_that_asked_for_0_is_a_protocol_error() -> None:
    """5.0, 3.14.2.2.2: not a valid DISCONNECT (the will stays); the server answers DISCONNECT 0x82."""
    conn = connected(V5)
    events = feed(conn, encode(Disconnect(0, Properties(session_expiry_interval=60)), V5))
    assert [type(e) for e in events] == [ev.ProtocolViolation]
    violation = events[0]
    assert isinstance(violation, ev.ProtocolViolation)
    assert violation.reason_code == 0x82
    conn.reject(violation)
    assert conn.data_to_send() == b"\xe0\x01\x82"
    assert conn.closed


@pytest.mark.parametrize(("asked", "leaving"), [(3600, 60), (3600, 0), (0, 0), (0, None)])
def test_a_disconnect_may_set_an_expiry_unless_the_connect_asked_for_0(asked: int, leaving: int | None) -> None:
    """What the CONNECT asked decides, not what the server granted; setting 0 is always allowed."""
    conn = connected(V5, props=Properties(session_expiry_interval=asked))
    packet = Disconnect(0, Properties(session_expiry_interval=leaving))
    assert feed(conn, encode(packet, V5)) == [ev.Disconnect(0, packet.properties)]
    assert conn.closed


@pytest.mark.parametrize(("version", "wire"), [(V5, b"\xe0\x01\x8b"), (V311, b""), (V31, b"")])
def test_server_disconnect(version: int, wire: bytes) -> None:
    conn = connected(version)
    conn.disconnect(0x8B)
    assert conn.data_to_send() == wire
    assert conn.closed
    conn.disconnect(0x8B)
    conn.puback(1)
    assert conn.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        conn.publish("t", b"")


def test_server_disconnect_before_the_connack_just_closes() -> None:
    conn = MqttServerConnection()
    conn.receive_data(encode(Connect("c"), V5), 0.0)
    conn.disconnect(0x8B)
    assert conn.data_to_send() == b""
    assert conn.closed


# ---------------------------------------------------------------------------------------------------- violations
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize(("version", "wire"), [(V5, b"\xe0\x01\x81"), (V311, b""), (V31, b"")])
def test_a_violation_comes_after_the_events_before_it(version: int, wire: bytes, piece: int | None) -> None:
    conn = connected(version)
    subscribe = Subscribe(1, (Subscription("s", 0),))
    data = encode(Publish("t", b"p"), version) + encode(subscribe, version) + b"\x00\x00" + encode(Pingreq(), version)
    events = feed(conn, data, piece)
    assert events[:2] == [pub("t", b"p", 0), ev.Subscribe(1, subscribe.subscriptions)]
    assert len(events) == 3
    v = events[2]
    assert isinstance(v, ev.ProtocolViolation)
    assert v.reason_code == 0x81
    assert feed(conn, encode(Pingreq(), version)) == []  # nothing after it is read
    assert state(conn) is not State.CLOSED  # the shell may still answer the events before it
    conn.suback(1, (0,))
    sent(conn, version)
    conn.reject(v)
    assert conn.data_to_send() == wire
    assert conn.closed
    conn.reject(v)
    assert conn.data_to_send() == b""


def test_a_violation_before_the_accept_is_answered_with_a_connack_in_5() -> None:
    conn = MqttServerConnection()
    events = conn.receive_data(encode(Connect("c"), V5) + encode(Connack(), V5), 0.0)
    assert [type(e) for e in events] == [ev.Connect, ev.ProtocolViolation]
    assert isinstance(events[1], ev.ProtocolViolation)
    conn.reject(events[1])
    assert sent(conn, V5) == [Connack(reason_code=0x82)]


def test_a_violation_before_the_accept_just_closes_before_5() -> None:
    conn = MqttServerConnection()
    events = conn.receive_data(encode(Connect("c"), V311) + b"\x00\x00", 0.0)
    assert isinstance(events[1], ev.ProtocolViolation)
    conn.reject(events[1])
    assert conn.data_to_send() == b""
    assert conn.closed


@pytest.mark.parametrize("piece", PIECES)
def test_an_unsupported_protocol_version_gets_return_code_1(piece: int | None) -> None:
    conn = MqttServerConnection()
    level_6 = bytearray(encode(Connect("c"), V311))
    level_6[8] = 6  # after 0x10, length, the name "MQTT" with its length
    v = violation(conn, bytes(level_6), piece)
    assert v.reason_code == 0x84
    conn.reject(v)
    assert conn.data_to_send() == b"\x20\x02\x00\x01"
    assert conn.closed


def test_a_first_packet_other_than_connect_is_closed_without_answer() -> None:
    conn = MqttServerConnection()
    v = violation(conn, encode(Pingreq(), V311))
    assert v.reason_code == 0x82
    conn.reject(v)
    assert conn.data_to_send() == b""
    assert conn.closed


@pytest.mark.parametrize(
    "packet",
    [Connect("again"), Connack(), Suback(1, (0,)), Unsuback(1), Pingresp(), Auth(0x18)],
    ids=lambda p: type(p).__name__,
)
def test_packets_a_client_must_not_send_are_protocol_errors(packet: Packet) -> None:
    conn = connected(V5)
    v = violation(conn, encode(packet, V5))
    assert v.reason_code == 0x82
    conn.reject(v)
    assert conn.data_to_send() == b"\xe0\x01\x82"


def test_the_servers_maximum_packet_size_is_enforced_by_the_parser() -> None:
    conn = connected(V5, max_packet_size=64)
    assert feed(conn, encode(Publish("t", b"x" * 50), V5)) != []
    v = violation(conn, encode(Publish("t", b"x" * 100), V5)[:10])  # refused from its fixed header
    assert v.reason_code == 0x95
    conn.reject(v)
    assert conn.data_to_send() == b"\xe0\x01\x95"


def test_answers_for_ids_not_awaiting_them_are_caller_bugs() -> None:
    conn = connected(V5)
    with pytest.raises(LocalProtocolError):
        conn.puback(1)
    with pytest.raises(LocalProtocolError):
        conn.pubrec(1)
    feed(conn, encode(Publish("t", b"", 2, packet_id=1), V5))
    with pytest.raises(LocalProtocolError):
        conn.puback(1)


def test_constructor_limits_are_checked() -> None:
    for kwargs in ({"receive_maximum": 0}, {"topic_alias_maximum": 70_000}, {"max_packet_size": 1}):
        with pytest.raises(LocalProtocolError):
            MqttServerConnection(**kwargs)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_resumed_session_resends_with_chosen_ids(version: int) -> None:
    conn = connected(version)
    conn.pubrel(7)  # received by the client on an earlier connection
    assert conn.in_flight(7)
    assert conn.publish("t", b"again", 1, packet_id=9, dup=True) == 9
    assert sent(conn, version) == [Pubrel(7), Publish("t", b"again", 1, dup=True, packet_id=9)]
    with pytest.raises(LocalProtocolError):
        conn.publish("t", b"", 1, packet_id=9)  # in flight
    assert conn.send_window == 65_533
    assert feed(conn, encode(Pubcomp(7), version)) == [ev.PubcompReceived(7)]
    assert feed(conn, encode(Puback(9), version)) == [ev.PubackReceived(9)]
    assert not conn.in_flight(7)
    assert not conn.in_flight(9)
    assert conn.publish("t", b"", 0, packet_id=5, dup=True) == 0
    assert sent(conn, version) == [Publish("t", b"", 0)]  # QoS 0 has neither


def test_pubrel_for_a_publish_not_yet_received_is_a_bug_of_the_shell() -> None:
    conn = connected(V5)
    assert conn.publish("t", b"", 2) == 1
    with pytest.raises(LocalProtocolError):
        conn.pubrel(1)


def test_request_problem_information_0_keeps_reason_strings_to_publish_connack_and_disconnect() -> None:
    """[MQTT-3.1.2-29]: a client that asks for no problem information gets no reason string or user
    properties but on PUBLISH, CONNACK and DISCONNECT."""
    problem = Properties(reason_string="why", user_properties=(("k", "v"),))
    conn = connected(props=Properties(request_problem_information=False))
    assert conn.problem_information is False
    feed(conn, encode(Publish("a", b"", 1, packet_id=1), V5) + encode(Subscribe(2, (Subscription("b"),)), V5))
    conn.puback(1, 0x87, problem)
    conn.suback(2, (0x87,), problem)
    conn.publish("t", b"x", properties=Properties(user_properties=(("k", "v"),)))
    conn.disconnect(0x80, problem)
    assert sent(conn, V5) == [
        Puback(1, 0x87),
        Suback(2, (0x87,)),
        Publish("t", b"x", properties=Properties(user_properties=(("k", "v"),))),
        Disconnect(0x80, problem),
    ]
    told = connected()  # the default: told
    feed(told, encode(Publish("a", b"", 1, packet_id=1), V5))
    told.puback(1, 0x87, problem)
    assert sent(told, V5) == [Puback(1, 0x87, problem)]
