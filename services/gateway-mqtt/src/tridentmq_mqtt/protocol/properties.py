"""MQTT 5 properties, and the wire primitives they share with the packets: two- and four-byte integers, the
variable byte integer, UTF-8 strings and binary data, each prefixed by a two-byte length.

Readers take ``(data, pos, end)`` and return ``(value, new_pos)``; ``end`` bounds the enclosing structure, so
a length reaching past it is a Malformed Packet rather than a read into the next packet.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from tridentmq_mqtt.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_mqtt.protocol.reason_codes import MALFORMED_PACKET, PROTOCOL_ERROR, TOPIC_ALIAS_INVALID

U16: Final = struct.Struct(">H")
U32: Final = struct.Struct(">I")
VBI_MAX: Final = 268_435_455  # four bytes of seven bits
_VBI_SMALL: Final = tuple(bytes((n,)) for n in range(128))

# Packet types (the high nibble of the first byte). 0 is reserved, so it stands for "will properties" here.
WILL: Final = 0
CONNECT: Final = 1
CONNACK: Final = 2
PUBLISH: Final = 3
PUBACK: Final = 4
PUBREC: Final = 5
PUBREL: Final = 6
PUBCOMP: Final = 7
SUBSCRIBE: Final = 8
SUBACK: Final = 9
UNSUBSCRIBE: Final = 10
UNSUBACK: Final = 11
PINGREQ: Final = 12
PINGRESP: Final = 13
DISCONNECT: Final = 14
AUTH: Final = 15


# ---------------------------------------------------------------------------------------------------- primitives
def malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(message, MALFORMED_PACKET)


def encode_vbi(value: int) -> bytes:
    if value < 128:
        if value < 0:
            raise LocalProtocolError(f"variable byte integer {value} is negative")
        return _VBI_SMALL[value]
    if value > VBI_MAX:
        raise LocalProtocolError(f"variable byte integer {value} exceeds {VBI_MAX}")
    out = bytearray()
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_vbi(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = 0
    for shift in (0, 7, 14, 21):
        if pos >= end:
            raise malformed("variable byte integer runs past its end")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise malformed("variable byte integer longer than four bytes")


def read_u16(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos + 2 > end:
        raise malformed("two-byte integer runs past its end")
    return U16.unpack_from(data, pos)[0], pos + 2


def read_bin(data: bytes, pos: int, end: int) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise malformed("length of binary data runs past its end")
    stop = pos + 2 + U16.unpack_from(data, pos)[0]
    if stop > end:
        raise malformed("binary data runs past its end")
    return data[pos + 2 : stop], stop


def read_str(data: bytes, pos: int, end: int) -> tuple[str, int]:
    if pos + 2 > end:
        raise malformed("length of a string runs past its end")
    stop = pos + 2 + U16.unpack_from(data, pos)[0]
    if stop > end:
        raise malformed("string runs past its end")
    return decode_utf8(data[pos + 2 : stop]), stop


def decode_utf8(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")  # strict: also refuses encoded surrogates, as [MQTT-1.5.4-1] asks
    except UnicodeDecodeError:
        raise malformed("string is not well-formed UTF-8") from None
    if "\x00" in text:
        raise malformed("string contains U+0000")
    return text


def encode_bin(value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise LocalProtocolError(f"binary data of {len(value)} bytes exceeds 65535")
    return U16.pack(len(value)) + value


def encode_str(value: str) -> bytes:
    raw = value.encode("utf-8")  # refuses lone surrogates
    if len(raw) > 0xFFFF:
        raise LocalProtocolError(f"string of {len(raw)} bytes exceeds 65535")
    if b"\x00" in raw:
        raise LocalProtocolError("string contains U+0000")
    return U16.pack(len(raw)) + raw


# ---------------------------------------------------------------------------------------------------- properties
@dataclass(frozen=True, slots=True, repr=False)
class Properties:
    """The MQTT 5 properties of a packet (or of a will); ``None`` or ``()`` means absent. Before 5.0 always
    empty."""

    payload_format_indicator: int | None = None  # 0 bytes, 1 UTF-8
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()  # several in a PUBLISH, at most one in a SUBSCRIBE
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: bool | None = None
    will_delay_interval: int | None = None
    request_response_information: bool | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: bool | None = None
    user_properties: tuple[tuple[str, str], ...] = ()  # order matters and names may repeat
    maximum_packet_size: int | None = None
    wildcard_subscription_available: bool | None = None
    subscription_identifier_available: bool | None = None
    shared_subscription_available: bool | None = None

    def __repr__(self) -> str:  # only what is present: 27 fields of None drown the rest
        fields = ", ".join(
            f"{spec.name}={getattr(self, spec.name)!r}"
            for spec in PROPERTY_SPECS.values()
            if getattr(self, spec.name) not in (None, ())
        )
        return f"Properties({fields})"


NO_PROPERTIES: Final = Properties()

# Value kinds on the wire.
BYTE: Final = "byte"  # 0 or 1, kept as int
FLAG: Final = "flag"  # 0 or 1, kept as bool
TWO: Final = "u16"
FOUR: Final = "u32"
VBI: Final = "vbi"
STRING: Final = "string"
BINARY: Final = "binary"
PAIR: Final = "pair"


class PropertySpec(NamedTuple):
    name: str  # the Properties field
    kind: str
    allowed: frozenset[int]  # packet types (WILL for the will properties of a CONNECT)
    nonzero: bool = False  # zero is a Protocol Error...
    zero_reason: int = PROTOCOL_ERROR  # ...answered with this reason code


def _types(*types: int) -> frozenset[int]:
    return frozenset(types)


_PUB = _types(PUBLISH, WILL)
_REASON_STRING = _types(CONNACK, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK, DISCONNECT, AUTH)

#: Section 2.2.2.2 of MQTT 5.0, by identifier.
PROPERTY_SPECS: Final[dict[int, PropertySpec]] = {
    0x01: PropertySpec("payload_format_indicator", BYTE, _PUB),
    0x02: PropertySpec("message_expiry_interval", FOUR, _PUB),
    0x03: PropertySpec("content_type", STRING, _PUB),
    0x08: PropertySpec("response_topic", STRING, _PUB),
    0x09: PropertySpec("correlation_data", BINARY, _PUB),
    0x0B: PropertySpec("subscription_identifiers", VBI, _types(PUBLISH, SUBSCRIBE), nonzero=True),
    0x11: PropertySpec("session_expiry_interval", FOUR, _types(CONNECT, CONNACK, DISCONNECT)),
    0x12: PropertySpec("assigned_client_identifier", STRING, _types(CONNACK)),
    0x13: PropertySpec("server_keep_alive", TWO, _types(CONNACK)),
    0x15: PropertySpec("authentication_method", STRING, _types(CONNECT, CONNACK, AUTH)),
    0x16: PropertySpec("authentication_data", BINARY, _types(CONNECT, CONNACK, AUTH)),
    0x17: PropertySpec("request_problem_information", FLAG, _types(CONNECT)),
    0x18: PropertySpec("will_delay_interval", FOUR, _types(WILL)),
    0x19: PropertySpec("request_response_information", FLAG, _types(CONNECT)),
    0x1A: PropertySpec("response_information", STRING, _types(CONNACK)),
    0x1C: PropertySpec("server_reference", STRING, _types(CONNACK, DISCONNECT)),
    0x1F: PropertySpec("reason_string", STRING, _REASON_STRING),
    0x21: PropertySpec("receive_maximum", TWO, _types(CONNECT, CONNACK), nonzero=True),
    0x22: PropertySpec("topic_alias_maximum", TWO, _types(CONNECT, CONNACK)),
    # "A Topic Alias value of 0 or greater than the Maximum Topic Alias is a Protocol Error, the receiver uses
    # DISCONNECT with Reason Code of 0x94 (Topic Alias invalid)" (5.0, 3.3.4; [MQTT-3.3.2-8]).
    0x23: PropertySpec("topic_alias", TWO, _types(PUBLISH), nonzero=True, zero_reason=TOPIC_ALIAS_INVALID),
    0x24: PropertySpec("maximum_qos", BYTE, _types(CONNACK)),
    0x25: PropertySpec("retain_available", FLAG, _types(CONNACK)),
    0x26: PropertySpec("user_properties", PAIR, _REASON_STRING | _PUB | _types(CONNECT, SUBSCRIBE, UNSUBSCRIBE)),
    0x27: PropertySpec("maximum_packet_size", FOUR, _types(CONNECT, CONNACK), nonzero=True),
    0x28: PropertySpec("wildcard_subscription_available", FLAG, _types(CONNACK)),
    0x29: PropertySpec("subscription_identifier_available", FLAG, _types(CONNACK)),
    0x2A: PropertySpec("shared_subscription_available", FLAG, _types(CONNACK)),
}
_REPEATABLE: Final = frozenset({0x0B, 0x26})  # kept as tuples


def decode_properties(data: bytes, pos: int, end: int, packet_type: int) -> tuple[Properties, int]:
    """Read a property length and the properties it covers."""
    length, pos = read_vbi(data, pos, end)
    stop = pos + length
    if stop > end:
        raise malformed("properties run past the end of the packet")
    if not length:
        return NO_PROPERTIES, pos
    values: dict[str, Any] = {}
    subscription_ids: list[int] = []
    user: list[tuple[str, str]] = []
    while pos < stop:
        ident = data[pos]  # a one-byte variable byte integer for every defined identifier
        spec = PROPERTY_SPECS.get(ident)
        if spec is None or packet_type not in spec.allowed:
            raise malformed(f"property 0x{ident:02x} is not valid in packet type {packet_type}")
        value, pos = _read_value(data, pos + 1, stop, spec)
        if ident == 0x26:
            user.append(value)
        elif ident == 0x0B and (packet_type == PUBLISH or not subscription_ids):
            subscription_ids.append(value)
        elif spec.name in values or ident == 0x0B:
            raise RemoteProtocolError(f"property 0x{ident:02x} ({spec.name}) repeated", PROTOCOL_ERROR)
        else:
            values[spec.name] = value
    if user:
        values["user_properties"] = tuple(user)
    if subscription_ids:
        values["subscription_identifiers"] = tuple(subscription_ids)
    return Properties(**values), stop


def _read_value(data: bytes, pos: int, end: int, spec: PropertySpec) -> tuple[Any, int]:
    kind = spec.kind
    value: Any
    if kind in (BYTE, FLAG):
        if pos >= end:
            raise malformed(f"property {spec.name} runs past the properties")
        value = data[pos]
        if value > 1:
            raise RemoteProtocolError(f"property {spec.name} must be 0 or 1, not {value}", PROTOCOL_ERROR)
        return (bool(value) if kind == FLAG else value), pos + 1
    if kind == TWO:
        value, pos = read_u16(data, pos, end)
    elif kind == FOUR:
        if pos + 4 > end:
            raise malformed(f"property {spec.name} runs past the properties")
        value, pos = U32.unpack_from(data, pos)[0], pos + 4
    elif kind == VBI:
        value, pos = read_vbi(data, pos, end)
    elif kind == STRING:
        return read_str(data, pos, end)
    elif kind == BINARY:
        return read_bin(data, pos, end)
    else:
        name, pos = read_str(data, pos, end)
        text, pos = read_str(data, pos, end)
        return (name, text), pos
    if spec.nonzero and value == 0:
        raise RemoteProtocolError(f"property {spec.name} must not be 0", spec.zero_reason)
    return value, pos


def encode_properties(props: Properties, packet_type: int) -> bytes:
    """The property length and the properties, in identifier order."""
    if props is NO_PROPERTIES:
        return b"\x00"
    out = bytearray()
    for ident, spec in PROPERTY_SPECS.items():
        value = getattr(props, spec.name)
        if value is None or value == ():
            continue
        if packet_type not in spec.allowed:
            raise LocalProtocolError(f"property {spec.name} is not valid in packet type {packet_type}")
        if ident not in _REPEATABLE:
            out += _encode_value(ident, spec, value)
            continue
        if ident == 0x0B and packet_type != PUBLISH and len(value) > 1:
            raise LocalProtocolError("a SUBSCRIBE carries at most one subscription identifier")
        for item in value:
            out += _encode_value(ident, spec, item)
    return encode_vbi(len(out)) + out


def _encode_value(ident: int, spec: PropertySpec, value: Any) -> bytes:
    kind = spec.kind
    head = _VBI_SMALL[ident]
    if kind in (BYTE, FLAG):
        if value not in (0, 1):
            raise LocalProtocolError(f"property {spec.name} must be 0 or 1")
        return bytes((ident, int(value)))
    if kind == STRING:
        return head + encode_str(value)
    if kind == BINARY:
        return head + encode_bin(value)
    if kind == PAIR:
        return head + encode_str(value[0]) + encode_str(value[1])
    if spec.nonzero and value == 0:
        raise LocalProtocolError(f"property {spec.name} must not be 0")
    if kind == VBI:
        return head + encode_vbi(value)
    limit = 0xFFFF if kind == TWO else 0xFFFFFFFF
    if not 0 <= value <= limit:
        raise LocalProtocolError(f"property {spec.name} = {value} is out of range")
    return head + (U16.pack(value) if kind == TWO else U32.pack(value))
