"""The sans-IO MQTT codec: golden bytes from the specifications, round trips in every version, fed whole, byte
by byte and in random chunks, and one test per validation rule."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    encode_plain_publish,
    encode_topic,
)
from tridentmq_mqtt.protocol.properties import (
    AUTH,
    BINARY,
    BYTE,
    CONNACK,
    CONNECT,
    DISCONNECT,
    FLAG,
    FOUR,
    PAIR,
    PROPERTY_SPECS,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    STRING,
    SUBACK,
    SUBSCRIBE,
    TWO,
    UNSUBACK,
    UNSUBSCRIBE,
    VBI_MAX,
    WILL,
    Properties,
)
from tridentmq_mqtt.protocol.reason_codes import (
    MALFORMED_PACKET,
    PACKET_TOO_LARGE,
    PROTOCOL_ERROR,
    TOPIC_NAME_INVALID,
    UNSUPPORTED_PROTOCOL_VERSION,
)

CONNECT_31 = bytes.fromhex("10 0e 00 06 4d 51 49 73 64 70 03 02 00 3c 00 00")
CONNECT_311 = bytes.fromhex("10 0c 00 04 4d 51 54 54 04 02 00 3c 00 00")
CONNECT_5 = bytes.fromhex("10 0d 00 04 4d 51 54 54 05 02 00 3c 00 00 00")
CONNECTS = {V31: CONNECT_31, V311: CONNECT_311, V5: CONNECT_5}


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def feed_all(parser: PacketParser, chunks: list[bytes]) -> tuple[list[Packet], RemoteProtocolError | None]:
    """Every packet the chunks give, and the error they end in, if any (surfaced by one more empty feed)."""
    packets: list[Packet] = []
    try:
        for chunk in [*chunks, b""]:
            packets.extend(parser.feed(chunk))
    except RemoteProtocolError as exc:
        return packets, exc
    return packets, None


def chunkings(data: bytes, seed: int = 0) -> list[list[bytes]]:
    """``data`` whole, byte by byte and in random chunks."""
    rng = random.Random(seed)
    pieces: list[bytes] = []
    pos = 0
    while pos < len(data):
        size = rng.randint(1, 9)
        pieces.append(data[pos : pos + size])
        pos += size
    return [[data], [data[i : i + 1] for i in range(len(data))], pieces]


def parse_every_way(data: bytes, version: int | None = None, **kwargs: int) -> list[Packet]:
    """The packets in ``data``, checked to be the same however the bytes arrive; errors are re-raised."""
    results = [feed_all(PacketParser(version, **kwargs), chunks) for chunks in chunkings(data)]
    packets, error = results[0]
    for other_packets, other_error in results[1:]:
        assert other_packets == packets
        assert (other_error is None) == (error is None)
        if error is not None and other_error is not None:
            assert (other_error.reason_code, other_error.message) == (error.reason_code, error.message)
    if error is not None:
        raise error
    return packets


def after_connect(version: int, data: bytes) -> list[Packet]:
    """Parse ``data`` on a server parser behind a minimal CONNECT of ``version``."""
    packets = parse_every_way(CONNECTS[version] + data)
    assert isinstance(packets[0], Connect)
    return packets[1:]


def rejected(version: int, data: bytes, reason: int) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        after_connect(version, data)
    assert info.value.reason_code == reason, info.value
    return info.value


# ---------------------------------------------------------------------------------------------------- golden bytes
GOLDEN_311: list[tuple[Packet, str]] = [
    (Connect("", clean_start=True, keep_alive=60), "10 0c 00 04 4d 51 54 54 04 02 00 3c 00 00"),
    (
        Connect(
            "c",
            clean_start=True,
            keep_alive=10,
            username="u",
            password=b"pw",
            will=Will("w", b"by", qos=1, retain=True),
        ),
        "10 1b 00 04 4d 51 54 54 04 ee 00 0a 00 01 63 00 01 77 00 02 62 79 00 01 75 00 02 70 77",
    ),
    (Connack(session_present=True), "20 02 01 00"),
    (Connack(reason_code=5), "20 02 00 05"),
    (Publish("a/b", b"hi"), "30 07 00 03 61 2f 62 68 69"),
    (Publish("a/b", b"hi", qos=1, retain=True, dup=True, packet_id=10), "3b 09 00 03 61 2f 62 00 0a 68 69"),
    (Publish("a/b", b"", qos=2, packet_id=0xFFFF), "34 07 00 03 61 2f 62 ff ff"),
    (Puback(10), "40 02 00 0a"),
    (Pubrec(10), "50 02 00 0a"),
    (Pubrel(10), "62 02 00 0a"),
    (Pubcomp(10), "70 02 00 0a"),
    (Subscribe(1, (Subscription("a/#", 1),)), "82 08 00 01 00 03 61 2f 23 01"),
    (Suback(1, (1, 0x80)), "90 04 00 01 01 80"),
    (Unsubscribe(2, ("a",)), "a2 05 00 02 00 01 61"),
    (Unsuback(2), "b0 02 00 02"),
    (Pingreq(), "c0 00"),
    (Pingresp(), "d0 00"),
    (Disconnect(), "e0 00"),
]

GOLDEN_5: list[tuple[Packet, str]] = [
    (
        Connect("c", keep_alive=60, properties=Properties(session_expiry_interval=120, receive_maximum=10)),
        "10 16 00 04 4d 51 54 54 05 02 00 3c 08 11 00 00 00 78 21 00 0a 00 01 63",
    ),
    (Connect("", password=b"p"), "10 10 00 04 4d 51 54 54 05 42 00 00 00 00 00 00 01 70"),  # no user name: fine in 5
    (Connack(), "20 03 00 00 00"),
    (Connack(reason_code=0x86, properties=Properties(reason_string="no")), "20 08 00 86 05 1f 00 02 6e 6f"),
    (Publish("a/b", b"hi"), "30 08 00 03 61 2f 62 00 68 69"),
    (
        Publish("", b"x", qos=1, packet_id=1, properties=Properties(topic_alias=5)),
        "32 09 00 00 00 01 03 23 00 05 78",
    ),
    (
        Publish("t", b"", properties=Properties(subscription_identifiers=(1, 300), user_properties=(("k", "v"),))),
        "30 10 00 01 74 0c 0b 01 0b ac 02 26 00 01 6b 00 01 76",
    ),
    (Puback(1), "40 02 00 01"),
    (Puback(1, 0x10), "40 03 00 01 10"),
    (Pubrec(1, 0x80, Properties(reason_string="x")), "50 08 00 01 80 04 1f 00 01 78"),
    (Pubrel(1, 0x92), "62 03 00 01 92"),
    (Pubcomp(1), "70 02 00 01"),
    (
        Subscribe(
            1,
            (Subscription("a/+", 2, no_local=True, retain_as_published=True, retain_handling=2),),
            Properties(subscription_identifiers=(7,)),
        ),
        "82 0b 00 01 02 0b 07 00 03 61 2f 2b 2e",
    ),
    (Suback(1, (2, 0x87)), "90 05 00 01 00 02 87"),
    (Unsubscribe(2, ("a", "b")), "a2 09 00 02 00 00 01 61 00 01 62"),
    (Unsuback(2, (0, 0x11)), "b0 05 00 02 00 00 11"),
    (Pingreq(), "c0 00"),
    (Disconnect(), "e0 00"),
    (Disconnect(0x04), "e0 01 04"),
    (Disconnect(properties=Properties(session_expiry_interval=0)), "e0 07 00 05 11 00 00 00 00"),
    (Auth(0x18, Properties(authentication_method="m")), "f0 06 18 04 15 00 01 6d"),
]

GOLDEN = [(V311, packet, wire) for packet, wire in GOLDEN_311] + [(V5, packet, wire) for packet, wire in GOLDEN_5]


@pytest.mark.parametrize(("version", "packet", "wire"), GOLDEN)
def test_golden_bytes_encode_and_decode(version: int, packet: Packet, wire: str) -> None:
    assert encode(packet, version).hex(" ") == wire
    assert parse_every_way(h(wire), version) == [packet]


def test_mqtt_31_connect_names_the_protocol_mqisdp() -> None:
    assert encode(Connect("", keep_alive=60), V31) == CONNECT_31
    parser = PacketParser()
    assert parser.feed(CONNECT_31) == [Connect("", keep_alive=60)]
    assert parser.version == V31


@pytest.mark.parametrize("version", VERSIONS)
def test_the_parser_learns_the_version_from_the_connect(version: int) -> None:
    parser = PacketParser()
    assert parser.version is None
    parser.feed(CONNECTS[version][:5])
    assert parser.version is None
    parser.feed(CONNECTS[version][5:])
    assert parser.version == version


def test_a_v5_stream_parses_after_its_connect() -> None:
    stream = b"".join(h(wire) for packet, wire in GOLDEN_5 if not isinstance(packet, Connect))
    expected = [packet for packet, _ in GOLDEN_5 if not isinstance(packet, Connect)]
    assert after_connect(V5, stream) == expected


def test_the_same_bytes_read_differently_per_version() -> None:
    # A v3.1.1 PUBLISH has no property length: the byte after the topic is payload.
    assert after_connect(V311, h("30 06 00 01 74 00 68 69")) == [Publish("t", b"\x00hi")]
    assert after_connect(V5, h("30 06 00 01 74 00 68 69")) == [Publish("t", b"hi")]


# ---------------------------------------------------------------------------------------------------- round trips
SAMPLES_ALL: list[Packet] = [
    Connect(
        "client-1",
        clean_start=False,
        keep_alive=30,
        username="user",
        password=b"secret",
        will=Will("last/will", b"bye", 2, retain=True),
    ),
    Connect("x" * 300, keep_alive=0xFFFF),
    Connack(),
    Publish("a/b/c", b"\x00\xff" * 100, 2, retain=True, dup=True, packet_id=65535),
    Publish("ü/日本", b"x" * 20000, 1, packet_id=1),  # a three-byte remaining length
    Puback(1),
    Pubrec(2),
    Pubrel(3),
    Pubcomp(4),
    Subscribe(5, (Subscription("a/+/b", 0), Subscription("#", 2))),
    Suback(5, (0, 2)),
    Unsubscribe(6, ("a/+/b", "#")),
    Unsuback(6),
    Pingreq(),
    Pingresp(),
    Disconnect(),
]
_FULL_WILL = Properties(
    payload_format_indicator=1,
    message_expiry_interval=9,
    content_type="text/plain",
    response_topic="r",
    correlation_data=b"\x01",
    will_delay_interval=5,
    user_properties=(("a", "1"), ("a", "2")),
)
SAMPLES_5: list[Packet] = [
    Connack(
        session_present=True,
        properties=Properties(
            session_expiry_interval=1,
            assigned_client_identifier="id",
            server_keep_alive=5,
            authentication_method="m",
            authentication_data=b"d",
            response_information="ri",
            server_reference="s",
            reason_string="r",
            receive_maximum=10,
            topic_alias_maximum=3,
            maximum_qos=1,
            retain_available=False,
            maximum_packet_size=1024,
            wildcard_subscription_available=True,
            subscription_identifier_available=False,
            shared_subscription_available=True,
            user_properties=(("k", "v"),),
        ),
    ),
    Connect(
        "c",
        keep_alive=5,
        will=Will("w", b"", 1, properties=_FULL_WILL),
        properties=Properties(
            session_expiry_interval=0xFFFFFFFF,
            authentication_method="SCRAM",
            authentication_data=b"\x00",
            request_problem_information=False,
            request_response_information=True,
            receive_maximum=1,
            topic_alias_maximum=0,
            maximum_packet_size=1,
            user_properties=(("", ""),),
        ),
    ),
    Publish(
        "t",
        b"p",
        1,
        packet_id=9,
        properties=Properties(
            payload_format_indicator=0,
            message_expiry_interval=0,
            content_type="",
            response_topic="r/t",
            correlation_data=b"",
            subscription_identifiers=(VBI_MAX, 1),
            topic_alias=65535,
        ),
    ),
    Puback(1, 0x97, Properties(reason_string="quota", user_properties=(("a", "b"),))),
    Pubrec(1, 0, Properties(reason_string="ok")),
    Pubrel(1, 0x92),
    Pubcomp(1, 0, Properties(user_properties=(("a", "b"),))),
    Subscribe(
        1,
        (
            Subscription("a", 1, retain_as_published=True, retain_handling=1),
            Subscription("$share/g/b", 0, no_local=True),
        ),
    ),
    Suback(1, (0, 1, 2, 0x80, 0xA2), Properties(reason_string="partly")),
    Unsubscribe(1, ("a",), Properties(user_properties=(("x", "y"),))),
    Unsuback(1, (0,), Properties(reason_string="r")),
    Disconnect(0x8E, Properties(reason_string="taken over", server_reference="other", session_expiry_interval=3)),
    Auth(),
    Auth(0x19, Properties(authentication_method="m", authentication_data=b"\x01\x02", reason_string="again")),
]
ROUND_TRIPS = [(v, p) for v in VERSIONS for p in SAMPLES_ALL] + [(V5, p) for p in SAMPLES_5]


@pytest.mark.parametrize(("version", "packet"), ROUND_TRIPS)
def test_every_packet_round_trips_in_every_version_it_exists_in(version: int, packet: Packet) -> None:
    assert parse_every_way(encode(packet, version), version) == [packet]


@pytest.mark.parametrize("version", VERSIONS)
def test_many_packets_in_one_feed_and_split_anywhere(version: int) -> None:
    packets = [p for v, p in ROUND_TRIPS if v == version and not isinstance(p, Connect)]
    stream = CONNECTS[version] + b"".join(encode(p, version) for p in packets)
    for seed in range(5):
        results = [feed_all(PacketParser(), chunks)[0] for chunks in chunkings(stream, seed)]
        assert all(result == results[0] for result in results)  # however the stream is cut
    assert after_connect(version, stream[len(CONNECTS[version]) :]) == packets


# ---------------------------------------------------------------------------------------------------- hypothesis
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
TOPIC = TEXT.filter(lambda t: t != "" and "+" not in t and "#" not in t)
PACKET_ID = st.integers(1, 0xFFFF)
QOS = st.integers(0, 2)


def _property_value(kind: str, nonzero: bool) -> st.SearchStrategy[object]:
    low = 1 if nonzero else 0
    strategies: dict[str, st.SearchStrategy[object]] = {
        BYTE: st.integers(0, 1),
        FLAG: st.booleans(),
        TWO: st.integers(low, 0xFFFF),
        FOUR: st.integers(low, 0xFFFFFFFF),
        STRING: TEXT,
        BINARY: st.binary(max_size=12),
    }
    return strategies[kind]


def properties(packet_type: int) -> st.SearchStrategy[Properties]:
    fields: dict[str, st.SearchStrategy[object]] = {}
    for ident, spec in PROPERTY_SPECS.items():
        if packet_type not in spec.allowed:
            continue
        if spec.kind == PAIR:
            fields[spec.name] = st.lists(st.tuples(TEXT, TEXT), max_size=3).map(tuple)
        elif ident == 0x0B:
            many = 3 if packet_type == PUBLISH else 1
            fields[spec.name] = st.lists(st.integers(1, VBI_MAX), max_size=many).map(tuple)
        elif spec.name == "response_topic":  # a topic name: not empty, no wildcards ([MQTT-3.3.2-14])
            fields[spec.name] = st.none() | TOPIC
        else:
            fields[spec.name] = st.none() | _property_value(spec.kind, spec.nonzero)
    return st.fixed_dictionaries(fields).map(lambda values: Properties(**values))  # type: ignore[arg-type]


@st.composite
def packets(draw: st.DrawFn, version: int) -> Packet:
    v5 = version == V5

    def props(packet_type: int) -> Properties:
        return draw(properties(packet_type)) if v5 else Properties()

    def code() -> int:
        return draw(st.integers(0, 255)) if v5 else 0

    kind = draw(
        st.sampled_from(
            [
                "connect",
                "connack",
                "publish",
                "ack",
                "subscribe",
                "suback",
                "unsubscribe",
                "unsuback",
                "ping",
                "disconnect",
                "auth",
            ]
        )
    )
    if kind == "connect":
        will = None
        if draw(st.booleans()):
            will = Will(draw(TOPIC), draw(st.binary(max_size=20)), draw(QOS), draw(st.booleans()), props(WILL))
        username = draw(st.none() | TEXT)
        password = draw(st.none() | st.binary(max_size=8)) if v5 or username is not None else None
        return Connect(
            draw(TEXT), draw(st.booleans()), draw(st.integers(0, 0xFFFF)), username, password, will, props(CONNECT)
        )
    if kind == "connack":
        return Connack(draw(st.booleans()) and version != V31, draw(st.integers(0, 255)), props(CONNACK))
    if kind == "publish":
        qos = draw(QOS)
        return Publish(
            draw(TOPIC),
            draw(st.binary(max_size=64)),
            qos,
            draw(st.booleans()),
            qos > 0 and draw(st.booleans()),
            draw(PACKET_ID) if qos else None,
            props(PUBLISH),
        )
    if kind == "ack":
        acks: list[tuple[type[Puback | Pubrec | Pubrel | Pubcomp], int]] = [
            (Puback, PUBACK),
            (Pubrec, PUBREC),
            (Pubrel, PUBREL),
            (Pubcomp, PUBCOMP),
        ]
        cls, packet_type = draw(st.sampled_from(acks))
        return cls(draw(PACKET_ID), code(), props(packet_type))
    if kind == "subscribe":
        options = (
            st.builds(Subscription, TEXT, QOS, st.booleans(), st.booleans(), st.integers(0, 2))
            if v5
            else (st.builds(Subscription, TEXT, QOS))
        )
        return Subscribe(draw(PACKET_ID), tuple(draw(st.lists(options, min_size=1, max_size=4))), props(SUBSCRIBE))
    if kind == "suback":
        granted = st.integers(0, 255) if v5 else st.sampled_from([0, 1, 2, 0x80])
        return Suback(draw(PACKET_ID), tuple(draw(st.lists(granted, max_size=4))), props(SUBACK))
    if kind == "unsubscribe":
        return Unsubscribe(draw(PACKET_ID), tuple(draw(st.lists(TEXT, min_size=1, max_size=4))), props(UNSUBSCRIBE))
    if kind == "unsuback":
        codes = tuple(draw(st.lists(st.integers(0, 255), max_size=4))) if v5 else ()
        return Unsuback(draw(PACKET_ID), codes, props(UNSUBACK))
    if kind == "ping":
        return Pingreq() if draw(st.booleans()) else Pingresp()
    if kind == "auth" and v5:
        return Auth(code(), props(AUTH))
    return Disconnect(code(), props(DISCONNECT))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_any_packet_round_trips(data: st.DataObject) -> None:
    version = data.draw(st.sampled_from(VERSIONS))
    sequence = data.draw(st.lists(packets(version), min_size=1, max_size=5))
    sequence = sequence[:1] + [p for p in sequence[1:] if not isinstance(p, Connect)]  # a second one is refused
    stream = b"".join(encode(packet, version) for packet in sequence)
    parser = PacketParser(version)
    chunks = data.draw(st.lists(st.integers(1, 50), max_size=10))
    got: list[Packet] = []
    pos = 0
    for size in chunks:
        got.extend(parser.feed(stream[pos : pos + size]))
        pos += size
    got.extend(parser.feed(stream[pos:]))
    assert got == sequence


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(VERSIONS), st.binary(max_size=200), st.integers(1, 20))
def test_garbage_after_a_connect_gives_packets_or_a_remote_protocol_error(
    version: int, garbage: bytes, piece: int
) -> None:
    parser = PacketParser(max_packet_size=1000)
    stream = CONNECTS[version] + garbage
    try:
        for start in range(0, len(stream), piece):
            parser.feed(stream[start : start + piece])
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            parser.feed(b"")  # and it stays failed


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(VERSIONS), st.data())
def test_a_mutated_packet_gives_a_packet_or_a_remote_protocol_error(version: int, data: st.DataObject) -> None:
    wire = bytearray(encode(data.draw(packets(version)), version))
    index = data.draw(st.integers(0, len(wire) - 1))
    wire[index] = data.draw(st.integers(0, 255))
    parser = PacketParser(version)
    with contextlib.suppress(RemoteProtocolError):
        parser.feed(bytes(wire))


# ---------------------------------------------------------------------------------------------------- fixed header
def test_a_fifth_remaining_length_byte_is_refused_as_soon_as_the_fourth_continues() -> None:
    assert after_connect(V311, h("30 ff ff ff")) == []  # may still end
    error = rejected(V311, h("30 ff ff ff ff"), MALFORMED_PACKET)
    assert "four bytes" in error.message


def test_the_largest_remaining_length_is_read() -> None:
    parser = PacketParser(V311)
    assert parser.feed(h("30 ff ff ff 7f 00 01 74")) == []  # 256 MiB announced, three bytes of it here


def test_a_packet_over_the_limit_is_refused_once_its_length_is_known() -> None:
    parser = PacketParser(max_packet_size=100)
    parser.feed(CONNECT_311)
    with pytest.raises(RemoteProtocolError) as info:
        parser.feed(h("30 64"))  # 100 bytes to come, 102 in all: refused before any of the body
    assert info.value.reason_code == PACKET_TOO_LARGE
    assert not parser._buffer  # nothing of it was buffered


def test_a_packet_at_the_limit_is_accepted() -> None:
    packet = Publish("t", b"x" * 95)
    wire = encode(packet, V311)
    assert len(wire) == 100
    assert parse_every_way(CONNECT_311 + wire, max_packet_size=100)[1:] == [packet]


@pytest.mark.parametrize(
    "wire",
    [
        "60 02 00 01",  # PUBREL without its 0b0010
        "63 02 00 01",
        "80 06 00 01 00 01 61 00",  # SUBSCRIBE
        "a0 05 00 01 00 01 61",  # UNSUBSCRIBE
        "42 02 00 01",  # PUBACK
        "51 02 00 01",
        "78 02 00 01",
        "92 03 00 01 00",
        "b1 02 00 01",
        "c1 00",
        "d2 00",
        "e8 00",
        "24 02 00 00",
    ],
)
@pytest.mark.parametrize("version", [V311, V5])
def test_reserved_fixed_header_flags_are_malformed(version: int, wire: str) -> None:
    rejected(version, h(wire), MALFORMED_PACKET)


def test_mqtt_31_allows_dup_on_pubrel_subscribe_and_unsubscribe() -> None:
    assert after_connect(V31, h("6a 02 00 01")) == [Pubrel(1)]
    assert after_connect(V31, h("8a 06 00 01 00 01 61 00")) == [Subscribe(1, (Subscription("a"),))]
    rejected(V311, h("6a 02 00 01"), MALFORMED_PACKET)


def test_connect_with_reserved_fixed_header_flags_is_malformed() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_every_way(b"\x11" + CONNECT_311[1:])
    assert info.value.reason_code == MALFORMED_PACKET


@pytest.mark.parametrize("version", VERSIONS)
def test_reserved_packet_types_are_malformed(version: int) -> None:
    rejected(version, h("00 00"), MALFORMED_PACKET)
    if version != V5:
        rejected(version, h("f0 00"), MALFORMED_PACKET)  # AUTH arrived in 5.0


# ---------------------------------------------------------------------------------------------------- connect
def test_the_first_packet_must_be_a_connect() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        PacketParser().feed(b"\x30")  # refused on its first byte
    assert info.value.reason_code == PROTOCOL_ERROR


def test_a_second_connect_is_a_protocol_error() -> None:
    rejected(V311, CONNECT_311, PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "wire",
    [
        "10 0c 00 04 4d 51 54 54 06 02 00 3c 00 00",  # level 6
        "10 0c 00 04 4d 51 54 54 03 02 00 3c 00 00",  # MQTT at level 3
        "10 0e 00 06 4d 51 49 73 64 70 04 02 00 3c 00 00",  # MQIsdp at level 4
        "10 0c 00 04 4d 51 54 58 04 02 00 3c 00 00",  # MQTX
    ],
)
def test_unsupported_protocols_are_refused(wire: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_every_way(h(wire))
    assert info.value.reason_code == UNSUPPORTED_PROTOCOL_VERSION


def test_a_connect_of_another_level_on_a_versioned_parser_is_refused() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        PacketParser(V5).feed(CONNECT_311)
    assert info.value.reason_code == UNSUPPORTED_PROTOCOL_VERSION


def connect_with_flags(flags: int, tail: str = "", version: int = V311) -> bytes:
    body = h(f"00 04 4d 51 54 54 {version:02x} {flags:02x} 00 3c") + (b"\x00" if version == V5 else b"")
    body += h("00 00" + tail)
    return bytes((0x10, len(body))) + body


@pytest.mark.parametrize(
    ("flags", "tail"),
    [
        (0x03, ""),  # the reserved bit
        (0x1E, "00 01 77 00 00"),  # will QoS 3
        (0x0A, ""),  # will QoS without a will
        (0x22, ""),  # will retain without a will
        (0x42, "00 01 70"),  # a password without a user name, before 5.0
    ],
)
def test_bad_connect_flags_are_malformed(flags: int, tail: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_every_way(connect_with_flags(flags, tail))
    assert info.value.reason_code == MALFORMED_PACKET


def test_connect_fields_must_fill_the_packet_exactly() -> None:
    for wire in (connect_with_flags(0x82), connect_with_flags(0x02, "00")):  # a user name missing; a stray byte
        with pytest.raises(RemoteProtocolError) as info:
            parse_every_way(wire)
        assert info.value.reason_code == MALFORMED_PACKET


def test_a_will_topic_with_a_wildcard_is_refused() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_every_way(connect_with_flags(0x06, "00 01 23 00 00"))
    assert info.value.reason_code == TOPIC_NAME_INVALID


# ---------------------------------------------------------------------------------------------------- publish
@pytest.mark.parametrize("version", VERSIONS)
def test_publish_with_qos_3_is_malformed(version: int) -> None:
    rejected(version, h("36 05 00 01 74 00 01"), MALFORMED_PACKET)


@pytest.mark.parametrize("version", VERSIONS)
def test_dup_at_qos_0_is_malformed(version: int) -> None:
    rejected(version, h("38 03 00 01 74"), MALFORMED_PACKET)


@pytest.mark.parametrize(
    "wire", ["32 05 00 01 74 00 00", "40 02 00 00", "50 02 00 00", "62 02 00 00", "70 02 00 00",
             "82 06 00 00 00 01 61 00", "90 03 00 00 00", "a2 05 00 00 00 01 61", "b0 02 00 00"],
)  # fmt: skip
def test_packet_identifier_0_is_malformed(wire: str) -> None:
    rejected(V311, h(wire), MALFORMED_PACKET)


@pytest.mark.parametrize(
    "wire",
    [
        "30 05 00 02 c3 28 78",  # not UTF-8
        "30 05 00 02 61 00 78",  # U+0000
        "30 05 00 03 ed a0 80",  # an encoded surrogate
        "30 03 00 05 61",  # the length runs past the packet
        "30 01 00",  # the length itself is cut
    ],
)
def test_bad_strings_are_malformed(wire: str) -> None:
    rejected(V311, h(wire), MALFORMED_PACKET)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("topic", ["a/+", "#", "a/#/b", ""])
def test_topic_names_without_wildcards_and_not_empty(version: int, topic: str) -> None:
    raw = topic.encode()
    body = len(raw).to_bytes(2, "big") + raw + (b"\x00" if version == V5 else b"")
    rejected(version, bytes((0x30, len(body))) + body, TOPIC_NAME_INVALID)


@pytest.mark.parametrize("response_topic", ["r/+", "#", ""])
def test_a_response_topic_that_is_no_topic_name_is_a_protocol_error(response_topic: str) -> None:
    raw = response_topic.encode()
    props = b"\x08" + len(raw).to_bytes(2, "big") + raw
    body = b"\x00\x01t" + bytes((len(props),)) + props
    rejected(V5, bytes((0x30, len(body))) + body, PROTOCOL_ERROR)
    will = bytes((len(props),)) + props + b"\x00\x01t\x00\x00"  # the same in a will's properties
    connect = b"\x00\x04MQTT\x05\x06\x00\x00\x00\x00\x00" + will
    with pytest.raises(RemoteProtocolError) as info:
        PacketParser().feed(bytes((0x10, len(connect))) + connect)
    assert info.value.reason_code == PROTOCOL_ERROR
    fine = b"\x08\x00\x03r/t"
    body = b"\x00\x01t" + bytes((len(fine),)) + fine
    expected = Publish("t", properties=Properties(response_topic="r/t"))
    assert after_connect(V5, bytes((0x30, len(body))) + body) == [expected]


def test_an_empty_topic_name_is_fine_with_a_topic_alias_in_5() -> None:
    assert after_connect(V5, h("30 06 00 00 03 23 00 01")) == [Publish("", properties=Properties(topic_alias=1))]


def test_publish_properties_and_payload_in_5() -> None:
    rejected(V5, h("30 03 00 01 74"), MALFORMED_PACKET)  # no property length
    rejected(V5, h("30 05 00 01 74 05 01"), MALFORMED_PACKET)  # properties run past the packet


# ---------------------------------------------------------------------------------------------------- subscribe
@pytest.mark.parametrize("version", VERSIONS)
def test_subscribe_needs_a_topic_filter(version: int) -> None:
    rejected(version, h("82 02 00 01") if version != V5 else h("82 03 00 01 00"), PROTOCOL_ERROR)
    rejected(version, h("a2 02 00 01") if version != V5 else h("a2 03 00 01 00"), PROTOCOL_ERROR)


@pytest.mark.parametrize(
    ("version", "options", "reason"),
    [
        (V311, 0x03, MALFORMED_PACKET),  # QoS 3
        (V311, 0x04, MALFORMED_PACKET),  # reserved before 5.0
        (V31, 0x80, MALFORMED_PACKET),
        (V5, 0x03, MALFORMED_PACKET),
        (V5, 0x40, MALFORMED_PACKET),
        (V5, 0x30, PROTOCOL_ERROR),  # retain handling 3
    ],
)
def test_bad_subscription_options(version: int, options: int, reason: int) -> None:
    props = "00 " if version == V5 else ""
    body = h(f"00 01 {props}00 01 61 {options:02x}")
    rejected(version, bytes((0x82, len(body))) + body, reason)


def test_subscribe_options_cut_short_is_malformed() -> None:
    rejected(V311, h("82 05 00 01 00 01 61"), MALFORMED_PACKET)


# ---------------------------------------------------------------------------------------------------- properties
@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        ("30 09 00 01 74 05 11 00 00 00 00", MALFORMED_PACKET),  # session expiry is not a PUBLISH property
        ("30 05 00 01 74 01 7f", MALFORMED_PACKET),  # no such property
        ("30 06 00 01 74 02 85 01", MALFORMED_PACKET),  # a two-byte identifier: none is defined
        ("30 0a 00 01 74 06 23 00 01 23 00 02", PROTOCOL_ERROR),  # topic alias twice
        ("30 09 00 01 74 05 0b 80 80 80 80", MALFORMED_PACKET),  # a five-byte variable byte integer
        ("30 06 00 01 74 02 0b 00", PROTOCOL_ERROR),  # subscription identifier 0
        ("30 07 00 01 74 03 23 00 00", 0x94),  # topic alias 0: Topic Alias invalid (5.0, 3.3.4)
        ("30 06 00 01 74 02 01 02", PROTOCOL_ERROR),  # payload format indicator 2
        ("30 06 00 01 74 02 23 00", MALFORMED_PACKET),  # a two-byte value cut by the property length
        ("30 08 00 01 74 04 03 00 05 61", MALFORMED_PACKET),  # a string running past the properties
        ("82 0b 00 01 04 0b 01 0b 02 00 01 61 00", PROTOCOL_ERROR),  # two subscription identifiers in SUBSCRIBE
        ("40 06 00 01 00 02 17 01", MALFORMED_PACKET),  # a CONNECT property in PUBACK
        ("e0 05 00 03 21 00 00", MALFORMED_PACKET),  # receive maximum in DISCONNECT
    ],
)
def test_bad_properties(wire: str, reason: int) -> None:
    rejected(V5, h(wire), reason)


def test_repeatable_properties_repeat() -> None:
    wire = h("30 14 00 01 74 10 0b 01 0b 02 26 00 01 61 00 00 26 00 01 61 00 00")
    assert after_connect(V5, wire) == [
        Publish("t", properties=Properties(subscription_identifiers=(1, 2), user_properties=(("a", ""), ("a", ""))))
    ]


def test_connect_properties_are_checked() -> None:
    base = "00 04 4d 51 54 54 05 02 00 3c"
    for props, reason in [
        ("03 21 00 00", PROTOCOL_ERROR),
        ("02 17 02", PROTOCOL_ERROR),
        ("0a 11 00 00 00 01 11 00 00 00 02", PROTOCOL_ERROR),
        ("03 23 00 01", MALFORMED_PACKET),
    ]:
        body = h(f"{base} {props} 00 00")
        with pytest.raises(RemoteProtocolError) as info:
            parse_every_way(bytes((0x10, len(body))) + body)
        assert info.value.reason_code == reason


# ---------------------------------------------------------------------------------------------------- lengths
@pytest.mark.parametrize(
    ("version", "wire"),
    [
        (V311, "40 03 00 01 00"),  # an ack is exactly two bytes before 5.0
        (V311, "b0 03 00 01 00"),
        (V311, "e0 01 00"),
        (V311, "20 03 00 00 00"),
        (V311, "20 01 00"),
        (V31, "20 02 01 00"),  # 3.1 has no session-present flag
        (V311, "20 02 02 00"),  # reserved CONNACK flags
        (V5, "c0 01 00"),
        (V5, "d0 01 00"),
        (V5, "40 01 00"),
        (V5, "20 02 00 00"),  # CONNACK needs its property length in 5.0
        (V5, "40 05 00 01 00 00 00"),  # a stray byte after the properties
    ],
)
def test_wrong_lengths_are_malformed(version: int, wire: str) -> None:
    rejected(version, h(wire), MALFORMED_PACKET)


# ---------------------------------------------------------------------------------------------------- failures
def test_packets_before_an_error_come_first_and_the_parser_stays_failed() -> None:
    parser = PacketParser()
    assert parser.feed(CONNECT_311 + h("c0 00 36 00")) == [Connect("", keep_alive=60), Pingreq()]
    for _ in range(2):
        with pytest.raises(RemoteProtocolError) as info:
            parser.feed(h("c0 00"))
        assert info.value.reason_code == MALFORMED_PACKET


def test_errors_carry_message_and_reason() -> None:
    error = rejected(V311, h("36 00"), MALFORMED_PACKET)
    assert "QoS 3" in error.message
    assert "0x81" in str(error)


# ---------------------------------------------------------------------------------------------------- encoding
@pytest.mark.parametrize(
    ("packet", "version"),
    [
        (Publish("t", qos=3, packet_id=1), V311),
        (Publish("t", qos=1), V311),  # no packet identifier
        (Publish("t", packet_id=1), V311),  # a packet identifier at QoS 0
        (Publish("t", dup=True), V311),
        (Publish("a/+"), V311),
        (Publish(""), V311),
        (Publish("", properties=Properties(subscription_identifiers=(1,))), V5),  # no topic alias
        (Publish("t", properties=Properties(topic_alias=1)), V311),  # properties before 5.0
        (Publish("t", properties=Properties(session_expiry_interval=1)), V5),  # not a PUBLISH property
        (Publish("t", properties=Properties(topic_alias=0)), V5),
        (Publish("t", properties=Properties(topic_alias=70000)), V5),
        (Publish("t", properties=Properties(subscription_identifiers=(VBI_MAX + 1,))), V5),
        (Publish("\x00"), V311),
        (Publish("x" * 70000), V311),
        (Puback(0), V311),
        (Puback(70000), V311),
        (Puback(1, 0x10), V311),  # reason codes before 5.0
        (Puback(1, 300), V5),
        (Subscribe(1, ()), V311),
        (Subscribe(1, (Subscription("a", no_local=True),)), V311),
        (Subscribe(1, (Subscription("a", retain_handling=3),)), V5),
        (Subscribe(1, (Subscription("a"),), Properties(subscription_identifiers=(1, 2))), V5),
        (Unsubscribe(1, ()), V311),
        (Unsuback(1, (0,)), V311),
        (Auth(), V311),
        (Connect("c", username=None, password=b"p"), V311),
        (Connect("c", keep_alive=-1), V311),
        (Connect("c", will=Will("w", b"", qos=3)), V311),
        (Connack(session_present=True), V31),
        (Connack(properties=Properties(topic_alias=1)), V5),
        (Disconnect(1), V311),
        (Pingreq(), 6),
    ],
)
def test_encoding_what_the_version_cannot_carry_is_a_local_error(packet: Packet, version: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode(packet, version)


def test_encoding_something_else_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        encode(object(), V5)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        PacketParser(6)


@pytest.mark.parametrize("version", [V31, V311, V5])
@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("size", [0, 100, 200_000])
@pytest.mark.parametrize(("qos", "packet_id", "dup"), [(0, None, False), (1, 7, False), (2, 65535, True)])
def test_a_plain_publish_encodes_as_the_packet_does(
    version: int, retain: bool, size: int, qos: int, packet_id: int | None, dup: bool
) -> None:
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    plain = encode_plain_publish(encode_topic("a/ü/c"), payload, version, qos, packet_id, dup=dup, retain=retain)
    assert plain == encode(Publish("a/ü/c", payload, qos, retain, dup, packet_id), version)


@pytest.mark.parametrize("topic", ["a/+", "#", ""])
def test_encode_topic_refuses_what_no_topic_name_may_be(topic: str) -> None:
    with pytest.raises(LocalProtocolError):
        encode_topic(topic)
