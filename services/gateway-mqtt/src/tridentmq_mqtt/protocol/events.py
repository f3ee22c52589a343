"""Events produced by ``MqttServerConnection.receive_data``: one per client packet that needs the shell's
attention (PINGREQ is answered by the connection itself, acknowledgements of unknown packet ids are dropped)."""

from __future__ import annotations

from dataclasses import dataclass

# SUBSCRIBE and UNSUBSCRIBE reach the shell as the decoded packets (answer with ``suback``/``unsuback``).
from tridentmq_mqtt.protocol.packets import Subscribe, Unsubscribe, Will
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties


@dataclass(frozen=True, slots=True)
class Connect:
    """The CONNECT: answer with ``accept`` or ``refuse``."""

    version: int  # protocol level: 3 (3.1), 4 (3.1.1) or 5 (5.0)
    client_id: str  # may be empty: the server then assigns one
    clean_start: bool  # "clean session" before 5.0
    keep_alive: int  # seconds, 0 = none
    username: str | None
    password: bytes | None
    will: Will | None
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class Publish:
    """An application message from the client. ``topic`` is resolved from a 5.0 topic alias, and
    ``properties`` no longer carry the alias.

    ``duplicate`` is True when a PUBLISH with this QoS 1/2 packet id is still being handled (not yet answered
    with PUBACK, or awaiting PUBREL): do not deliver it again and do not answer it again (a PUBREC already
    sent is repeated by the connection itself)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool  # the DUP flag as sent
    packet_id: int | None
    properties: Properties = NO_PROPERTIES
    duplicate: bool = False


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class PubrelReceived:
    """The client released its QoS 2 message ``packet_id``: answer with ``pubcomp``. ``known`` is False when
    no PUBREC was sent for that id on this connection (a PUBREL resent after a reconnect, say)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    known: bool = True


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class PubackReceived:
    """The client acknowledged our QoS 1 PUBLISH; its packet id is free again."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class PubrecReceived:
    """The client received our QoS 2 PUBLISH: answer with ``pubrel`` once that is recorded. When
    ``reason_code`` is an error (0x80 or more, 5.0) the flow ends instead and the packet id is free again."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)  # not frozen: one per message, and a frozen __init__ costs four times as much
class PubcompReceived:
    """Our QoS 2 flow is complete; its packet id is free again."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Disconnect:
    """The client's DISCONNECT; nothing after it is read and the connection is closed. ``with_will`` (5.0
    reason 0x04) asks for the will to be published all the same; otherwise it is discarded."""

    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    with_will: bool = False


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The client closed its side (EOF)."""


@dataclass(frozen=True, slots=True)
class ProtocolViolation:
    """The client broke the protocol; nothing after it is read. It comes after the events of the packets
    before it, so the shell handles those first, then calls ``MqttServerConnection.reject``."""

    message: str
    reason_code: int  # the 5.0 reason code for the CONNACK or DISCONNECT


Event = (
    Connect
    | Publish
    | PubrelReceived
    | PubackReceived
    | PubrecReceived
    | PubcompReceived
    | Subscribe
    | Unsubscribe
    | Disconnect
    | ConnectionClosed
    | ProtocolViolation
)

__all__ = [
    "Connect",
    "ConnectionClosed",
    "Disconnect",
    "Event",
    "ProtocolViolation",
    "PubackReceived",
    "PubcompReceived",
    "Publish",
    "PubrecReceived",
    "PubrelReceived",
    "Subscribe",
    "Unsubscribe",
]
