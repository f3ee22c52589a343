"""AMQP messages ↔ core messages, with proton as the independent AMQP implementation on the other side."""

from __future__ import annotations

import uuid
from typing import Any

import proton
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridentmq_amqp import messages
from tridentmq_amqp.messages import (
    ENC_APPLICATION_PROPERTIES,
    ENC_BODY,
    ENC_FOOTER,
    ENC_MESSAGE_ANNOTATIONS,
    ENC_PROPERTIES,
    MessageFormatError,
    to_amqp,
    to_core,
)
from tridentmq_amqp.protocol.errors import RemoteProtocolError
from tridentmq_amqp.protocol.types import (
    Char,
    Decimal,
    Described,
    Symbol,
    Timestamp,
    UByte,
    UInt,
    ULong,
    encode,
    skip,
)
from tridentmq_shared.message import (
    M_ADDRESS,
    M_BODY,
    M_CONTENT_TYPE,
    M_DURABLE,
    M_EXPIRATION,
    M_GROUP,
    M_ID,
    M_PRIORITY,
    M_PROPS,
    M_PROTOCOL,
    M_ROUTING,
    M_SCHEDULED,
    M_TIMESTAMP,
    ROUTING_DEFAULT,
    check_message,
    new_message,
)

NOW = 1_700_000_000_000
U = uuid.UUID("12345678-1234-5678-1234-567812345678")


def section(code: int, value: Any) -> bytes:
    return encode(Described(ULong(code), value))


def footer() -> bytes:
    return section(0x78, {Symbol("x-opt-sig"): b"\x01\x02"})


def without_header(data: bytes) -> bytes:
    """The sections a consumer gets as sent: all but the header and the delivery annotations."""
    data = bytes(data)
    for prefix in (b"\x00\x53\x70", b"\x00\x53\x71"):
        if data.startswith(prefix):
            data = data[skip(data, 3) :]
    return data


def decoded(data: bytes) -> proton.Message:
    m = proton.Message()
    m.decode(data)
    return m


def proton_sections(data: bytes) -> list[Any]:
    """The sections of a message as proton's Data decodes them (keeping the ulong and symbol types)."""
    out = []
    while data:
        d = proton.Data()
        n = d.decode(data)
        d.rewind()
        d.next()
        out.append(d.get_object())
        data = data[n:]
    return out


def full_message(body: Any = "text", **kw: Any) -> proton.Message:
    m = proton.Message(
        id="id-1",
        user_id=b"alice",
        address="orders",
        subject="new order",
        reply_to="replies",
        correlation_id=U,
        content_type="text/plain",
        content_encoding="utf-8",
        expiry_time=(NOW + 60_000) / 1000,
        creation_time=NOW / 1000,
        group_id="g1",
        group_sequence=3,
        reply_to_group_id="rg",
        durable=True,
        priority=7,
        ttl=30.0,
        instructions={Symbol("x-opt-hop"): 1},
        annotations={Symbol("x-opt-a"): "b", Symbol("x-opt-n"): proton.uint(9)},
        properties={"s": "v", "i": 42, "f": 1.5, "b": True, "n": None, "bin": b"\x00", "sym": proton.symbol("y")},
        body=body,
    )
    for name, value in kw.items():
        setattr(m, name, value)
    return m


def core(data: bytes, address: str | None = "q", now_ms: int = NOW) -> list[Any]:
    m = to_core(data, address, ROUTING_DEFAULT, now_ms)
    assert check_message(m) is None
    return m


# ---------------------------------------------------------------- AMQP → core


def test_a_plain_durable_data_message() -> None:
    data = section(0x70, [True]) + section(0x75, b"payload")
    m = core(data)
    assert m == new_message("q", b"payload", durable=True, protocol="amqp")
    assert to_amqp(m, 1, NOW) == data


def test_every_field_of_a_full_message() -> None:
    m = core(full_message().encode(), "orders.q")
    assert m[M_ADDRESS] == "orders.q"
    assert m[M_ROUTING] == ROUTING_DEFAULT
    assert (m[M_DURABLE], m[M_PRIORITY], m[M_EXPIRATION]) == (True, 7, NOW + 30_000)  # ttl earlier than expiry
    assert (m[M_GROUP], m[M_CONTENT_TYPE], m[M_PROTOCOL], m[M_BODY]) == ("g1", "text/plain", "amqp", b"text")
    props = m[M_PROPS]
    assert {k: v for k, v in props.items() if not k.startswith("$enc.")} == {
        "amqp_message_id": "id-1",
        "amqp_user_id": b"alice",
        "amqp_to": "orders",
        "amqp_subject": "new order",
        "reply-to": "replies",
        "correlation-id": str(U),
        "amqp_content_encoding": "utf-8",
        "amqp_creation_time": NOW,
        "amqp_group_sequence": 3,
        "amqp_reply_to_group_id": "rg",
        "s": "v",
        "i": 42,
        "f": 1.5,
        "b": True,
        "n": None,
        "bin": b"\x00",
        "sym": "y",
    }
    assert type(props["sym"]) is str
    assert props[ENC_BODY] == "string"
    for name in (ENC_MESSAGE_ANNOTATIONS, ENC_PROPERTIES, ENC_APPLICATION_PROPERTIES):
        assert type(props[name]) is bytes


def test_the_absolute_expiry_wins_when_earlier_than_the_ttl() -> None:
    m = core(full_message(ttl=120.0).encode())
    assert m[M_EXPIRATION] == NOW + 60_000
    m = core(full_message(ttl=0).encode())  # proton leaves out a zero ttl
    assert m[M_EXPIRATION] == NOW + 60_000


@pytest.mark.parametrize(("priority", "expected"), [(0, 0), (4, 4), (9, 9), (10, 9), (255, 9)])
def test_priority_is_clamped(priority: int, expected: int) -> None:
    assert core(section(0x70, [None, UByte(priority)]))[M_PRIORITY] == expected


def test_message_ids_of_every_type() -> None:
    for given_id, stored in [("s", "s"), (proton.ulong(7), 7), (U, str(U)), (b"\x01", b"\x01")]:
        m = core(proton.Message(id=given_id, correlation_id=given_id, body=b"", inferred=True).encode())
        assert m[M_PROPS]["amqp_message_id"] == stored
        assert m[M_PROPS]["correlation-id"] == stored
        assert type(m[M_PROPS]["amqp_message_id"]) is type(stored)


def test_application_property_values_become_plain_values() -> None:
    app = {
        "sym": Symbol("a"),
        "ch": Char("c"),
        "ts": Timestamp(5),
        "u": U,
        "dec": Decimal(0x74, b"\x00\x00\x00\x01"),
        "ui": UInt(3),
        "f": 0.5,
    }
    m = core(section(0x74, app))
    props = m[M_PROPS]
    assert {k: (v, type(v)) for k, v in props.items() if not k.startswith("$enc.")} == {
        "sym": ("a", str),
        "ch": ("c", str),
        "ts": (5, int),
        "u": (str(U), str),
        "dec": (b"\x00\x00\x00\x01", bytes),
        "ui": (3, int),
        "f": (0.5, float),
    }


def test_properties_fields_win_over_application_properties_of_the_same_name() -> None:
    data = section(0x73, [None, None, "real"]) + section(0x74, {"amqp_to": "fake"})
    assert core(data)[M_PROPS]["amqp_to"] == "real"


@pytest.mark.parametrize(
    ("annotations", "scheduled"),
    [
        ({Symbol("x-opt-delivery-time"): Timestamp(NOW + 5000)}, NOW + 5000),
        ({Symbol("x-opt-delivery-time"): NOW + 5000}, NOW + 5000),
        ({Symbol("x-opt-delivery-delay"): 2500}, NOW + 2500),
        ({Symbol("x-opt-delivery-delay"): 0}, 0),
        ({Symbol("x-opt-delivery-time"): Timestamp(NOW + 1), Symbol("x-opt-delivery-delay"): 9}, NOW + 1),
        ({Symbol("x-opt-other"): 1}, 0),
    ],
)
def test_scheduled_delivery_annotations(annotations: dict[Any, Any], scheduled: int) -> None:
    m = core(section(0x72, annotations) + section(0x75, b""))
    assert m[M_SCHEDULED] == scheduled


def test_delivery_annotations_are_dropped() -> None:
    m = core(section(0x71, {Symbol("x-opt-hop"): 1}) + section(0x75, b"x"))
    assert m[M_PROPS] == {}
    assert to_amqp(m, 1, NOW) == section(0x75, b"x")


def test_symbolic_section_descriptors_are_accepted() -> None:
    def named(name: str, value: Any) -> bytes:
        return encode(Described(Symbol(name), value))

    data = (
        named("amqp:header:list", [True])
        + named("amqp:delivery-annotations:map", {})
        + named("amqp:message-annotations:map", {Symbol("x-opt-delivery-delay"): 10})
        + named("amqp:properties:list", ["id"])
        + named("amqp:application-properties:map", {"a": 1})
        + named("amqp:data:binary", b"x")
        + named("amqp:footer:map", {})
    )
    m = core(data)
    assert (m[M_DURABLE], m[M_SCHEDULED], m[M_BODY]) == (True, NOW + 10, b"x")
    assert (m[M_PROPS]["amqp_message_id"], m[M_PROPS]["a"]) == ("id", 1)
    assert without_header(to_amqp(m, 1, NOW)) == data[skip(data) :].replace(
        named("amqp:delivery-annotations:map", {}), b""
    ).replace(named("amqp:data:binary", b"x"), section(0x75, b"x"))
    numeric = section(0x70, [True]) + encode(Described(ULong(0x75), b"x"))
    long_descriptor = b"\x00\x80" + (0x75).to_bytes(8, "big") + encode(b"x")
    assert core(long_descriptor)[M_BODY] == core(numeric)[M_BODY] == b"x"


def test_the_anonymous_relay_takes_the_address_from_to() -> None:
    m = core(proton.Message(address="Orders/EU", body=b"x", inferred=True).encode(), None)
    assert m[M_ADDRESS] == "Orders/EU"
    for data in (section(0x75, b"x"), proton.Message(body=b"x").encode(), section(0x73, [None, None, ""])):
        with pytest.raises(MessageFormatError, match="anonymous relay"):
            to_core(data, None, ROUTING_DEFAULT, NOW)


# ---------------------------------------------------------------- bodies

several_data = section(0x75, b"a") + section(0x75, b"bc")
two_sequences = section(0x76, [1, "x"]) + section(0x76, [])


@pytest.mark.parametrize(
    ("body", "expected_body", "kind"),
    [
        (section(0x75, b"raw"), b"raw", None),
        (b"", b"", "none"),
        (section(0x77, "héllo"), "héllo".encode(), "string"),
        (section(0x77, "x" * 300), b"x" * 300, "string"),
        (section(0x77, b"\x00\x01"), b"\x00\x01", "binary"),
        (section(0x77, b"z" * 300), b"z" * 300, "binary"),
        (section(0x77, [1, "a"]), section(0x77, [1, "a"]), "encoded"),
        (section(0x77, {"k": 1}), section(0x77, {"k": 1}), "encoded"),
        (section(0x77, 42), section(0x77, 42), "encoded"),
        (section(0x77, None), section(0x77, None), "encoded"),
        (section(0x77, Symbol("s")), section(0x77, Symbol("s")), "encoded"),
        (several_data, several_data, "encoded"),
        (two_sequences, two_sequences, "encoded"),
        (section(0x76, [b"a"]), section(0x76, [b"a"]), "encoded"),
    ],
)
def test_every_body_kind_round_trips(body: bytes, expected_body: bytes, kind: str | None) -> None:
    data = section(0x70, [True]) + section(0x73, ["id"]) + body + footer()
    m = core(data)
    assert m[M_BODY] == expected_body
    assert m[M_PROPS].get(ENC_BODY) == kind
    assert m[M_PROPS][ENC_FOOTER] == footer()
    assert to_amqp(m, 1, NOW) == data


@pytest.mark.parametrize(
    "message",
    [
        full_message(),
        full_message(body=b"bin"),
        full_message(body=b"bin", inferred=True),
        full_message(body=[1, "two", 3.0]),
        full_message(body=[1, "two"], inferred=True),
        full_message(body={"k": [1, 2], "m": {"n": None}}),
        full_message(body=17),
        full_message(body=None),
        full_message(body="x" * 1000, ttl=0, durable=False, priority=4),
        proton.Message(body=b"just data", inferred=True),
        proton.Message(body="just text"),
        proton.Message(),
    ],
)
def test_proton_messages_round_trip_apart_from_the_header(message: proton.Message) -> None:
    for data in (message.encode(), message.encode() + footer()):
        m = core(data)
        out = to_amqp(m, 1, NOW)
        assert without_header(out) == without_header(data)
        back = decoded(out)
        assert (back.body, back.properties, back.annotations, back.id) == (
            message.body,
            message.properties,
            message.annotations,
            message.id,
        )
        assert back.instructions is None  # delivery annotations are not forwarded
        assert (back.durable, back.priority) == (message.durable, message.priority)


# ---------------------------------------------------------------- core → AMQP: the header


def test_the_header_carries_the_core_fields() -> None:
    m = new_message("q", b"x", durable=True, priority=8, expiration_ms=NOW + 1000, protocol="amqp")
    back = decoded(to_amqp(m, 3, NOW + 400))
    assert (back.durable, back.priority, back.ttl, back.delivery_count) == (True, 8, 0.6, 2)
    assert back.body == b"x"


def test_an_expired_message_keeps_a_ttl_of_one_millisecond() -> None:
    m = new_message("q", b"x", expiration_ms=NOW, protocol="amqp")
    assert decoded(to_amqp(m, 1, NOW + 5000)).ttl == 0.001


def test_default_header_fields_are_left_out() -> None:
    m = new_message("q", b"x", protocol="amqp")
    assert to_amqp(m, 1, NOW) == section(0x75, b"x")  # no header at all
    m[M_DURABLE] = True
    assert to_amqp(m, 1, NOW) == section(0x70, [True]) + section(0x75, b"x")
    m[M_PRIORITY] = 0
    assert to_amqp(m, 1, NOW) == section(0x70, [True, UByte(0)]) + section(0x75, b"x")
    m[M_PRIORITY] = 4
    assert to_amqp(m, 2, NOW) == section(0x70, [True, None, None, None, UInt(1)]) + section(0x75, b"x")
    m[M_EXPIRATION] = NOW + 10
    assert to_amqp(m, 1, NOW) == section(0x70, [True, None, UInt(10)]) + section(0x75, b"x")


def test_a_large_body_uses_a_wide_data_section() -> None:
    m = new_message("q", b"y" * 70_000, protocol="amqp")
    assert core(to_amqp(m, 1, NOW))[M_BODY] == b"y" * 70_000


# ---------------------------------------------------------------- core → AMQP: core annotations

DEAD = {"_AMQ_ORIG_ADDRESS": "orders", "_AMQ_ORIG_QUEUE": "orders.q", "_AMQ_ORIG_REASON": "expired"}
DEAD_ANNOTATIONS = {"x-opt-ORIG-ADDRESS": "orders", "x-opt-ORIG-QUEUE": "orders.q", "x-opt-ORIG-REASON": "expired"}


def test_core_properties_are_merged_into_the_kept_annotations() -> None:
    original = full_message(annotations={Symbol("x-opt-a"): "b", Symbol("x-opt-ORIG-QUEUE"): "older"})
    m = core(original.encode())
    m[M_PROPS].update(DEAD)
    back = decoded(to_amqp(m, 1, NOW))
    assert back.annotations == {"x-opt-a": "b", **DEAD_ANNOTATIONS}
    assert back.properties == original.properties  # core properties are not application properties
    assert back.body == original.body
    assert back.annotations is not None


def test_core_properties_become_the_only_annotations_when_none_were_sent() -> None:
    m = core(proton.Message(body=b"x", inferred=True, properties={"p": 1}).encode())
    m[M_PROPS].update(DEAD)
    back = decoded(to_amqp(m, 1, NOW))
    assert (back.annotations, back.properties, back.body) == (DEAD_ANNOTATIONS, {"p": 1}, b"x")


def test_many_annotations_merge_into_a_wide_map() -> None:
    many = {Symbol(f"x-opt-{i}"): "v" * 20 for i in range(20)}
    m = core(section(0x72, many) + section(0x75, b""))
    m[M_PROPS].update(DEAD)
    assert decoded(to_amqp(m, 1, NOW)).annotations == {**many, **DEAD_ANNOTATIONS}
    m[M_PROPS][ENC_MESSAGE_ANNOTATIONS] = to_amqp(m, 1, NOW)[: -len(section(0x75, b""))]
    assert decoded(to_amqp(m, 1, NOW)).annotations == {**many, **DEAD_ANNOTATIONS}


# ---------------------------------------------------------------- core → AMQP: other protocols' messages


def test_a_stomp_message_reaches_proton_with_properties_and_application_properties() -> None:
    m = new_message(
        "orders",
        b"hello",
        durable=True,
        priority=6,
        expiration_ms=NOW + 9000,
        group_id="g",
        content_type="text/plain",
        protocol="stomp",
        properties={
            "reply-to": "/queue/replies",
            "correlation-id": "c-1",
            "amqp_subject": "subj",
            "colour": "red",
            "n": 5,
            "big": 2**70,
            "f": 0.25,
            "yes": True,
            "none": None,
            "raw": b"\x01",
            "$enc.stomp.x": "hidden",
            **DEAD,
        },
    )
    m[M_ID] = 77
    m[M_TIMESTAMP] = NOW - 5
    back = decoded(to_amqp(m, 1, NOW))
    assert (back.id, back.address, back.reply_to, back.correlation_id, back.subject) == (
        77,
        "orders",
        "/queue/replies",
        "c-1",
        "subj",
    )
    properties = next(s.value for s in proton_sections(to_amqp(m, 1, NOW)) if s.descriptor == 0x73)
    assert type(properties[0]) is proton.ulong
    assert type(back.content_type) is proton.symbol
    assert (back.content_type, back.group_id, back.creation_time, back.expiry_time) == (
        "text/plain",
        "g",
        (NOW - 5) / 1000,
        (NOW + 9000) / 1000,
    )
    assert (back.durable, back.priority, back.ttl) == (True, 6, 9.0)
    assert back.properties == {
        "colour": "red",
        "n": 5,
        "big": str(2**70),
        "f": 0.25,
        "yes": True,
        "none": None,
        "raw": b"\x01",
    }
    assert back.annotations == DEAD_ANNOTATIONS
    assert back.body == b"hello"


def test_an_mqtt_message_gives_its_response_topic_and_correlation_data() -> None:
    props = {"mqtt_response_topic": "r/1", "mqtt_correlation_data": b"\x09", "mqtt_qos": 1}
    m = new_message("t/1", b"{}", protocol="mqtt", properties=props)
    back = decoded(to_amqp(m, 1, NOW))
    assert (back.reply_to, back.correlation_id, back.properties) == ("r/1", b"\x09", {"mqtt_qos": 1})
    assert back.annotations is None


def test_a_plain_foreign_message_has_just_properties_and_data() -> None:
    m = new_message("a.b", b"x", protocol=None)
    m[M_ID] = 3
    out = to_amqp(m, 1, NOW)
    assert out == section(0x73, [ULong(3), None, "a.b"]) + section(0x75, b"x")
    back = core(out, None)
    assert (back[M_ADDRESS], back[M_BODY], back[M_PROPS]["amqp_message_id"]) == ("a.b", b"x", 3)


def test_integer_correlation_ids_become_ulongs() -> None:
    m = new_message("a", b"", protocol="stomp", properties={"correlation-id": 5})
    back = decoded(to_amqp(m, 1, NOW))
    assert (back.correlation_id, back.properties) == (5, None)
    properties = next(s.value for s in proton_sections(to_amqp(m, 1, NOW)) if s.descriptor == 0x73)
    assert type(properties[5]) is proton.ulong


# ---------------------------------------------------------------- malformed messages

BAD: list[tuple[str, bytes]] = [
    ("not described", b"\x40"),
    ("unknown section", section(0x79, None)),
    ("unknown symbolic section", encode(Described(Symbol("amqp:nope:list"), []))),
    ("string descriptor", b"\x00\xa1\x01x\x45"),
    ("truncated descriptor", b"\x00"),
    ("truncated section", b"\x00\x53\x75\xa0\x05ab"),
    ("undecodable value", b"\x00\x53\x77\x01"),
    ("two headers", section(0x70, []) + section(0x70, [])),
    ("header after properties", section(0x73, []) + section(0x70, [])),
    ("two property sections", section(0x73, []) + section(0x73, [])),
    ("application properties after the body", section(0x75, b"") + section(0x74, {})),
    ("data then a sequence", section(0x75, b"") + section(0x76, [])),
    ("two amqp-values", section(0x77, 1) + section(0x77, 1)),
    ("section after the footer", section(0x78, {}) + section(0x75, b"")),
    ("header not a list", section(0x70, {})),
    ("header durable not a boolean", section(0x70, [1])),
    ("header priority not a number", section(0x70, [None, "high"])),
    ("header ttl not a number", section(0x70, [None, None, True])),
    ("delivery annotations not a map", section(0x71, [])),
    ("message annotations not a map", section(0x72, [])),
    ("delivery time not a number", section(0x72, {Symbol("x-opt-delivery-time"): "soon"})),
    ("delivery delay not a number", section(0x72, {Symbol("x-opt-delivery-delay"): 1.5})),
    ("properties not a list", section(0x73, "x")),
    ("message id a list", section(0x73, [[1]])),
    ("user id a string", section(0x73, [None, "alice"])),
    ("to a number", section(0x73, [None, None, 5])),
    ("absolute expiry a string", section(0x73, [None] * 8 + ["tomorrow"])),
    ("group sequence a string", section(0x73, [None] * 11 + ["3"])),
    ("application properties not a map", section(0x74, [])),
    ("application property key not a string", section(0x74, {1: "x"})),
    ("application property value a list", section(0x74, {"a": [1]})),
    ("application property value a map", section(0x74, {"a": {}})),
    ("application property value described", section(0x74, {"a": Described(1, 2)})),
    ("data holding a string", section(0x75, "text")),
    ("sequence holding a map", section(0x76, {})),
    ("value with invalid utf-8", b"\x00\x53\x77\xa1\x02\xc3\x28"),
    ("footer not a map", section(0x78, [])),
    ("trailing garbage", section(0x75, b"") + b"\x99"),
]


@pytest.mark.parametrize(("name", "data"), BAD, ids=[name for name, _ in BAD])
def test_malformed_messages_raise_message_format_errors(name: str, data: bytes) -> None:
    with pytest.raises(MessageFormatError):
        to_core(data, "q", ROUTING_DEFAULT, NOW)


def test_the_error_is_a_remote_protocol_error_with_a_condition() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        to_core(section(0x73, [[1]]), "q", ROUTING_DEFAULT, NOW)
    assert info.value.condition == "amqp:invalid-field"
    with pytest.raises(RemoteProtocolError) as info:
        to_core(b"\x40", "q", ROUTING_DEFAULT, NOW)
    assert info.value.condition == "amqp:decode-error"


def test_every_prefix_either_parses_at_a_section_boundary_or_raises() -> None:
    data = full_message().encode() + footer()
    boundaries = {0}
    pos = 0
    while pos < len(data):
        pos = skip(data, pos)
        boundaries.add(pos)
    for n in range(len(data)):
        if n in boundaries:
            to_core(data[:n], "q", ROUTING_DEFAULT, NOW)
        else:
            with pytest.raises(MessageFormatError):
                to_core(data[:n], "q", ROUTING_DEFAULT, NOW)


@settings(max_examples=1000)
@given(st.binary(max_size=80), st.sampled_from([b"", b"\x00\x53\x70", b"\x00\x53\x73", b"\x00\x53\x74", b"\x00\x53"]))
def test_garbage_raises_only_message_format_errors(data: bytes, prefix: bytes) -> None:
    try:
        m = to_core(prefix + data, "q", ROUTING_DEFAULT, NOW)
    except MessageFormatError:
        return
    assert check_message(m) is None


def test_protocol_constants() -> None:
    assert messages.PROTOCOL == "amqp"
    assert messages.ENCODING_PREFIX == "$enc."
    assert all(
        name.startswith(messages.ENCODING_PREFIX)
        for name in (ENC_MESSAGE_ANNOTATIONS, ENC_PROPERTIES, ENC_APPLICATION_PROPERTIES, ENC_BODY, ENC_FOOTER)
    )
