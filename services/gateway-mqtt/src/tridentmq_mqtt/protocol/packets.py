"""MQTT control packets, their encoder and an incremental parser, for 3.1 (level 3), 3.1.1 (4) and 5.0 (5).

A packet is a fixed header (type and flags in one byte, then the remaining length as a variable byte integer
of at most four bytes), a variable header and a payload. The parser learns the version from the CONNECT,
which must come first, and reads every later packet by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar

from tridentmq_mqtt.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_mqtt.protocol.properties import (
    AUTH,
    CONNACK,
    CONNECT,
    DISCONNECT,
    NO_PROPERTIES,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    SUBSCRIBE,
    U16,
    UNSUBACK,
    UNSUBSCRIBE,
    WILL,
    Properties,
    decode_properties,
    decode_utf8,
    encode_bin,
    encode_properties,
    encode_str,
    encode_vbi,
    malformed,
    read_bin,
    read_str,
    read_u16,
)
from tridentmq_mqtt.protocol.reason_codes import (
    PACKET_TOO_LARGE,
    PROTOCOL_ERROR,
    TOPIC_NAME_INVALID,
    UNSUPPORTED_PROTOCOL_VERSION,
)

V31: Final = 3
V311: Final = 4
V5: Final = 5
VERSIONS: Final = (V31, V311, V5)
_PROTOCOL_NAMES: Final = {V31: "MQIsdp", V311: "MQTT", V5: "MQTT"}

#: The largest packet the fixed header can describe.
MAX_PACKET_SIZE: Final = 1 + 4 + 268_435_455
#: The first byte of a PUBACK; with a remaining length of 2 it is the same in every version (no reason code).
_PLAIN_PUBACK: Final = PUBACK << 4


# ---------------------------------------------------------------------------------------------------- packets
@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connect:
    client_id: str
    clean_start: bool = True  # "clean session" before 5.0
    keep_alive: int = 0
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connack:
    session_present: bool = False
    reason_code: int = 0  # the return code before 5.0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class Publish:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # exactly when qos > 0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class _Ack:
    packet_id: int
    reason_code: int = 0  # always 0 before 5.0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class Puback(_Ack):
    pass


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class Pubrec(_Ack):
    pass


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class Pubrel(_Ack):
    pass


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class Pubcomp(_Ack):
    pass


@dataclass(frozen=True, slots=True)
class Subscription:
    topic_filter: str
    qos: int = 0  # the maximum QoS
    no_local: bool = False  # this and the next two exist from 5.0 on
    retain_as_published: bool = False
    retain_handling: int = 0  # 0 send retained, 1 only for a new subscription, 2 never


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    subscriptions: tuple[Subscription, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Suback:
    packet_id: int
    reason_codes: tuple[int, ...]  # granted QoS, or a failure code, per subscription
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: tuple[str, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsuback:
    packet_id: int
    reason_codes: tuple[int, ...] = ()  # one per filter in 5.0, none before
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Pingreq:
    pass


@dataclass(frozen=True, slots=True)
class Pingresp:
    pass


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason_code: int = 0  # 5.0 only; the client's DISCONNECT is always 0 before
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Auth:  # 5.0 only
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


Packet = (
    Connect
    | Connack
    | Publish
    | Puback
    | Pubrec
    | Pubrel
    | Pubcomp
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | Pingreq
    | Pingresp
    | Disconnect
    | Auth
)


# ---------------------------------------------------------------------------------------------------- encoding
def encode(packet: Packet, version: int) -> bytes:
    """The bytes of ``packet`` in protocol ``version`` (3, 4 or 5). Raises ``LocalProtocolError`` for what
    that version cannot carry or the protocol forbids."""
    if version not in VERSIONS:
        raise LocalProtocolError(f"unknown protocol version {version}")
    if type(packet) is Publish:  # the hot path, first
        return _encode_publish(packet, version)
    encoder = _ENCODERS.get(type(packet))
    if encoder is None:
        raise LocalProtocolError(f"not an MQTT packet: {packet!r}")
    return encoder(packet, version)


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_vbi(len(body)) + body


def _props(props: Properties, packet_type: int, version: int) -> bytes:
    if version == V5:
        return encode_properties(props, packet_type)
    if props is not NO_PROPERTIES and props != NO_PROPERTIES:
        raise LocalProtocolError(f"properties need MQTT 5, not level {version}")
    return b""


def _qos(qos: int) -> int:
    if qos not in (0, 1, 2):
        raise LocalProtocolError(f"QoS {qos} is not 0, 1 or 2")
    return qos


def _packet_id(packet_id: int | None) -> bytes:
    if packet_id is None or not 0 < packet_id <= 0xFFFF:
        raise LocalProtocolError(f"packet identifier {packet_id} is not in 1..65535")
    return U16.pack(packet_id)


def _u8(value: int, what: str) -> bytes:
    if not 0 <= value <= 0xFF:
        raise LocalProtocolError(f"{what} {value} is not a byte")
    return bytes((value,))


def _check_topic_name(topic: str, version: int, props: Properties) -> None:
    if "+" in topic or "#" in topic:
        raise LocalProtocolError(f"topic name {topic!r} contains a wildcard")
    if not topic and (version != V5 or props.topic_alias is None):
        raise LocalProtocolError("an empty topic name needs a topic alias (MQTT 5)")


def _encode_connect(packet: Connect, version: int) -> bytes:
    will = packet.will
    flags = 0x02 if packet.clean_start else 0
    tail = b""
    if will is not None:
        _check_topic_name(will.topic, V311, NO_PROPERTIES)
        flags |= 0x04 | _qos(will.qos) << 3 | (0x20 if will.retain else 0)
        tail = _props(will.properties, WILL, version) + encode_str(will.topic) + encode_bin(will.payload)
    if packet.username is not None:
        flags |= 0x80
        tail += encode_str(packet.username)
    if packet.password is not None:
        if packet.username is None and version != V5:
            raise LocalProtocolError("a password needs a user name before MQTT 5")
        flags |= 0x40
        tail += encode_bin(packet.password)
    if not 0 <= packet.keep_alive <= 0xFFFF:
        raise LocalProtocolError(f"keep-alive {packet.keep_alive} is not in 0..65535")
    body = (
        encode_str(_PROTOCOL_NAMES[version])
        + bytes((version, flags))
        + U16.pack(packet.keep_alive)
        + _props(packet.properties, CONNECT, version)
        + encode_str(packet.client_id)
        + tail
    )
    return _frame(0x10, body)


def _encode_connack(packet: Connack, version: int) -> bytes:
    if packet.session_present and version == V31:
        raise LocalProtocolError("MQTT 3.1 has no session-present flag")
    body = bytes((1 if packet.session_present else 0,)) + _u8(packet.reason_code, "reason code")
    return _frame(0x20, body + _props(packet.properties, CONNACK, version))


def encode_topic(topic: str) -> bytes:
    """A topic name as a PUBLISH carries it (length-prefixed UTF-8), for ``encode_plain_publish``."""
    _check_topic_name(topic, V311, NO_PROPERTIES)
    return encode_str(topic)


def encode_plain_publish(
    encoded_topic: bytes,
    payload: bytes,
    version: int,
    qos: int = 0,
    packet_id: int | None = None,
    *,
    dup: bool = False,
    retain: bool = False,
) -> bytes:
    """A PUBLISH without properties from a topic encoded once by ``encode_topic``: the bytes ``encode(Publish(
    topic, payload, qos, retain, dup, packet_id), version)`` gives, without a packet object per message."""
    head = encoded_topic + _packet_id(packet_id) if qos and packet_id is not None else encoded_topic
    if version == V5:
        head += b"\x00"
    first = 0x30 | (0x08 if dup else 0) | qos << 1 | (0x01 if retain else 0)
    size = len(head) + len(payload)
    fixed = bytes((first, size)) if size < 128 else bytes((first,)) + encode_vbi(size)  # a one-byte size: most
    return b"".join((fixed, head, payload))


def _encode_publish(packet: Publish, version: int) -> bytes:
    qos = packet.qos
    props = packet.properties
    _check_topic_name(packet.topic, version, props)
    if qos:
        head = encode_str(packet.topic) + _packet_id(packet.packet_id)
    elif packet.packet_id is not None or packet.dup:
        raise LocalProtocolError("a QoS 0 PUBLISH has no packet identifier and no DUP flag")
    else:
        head = encode_str(packet.topic)
    if version == V5:
        head += b"\x00" if props is NO_PROPERTIES else encode_properties(props, PUBLISH)
    elif props is not NO_PROPERTIES and props != NO_PROPERTIES:
        raise LocalProtocolError(f"properties need MQTT 5, not level {version}")
    first = 0x30 | (0x08 if packet.dup else 0) | _qos(qos) << 1 | (0x01 if packet.retain else 0)
    payload = packet.payload
    return bytes((first,)) + encode_vbi(len(head) + len(payload)) + head + payload


_ACK_TYPES: Final = {Puback: PUBACK, Pubrec: PUBREC, Pubrel: PUBREL, Pubcomp: PUBCOMP}


def _encode_ack(packet: _Ack, version: int) -> bytes:
    packet_type = _ACK_TYPES[type(packet)]
    first = packet_type << 4 | (0x02 if packet_type == PUBREL else 0)
    body = _packet_id(packet.packet_id)
    return _frame(first, body + _reason_and_props(packet.reason_code, packet.properties, packet_type, version))


def _reason_and_props(reason_code: int, props: Properties, packet_type: int, version: int) -> bytes:
    """5.0 leaves out a trailing success code and empty properties; before 5.0 neither exists."""
    if version != V5:
        if reason_code:
            raise LocalProtocolError(f"reason code 0x{reason_code:02x} needs MQTT 5")
        return _props(props, packet_type, version)
    if props is NO_PROPERTIES or props == NO_PROPERTIES:
        return _u8(reason_code, "reason code") if reason_code else b""
    return _u8(reason_code, "reason code") + encode_properties(props, packet_type)


def _encode_subscribe(packet: Subscribe, version: int) -> bytes:
    if not packet.subscriptions:
        raise LocalProtocolError("a SUBSCRIBE needs at least one topic filter")
    out = bytearray(_packet_id(packet.packet_id) + _props(packet.properties, SUBSCRIBE, version))
    for sub in packet.subscriptions:
        options = _qos(sub.qos)
        if version == V5:
            if sub.retain_handling not in (0, 1, 2):
                raise LocalProtocolError(f"retain handling {sub.retain_handling} is not 0, 1 or 2")
            options |= (0x04 if sub.no_local else 0) | (0x08 if sub.retain_as_published else 0)
            options |= sub.retain_handling << 4
        elif sub.no_local or sub.retain_as_published or sub.retain_handling:
            raise LocalProtocolError("subscription options beyond QoS need MQTT 5")
        out += encode_str(sub.topic_filter) + bytes((options,))
    return _frame(0x82, bytes(out))


def _encode_suback(packet: Suback, version: int) -> bytes:
    codes = b"".join(_u8(code, "reason code") for code in packet.reason_codes)
    return _frame(0x90, _packet_id(packet.packet_id) + _props(packet.properties, SUBACK, version) + codes)


def _encode_unsubscribe(packet: Unsubscribe, version: int) -> bytes:
    if not packet.topic_filters:
        raise LocalProtocolError("an UNSUBSCRIBE needs at least one topic filter")
    filters = b"".join(encode_str(topic_filter) for topic_filter in packet.topic_filters)
    return _frame(0xA2, _packet_id(packet.packet_id) + _props(packet.properties, UNSUBSCRIBE, version) + filters)


def _encode_unsuback(packet: Unsuback, version: int) -> bytes:
    if version != V5 and packet.reason_codes:
        raise LocalProtocolError("UNSUBACK reason codes need MQTT 5")
    codes = b"".join(_u8(code, "reason code") for code in packet.reason_codes)
    return _frame(0xB0, _packet_id(packet.packet_id) + _props(packet.properties, UNSUBACK, version) + codes)


def _encode_pingreq(packet: Pingreq, version: int) -> bytes:
    return b"\xc0\x00"


def _encode_pingresp(packet: Pingresp, version: int) -> bytes:
    return b"\xd0\x00"


def _encode_disconnect(packet: Disconnect, version: int) -> bytes:
    return _frame(0xE0, _reason_and_props(packet.reason_code, packet.properties, DISCONNECT, version))


def _encode_auth(packet: Auth, version: int) -> bytes:
    if version != V5:
        raise LocalProtocolError("AUTH needs MQTT 5")
    return _frame(0xF0, _reason_and_props(packet.reason_code, packet.properties, AUTH, version))


_ENCODERS: Final[dict[type, Callable[..., bytes]]] = {
    Connect: _encode_connect,
    Connack: _encode_connack,
    Puback: _encode_ack,
    Pubrec: _encode_ack,
    Pubrel: _encode_ack,
    Pubcomp: _encode_ack,
    Subscribe: _encode_subscribe,
    Suback: _encode_suback,
    Unsubscribe: _encode_unsubscribe,
    Unsuback: _encode_unsuback,
    Pingreq: _encode_pingreq,
    Pingresp: _encode_pingresp,
    Disconnect: _encode_disconnect,
    Auth: _encode_auth,
}


# ---------------------------------------------------------------------------------------------------- decoding
class PacketParser:
    """Bytes in, packets out. With ``version=None`` (a server) the first packet must be a CONNECT, which sets
    ``version``; a given ``version`` reads packets of that version from the start (a client, or a test).

    Bad input raises ``RemoteProtocolError``, but only once the packets before it have been returned: then
    the next call raises. The parser stays failed."""

    __slots__ = ("_awaiting_connect", "_buffer", "_connect_seen", "_failure", "_needed", "_version", "max_packet_size")

    def __init__(self, version: int | None = None, max_packet_size: int = MAX_PACKET_SIZE) -> None:
        if version is not None and version not in VERSIONS:
            raise LocalProtocolError(f"unknown protocol version {version}")
        self._version = version
        self._awaiting_connect = version is None
        self._connect_seen = False
        self.max_packet_size = max_packet_size
        self._buffer = bytearray()  # the start of an incomplete packet
        self._needed = 0  # how many bytes that packet has in all, once its fixed header is known
        # What the first violation was (not the exception: its traceback holds this parser's frame, and so this
        # parser, which would hold it: a cycle only the cyclic collector frees, with the session around it).
        self._failure: tuple[str, int] | None = None

    @property
    def version(self) -> int | None:
        """The protocol level (3, 4 or 5); ``None`` until the CONNECT has been read."""
        return self._version

    def feed(self, data: bytes) -> list[Packet]:
        if self._failure is not None:
            raise RemoteProtocolError(*self._failure)
        buffer = self._buffer
        if buffer:
            buffer += data
            if len(buffer) < self._needed:
                return []  # a large packet arriving in pieces is not re-parsed, nor copied, per piece
            data = bytes(buffer)
            buffer.clear()
        elif type(data) is not bytes:
            data = bytes(data)
        packets: list[Packet] = []
        try:
            pos = self._parse(data, packets)
        except RemoteProtocolError as exc:
            self._failure = (exc.message, exc.reason_code)
            if not packets:
                raise
            return packets
        if pos < len(data):
            buffer += memoryview(data)[pos:]
        return packets

    def _parse(self, data: bytes, packets: list[Packet]) -> int:
        """Append the complete packets at the start of ``data`` to ``packets``; return how far they reach."""
        pos = 0
        end = len(data)
        self._needed = 0
        while pos < end:
            first = data[pos]
            if self._awaiting_connect and first >> 4 != CONNECT:
                raise RemoteProtocolError("the first packet must be a CONNECT", PROTOCOL_ERROR)
            # The remaining length, inlined: this loop runs once per packet.
            length = 0
            index = pos + 1
            for shift in (0, 7, 14, 21):
                if index >= end:
                    return pos
                byte = data[index]
                index += 1
                length |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
            else:
                raise malformed("remaining length longer than four bytes")
            stop = index + length
            if stop - pos > self.max_packet_size:  # refused before the rest is buffered
                raise RemoteProtocolError(
                    f"packet of {stop - pos} bytes exceeds {self.max_packet_size}", PACKET_TOO_LARGE
                )
            if stop > end:
                self._needed = stop - pos
                return pos
            if first == _PLAIN_PUBACK and length == 2:  # a subscriber's PUBACK: one per message it takes
                packet_id = data[index] << 8 | data[index + 1]
                if not packet_id:
                    raise malformed("packet identifier 0")
                packets.append(Puback(packet_id))
            else:
                packets.append(self._decode(first, data, index, stop))
            pos = stop
        return pos

    def _decode(self, first: int, data: bytes, pos: int, end: int) -> Packet:
        packet_type = first >> 4
        if packet_type == CONNECT:
            return self._decode_connect(first, data, pos, end)
        version = self._version
        assert version is not None  # set by the constructor or the CONNECT
        if packet_type == PUBLISH:
            return _decode_publish(first & 0x0F, data, pos, end, version)
        decoder = _DECODERS[packet_type]
        if decoder is None or (packet_type == AUTH and version != V5):
            raise malformed(f"reserved packet type {packet_type}")
        _check_flags(first, version)
        return decoder(data, pos, end, version)

    def _decode_connect(self, first: int, data: bytes, pos: int, end: int) -> Connect:
        if first != 0x10:
            raise malformed(f"reserved flags 0x{first & 0x0F:x} in CONNECT")
        if self._connect_seen:
            raise RemoteProtocolError("a second CONNECT", PROTOCOL_ERROR)
        version, pos = _read_protocol(data, pos, end)
        if self._version is not None and version != self._version:
            raise RemoteProtocolError(
                f"CONNECT of level {version} on a level {self._version} parser", UNSUPPORTED_PROTOCOL_VERSION
            )
        packet = _decode_connect_body(data, pos, end, version)
        self._version = version
        self._connect_seen = True
        self._awaiting_connect = False
        return packet


_FLAGS_0010: Final = frozenset({PUBREL, SUBSCRIBE, UNSUBSCRIBE})


def _check_flags(first: int, version: int) -> None:
    """Fixed-header flags other than PUBLISH's are fixed: 0b0010 for PUBREL, SUBSCRIBE and UNSUBSCRIBE, else 0."""
    flags = first & 0x0F
    if first >> 4 in _FLAGS_0010:
        # 3.1 sent these at QoS 1 and set DUP on a retry, so 3.1 clients may set that bit.
        if flags == 0x02 or (version == V31 and flags == 0x0A):
            return
    elif not flags:
        return
    raise malformed(f"reserved flags 0x{flags:x} in packet type {first >> 4}")


def _read_protocol(data: bytes, pos: int, end: int) -> tuple[int, int]:
    name, pos = read_str(data, pos, end)
    if pos >= end:
        raise malformed("CONNECT ends before the protocol level")
    level = data[pos]
    if name not in ("MQTT", "MQIsdp"):
        raise RemoteProtocolError(f"unknown protocol name {name[:20]!r}", UNSUPPORTED_PROTOCOL_VERSION)
    if level not in VERSIONS or _PROTOCOL_NAMES[level] != name:
        raise RemoteProtocolError(f"unsupported protocol {name!r} level {level}", UNSUPPORTED_PROTOCOL_VERSION)
    return level, pos + 1


def _decode_connect_body(data: bytes, pos: int, end: int, version: int) -> Connect:
    if pos + 3 > end:
        raise malformed("CONNECT ends inside its variable header")
    flags = data[pos]
    keep_alive = U16.unpack_from(data, pos + 1)[0]
    pos += 3
    if flags & 0x01:
        raise malformed("reserved CONNECT flag set")
    will_qos = flags >> 3 & 0x03
    if will_qos == 3:
        raise malformed("will QoS 3")
    if not flags & 0x04 and flags & 0x38:
        raise malformed("will QoS or will retain without a will")
    if flags & 0x40 and not flags & 0x80 and version != V5:
        raise malformed("password flag without user name flag")
    props = NO_PROPERTIES
    if version == V5:
        props, pos = decode_properties(data, pos, end, CONNECT)
    client_id, pos = read_str(data, pos, end)
    will = None
    if flags & 0x04:
        will, pos = _decode_will(data, pos, end, version, will_qos, bool(flags & 0x20))
    username = password = None
    if flags & 0x80:
        username, pos = read_str(data, pos, end)
    if flags & 0x40:
        password, pos = read_bin(data, pos, end)
    if pos != end:
        raise malformed("bytes after the CONNECT payload")
    return Connect(client_id, bool(flags & 0x02), keep_alive, username, password, will, props)


def _decode_will(data: bytes, pos: int, end: int, version: int, qos: int, retain: bool) -> tuple[Will, int]:
    props = NO_PROPERTIES
    if version == V5:
        props, pos = decode_properties(data, pos, end, WILL)
    if props is not NO_PROPERTIES:
        _check_response_topic(props)
    topic, pos = read_str(data, pos, end)
    _check_received_topic(topic, version, NO_PROPERTIES)
    payload, pos = read_bin(data, pos, end)
    return Will(topic, payload, qos, retain, props), pos


def _check_received_topic(topic: str, version: int, props: Properties) -> None:
    if "+" in topic or "#" in topic:
        raise RemoteProtocolError(f"wildcard in topic name {topic[:40]!r}", TOPIC_NAME_INVALID)
    if not topic and (version != V5 or props.topic_alias is None):
        raise RemoteProtocolError("empty topic name without a topic alias", TOPIC_NAME_INVALID)


def _check_response_topic(props: Properties) -> None:
    """A response topic is a topic name: not empty and without wildcards ([MQTT-3.3.2-14]). A responder would
    otherwise publish to it and have its own connection ended for a topic name it did not choose."""
    topic = props.response_topic
    if topic is not None and (not topic or "+" in topic or "#" in topic):
        raise RemoteProtocolError(f"response topic {topic[:40]!r} is not a topic name", PROTOCOL_ERROR)


def _decode_publish(flags: int, data: bytes, pos: int, end: int, version: int) -> Publish:
    qos = flags >> 1 & 0x03
    if qos == 3:
        raise malformed("PUBLISH with QoS 3")
    dup = flags >= 0x08
    if dup and not qos:
        raise malformed("PUBLISH with DUP at QoS 0")
    if pos + 2 > end:
        raise malformed("PUBLISH ends before its topic name")
    stop = pos + 2 + U16.unpack_from(data, pos)[0]
    if stop > end:
        raise malformed("topic name runs past the PUBLISH")
    topic = decode_utf8(data[pos + 2 : stop])
    pos = stop
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise malformed("PUBLISH ends before its packet identifier")
        packet_id = U16.unpack_from(data, pos)[0]
        if not packet_id:
            raise malformed("packet identifier 0")
        pos += 2
    props = NO_PROPERTIES
    if version == V5:
        if pos < end and data[pos] == 0:  # no properties: the common case
            pos += 1
        else:
            props, pos = decode_properties(data, pos, end, PUBLISH)
            _check_response_topic(props)
    if "+" in topic or "#" in topic or not topic:
        _check_received_topic(topic, version, props)
    return Publish(topic, data[pos:end], qos, bool(flags & 0x01), dup, packet_id, props)


def _read_packet_id(data: bytes, pos: int, end: int) -> tuple[int, int]:
    packet_id, pos = read_u16(data, pos, end)
    if not packet_id:
        raise malformed("packet identifier 0")
    return packet_id, pos


def _read_props(data: bytes, pos: int, end: int, packet_type: int, version: int) -> tuple[Properties, int]:
    if version != V5:
        return NO_PROPERTIES, pos
    return decode_properties(data, pos, end, packet_type)


def _expect_end(pos: int, end: int, what: str) -> None:
    if pos != end:
        raise malformed(f"{end - pos} unexpected bytes at the end of {what}")


def _decode_connack(data: bytes, pos: int, end: int, version: int) -> Connack:
    if pos + 2 > end:
        raise malformed("CONNACK shorter than 2 bytes")
    flags, code = data[pos], data[pos + 1]
    if flags > 1 or (flags and version == V31):
        raise malformed("reserved CONNACK flags set")
    props, pos = _read_props(data, pos + 2, end, CONNACK, version)
    _expect_end(pos, end, "CONNACK")
    return Connack(bool(flags), code, props)


_A = TypeVar("_A", Puback, Pubrec, Pubrel, Pubcomp)


def _decode_ack(packet_type: int, cls: type[_A]) -> Callable[[bytes, int, int, int], _A]:
    def decode(data: bytes, pos: int, end: int, version: int) -> _A:
        packet_id, pos = _read_packet_id(data, pos, end)
        code, props, pos = _read_reason_and_props(data, pos, end, packet_type, version)
        _expect_end(pos, end, cls.__name__.upper())
        return cls(packet_id, code, props)

    return decode


def _read_reason_and_props(
    data: bytes, pos: int, end: int, packet_type: int, version: int
) -> tuple[int, Properties, int]:
    """5.0 may leave out the reason code (then 0) and the properties (then none) at the end of a packet."""
    if version != V5 or pos == end:
        return 0, NO_PROPERTIES, pos
    code = data[pos]
    if pos + 1 == end:
        return code, NO_PROPERTIES, end
    props, pos = decode_properties(data, pos + 1, end, packet_type)
    return code, props, pos


def _decode_subscribe(data: bytes, pos: int, end: int, version: int) -> Subscribe:
    packet_id, pos = _read_packet_id(data, pos, end)
    props, pos = _read_props(data, pos, end, SUBSCRIBE, version)
    subscriptions = []
    while pos < end:
        topic_filter, pos = read_str(data, pos, end)
        if pos >= end:
            raise malformed("SUBSCRIBE ends before subscription options")
        subscriptions.append(_subscription(topic_filter, data[pos], version))
        pos += 1
    if not subscriptions:
        raise RemoteProtocolError("SUBSCRIBE without a topic filter", PROTOCOL_ERROR)
    return Subscribe(packet_id, tuple(subscriptions), props)


def _subscription(topic_filter: str, options: int, version: int) -> Subscription:
    qos = options & 0x03
    if qos == 3:
        raise malformed("subscription QoS 3")
    if version != V5:
        if options > 3:
            raise malformed("reserved subscription option bits set")
        return Subscription(topic_filter, qos)
    if options >= 0x40:
        raise malformed("reserved subscription option bits set")
    retain_handling = options >> 4
    if retain_handling == 3:
        raise RemoteProtocolError("retain handling 3", PROTOCOL_ERROR)
    return Subscription(topic_filter, qos, bool(options & 0x04), bool(options & 0x08), retain_handling)


def _decode_suback(data: bytes, pos: int, end: int, version: int) -> Suback:
    packet_id, pos = _read_packet_id(data, pos, end)
    props, pos = _read_props(data, pos, end, SUBACK, version)
    return Suback(packet_id, tuple(data[pos:end]), props)


def _decode_unsubscribe(data: bytes, pos: int, end: int, version: int) -> Unsubscribe:
    packet_id, pos = _read_packet_id(data, pos, end)
    props, pos = _read_props(data, pos, end, UNSUBSCRIBE, version)
    filters = []
    while pos < end:
        topic_filter, pos = read_str(data, pos, end)
        filters.append(topic_filter)
    if not filters:
        raise RemoteProtocolError("UNSUBSCRIBE without a topic filter", PROTOCOL_ERROR)
    return Unsubscribe(packet_id, tuple(filters), props)


def _decode_unsuback(data: bytes, pos: int, end: int, version: int) -> Unsuback:
    packet_id, pos = _read_packet_id(data, pos, end)
    if version != V5:
        _expect_end(pos, end, "UNSUBACK")
        return Unsuback(packet_id)
    props, pos = decode_properties(data, pos, end, UNSUBACK)
    return Unsuback(packet_id, tuple(data[pos:end]), props)


def _decode_pingreq(data: bytes, pos: int, end: int, version: int) -> Pingreq:
    _expect_end(pos, end, "PINGREQ")
    return Pingreq()


def _decode_pingresp(data: bytes, pos: int, end: int, version: int) -> Pingresp:
    _expect_end(pos, end, "PINGRESP")
    return Pingresp()


def _decode_disconnect(data: bytes, pos: int, end: int, version: int) -> Disconnect:
    code, props, pos = _read_reason_and_props(data, pos, end, DISCONNECT, version)
    _expect_end(pos, end, "DISCONNECT")
    return Disconnect(code, props)


def _decode_auth(data: bytes, pos: int, end: int, version: int) -> Auth:
    code, props, pos = _read_reason_and_props(data, pos, end, AUTH, version)
    _expect_end(pos, end, "AUTH")
    return Auth(code, props)


_Decoder = Callable[[bytes, int, int, int], Packet]

#: By packet type; CONNECT and PUBLISH are handled before the table, 0 is reserved.
_DECODERS: Final[tuple[_Decoder | None, ...]] = (
    None,
    None,
    _decode_connack,
    None,
    _decode_ack(PUBACK, Puback),
    _decode_ack(PUBREC, Pubrec),
    _decode_ack(PUBREL, Pubrel),
    _decode_ack(PUBCOMP, Pubcomp),
    _decode_subscribe,
    _decode_suback,
    _decode_unsubscribe,
    _decode_unsuback,
    _decode_pingreq,
    _decode_pingresp,
    _decode_disconnect,
    _decode_auth,
)
