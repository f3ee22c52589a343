"""AMQP 1.0 messages (spec part 3.2) ↔ core messages (pure).

An AMQP message is a sequence of described sections. The core keeps what other protocols understand in its
own fields (durable, priority, expiration, group, content type, scheduled delivery) and copies the
properties section's fields and the application properties into core properties, so that STOMP headers,
MQTT user properties and selectors see them. The sections themselves travel along as their original bytes
in properties named ``$enc.amqp.*``: an AMQP consumer gets back exactly what was sent, header apart (the
header is rebuilt from the core fields, which the core may have changed). Messages from other protocols get
a properties section, application properties and one data section built from the core fields.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any, Final

from tridentmq_amqp.protocol.errors import DECODE_ERROR, INVALID_FIELD, RemoteProtocolError
from tridentmq_amqp.protocol.types import (
    Char,
    Decimal,
    Symbol,
    Timestamp,
    UByte,
    UInt,
    ULong,
    decode,
    encode,
    skip,
)
from tridentmq_shared.message import (
    DEFAULT_PRIORITY,
    ENCODING_PREFIX,
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
    M_TIMESTAMP,
    MAX_PRIORITY,
    MAX_TIME_MS,
    WireMessage,
    time_problem,
)

PROTOCOL: Final = "amqp"

ENC_MESSAGE_ANNOTATIONS: Final = f"{ENCODING_PREFIX}amqp.message_annotations"
ENC_PROPERTIES: Final = f"{ENCODING_PREFIX}amqp.properties"
ENC_APPLICATION_PROPERTIES: Final = f"{ENCODING_PREFIX}amqp.application_properties"
ENC_BODY: Final = f"{ENCODING_PREFIX}amqp.body"  # how M_BODY was carried; absent for the common single data section
ENC_FOOTER: Final = f"{ENCODING_PREFIX}amqp.footer"
BODY_NONE: Final = "none"
BODY_STRING: Final = "string"  # amqp-value holding a string: M_BODY is its UTF-8
BODY_BINARY: Final = "binary"  # amqp-value holding binary
BODY_ENCODED: Final = "encoded"  # M_BODY is the original body sections

# Core properties the properties section's fields are copied to. Reply-to and correlation-id use the STOMP
# names so that request/reply works across protocols.
MESSAGE_ID: Final = "amqp_message_id"
USER_ID: Final = "amqp_user_id"
TO: Final = "amqp_to"
SUBJECT: Final = "amqp_subject"
REPLY_TO: Final = "reply-to"
CORRELATION_ID: Final = "correlation-id"
CONTENT_ENCODING: Final = "amqp_content_encoding"
CREATION_TIME: Final = "amqp_creation_time"
GROUP_SEQUENCE: Final = "amqp_group_sequence"
REPLY_TO_GROUP_ID: Final = "amqp_reply_to_group_id"
# Other protocols' names for reply-to and correlation (tridentmq_mqtt.messages; services do not import each other).
MQTT_RESPONSE_TOPIC: Final = "mqtt_response_topic"
MQTT_CORRELATION_DATA: Final = "mqtt_correlation_data"

DELIVERY_TIME: Final = "x-opt-delivery-time"
DELIVERY_DELAY: Final = "x-opt-delivery-delay"
CORE_PREFIX: Final = "_AMQ_"  # properties the core adds (dead-lettering, expiry), sent as x-opt-* annotations

HEADER: Final = 0x70
DELIVERY_ANNOTATIONS: Final = 0x71
MESSAGE_ANNOTATIONS: Final = 0x72
PROPERTIES: Final = 0x73
APPLICATION_PROPERTIES: Final = 0x74
DATA: Final = 0x75
AMQP_SEQUENCE: Final = 0x76
AMQP_VALUE: Final = 0x77
FOOTER: Final = 0x78
_SYMBOLIC: Final = {
    "amqp:header:list": HEADER,
    "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    "amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    "amqp:properties:list": PROPERTIES,
    "amqp:application-properties:map": APPLICATION_PROPERTIES,
    "amqp:data:binary": DATA,
    "amqp:amqp-sequence:list": AMQP_SEQUENCE,
    "amqp:amqp-value:*": AMQP_VALUE,
    "amqp:footer:map": FOOTER,
}
_NAMES: Final = {code: name.split(":")[1] for name, code in _SYMBOLIC.items()}
_BODY_RANK: Final = DATA  # data, amqp-sequence and amqp-value share one place in the order
_MAX_UINT: Final = 0xFFFFFFFF
_LIST: Final = (0xC0, 0xD0, 0x45)
_MAP: Final = (0xC1, 0xD1)
_U32: Final = struct.Struct(">I")
_U32X2: Final = struct.Struct(">II")
_DATA: Final = b"\x00\x53\x75"
_VALUE: Final = b"\x00\x53\x77"


class MessageFormatError(RemoteProtocolError):
    """The bytes of a transfer are not a valid AMQP message; the gateway rejects the delivery with this."""

    def __init__(self, message: str, condition: str = DECODE_ERROR) -> None:
        super().__init__(message, condition)


# ---------------------------------------------------------------- AMQP → core


def _section(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(section code, offset of its value, offset after it) of the section at ``pos``."""
    if buf[pos] != 0x00:
        raise MessageFormatError(f"expected a described message section at offset {pos}")
    if buf[pos + 1] == 0x53:  # smallulong: how nearly every peer writes section descriptors
        code = buf[pos + 2]
        value = pos + 3
    else:
        descriptor, value = decode(buf, pos + 1)
        code = _SYMBOLIC.get(descriptor, -1) if isinstance(descriptor, str) else descriptor
    if type(code) is not int or not HEADER <= code <= FOOTER:
        raise MessageFormatError(f"unknown message section {str(code)[:64]!r}")
    return code, value, skip(buf, value)


def _value(buf: bytes, pos: int, end: int, kinds: tuple[int, ...], code: int) -> Any:
    """The decoded value of a section, checked to be a list or map as the section requires."""
    if buf[pos] not in kinds:
        raise MessageFormatError(f"the {_NAMES[code]} section does not hold a {'list' if kinds is _LIST else 'map'}")
    value, after = decode(buf, pos)
    assert after == end
    return value


def _wrong(field: str) -> MessageFormatError:
    return MessageFormatError(f"{field} has the wrong type", INVALID_FIELD)


def _identifier(value: Any, field: str) -> str | int | bytes:
    """A message-id or correlation-id (ulong, uuid, binary or string) as a core property value."""
    t = type(value)
    if t is int or t is bytes:
        return value  # type: ignore[no-any-return]
    if t is uuid.UUID:
        return str(value)
    if isinstance(value, str):
        return str(value)
    raise _wrong(field)


def _optional(value: Any, kind: type, field: str) -> Any:
    if value is None or (isinstance(value, kind) and type(value) is not bool):
        return value
    raise _wrong(field)


_IDENTITY: Final = frozenset({str, int, float, bool, bytes, type(None)})
_SIMPLE: Final[dict[type, Any]] = {
    Symbol: str,
    Char: str,
    Timestamp: int,
    uuid.UUID: str,
    Decimal: lambda d: d.raw,
}


_MAX_DELAY_MS: Final = 2**53  # far beyond any real delay, and far from overflowing a 64-bit time


def _application_properties(value: dict[Any, Any], props: dict[str, Any]) -> None:
    for key, v in value.items():
        if not isinstance(key, str):
            raise MessageFormatError("application property names must be strings", INVALID_FIELD)
        if key.startswith(ENCODING_PREFIX):  # the gateway's own: a client must not forge what others receive
            raise MessageFormatError(
                f"application property names may not start with {ENCODING_PREFIX!r}", INVALID_FIELD
            )
        t = type(v)
        if t not in _IDENTITY:
            convert = _SIMPLE.get(t)
            if convert is None:
                raise MessageFormatError(f"application property {key[:64]!r} is not of a simple type", INVALID_FIELD)
            v = convert(v)
        props[str(key)] = v


def _scheduled(annotations: dict[Any, Any], now_ms: int) -> int:
    """When the message is to be delivered per Artemis' annotations, 0 for now."""
    at = annotations.get(DELIVERY_TIME)
    if at is not None:
        if type(at) is not int and type(at) is not Timestamp:
            raise _wrong(DELIVERY_TIME)
        return int(at) if at > 0 else 0
    delay = annotations.get(DELIVERY_DELAY)
    if delay is not None:
        if type(delay) is not int:
            raise _wrong(DELIVERY_DELAY)
        if delay > _MAX_DELAY_MS:
            raise MessageFormatError(f"{DELIVERY_DELAY} is out of range", INVALID_FIELD)
        return now_ms + delay if delay > 0 else 0
    return 0


def to_core(encoded: bytes | bytearray | memoryview, address: str | None, routing: int, now_ms: int) -> WireMessage:
    """The core message of the AMQP message ``encoded`` sent to ``address`` (None: to its ``to``)."""
    if type(encoded) is not bytes:
        encoded = bytes(encoded)  # a bytearray or view: the kept sections must be immutable bytes
    try:
        return _to_core(encoded, address, routing, now_ms)
    except MessageFormatError:
        raise
    except RemoteProtocolError as e:
        raise MessageFormatError(f"malformed message: {e.message}") from e
    except (IndexError, struct.error) as e:
        raise MessageFormatError("truncated message section") from e


def _to_core(encoded: bytes, address: str | None, routing: int, now_ms: int) -> WireMessage:
    durable = False
    priority = DEFAULT_PRIORITY
    expiration = 0
    scheduled = 0
    group = None
    content_type = None
    props: dict[str, Any] = {}
    fields: dict[str, Any] | None = None  # from the properties section, applied after application properties
    kept: dict[str, bytes] | None = None  # original bytes of the sections passed through
    body_code = 0
    body_start = body_end = data_value = 0
    body_sections = 0
    rank = -1
    pos = 0
    n = len(encoded)
    while pos < n:
        code, value, end = _section(encoded, pos)
        this = code if code < DATA or code == FOOTER else _BODY_RANK
        if this <= rank and not (code == body_code and code != AMQP_VALUE):
            raise MessageFormatError(f"the {_NAMES[code]} section is repeated or out of order")
        rank = this
        if this == _BODY_RANK:
            if body_code == 0:
                body_code = code
                body_start = pos
            body_sections += 1
            body_end = end
            if code == DATA:
                if encoded[value] not in (0xA0, 0xB0):
                    raise MessageFormatError("a data section does not hold binary")
                data_value = value
            elif code == AMQP_SEQUENCE:
                _value(encoded, value, end, _LIST, code)
            else:
                data_value = value
        elif code == HEADER:
            known = _HEADER_FIELDS.get(encoded[pos:end])
            if known is not None:  # the usual headers, without a ttl: no need to decode them
                durable, priority = known
                pos = end
                continue
            header = _value(encoded, value, end, _LIST, code)
            header += [None] * (3 - len(header))
            if header[0] is not None and type(header[0]) is not bool:
                raise _wrong("header durable")
            durable = header[0] is True
            p = _optional(header[1], int, "header priority")
            if p is not None:
                priority = 0 if p < 0 else min(p, MAX_PRIORITY)
            ttl = _optional(header[2], int, "header ttl")
            if ttl is not None:
                if not 0 <= ttl <= _MAX_UINT:  # a uint: anything else cannot be a time to live
                    raise MessageFormatError("header ttl is out of range", INVALID_FIELD)
                expiration = now_ms + ttl
        elif code == DELIVERY_ANNOTATIONS:
            if encoded[value] not in _MAP:
                raise MessageFormatError("the delivery-annotations section does not hold a map")
        elif code == MESSAGE_ANNOTATIONS:
            scheduled = _scheduled(_value(encoded, value, end, _MAP, code), now_ms)
            kept = kept or {}
            kept[ENC_MESSAGE_ANNOTATIONS] = encoded[pos:end]
        elif code == PROPERTIES:
            fields, expiry, group, content_type = _properties(_value(encoded, value, end, _LIST, code))
            if expiry:
                expiration = min(expiration, expiry) if expiration else expiry
            kept = kept or {}
            kept[ENC_PROPERTIES] = encoded[pos:end]
        elif code == APPLICATION_PROPERTIES:
            _application_properties(_value(encoded, value, end, _MAP, code), props)
            kept = kept or {}
            kept[ENC_APPLICATION_PROPERTIES] = encoded[pos:end]
        else:  # footer
            _value(encoded, value, end, _MAP, code)
            kept = kept or {}
            kept[ENC_FOOTER] = encoded[pos:end]
        pos = end

    body: bytes
    if body_code == DATA and body_sections == 1:
        # The common case: no marker, and the binary sliced out directly (skip checked its size).
        body = encoded[data_value + (2 if encoded[data_value] == 0xA0 else 5) : body_end]
    elif body_code == 0:
        body = b""
        props[ENC_BODY] = BODY_NONE
    else:
        body_kind = BODY_ENCODED
        if body_code == AMQP_VALUE:
            value_type = encoded[data_value]
            if value_type in (0xA1, 0xB1):
                body = decode(encoded, data_value)[0].encode()
                body_kind = BODY_STRING
            elif value_type in (0xA0, 0xB0):
                body = decode(encoded, data_value)[0]
                body_kind = BODY_BINARY
            else:
                decode(encoded, data_value)  # checked, not used
        if body_kind == BODY_ENCODED:
            body = bytes(encoded[body_start:body_end])
        props[ENC_BODY] = body_kind

    if fields is not None:
        props.update(fields)
    if kept is not None:
        props.update(kept)
    if address is None:
        to = fields.get(TO) if fields is not None else None
        if not to:
            raise MessageFormatError("a message sent to the anonymous relay needs a to address", INVALID_FIELD)
        address = to
    if not (0 <= expiration <= MAX_TIME_MS and 0 <= scheduled <= MAX_TIME_MS):  # the core would refuse them
        problem = time_problem("absolute-expiry-time", expiration) or time_problem(DELIVERY_TIME, scheduled)
        raise MessageFormatError(str(problem), INVALID_FIELD)
    # The fields of new_message(...), built directly: this runs for every transfer.
    return [
        0,
        address,
        routing,
        durable,
        priority,
        expiration,
        0,
        group,
        None,
        None,
        props,
        body,
        content_type,
        PROTOCOL,
        scheduled,
    ]


def _properties(value: list[Any]) -> tuple[dict[str, Any], int, str | None, str | None]:
    """(core properties, absolute expiry time, group id, content type) of a properties section's list."""
    value = value + [None] * (13 - len(value))
    (
        message_id,
        user_id,
        to,
        subject,
        reply_to,
        correlation_id,
        content_type,
        content_encoding,
        expiry,
        creation,
        group,
        group_sequence,
        reply_to_group,
    ) = value[:13]
    fields: dict[str, Any] = {}
    if message_id is not None:
        fields[MESSAGE_ID] = _identifier(message_id, "message-id")
    if user_id is not None:
        fields[USER_ID] = _optional(user_id, bytes, "user-id")
    for name, v in (
        (TO, to),
        (SUBJECT, subject),
        (REPLY_TO, reply_to),
        (CONTENT_ENCODING, content_encoding),
        (REPLY_TO_GROUP_ID, reply_to_group),
    ):
        if v is not None:
            fields[name] = str(_optional(v, str, name))
    if correlation_id is not None:
        fields[CORRELATION_ID] = _identifier(correlation_id, "correlation-id")
    if creation is not None:
        fields[CREATION_TIME] = int(_optional(creation, int, "creation-time"))
    if group_sequence is not None:
        fields[GROUP_SEQUENCE] = int(_optional(group_sequence, int, "group-sequence"))
    expiry = int(_optional(expiry, int, "absolute-expiry-time") or 0)
    group = _optional(group, str, "group-id")
    content_type = _optional(content_type, str, "content-type")
    return (
        fields,
        max(expiry, 0),
        None if group is None else str(group),
        None if content_type is None else str(content_type),
    )


# ---------------------------------------------------------------- core → AMQP


def _encode_header(durable: bool, priority: int, ttl: int, count: int) -> bytes:
    fields: list[Any] = [
        True if durable else None,
        None if priority == DEFAULT_PRIORITY else UByte(priority),
        UInt(ttl) if ttl else None,
        None,
        UInt(count) if count else None,
    ]
    while fields and fields[-1] is None:
        fields.pop()  # trailing defaults are left out
    return b"\x00\x53\x70" + encode(fields) if fields else b""


_HEADERS: Final = {(durable, p): _encode_header(durable, p, 0, 0) for durable in (False, True) for p in range(10)}


# Header sections as we (and most peers) write them, to the (durable, priority) they give.
_HEADER_FIELDS: Final = {encoded: fields for fields, encoded in _HEADERS.items() if encoded} | {
    b"\x00\x53\x70\x45": (False, DEFAULT_PRIORITY)
}


def _header(message: WireMessage, delivery_count: int, now_ms: int) -> bytes:
    expiration = message[M_EXPIRATION]
    if not expiration and delivery_count <= 1:
        cached = _HEADERS.get((message[M_DURABLE], message[M_PRIORITY]))
        if cached is not None:
            return cached
    ttl = min(max(expiration - now_ms, 1), _MAX_UINT) if expiration else 0
    return _encode_header(message[M_DURABLE], message[M_PRIORITY], ttl, max(delivery_count - 1, 0))


def _data(body: bytes) -> bytes:
    n = len(body)
    if n < 256:
        return b"\x00\x53\x75\xa0" + n.to_bytes(1, "big") + body
    return b"\x00\x53\x75\xb0" + _U32.pack(n) + body


def _map(count: int, body: bytes) -> bytes:
    size = len(body) + 1
    if size < 256 and count < 256:
        return bytes((0xC1, size, count)) + body
    return b"\xd1" + _U32X2.pack(size + 3, count) + body


def _core_annotations(props: dict[str, Any]) -> dict[str, Any] | None:
    """The ``_AMQ_*`` properties as annotations (``_AMQ_ORIG_ADDRESS`` → ``x-opt-ORIG-ADDRESS``), or None."""
    found = None
    for name, value in props.items():
        if name.startswith(CORE_PREFIX):
            found = found or {}
            found["x-opt-" + name[len(CORE_PREFIX) :].replace("_", "-")] = value
    return found


def _annotations(kept: bytes | None, extra: dict[str, Any]) -> bytes:
    """A message-annotations section: the kept one with ``extra`` added (replacing the same keys), leaving
    the bytes of the other entries as they were."""
    pairs: list[bytes] = []
    if kept:
        _, value, _ = _section(kept, 0)
        if kept[value] == 0xC1:
            count = kept[value + 2]
            pos = value + 3
        else:
            count = _U32X2.unpack_from(kept, value + 1)[1]
            pos = value + 9
        for _ in range(count // 2):
            after_key = skip(kept, pos)
            end = skip(kept, after_key)
            if decode(kept, pos)[0] not in extra:
                pairs.append(kept[pos:end])
            pos = end
    for name, v in extra.items():
        pairs.append(encode(Symbol(name)) + encode(v))
    return b"\x00\x53\x72" + _map(2 * len(pairs), b"".join(pairs))


def to_amqp(message: WireMessage, delivery_count: int, now_ms: int) -> bytes:
    """The bytes of the transfer delivering ``message`` for the ``delivery_count``-th time (from 1)."""
    header = _header(message, delivery_count, now_ms)
    props: dict[str, Any] = message[M_PROPS]
    body: bytes = message[M_BODY]
    if message[M_PROTOCOL] != PROTOCOL:
        return header + _foreign(message, props, body)
    if not props:
        return header + _data(body)  # the common case: a plain data message
    extra = _core_annotations(props)
    annotations = (
        props.get(ENC_MESSAGE_ANNOTATIONS, b"")
        if extra is None
        else _annotations(props.get(ENC_MESSAGE_ANNOTATIONS), extra)
    )
    kind = props.get(ENC_BODY)
    if kind is None:
        sections = _data(body)
    elif kind == BODY_ENCODED:
        sections = body
    elif kind == BODY_STRING:
        sections = (
            _VALUE
            + (b"\xa1" + len(body).to_bytes(1, "big") if len(body) < 256 else b"\xb1" + _U32.pack(len(body)))
            + body
        )
    elif kind == BODY_BINARY:
        sections = _VALUE + encode(body)
    elif kind == BODY_NONE:
        sections = b""
    else:
        sections = _data(body)
    return b"".join(
        (
            header,
            annotations,
            props.get(ENC_PROPERTIES, b""),
            props.get(ENC_APPLICATION_PROPERTIES, b""),
            sections,
            props.get(ENC_FOOTER, b""),
        )
    )


def _foreign(message: WireMessage, props: dict[str, Any], body: bytes) -> bytes:
    """Annotations, properties, application properties and body of a message another protocol sent."""
    moved: set[str] = set()
    reply_to = props.get(REPLY_TO)
    if type(reply_to) is str:
        moved.add(REPLY_TO)
    else:
        reply_to = props.get(MQTT_RESPONSE_TOPIC)
        if type(reply_to) is str:
            moved.add(MQTT_RESPONSE_TOPIC)
        else:
            reply_to = None
    correlation = props.get(CORRELATION_ID)
    if type(correlation) is str or type(correlation) is bytes:
        moved.add(CORRELATION_ID)
    elif type(correlation) is int and 0 <= correlation <= 0xFFFFFFFFFFFFFFFF:
        correlation = ULong(correlation)
        moved.add(CORRELATION_ID)
    else:
        correlation = props.get(MQTT_CORRELATION_DATA)
        if type(correlation) is bytes:
            moved.add(MQTT_CORRELATION_DATA)
        else:
            correlation = None
    subject = props.get(SUBJECT)
    if type(subject) is str:
        moved.add(SUBJECT)
    else:
        subject = None
    content_type = message[M_CONTENT_TYPE]
    expiration = message[M_EXPIRATION]
    timestamp = message[M_TIMESTAMP]
    fields = [
        ULong(message[M_ID]),
        None,
        message[M_ADDRESS],
        subject,
        reply_to,
        correlation,
        None if content_type is None else Symbol(content_type),
        None,
        Timestamp(expiration) if expiration else None,
        Timestamp(timestamp) if timestamp else None,
        message[M_GROUP],
    ]
    while fields[-1] is None:
        fields.pop()
    properties = b"\x00\x53\x73" + encode(fields)
    if not props:
        return properties + _data(body)
    extra = _core_annotations(props)
    annotations = b"" if extra is None else _annotations(None, extra)
    application = {
        name: (str(value) if type(value) is int and not -(2**63) <= value < 2**63 else value)
        for name, value in props.items()
        if name not in moved and not name.startswith((ENCODING_PREFIX, CORE_PREFIX))
    }
    application_section = b"\x00\x53\x74" + encode(application) if application else b""
    return annotations + properties + application_section + _data(body)
