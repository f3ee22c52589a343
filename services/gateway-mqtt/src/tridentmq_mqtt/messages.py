"""MQTT application messages ↔ core messages (pure).

The body is the payload, untouched. QoS 1 and 2 messages are durable. A 5.0 message expiry interval becomes
the core expiration, the content type the core content type, and user properties become core properties,
so that a STOMP or AMQP consumer sees them as headers or application properties (and properties set by
those protocols reach 5.0 subscribers as user properties). What only MQTT can express travels in properties
named ``mqtt_*``: the publish QoS, the retain flag, the payload format, the response topic, the correlation
data, the publishing client (for no-local), and, when names repeat or clash with ours, the user properties
as a list.
"""

from __future__ import annotations

import json
import math
from typing import Final

from tridentmq_mqtt.convert import is_topic_name
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_shared.message import (
    DEFAULT_PRIORITY,
    ENCODING_PREFIX,
    M_ADDRESS,
    M_CONTENT_TYPE,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_LVQ,
    M_PROPS,
    M_ROUTING,
    MAX_PROPERTIES,
    RoutingType,
    WireMessage,
    property_text,
)

PROTOCOL: Final = "mqtt"
QOS: Final = "mqtt_qos"
RETAIN: Final = "mqtt_retain"
CLIENT: Final = "mqtt_client"
PAYLOAD_FORMAT: Final = "mqtt_payload_format"
RESPONSE_TOPIC: Final = "mqtt_response_topic"
CORRELATION_DATA: Final = "mqtt_correlation_data"
USER_PROPERTIES: Final = "mqtt_user_properties"
TOPIC: Final = "mqtt_topic"  # the topic of a retained message (its last-value key in the retained store)
SUBSCRIPTION_ID: Final = "mqtt_subscription_id"  # of the subscription a retained message in an outbox is for
INTERNAL: Final = frozenset(
    {QOS, RETAIN, CLIENT, PAYLOAD_FORMAT, RESPONSE_TOPIC, CORRELATION_DATA, USER_PROPERTIES, TOPIC, SUBSCRIPTION_ID}
)
_MAX_EXPIRY: Final = 0xFFFFFFFF
_MULTICAST: Final = int(RoutingType.MULTICAST)
_ANYCAST: Final = int(RoutingType.ANYCAST)
_PLAIN: Final = frozenset({QOS, CLIENT})  # the properties every MQTT message has


def to_message(
    address: str, payload: bytes, qos: int, properties: Properties, client_id: str, now_ms: int, *, retain: bool = False
) -> WireMessage:
    """The core message of a PUBLISH (or will) to the topic at ``address``."""
    props: dict[str, str | int | bytes | bool | float | None] = {QOS: qos, CLIENT: client_id}
    if retain:
        props[RETAIN] = True
    expiration = 0
    if properties is not NO_PROPERTIES:
        if properties.message_expiry_interval is not None:
            expiration = now_ms + properties.message_expiry_interval * 1000
        if properties.payload_format_indicator:
            props[PAYLOAD_FORMAT] = properties.payload_format_indicator
        if properties.response_topic is not None:
            props[RESPONSE_TOPIC] = properties.response_topic
        if properties.correlation_data is not None:
            props[CORRELATION_DATA] = properties.correlation_data
        user = properties.user_properties
        if user:
            names = [name for name, _ in user]
            if (
                len(set(names)) < len(names)
                or not INTERNAL.isdisjoint(names)
                or len(names) > MAX_PROPERTIES - len(INTERNAL)  # room for ours: the core ends a link sending more
            ):
                props[USER_PROPERTIES] = json.dumps(user, ensure_ascii=False)  # order and repeats kept
            else:
                props.update(user)
    # The fields of new_message(address, payload, routing=MULTICAST, durable=qos > 0, expiration_ms=expiration,
    # properties=props, content_type=..., protocol=PROTOCOL), built directly: this runs for every PUBLISH.
    return [
        0,
        address,
        _MULTICAST,
        qos > 0,
        DEFAULT_PRIORITY,
        expiration,
        0,
        None,
        None,
        None,
        props,
        payload,
        properties.content_type,
        PROTOCOL,
        0,
    ]


def published_qos(message: WireMessage) -> int:
    """The QoS the message was published with; for other protocols', 1 when durable, else 0."""
    qos = message[M_PROPS].get(QOS)
    if type(qos) is int and 0 <= qos <= 2:
        return qos
    return 1 if message[M_DURABLE] else 0


def was_retained(message: WireMessage) -> bool:
    return message[M_PROPS].get(RETAIN) is True


def retained_delivery(retained: WireMessage, outbox: str, qos: int, subscription_id: int | None) -> WireMessage:
    """A copy of a retained message (as the retained store holds it, its topic in ``TOPIC``) for a session's
    outbox queue ``outbox``, to be delivered at ``qos`` (1 or 2) for a subscription with ``subscription_id``. It is
    a new durable message of that queue alone: the core keeps it until the client has acknowledged it and
    delivers it again, counted, to the session's next connection, as it does a subscription's messages."""
    copy = list(retained)
    copy[M_ID] = 0
    copy[M_ADDRESS] = outbox
    copy[M_ROUTING] = _ANYCAST
    copy[M_DURABLE] = True
    copy[M_DEDUP] = None
    copy[M_LVQ] = None
    props = {**retained[M_PROPS], QOS: qos, RETAIN: True}  # delivered with the RETAIN flag, as on subscribe
    if subscription_id is not None:
        props[SUBSCRIPTION_ID] = subscription_id
    copy[M_PROPS] = props
    return copy


def outbox_subscription_id(message: WireMessage) -> int | None:
    """The subscription identifier an outbox's copy is delivered with (see ``retained_delivery``)."""
    sid = message[M_PROPS].get(SUBSCRIPTION_ID)
    return sid if type(sid) is int else None


def publish_properties(message: WireMessage, now_ms: int, subscription_id: int | None) -> Properties:
    """The 5.0 properties of the PUBLISH that delivers ``message`` (what is left of its expiry interval,
    rounded up)."""
    props = message[M_PROPS]
    expiration = message[M_EXPIRATION]
    content_type = message[M_CONTENT_TYPE]
    if (
        not expiration
        and content_type is None
        and subscription_id is None
        and len(props) <= 2
        and all(name in _PLAIN for name in props)
    ):
        return NO_PROPERTIES  # the common case: a plain MQTT message
    fmt = props.get(PAYLOAD_FORMAT)
    response_topic = props.get(RESPONSE_TOPIC)
    correlation = props.get(CORRELATION_DATA)
    return Properties(
        payload_format_indicator=1 if fmt == 1 else None,
        message_expiry_interval=(
            min(max(math.ceil((expiration - now_ms) / 1000), 1), _MAX_EXPIRY) if expiration else None
        ),
        content_type=None if content_type is None else _mqtt_string(content_type),
        # Set by another protocol's client too (a STOMP header): a response topic that is no topic name would
        # be a protocol error of ours in the client's eyes, and a text correlation data is its UTF-8.
        response_topic=response_topic if type(response_topic) is str and is_topic_name(response_topic) else None,
        correlation_data=correlation if type(correlation) is bytes else _utf8(correlation),
        subscription_identifiers=(subscription_id,) if subscription_id is not None else (),
        user_properties=user_properties(props),
    )


def _utf8(value: object) -> bytes | None:
    return value.encode("utf-8", "surrogatepass") if type(value) is str else None


def user_properties(props: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """A message's properties as 5.0 user properties: all but ours, values as text. MQTT strings may not hold
    U+0000, which another protocol's property may (an AMQP binary ``correlation-id``, a STOMP header): it
    becomes U+FFFD, as on STOMP frames, rather than leave the message undeliverable to every MQTT client."""
    listed = props.get(USER_PROPERTIES)
    if type(listed) is str:
        try:
            pairs = json.loads(listed)
            return tuple((_mqtt_string(str(name)), _mqtt_string(str(value))) for name, value in pairs)
        except (ValueError, TypeError):
            pass  # not ours after all: shown as it is below
    return tuple(
        (_mqtt_string(name), _mqtt_string(property_text(value)))
        for name, value in props.items()
        if name not in INTERNAL and not name.startswith(ENCODING_PREFIX)
    )


def _mqtt_string(text: str) -> str:
    return text.replace("\x00", "\ufffd") if "\x00" in text else text
