"""STOMP destinations and headers ↔ core addresses and messages (pure functions).

``/queue/x`` is the anycast address ``x``, ``/topic/x`` the multicast address ``x``; any other destination is
an address as it is, with the routing type from the ``destination-type`` header (ANYCAST or MULTICAST) or
the address's default. Headers that STOMP defines become message fields; every other header is kept as a
string property and handed back unchanged to STOMP consumers.

A MESSAGE names the destination its SEND named: ``/queue/x`` and ``/topic/x`` follow from the address and
routing type, and a destination without either prefix (``orders``, ``/exchange/amq.direct/key``) travels with
the message as :data:`SENT_DESTINATION`, since the address alone would come back as ``/queue/orders``.
"""

from __future__ import annotations

from typing import Final

from tridentmq_shared.message import (
    DEFAULT_PRIORITY,
    ENCODING_PREFIX,
    M_ADDRESS,
    M_BODY,
    M_CONTENT_TYPE,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_PRIORITY,
    M_PROPS,
    M_ROUTING,
    M_TIMESTAMP,
    ROUTING_DEFAULT,
    TEMPORARY_ADDRESS_PREFIX,
    RoutingType,
    WireMessage,
    new_message,
    property_text,
    time_problem,
)
from tridentmq_shared.mqtt_queues import queue_name
from tridentmq_shared.names import name_problem

QUEUE_PREFIX: Final = "/queue/"
TOPIC_PREFIX: Final = "/topic/"
TEMP_QUEUE_PREFIX: Final = "/temp-queue/"
FQQN_SEPARATOR: Final = "::"  # address::queue
#: The queues that mark a client id as connected (a temporary queue of that connection's link, see
#: ``client_id_lock``); ``$`` keeps them out of reach of wildcard subscriptions.
CLIENT_ID_LOCK_PREFIX: Final = "$stomp.lock."
#: The SEND's destination when it is the address as it is (no ``/queue/`` or ``/topic/``); hidden from others.
SENT_DESTINATION: Final = ENCODING_PREFIX + "stomp.destination"
#: Headers with a meaning of their own in STOMP frames: never stored as properties.
FRAME_HEADERS: Final = frozenset(
    {
        "destination",
        "content-length",
        "content-type",
        "receipt",
        "transaction",
        "persistent",
        "priority",
        "expires",
        "message-id",
        "subscription",
        "ack",
        "redelivered",
        "destination-type",
        "timestamp",
    }
)


def client_id_lock(client_id: str) -> str:
    """The queue whose existence on the core says a connection with ``client_id`` is connected. Named as the
    MQTT gateway's locks are (readable, then a hash): any client id makes a name within the core's rules."""
    return queue_name(CLIENT_ID_LOCK_PREFIX, client_id, "")


class ConversionError(ValueError):
    """A header value STOMP allows but this gateway cannot map (the ERROR frame says which)."""


def destination_to_address(destination: str, destination_type: str | None = None) -> tuple[str, int]:
    """(address, routing type or ``ROUTING_DEFAULT``) of a STOMP destination."""
    if destination.startswith(QUEUE_PREFIX):
        return checked_name(destination[len(QUEUE_PREFIX) :]), int(RoutingType.ANYCAST)
    if destination.startswith(TOPIC_PREFIX):
        return checked_name(destination[len(TOPIC_PREFIX) :]), int(RoutingType.MULTICAST)
    if destination_type is not None:
        kind = destination_type.upper()
        if kind not in ("ANYCAST", "MULTICAST"):
            raise ConversionError(f"destination-type {destination_type[:20]!r} is not ANYCAST or MULTICAST")
        return checked_name(destination), int(RoutingType[kind])
    return checked_name(destination), ROUTING_DEFAULT


def checked_name(address: str, kind: str = "address") -> str:
    """``address`` (or an ``address::queue``, each part), if it keeps the rules of every core name: refused
    here (ERROR ``invalid header``), never passed on to the core, when it is empty, too long or holds a
    control character (STOMP's framing lets a header carry even a NUL)."""
    if FQQN_SEPARATOR in address:
        name, _, queue = address.partition(FQQN_SEPARATOR)
        problem = name_problem(name, kind) or name_problem(queue, "queue name")
    else:
        problem = name_problem(address, kind)
    if problem is not None:
        raise ConversionError(problem)
    return address


def temporary_address(connection_id: str, destination: str) -> str:
    """The address of a connection's ``/temp-queue/<name>``: ``tmp.<connection id>.<name>``."""
    name = destination[len(TEMP_QUEUE_PREFIX) :]
    if not name or any(c in name for c in "*#"):
        raise ConversionError(f"{destination[:60]!r} is not a temporary queue name")
    return checked_name(f"{TEMPORARY_ADDRESS_PREFIX}{connection_id}.{name}", "temporary queue address")


def address_to_destination(address: str, routing: int) -> str:
    return (TOPIC_PREFIX if routing == RoutingType.MULTICAST else QUEUE_PREFIX) + address


def to_message(address: str, routing: int, headers: dict[str, str], body: bytes) -> WireMessage:
    if FQQN_SEPARATOR in address:
        raise ConversionError(f"{address[:60]!r} names a queue: send to its address, subscribe to the queue")
    priority = _int_header(headers, "priority", DEFAULT_PRIORITY)
    if not 0 <= priority <= 9:
        raise ConversionError(f"priority {priority} is not within 0..9")
    expires = max(_int_header(headers, "expires", 0), 0)
    problem = time_problem("expires", expires)
    if problem is not None:
        raise ConversionError(problem)
    properties = {k: v for k, v in headers.items() if k not in FRAME_HEADERS}
    if headers.get("destination") == address:  # named without a prefix: say it again as it was
        properties[SENT_DESTINATION] = address
    return new_message(
        address,
        body,
        routing=routing,
        durable=headers.get("persistent", "").lower() == "true",
        priority=priority,
        expiration_ms=expires,
        properties=properties,
        content_type=headers.get("content-type"),
        protocol="stomp",
    )


def message_headers(
    message: WireMessage,
    subscription: str,
    ack_id: str,
    delivery_count: int,
    destination: str | None = None,
    *,
    queue_routing: int = RoutingType.ANYCAST,
) -> list[tuple[str, str]]:
    """The headers of the MESSAGE frame for a delivery; ``queue_routing`` is the routing type of the queue the
    subscription takes from, which says where a message sent without one of its own went."""
    if destination is None:
        address = message[M_ADDRESS]
        # Only while the message is still at that address: a dead-lettered copy is at another one.
        sent = message[M_PROPS].get(SENT_DESTINATION)
        routing = message[M_ROUTING]
        if routing == ROUTING_DEFAULT:  # (a bare AMQP address, say): the address decided, as the queue shows
            routing = queue_routing
        destination = address if sent == address else address_to_destination(address, routing)
    headers = [
        ("destination", destination),
        ("message-id", str(message[M_ID])),
        ("subscription", subscription),
        ("ack", ack_id),
        ("persistent", "true" if message[M_DURABLE] else "false"),
        ("priority", str(message[M_PRIORITY])),
        ("timestamp", str(message[M_TIMESTAMP])),
        ("expires", str(message[M_EXPIRATION])),
    ]
    if delivery_count > 1:
        headers.append(("redelivered", "true"))
    if message[M_CONTENT_TYPE] is not None:
        headers.append(("content-type", message[M_CONTENT_TYPE]))
    for name, value in message[M_PROPS].items():
        if name not in FRAME_HEADERS and not name.startswith(ENCODING_PREFIX):
            headers.append((name, property_text(value)))
    return headers


def body_of(message: WireMessage) -> bytes:
    return bytes(message[M_BODY])


def _int_header(headers: dict[str, str], name: str, default: int) -> int:
    value = headers.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConversionError(f"{name} {value[:20]!r} is not a number") from None
