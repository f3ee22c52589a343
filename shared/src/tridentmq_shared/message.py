"""The message model shared by the core and every gateway.

On the wire and inside the core a message is a plain list with fixed positions (the ``M_*`` indexes),
not an object: the core routes and delivers the very list it received, so a message costs no
re-encoding between producer and consumer. ``new_message`` builds one; ``check_message`` validates
one that came from the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Any, Final


class RoutingType(IntEnum):
    """Artemis routing types: anycast = point to point, multicast = publish/subscribe."""

    ANYCAST = 0
    MULTICAST = 1


#: ``M_ROUTING`` value meaning "let the address decide" (the auto-create default applies).
ROUTING_DEFAULT: Final = -1

M_ID: Final = 0  # int, assigned by the core (0 until then); also the delivery tag within a queue
M_ADDRESS: Final = 1  # str, canonical address
M_ROUTING: Final = 2  # int, RoutingType or ROUTING_DEFAULT
M_DURABLE: Final = 3  # bool
M_PRIORITY: Final = 4  # int 0..9
M_EXPIRATION: Final = 5  # int, ms since the epoch, 0 = never
M_TIMESTAMP: Final = 6  # int, ms since the epoch, set by the core when 0
M_GROUP: Final = 7  # str | None, message group id
M_DEDUP: Final = 8  # str | None, duplicate-detection id (producer id + sequence)
M_LVQ: Final = 9  # str | None, last-value key
M_PROPS: Final = 10  # dict[str, scalar], typed user properties
M_BODY: Final = 11  # bytes, opaque
M_CONTENT_TYPE: Final = 12  # str | None
M_PROTOCOL: Final = 13  # str | None, protocol of the producer, so a same-protocol consumer gets it back as sent
M_SCHEDULED: Final = 14  # int, ms since the epoch, 0 = deliver now
MESSAGE_FIELDS: Final = 15

#: Duplicate-detection ids the link client stamps start with this, then its producer id, ``:`` and a number
#: that grows by one per stamped message. The core keeps such ids as runs of numbers per producer instead of
#: one entry each (ids under ``$`` are the broker's own: a client's own id should not use it).
LINK_DEDUP_PREFIX: Final = "$link:"
#: A publish the link client sends again after its link dropped before the node confirmed it carries this
#: property: the id of that node, which may have stored it all the same. Another node that takes the publish
#: in sends it there to be routed (see the core's ``_send_home``), so that the copy the first node may hold
#: makes it a duplicate under the producer's id, instead of both copies reaching consumers as new messages.
HOME_PROPERTY: Final = "$link.home"

DEFAULT_PRIORITY: Final = 4
#: Addresses of gateways' temporary (reply) queues start with this. The core never auto-creates a queue
#: there, so a reply that arrives after its requester left is dropped instead of kept for ever.
TEMPORARY_ADDRESS_PREFIX: Final = "tmp."
MAX_PRIORITY: Final = 9
#: Latest time a message may carry (its timestamp, expiration or scheduled delivery): 9999-12-31T23:59:59.999Z
#: in ms since the epoch. Times are turned into microseconds (audit) and added to (delays, redelivery), and
#: must stay far inside 64 bits doing so; no client means a later date.
MAX_TIME_MS: Final = 253_402_300_799_999
#: Largest message id (ids are signed 64-bit integers in every protocol that shows them).
MAX_MESSAGE_ID: Final = 2**63 - 1
#: Most user properties a message may carry (a link peer refuses a message with more as malformed).
MAX_PROPERTIES: Final = 256
#: Properties named under this prefix carry a protocol's original encoding of what the core model has no field
#: for (``$enc.amqp.properties`` ...), so that a consumer of the same protocol gets the message as it was sent;
#: the other protocols never show them.
ENCODING_PREFIX: Final = "$enc."

PropertyValue = str | int | float | bool | bytes | None
WireMessage = list[Any]

_SCALARS: Final = (str, int, float, bool, bytes, type(None))
_OPTIONAL_STR: Final = (str, type(None))


def new_message(
    address: str,
    body: bytes,
    *,
    routing: int = ROUTING_DEFAULT,
    durable: bool = False,
    priority: int = DEFAULT_PRIORITY,
    expiration_ms: int = 0,
    group_id: str | None = None,
    dedup_id: str | None = None,
    last_value_key: str | None = None,
    properties: Mapping[str, PropertyValue] | None = None,
    content_type: str | None = None,
    protocol: str | None = None,
    scheduled_ms: int = 0,
) -> WireMessage:
    """Build a wire message; the core fills in the id and the timestamp."""
    return [
        0,
        address,
        int(routing),
        durable,
        priority,
        expiration_ms,
        0,
        group_id,
        dedup_id,
        last_value_key,
        dict(properties) if properties else {},
        body,
        content_type,
        protocol,
        scheduled_ms,
    ]


def property_text(value: object) -> str:
    """A property value as text, for protocols whose headers are strings (STOMP headers, MQTT 5 user
    properties): booleans as ``true``/``false``, bytes as UTF-8 (invalid bytes replaced), None as empty."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def check_message(m: Any, max_properties: int = MAX_PROPERTIES) -> str | None:
    """Return what is wrong with a message that came off the wire, or None when it is well formed."""
    if type(m) is not list or len(m) != MESSAGE_FIELDS:
        return f"a message is a list of {MESSAGE_FIELDS} fields"
    (
        _id,
        address,
        routing,
        durable,
        priority,
        expiration,
        timestamp,
        group,
        dedup,
        lvq,
        props,
        body,
        ctype,
        proto,
        scheduled,
    ) = m
    # One expression for the common, valid case: this runs for every message the core receives.
    if (
        type(_id) is int
        and 0 <= _id <= MAX_MESSAGE_ID
        and type(address) is str
        and address
        and type(routing) is int
        and -1 <= routing <= 1
        and type(durable) is bool
        and type(priority) is int
        and 0 <= priority <= MAX_PRIORITY
        and type(expiration) is int
        and 0 <= expiration <= MAX_TIME_MS
        and type(timestamp) is int
        and 0 <= timestamp <= MAX_TIME_MS
        and type(scheduled) is int
        and 0 <= scheduled <= MAX_TIME_MS
        and type(body) is bytes
        and type(props) is dict
        and (group is None or type(group) is str)
        and (dedup is None or type(dedup) is str)
        and (lvq is None or type(lvq) is str)
        and (ctype is None or type(ctype) is str)
        and (proto is None or type(proto) is str)
    ):
        return _check_properties(props, max_properties) if props else None
    return _explain(m)


def _check_properties(props: dict[Any, Any], max_properties: int) -> str | None:
    if len(props) > max_properties:
        return f"more than {max_properties} properties"
    for key, value in props.items():
        if type(key) is not str:
            return "property names must be strings"
        if not isinstance(value, _SCALARS):
            return f"property {key[:64]!r} has a value of unsupported type {type(value).__name__}"
    return None


def _explain(m: list[Any]) -> str:
    """The first problem of a message that failed ``check_message``'s fast test (never echoes values)."""
    (_id, address, routing, durable, priority, expiration, timestamp, _, _, _, props, body, _, _, scheduled) = m
    if type(_id) is not int or type(expiration) is not int or type(timestamp) is not int:
        return "message id, expiration and timestamp must be integers"
    if type(scheduled) is not int:
        return "scheduled delivery time must be an integer"
    if not 0 <= _id <= MAX_MESSAGE_ID:
        return f"message id must be within 0..{MAX_MESSAGE_ID}"
    for name, value in (("expiration", expiration), ("timestamp", timestamp), ("scheduled delivery time", scheduled)):
        if not 0 <= value <= MAX_TIME_MS:
            return f"{name} must be within 0..{MAX_TIME_MS} (ms since the epoch, at most year 9999)"
    if type(address) is not str or not address:
        return "message address must be a non-empty string"
    if type(routing) is not int or routing not in (ROUTING_DEFAULT, 0, 1):
        return "unknown routing type"
    if type(durable) is not bool:
        return "durable must be a boolean"
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        return f"priority must be an integer 0..{MAX_PRIORITY}"
    if type(body) is not bytes:
        return "message body must be bytes"
    if type(props) is not dict:
        return "properties must be a map"
    return "group id, dedup id, last-value key, content type and protocol must be strings or nil"


def time_problem(name: str, value: int) -> str | None:
    """What is wrong with a time (ms since the epoch, 0 = none) a client gave, or None: for gateways, which
    refuse it with their protocol's error before the core would close their link over it."""
    if 0 <= value <= MAX_TIME_MS:
        return None
    return f"{name} must be within 0..{MAX_TIME_MS} (ms since the epoch, at most year 9999)"


#: The header fields a selector sees under these names, whatever the message's properties of the same names
#: (``JMSCorrelationID`` and ``JMSType`` when the message has the property they are taken from).
SELECTOR_HEADERS: Final = frozenset(
    {
        "JMSPriority",
        "JMSDeliveryMode",
        "JMSTimestamp",
        "JMSExpiration",
        "JMSMessageID",
        "AMQAddress",
        "JMSXGroupID",
        "JMSCorrelationID",
        "JMSType",
    }
)
#: Properties a selector also sees as JMS header fields, as ActiveMQ and Artemis map STOMP's headers (the
#: AMQP gateway keeps a correlation-id under the same name): ``correlation-id`` is no identifier a selector
#: could name.
_SELECTOR_ALIASES: Final = (("correlation-id", "JMSCorrelationID"), ("type", "JMSType"))


def selector_view(m: WireMessage) -> dict[str, PropertyValue]:
    """The names a selector can test: user properties plus the JMS-style header fields."""
    view: dict[str, PropertyValue] = dict(m[M_PROPS])
    view["JMSPriority"] = m[M_PRIORITY]
    view["JMSDeliveryMode"] = "PERSISTENT" if m[M_DURABLE] else "NON_PERSISTENT"
    view["JMSTimestamp"] = m[M_TIMESTAMP]
    view["JMSExpiration"] = m[M_EXPIRATION]
    view["JMSMessageID"] = str(m[M_ID])
    view["AMQAddress"] = m[M_ADDRESS]
    if m[M_GROUP] is not None:
        view["JMSXGroupID"] = m[M_GROUP]
    for name, field in _SELECTOR_ALIASES:
        value = view.get(name)
        if value is not None:
            view[field] = value
    return view
