"""The broker's audit events: which messages they cover, and the fields each event names.

``audit_messages`` says which messages get message events: ``all``, ``durable`` (the default) or none. Events
of connections, consumers, queues and wills are always emitted. A message's audit id is ``<node tag>-<id>``;
copies that move to other nodes carry the id it was first accepted under (``ORIGIN_MESSAGE_ID``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tridentmq_core.audit import AuditSink
from tridentmq_core.queues import Consumer, Queue
from tridentmq_shared.message import M_ADDRESS, M_BODY, M_DURABLE, M_ID, M_PROPS, M_PROTOCOL, M_TIMESTAMP, WireMessage

#: The audit id (``<node tag>-<id>``) a message was given where it was first accepted, carried by the copies
#: that move to other nodes (forwarded, redistributed) so their audit events name it as ``origin_message_id``.
ORIGIN_MESSAGE_ID = "_TMQ_ORIG_MESSAGE_ID"


class AuditEvents:
    __slots__ = ("all", "durable", "sink", "tag")

    def __init__(self, sink: AuditSink, node_id: str, audit_messages: str) -> None:
        self.sink = sink
        self.tag = node_id[:8]
        self.all = audit_messages == "all"  # on the hot path these two are read as attributes, not called
        self.durable = audit_messages in ("all", "durable")

    def covers(self, message: WireMessage) -> bool:
        return self.all or (self.durable and message[M_DURABLE])

    def audit_id(self, message: WireMessage) -> str:
        return f"{self.tag}-{message[M_ID]}"

    def origin(self, message: WireMessage) -> str:
        """The audit id of the message ``message`` is a copy of (or its own)."""
        origin: str | None = message[M_PROPS].get(ORIGIN_MESSAGE_ID)
        return origin or f"{self.tag}-{message[M_ID]}"

    def emit(self, now_ms: int, event: str, **fields: object) -> None:
        self.sink.emit(now_ms * 1000, event, fields)

    def message(self, now_ms: int, event: str, message: WireMessage, queue: Queue | None, **fields: object) -> None:
        origin = message[M_PROPS].get(ORIGIN_MESSAGE_ID)
        if origin is not None:
            fields["origin_message_id"] = origin
        self.sink.emit_message(
            now_ms * 1000,
            event,
            queue.name if queue is not None else None,
            message[M_ADDRESS],
            f"{self.tag}-{message[M_ID]}",
            len(message[M_BODY]),
            message[M_PROTOCOL] or "link",
            message[M_TIMESTAMP] * 1000,
            fields,
        )

    def sent(self, now_ms: int, message: WireMessage) -> None:
        """``msg.sent``, once per accepted message: ``message`` without its keyword fields."""
        self.sink.emit_message(
            now_ms * 1000,
            "msg.sent",
            None,
            message[M_ADDRESS],
            f"{self.tag}-{message[M_ID]}",
            len(message[M_BODY]),
            message[M_PROTOCOL] or "link",
            message[M_TIMESTAMP] * 1000,
            _origin_field(message),
        )

    def acked(self, now_ms: int, message: WireMessage, queue: Queue, consumer: Consumer | None) -> None:
        """``msg.acked``; no consumer for auto-ack and a last-value replacement."""
        session = consumer.session if consumer is not None else None
        self.sink.emit_acked(
            now_ms * 1000,
            queue.name,
            message[M_ADDRESS],
            f"{self.tag}-{message[M_ID]}",
            len(message[M_BODY]),
            message[M_PROTOCOL] or "link",
            message[M_TIMESTAMP] * 1000,
            session.conn_id if session is not None else None,
            str(consumer.id) if consumer is not None else None,
            session.client_name if session is not None else None,
            message[M_PROPS].get(ORIGIN_MESSAGE_ID),
        )

    def delivered(
        self, now_ms: int, queue: Queue, consumer: Consumer, delivery_count: int, message: WireMessage
    ) -> None:
        session = consumer.session
        self.sink.emit_delivered(
            now_ms * 1000,
            queue.name,
            message[M_ADDRESS],
            f"{self.tag}-{message[M_ID]}",
            len(message[M_BODY]),
            message[M_PROTOCOL] or "link",
            message[M_TIMESTAMP] * 1000,
            delivery_count,
            session.conn_id,
            str(consumer.id),
            session.client_name,
            message[M_PROPS].get(ORIGIN_MESSAGE_ID),
        )


_NO_FIELDS: Mapping[str, object] = MappingProxyType({})


def _origin_field(message: WireMessage) -> Mapping[str, object]:
    """The extra field of a message event of a copy that came from another node; none for the others."""
    origin = message[M_PROPS].get(ORIGIN_MESSAGE_ID)
    return _NO_FIELDS if origin is None else {"origin_message_id": origin}
