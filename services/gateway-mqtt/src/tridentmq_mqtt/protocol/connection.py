"""The server side of one MQTT connection (3.1, 3.1.1 and 5.0), sans-IO: bytes in, events out; replies in,
bytes queued.

The first packet must be a CONNECT; the shell answers it with ``accept`` or ``refuse``. Clients may send
packets right behind their CONNECT: those become events too, but nothing is sent to the client before the
CONNACK (an early PINGRESP waits for it). A protocol violation is not answered at once: it becomes a
``ProtocolViolation`` event after the events of the packets before it, and the shell answers it with
``reject`` (a 5.0 DISCONNECT, or CONNACK before the accept, with its reason code; before 5.0 the connection
is just closed).

Packet-id bookkeeping, per direction:

* Incoming QoS 1/2 PUBLISH: the id is in use until the shell's ``puback`` (QoS 1) or ``pubcomp`` after the
  client's PUBREL (QoS 2). In 5.0 more such messages in flight than the server's receive maximum is a
  violation (0x93); before 5.0 the limit is not announced, so not enforced. A PUBLISH resent with the same
  QoS while its id is in use (QoS 1 before ``puback``, QoS 2 before the PUBREL) is an event with
  ``duplicate=True``, answered with the first: its ``puback`` or ``pubrec`` answers each of them (a QoS 2 one
  sent again after the PUBREC gets a PUBREC at once); any other reuse of an id in use is a protocol
  violation. A PUBREL repeated before the ``pubcomp`` of its first is no event: the ``pubcomp`` answers each.
* 5.0 topic aliases from the client are resolved (up to the server's ``topic_alias_maximum``; above it is
  0x94, an unmapped alias 0x82; alias 0 is refused by the parser, as 0x94). The server sends no aliases.
* Outgoing QoS 1/2 PUBLISH (``publish``): the id is in use until PUBACK, PUBCOMP or an error PUBREC. At most
  the client's receive maximum are in flight: beyond that ``publish`` returns ``None`` and queues nothing.
  After a PUBREC the shell sends the PUBREL with ``pubrel`` (once it has recorded that the message is the
  client's: the PUBLISH must never be sent again after its PUBREL). A resumed session re-sends its PUBLISH
  with the same packet id (``publish(packet_id=..., dup=True)``) and its PUBRELs (``pubrel``).
  Acknowledgements for ids not in flight are ignored rather than treated as a protocol error (the spec
  allows either; a client retrying after a reconnect is better served by leniency), but for a successful
  PUBREC: the sender of a PUBLISH answers every such PUBREC with a PUBREL of its packet id ([MQTT-4.3.3-4];
  in 5.0 with 0x92, Packet Identifier not found, for an id it does not know), which frees the id the client
  holds for it; a client left waiting for it would hold the id, and its receive maximum, for good.

A 5.0 client that sets Request Problem Information to 0 gets no reason string or user properties on any
packet but PUBLISH, CONNACK and DISCONNECT: the connection leaves them out of what the shell asks for.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import Any, Final, cast

from tridentmq_mqtt.protocol import events as ev
from tridentmq_mqtt.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_mqtt.protocol.packets import (
    MAX_PACKET_SIZE,
    V5,
    V31,
    V311,
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
    Unsuback,
    Unsubscribe,
    encode,
    encode_plain_publish,
)
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, PUBACK, U16, Properties
from tridentmq_mqtt.protocol.reason_codes import (
    PACKET_IDENTIFIER_NOT_FOUND,
    PACKET_TOO_LARGE,
    PROTOCOL_ERROR,
    TOPIC_ALIAS_INVALID,
    UNSPECIFIED_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
)

DISCONNECT_WITH_WILL: Final = 0x04
KEEP_ALIVE_TIMEOUT: Final = 0x8D
RECEIVE_MAXIMUM_EXCEEDED: Final = 0x93
#: The client is declared gone after this many keep-alive periods of silence ([MQTT-3.1.2-24]).
KEEP_ALIVE_TOLERANCE: Final = 1.5
DEFAULT_RECEIVE_MAXIMUM: Final = 65_535
_PUBACK_HEAD: Final = bytes((PUBACK << 4, 2))  # a PUBACK with no reason code is its packet id alone

#: The packets that carry a reason string or user properties whatever the client's Request Problem Information.
_PROBLEMS_ALLOWED: Final = (Publish, Connack, Disconnect)
#: 5.0 CONNACK reason codes as 3.1/3.1.1 return codes; anything else is 3, Server unavailable.
_RETURN_CODES: Final = {
    0x84: 1,  # unacceptable protocol version
    0x85: 2,  # identifier rejected
    0x88: 3,  # server unavailable
    0x89: 3,  # server busy
    0x86: 4,  # bad user name or password
    0x8C: 4,  # bad authentication method
    0x87: 5,  # not authorized
    0x8A: 5,  # banned
}


class State(Enum):
    AWAITING_CONNECT = "awaiting-connect"
    CONNECTING = "connecting"  # CONNECT received; accept() or refuse() next
    CONNECTED = "connected"
    CLOSED = "closed"


class _In(Enum):
    """Where an incoming QoS 1/2 PUBLISH stands."""

    QOS1 = "awaiting puback()"
    RECEIVED = "awaiting pubrec()"
    RECORDED = "awaiting PUBREL"
    RELEASED = "awaiting pubcomp()"


class _Out(Enum):
    """Where an outgoing QoS 1/2 PUBLISH stands."""

    PUBACK = "awaiting PUBACK"
    PUBREC = "awaiting PUBREC"
    RECEIVED = "awaiting pubrel()"  # the shell makes the message's release safe, then sends the PUBREL
    PUBCOMP = "awaiting PUBCOMP"


class MqttServerConnection:
    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = (
        "_aliases",
        "_before_connect",
        "_held",
        "_incoming",
        "_input_done",
        "_last_received",
        "_max_connect_bytes",
        "_next_id",
        "_out",
        "_outgoing",
        "_parser",
        "_repeated",
        "client_max_packet_size",
        "client_receive_maximum",
        "connect_expiry_s",
        "discarded",
        "keep_alive",
        "max_packet_size",
        "problem_information",
        "receive_maximum",
        "state",
        "topic_alias_maximum",
        "version",
    )

    def __init__(
        self,
        *,
        max_packet_size: int = MAX_PACKET_SIZE,
        receive_maximum: int = DEFAULT_RECEIVE_MAXIMUM,
        topic_alias_maximum: int = 0,
        max_connect_bytes: int = 0,
        now: float = 0.0,
    ) -> None:
        """The server's limits: the largest packet it reads (also given to the parser), how many incoming
        QoS 1/2 messages may be unacknowledged at once, and the highest topic alias the client may use (0:
        none). 5.0 clients learn them from the CONNACK. More than ``max_connect_bytes`` (0: no limit) before
        the CONNECT is complete is refused as too large: an unauthenticated peer cannot make us buffer a
        packet of the full size."""
        if not 1 <= receive_maximum <= 0xFFFF:
            raise LocalProtocolError(f"receive maximum {receive_maximum} is not in 1..65535")
        if not 0 <= topic_alias_maximum <= 0xFFFF:
            raise LocalProtocolError(f"topic alias maximum {topic_alias_maximum} is not in 0..65535")
        if not 2 <= max_packet_size <= MAX_PACKET_SIZE:
            raise LocalProtocolError(f"maximum packet size {max_packet_size} is out of range")
        self._parser = PacketParser(max_packet_size=max_packet_size)
        self.max_packet_size = max_packet_size
        self._max_connect_bytes = max_connect_bytes
        self._before_connect = 0  # bytes received while awaiting the CONNECT
        self.receive_maximum = receive_maximum
        self.topic_alias_maximum = topic_alias_maximum
        self.state = State.AWAITING_CONNECT
        self.version: int | None = None  # known from the CONNECT on
        self.keep_alive = 0  # seconds; the client's, or the server keep-alive given to accept() in 5.0
        self.client_receive_maximum = DEFAULT_RECEIVE_MAXIMUM
        self.client_max_packet_size = MAX_PACKET_SIZE
        self.connect_expiry_s = 0  # the session expiry the 5.0 CONNECT asked for
        # 5.0 Request Problem Information 0: no reason strings or user properties but on PUBLISH, CONNACK and
        # DISCONNECT ([MQTT-3.1.2-29]); ``_write`` leaves them out of the other packets.
        self.problem_information = True
        self.discarded = 0  # outgoing packets dropped for exceeding the client's maximum packet size
        self._out: list[bytes] = []
        # Automatic answers to packets read before the CONNACK (a list only while connecting: each is 56 bytes).
        self._held: list[Packet] | None = None
        self._input_done = False  # input after a violation or a DISCONNECT is ignored
        self._last_received = now
        self._aliases: dict[int, str] = {}
        self._incoming: dict[int, _In] = {}
        # Packets sent again before the first one's answer, by packet id: a QoS 1/2 PUBLISH before its ``puback``
        # or ``pubrec``, a PUBREL before its ``pubcomp``. Each gets the answer with the first ([MQTT-4.3.2-2],
        # [MQTT-4.3.3-2]; made when one is: most connections never see one).
        self._repeated: dict[int, int] | None = None
        self._outgoing: dict[int, _Out] = {}
        self._next_id = 1

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    @property
    def send_window(self) -> int:
        """How many more QoS 1/2 PUBLISH ``publish`` may send before the client acknowledges some."""
        return self.client_receive_maximum - len(self._outgoing)

    # ------------------------------------------------------------------ input
    def receive_data(self, data: bytes, now: float) -> list[ev.Event]:
        """Feed bytes from the client; ``b""`` means it closed its side."""
        if self.state is State.CLOSED or self._input_done:
            return []
        if not data:
            self._close()
            return [ev.ConnectionClosed()]
        events: list[ev.Event] = []
        size = len(data)
        try:
            while packets := self._parser.feed(data):
                data = b""
                # Keep alive counts whole Control Packets ([MQTT-3.1.2-22]): bytes of one not finished yet do
                # not, or a client sending a byte now and then would hold its connection for ever.
                self._last_received = now
                for packet in packets:
                    event = self._event(packet)
                    if event is None:
                        continue
                    events.append(event)
                    if type(event) is ev.Disconnect:  # whatever follows is not read
                        self._close()
                        return events
            if self.state is State.AWAITING_CONNECT and self._max_connect_bytes:
                self._count_before_connect(size)
        except RemoteProtocolError as exc:
            self._input_done = True
            events.append(ev.ProtocolViolation(exc.message, exc.reason_code))
        return events

    def _count_before_connect(self, size: int) -> None:
        self._before_connect += size
        if self._before_connect > self._max_connect_bytes:
            raise RemoteProtocolError(
                f"more than {self._max_connect_bytes} bytes before a complete CONNECT", PACKET_TOO_LARGE
            )

    def _event(self, packet: Packet) -> ev.Event | None:
        match packet:
            case Publish():
                return self._publish_received(packet)
            case Puback():
                if self._outgoing.get(packet.packet_id) is _Out.PUBACK:
                    del self._outgoing[packet.packet_id]
                    return ev.PubackReceived(packet.packet_id, packet.reason_code, packet.properties)
                return None
            case Pubrec():
                return self._pubrec_received(packet)
            case Pubrel():
                return self._pubrel_received(packet)
            case Pubcomp():
                if self._outgoing.get(packet.packet_id) is _Out.PUBCOMP:
                    del self._outgoing[packet.packet_id]
                    return ev.PubcompReceived(packet.packet_id, packet.reason_code, packet.properties)
                return None
            case Subscribe() | Unsubscribe():
                return packet
            case Pingreq():
                self._auto(Pingresp())
                return None
            case Disconnect():
                if self.connect_expiry_s == 0 and (packet.properties.session_expiry_interval or 0) > 0:
                    # 5.0, 3.14.2.2.2: not a valid DISCONNECT, so the will stays; answered with DISCONNECT 0x82.
                    raise RemoteProtocolError("session expiry set on DISCONNECT after 0 on CONNECT", PROTOCOL_ERROR)
                return ev.Disconnect(packet.reason_code, packet.properties, packet.reason_code == DISCONNECT_WITH_WILL)
            case Connect():
                return self._connect(packet)
            case Auth():
                raise RemoteProtocolError("enhanced authentication (AUTH) is not supported", PROTOCOL_ERROR)
            case _:  # CONNACK, SUBACK, UNSUBACK, PINGRESP: server-to-client only
                raise RemoteProtocolError(f"{type(packet).__name__.upper()} from a client", PROTOCOL_ERROR)

    def _connect(self, packet: Connect) -> ev.Connect:
        version = self._parser.version
        assert version is not None  # the parser read the CONNECT
        self.version = version
        self.keep_alive = packet.keep_alive
        props = packet.properties
        if props.receive_maximum is not None:
            self.client_receive_maximum = props.receive_maximum
        if props.maximum_packet_size is not None:
            self.client_max_packet_size = props.maximum_packet_size
        if props.request_problem_information is False:
            self.problem_information = False
        self.connect_expiry_s = props.session_expiry_interval or 0
        self.state = State.CONNECTING
        return ev.Connect(
            version,
            packet.client_id,
            packet.clean_start,
            packet.keep_alive,
            packet.username,
            packet.password,
            packet.will,
            props,
        )

    def _publish_received(self, packet: Publish) -> ev.Publish:
        topic, props = packet.topic, packet.properties
        if props.subscription_identifiers:  # the server's to set, on the PUBLISHes it sends
            raise RemoteProtocolError("a client's PUBLISH must not hold a subscription identifier", PROTOCOL_ERROR)
        alias = props.topic_alias
        if alias is not None:  # 5.0 only: the parser has refused 0 already (0x94 Topic Alias invalid)
            if not 0 < alias <= self.topic_alias_maximum:
                raise RemoteProtocolError(
                    f"topic alias {alias} exceeds the maximum {self.topic_alias_maximum}", TOPIC_ALIAS_INVALID
                )
            if topic:
                self._aliases[alias] = topic
            else:
                known = self._aliases.get(alias)
                if known is None:
                    raise RemoteProtocolError(f"topic alias {alias} has no topic yet", PROTOCOL_ERROR)
                topic = known
            props = replace(props, topic_alias=None)
        duplicate = False
        packet_id = packet.packet_id
        if packet_id is not None:  # QoS 1 or 2
            state = self._incoming.get(packet_id)
            if state is None:
                if self.version == V5 and len(self._incoming) >= self.receive_maximum:
                    raise RemoteProtocolError(
                        f"more than {self.receive_maximum} QoS 1/2 messages unacknowledged", RECEIVE_MAXIMUM_EXCEEDED
                    )
                self._incoming[packet_id] = _In.QOS1 if packet.qos == 1 else _In.RECEIVED
            elif (state is _In.QOS1 and packet.qos == 1) or (packet.qos == 2 and state in (_In.RECEIVED, _In.RECORDED)):
                duplicate = True
                if state is _In.RECORDED:
                    self._auto(Pubrec(packet_id))
                else:  # answered with the first
                    self._repeat(packet_id)
            else:
                raise RemoteProtocolError(f"packet identifier {packet_id} is in use ({state.value})", PROTOCOL_ERROR)
        return ev.Publish(topic, packet.payload, packet.qos, packet.retain, packet.dup, packet_id, props, duplicate)

    def _pubrec_received(self, packet: Pubrec) -> ev.PubrecReceived | None:
        packet_id = packet.packet_id
        state = self._outgoing.get(packet_id)
        if state is _Out.PUBCOMP:  # our PUBREL crossed a resent PUBREC: repeat it
            self._auto(Pubrel(packet_id))
            return None
        if state is None:
            if packet.reason_code < UNSPECIFIED_ERROR:  # unknown: released all the same ([MQTT-4.3.3-4])
                self._auto(Pubrel(packet_id, *self._v5(PACKET_IDENTIFIER_NOT_FOUND, NO_PROPERTIES)))
            return None
        if state is not _Out.PUBREC:  # a QoS 1 id (the client's mistake), or the shell's pubrel() is awaited
            return None
        if packet.reason_code >= UNSPECIFIED_ERROR:
            del self._outgoing[packet_id]
        else:
            self._outgoing[packet_id] = _Out.RECEIVED
        return ev.PubrecReceived(packet_id, packet.reason_code, packet.properties)

    def _pubrel_received(self, packet: Pubrel) -> ev.PubrelReceived | None:
        packet_id = packet.packet_id
        state = self._incoming.get(packet_id)
        if state in (_In.QOS1, _In.RECEIVED):
            raise RemoteProtocolError(f"PUBREL for packet identifier {packet_id} before its PUBREC", PROTOCOL_ERROR)
        if state is _In.RELEASED:  # sent again before our PUBCOMP: answered with the first one's ``pubcomp``
            self._repeat(packet_id)
            return None
        self._incoming[packet_id] = _In.RELEASED
        return ev.PubrelReceived(packet_id, packet.reason_code, packet.properties, known=state is not None)

    # ------------------------------------------------------------------ answering the CONNECT
    def accept(
        self,
        now: float,
        *,
        session_present: bool = False,
        assigned_client_id: str | None = None,
        server_keep_alive: int | None = None,
        properties: Properties = NO_PROPERTIES,
    ) -> bool:
        """Answer the CONNECT with a successful CONNACK. In 5.0 it carries the server's receive maximum,
        maximum packet size and topic alias maximum (where they differ from the defaults), the assigned client
        id and the server keep-alive (which then replaces the client's), plus ``properties``; before 5.0 those
        are not sent (and ``server_keep_alive`` is ignored). A CONNACK larger than the client's maximum packet
        size, even without a reason string and user properties, is not sent: the connection is closed instead,
        and False returned."""
        if self.state is not State.CONNECTING:
            raise LocalProtocolError("accept() answers a CONNECT", PROTOCOL_ERROR)
        props = NO_PROPERTIES
        if self.version == V5:
            if server_keep_alive is not None:
                self.keep_alive = server_keep_alive
            props = replace(
                properties,
                receive_maximum=(
                    self.receive_maximum
                    if self.receive_maximum != DEFAULT_RECEIVE_MAXIMUM
                    else properties.receive_maximum
                ),
                maximum_packet_size=(
                    self.max_packet_size if self.max_packet_size < MAX_PACKET_SIZE else properties.maximum_packet_size
                ),
                topic_alias_maximum=self.topic_alias_maximum or properties.topic_alias_maximum,
                assigned_client_identifier=assigned_client_id,
                server_keep_alive=server_keep_alive,
            )
            if props == NO_PROPERTIES:
                props = NO_PROPERTIES
        discarded = self.discarded
        self._write(Connack(session_present and self.version != V31, 0, props))
        if self.discarded != discarded:
            # Too large for the client's maximum packet size even without its reason string and user properties
            # ([MQTT-3.2.2-19/20]): the client would wait for it for ever, so the connection closes instead.
            self._close()
            return False
        self.state = State.CONNECTED
        self._last_received = max(self._last_received, now)
        held, self._held = self._held, None
        for packet in held or ():
            self._write(packet)
        return True

    def refuse(self, reason_code: int = UNSPECIFIED_ERROR, properties: Properties = NO_PROPERTIES) -> None:
        """Answer the CONNECT with a failing CONNACK and close. ``reason_code`` is a 5.0 code (0x80 or more);
        before 5.0 it becomes the nearest return code (0x84 → 1, 0x85 → 2, 0x86/0x8C → 4, 0x87/0x8A → 5,
        anything else → 3, Server unavailable) and ``properties`` are dropped."""
        if self.state is not State.CONNECTING:
            raise LocalProtocolError("refuse() answers a CONNECT", PROTOCOL_ERROR)
        if not UNSPECIFIED_ERROR <= reason_code <= 0xFF:
            raise LocalProtocolError(f"refusal reason 0x{reason_code:02x} is not an error code", PROTOCOL_ERROR)
        if self.version == V5:
            self._write(Connack(session_present=False, reason_code=reason_code, properties=properties))
        else:
            self._write(Connack(session_present=False, reason_code=_RETURN_CODES.get(reason_code, 3)))
        self._close()

    def reject(self, violation: ev.ProtocolViolation) -> None:
        """Answer a ``ProtocolViolation`` and close: in 5.0 a DISCONNECT (a CONNACK if the CONNECT has not been
        accepted yet) with its reason code; before 5.0 nothing is sent. A CONNECT of an unsupported protocol
        version gets a 3.1.1 CONNACK with return code 1, whatever version the client speaks."""
        if self.state is State.CLOSED:
            return
        code = violation.reason_code
        if self.state is State.AWAITING_CONNECT:
            if code == UNSUPPORTED_PROTOCOL_VERSION:
                self._out.append(encode(Connack(session_present=False, reason_code=1), V311))
        elif self.version == V5:
            self._write(
                Connack(session_present=False, reason_code=code) if self.state is State.CONNECTING else Disconnect(code)
            )
        self._close()

    def disconnect(self, reason_code: int = 0, properties: Properties = NO_PROPERTIES) -> None:
        """Close from the server side: a DISCONNECT with ``reason_code`` in 5.0 once connected; before 5.0, or
        before the CONNACK, the connection is just closed. Nothing happens if it is closed already."""
        if self.state is State.CONNECTED and self.version == V5:
            self._write(Disconnect(reason_code, properties))
        self._close()

    # ------------------------------------------------------------------ answering the client's packets
    def puback(self, packet_id: int, reason_code: int = 0, properties: Properties = NO_PROPERTIES) -> None:
        """Acknowledge the client's QoS 1 PUBLISH ``packet_id`` (reason codes and properties are 5.0 only and
        dropped before). A no-op once closed."""
        if self._answerable(packet_id, _In.QOS1, "puback"):
            del self._incoming[packet_id]
            if reason_code == 0 and properties is NO_PROPERTIES:  # the common case, the same in every version
                self._out.append(_PUBACK_HEAD + U16.pack(packet_id))
            else:
                self._write(Puback(packet_id, *self._v5(reason_code, properties)))
            if self._repeated is not None:
                self._answer_repeats(packet_id, Puback(packet_id, *self._v5(reason_code, properties)))

    def pubrec(self, packet_id: int, reason_code: int = 0, properties: Properties = NO_PROPERTIES) -> None:
        """Acknowledge the client's QoS 2 PUBLISH ``packet_id`` (the message is now the server's). An error
        reason (0x80 or more, 5.0) ends the flow and frees the id."""
        if self._answerable(packet_id, _In.RECEIVED, "pubrec"):
            code, props = self._v5(reason_code, properties)
            if code >= UNSPECIFIED_ERROR:
                del self._incoming[packet_id]
            else:
                self._incoming[packet_id] = _In.RECORDED
            answer = Pubrec(packet_id, code, props)
            self._write(answer)
            if self._repeated is not None:
                self._answer_repeats(packet_id, answer)

    def pubcomp(self, packet_id: int, reason_code: int = 0, properties: Properties = NO_PROPERTIES) -> None:
        """Answer a ``PubrelReceived`` (5.0: 0x92 Packet Identifier not found suits an unknown one)."""
        if self._answerable(packet_id, _In.RELEASED, "pubcomp"):
            del self._incoming[packet_id]
            answer = Pubcomp(packet_id, *self._v5(reason_code, properties))
            self._write(answer)
            if self._repeated is not None:
                self._answer_repeats(packet_id, answer)

    def suback(self, packet_id: int, reason_codes: tuple[int, ...], properties: Properties = NO_PROPERTIES) -> None:
        """Answer a SUBSCRIBE: a granted QoS or a failure code per subscription (before 5.0 every failure code
        becomes 0x80)."""
        if self._sendable("suback"):
            if self.version == V5:
                self._write(Suback(packet_id, reason_codes, properties))
            else:
                codes = tuple(min(code, UNSPECIFIED_ERROR) if code > 2 else code for code in reason_codes)
                self._write(Suback(packet_id, codes))

    def unsuback(
        self, packet_id: int, reason_codes: tuple[int, ...] = (), properties: Properties = NO_PROPERTIES
    ) -> None:
        """Answer an UNSUBSCRIBE; the reason codes (one per filter) and properties are 5.0 only."""
        if self._sendable("unsuback"):
            if self.version == V5:
                self._write(Unsuback(packet_id, reason_codes, properties))
            else:
                self._write(Unsuback(packet_id))

    # ------------------------------------------------------------------ outgoing messages
    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        *,
        retain: bool = False,
        properties: Properties = NO_PROPERTIES,
        packet_id: int | None = None,
        dup: bool = False,
        encoded_topic: bytes | None = None,
    ) -> int | None:
        """Queue a PUBLISH to the client. Returns the packet id whose acknowledgement event will follow (QoS 1
        or 2), or 0 when none will: QoS 0, or a packet larger than the client's maximum packet size, which
        is discarded as if it had been sent ([MQTT-3.1.2-25]; counted in ``discarded``). Returns ``None`` and
        queues nothing when the client's receive maximum is reached (``send_window`` is 0): publish again
        after a ``PubackReceived``, ``PubcompReceived`` or error ``PubrecReceived``.

        ``packet_id`` picks the id of a QoS 1/2 message (it must be free, see ``in_flight``), so that a
        message sent again after a reconnect keeps the id the client may have recorded; ``dup`` marks it.
        ``encoded_topic``, the topic as ``packets.encode_topic`` gives it, saves encoding it again for each
        message of a topic."""
        if self.state is not State.CONNECTED:
            raise LocalProtocolError(f"cannot publish while {self.state.value}", PROTOCOL_ERROR)
        assert self.version is not None
        if qos:
            if len(self._outgoing) >= self.client_receive_maximum:
                return None
            if packet_id is None:
                packet_id = self._next_id
                while packet_id in self._outgoing:
                    packet_id = packet_id % 0xFFFF + 1
            elif packet_id in self._outgoing or not 0 < packet_id <= 0xFFFF:
                raise LocalProtocolError(f"packet id {packet_id} is in flight or out of range", PROTOCOL_ERROR)
        else:
            packet_id, dup = None, False
        if encoded_topic is not None and properties is NO_PROPERTIES:  # most messages: no packet object
            data = encode_plain_publish(encoded_topic, payload, self.version, qos, packet_id, dup=dup, retain=retain)
        else:
            data = encode(
                Publish(topic, payload, qos, retain, dup=dup, packet_id=packet_id, properties=properties), self.version
            )
        if len(data) > self.client_max_packet_size:
            self.discarded += 1
            return 0
        self._out.append(data)
        if packet_id is None:
            return 0
        self._outgoing[packet_id] = _Out.PUBACK if qos == 1 else _Out.PUBREC
        self._next_id = packet_id % 0xFFFF + 1
        return packet_id

    def publish_encoded(self, packets: bytes) -> None:
        """Queue QoS 0 PUBLISH packets encoded beforehand for this connection's protocol version (by
        ``packets.encode`` or ``encode_plain_publish``), so that one encoding serves many connections. The
        caller leaves out packets above ``client_max_packet_size``."""
        if self.state is not State.CONNECTED:
            raise LocalProtocolError(f"cannot publish while {self.state.value}", PROTOCOL_ERROR)
        self._out.append(packets)

    def in_flight(self, packet_id: int) -> bool:
        """Whether an outgoing QoS 1/2 flow holds ``packet_id``."""
        return packet_id in self._outgoing

    def pubrel(self, packet_id: int) -> None:
        """Release our QoS 2 message ``packet_id``: after its ``PubrecReceived``, or, in a resumed session, for
        a message the client received on an earlier connection (its id is then taken until the PUBCOMP, and
        counts towards the client's receive maximum). A no-op once closed."""
        if not self._sendable("pubrel"):
            return
        state = self._outgoing.get(packet_id)
        if state is _Out.PUBCOMP:
            return
        if state not in (None, _Out.RECEIVED):
            raise LocalProtocolError(f"pubrel({packet_id}): that packet id is {state.value}", PROTOCOL_ERROR)
        self._outgoing[packet_id] = _Out.PUBCOMP
        self._write(Pubrel(packet_id))

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    # ------------------------------------------------------------------ keep-alive
    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must run next: 1.5 keep-alive periods after the last whole packet from the
        client (the CONNACK's time for the first period)."""
        if self.state in (State.CONNECTING, State.CONNECTED) and self.keep_alive and not self._input_done:
            return self._last_received + self.keep_alive * KEEP_ALIVE_TOLERANCE
        return None

    def handle_timeout(self, now: float) -> None:
        """Close the connection if the client has been silent too long: queue a 5.0 DISCONNECT with 0x8D Keep
        Alive timeout (once connected) and raise ``RemoteProtocolError``."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return
        if self.state is State.CONNECTED and self.version == V5:
            self._write(Disconnect(KEEP_ALIVE_TIMEOUT))
        self._close()
        raise RemoteProtocolError(f"no packet received for {now - self._last_received:.3f} s", KEEP_ALIVE_TIMEOUT)

    # ------------------------------------------------------------------ internals
    def _repeat(self, packet_id: int) -> None:
        repeated = self._repeated
        if repeated is None:
            repeated = self._repeated = {}
        repeated[packet_id] = repeated.get(packet_id, 0) + 1

    def _answer_repeats(self, packet_id: int, answer: Packet) -> None:
        repeats = self._repeated.pop(packet_id, 0) if self._repeated is not None else 0
        for _ in range(repeats):
            self._write(answer)

    def _answerable(self, packet_id: int, expected: _In, method: str) -> bool:
        if not self._sendable(method):
            return False
        state = self._incoming.get(packet_id)
        if state is not expected:
            found = "unknown" if state is None else state.value
            raise LocalProtocolError(f"{method}({packet_id}): that packet id is {found}", PROTOCOL_ERROR)
        return True

    def _sendable(self, method: str) -> bool:
        if self.state is State.CLOSED:
            return False
        if self.state is not State.CONNECTED:
            raise LocalProtocolError(f"{method}() before accept()", PROTOCOL_ERROR)
        return True

    def _v5(self, reason_code: int, properties: Properties) -> tuple[int, Properties]:
        return (reason_code, properties) if self.version == V5 else (0, NO_PROPERTIES)

    def _auto(self, packet: Packet) -> None:
        """An answer the connection gives by itself; held back until the CONNACK has gone out."""
        if self.state is State.CONNECTED:
            self._write(packet)
        elif self.state is State.CONNECTING:
            if self._held is None:
                self._held = []
            self._held.append(packet)

    def _write(self, packet: Packet) -> None:
        assert self.version is not None
        if not self.problem_information and type(packet) not in _PROBLEMS_ALLOWED:
            packet = _without_problems(packet)
        data = encode(packet, self.version)
        if len(data) > self.client_max_packet_size:
            # [MQTT-3.1.2-25]: drop the reason string and user properties first; if that is not enough, drop it.
            slimmed = _without_problems(packet)
            if slimmed is not packet:
                data = encode(slimmed, self.version)
            if len(data) > self.client_max_packet_size:
                self.discarded += 1
                return
        self._out.append(data)

    def _close(self) -> None:
        self.state = State.CLOSED
        self._input_done = True
        self._held = None


def _without_problems(packet: Packet) -> Packet:
    """``packet`` without its reason string and user properties (itself when it has neither)."""
    props: Properties = getattr(packet, "properties", NO_PROPERTIES)
    if props.reason_string is None and not props.user_properties:
        return packet
    slim = replace(props, reason_string=None, user_properties=())
    return cast(Packet, replace(cast(Any, packet), properties=NO_PROPERTIES if slim == NO_PROPERTIES else slim))


__all__ = [
    "DISCONNECT_WITH_WILL",
    "KEEP_ALIVE_TIMEOUT",
    "RECEIVE_MAXIMUM_EXCEEDED",
    "TOPIC_ALIAS_INVALID",
    "MqttServerConnection",
    "State",
]
