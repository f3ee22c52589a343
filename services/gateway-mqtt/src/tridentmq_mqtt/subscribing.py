"""What a SUBSCRIBE asks of the core, without I/O: which queue a filter's subscription consumes from (its shared
group's, the session's durable one, or one of this connection's own), its window, whether its messages are done
once sent, what a filter subscribed again changes, whether it gets the retained messages, and which of those the
session keeps until the client acknowledges them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tridentmq_mqtt import convert
from tridentmq_mqtt.convert import ConversionError
from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.settings import MqttLimitsSection


class QueueKind(enum.Enum):
    SHARED = "shared"  # the group's queue: its members share the messages (durable, with the session's expiry)
    DURABLE = "durable"  # the session's own, kept for its next connection (a resumed one's too)
    CONNECTION = "connection"  # this connection's own, gone with it (temporary)


@dataclass(frozen=True, slots=True)
class Plan:
    """A subscription's queue and consumer, as the core is to be asked for them."""

    group: str | None  # the shared subscription's group
    topic_filter: str  # without ``$share/<group>/``
    pattern: str  # the core's address pattern of the filter
    kind: QueueKind
    queue: str  # for CONNECTION, the prefix of the name (the session adds what makes it unique)
    #: QoS 0 of a session that ends with its connection: may become a member of a fan-out feed, and its
    #: messages are done once sent (acknowledging them would keep nothing safe).
    fannable: bool

    @property
    def durable(self) -> bool:
        return self.kind is not QueueKind.CONNECTION


def plan(text: str, qos: int, *, v5: bool, client_id: str, persistent: bool, resumed: bool) -> Plan:
    """The queue of the subscription to ``text`` (a ``resumed`` one's is the earlier session's durable queue,
    even when this session ends with its connection). Raises ``ConversionError`` for a filter MQTT refuses."""
    group, topic_filter = convert.parse_subscription(text, shared=v5)
    pattern = convert.filter_to_pattern(topic_filter)
    kept = persistent or resumed
    if group is not None:
        kind, queue = QueueKind.SHARED, convert.shared_queue(group, topic_filter)
    else:
        kind = QueueKind.DURABLE if kept else QueueKind.CONNECTION
        queue = convert.subscription_queue(client_id, topic_filter)
    return Plan(group, topic_filter, pattern, kind, queue, fannable=qos == 0 and group is None and not kept)


def check_options(text: str, *, no_local: bool, v5: bool) -> None:
    """Options a filter cannot have: no-local on a shared subscription is a protocol error ([MQTT-3.8.3-4])."""
    group, _ = convert.parse_subscription(text, shared=v5)
    if group is not None and no_local:
        raise ConversionError("no-local on a shared subscription", rc.PROTOCOL_ERROR)


def longer_expiry(current: object, expiry_ms: int) -> int:
    """The expiry of a shared subscription's queue that a member whose session lasts ``expiry_ms`` leaves it:
    the longer of that and the queue's ``current`` one (-1: never; None: no queue yet). The group's queue lasts
    as long as its longest-lived member's session, whoever joined last: a member that ends with its connection
    must not have the queue, and the messages it gathers for a persistent member that is away, deleted."""
    if type(current) is not int:
        return expiry_ms
    if current < 0 or expiry_ms < 0:
        return -1
    return max(current, expiry_ms)


def window(qos: int, limits: MqttLimitsSection, client_receive_maximum: int) -> int:
    """Messages the core may send the subscription ahead of the client: QoS 0 a batch, QoS 1 and 2 no more than
    the client takes unacknowledged."""
    return limits.qos0_window if qos == 0 else min(limits.max_inflight, client_receive_maximum)


def keeps_its_queue(*, acknowledged: bool, qos: int) -> bool:
    """A filter subscribed again: True when the subscription keeps its queue with the new options (nothing
    queued is lost); False when a QoS 0 subscription whose messages were done once sent asks for QoS 1 or 2,
    which needs a queue whose messages wait for the client's acknowledgements."""
    return acknowledged or qos == 0


def sends_retained(retain_handling: int, *, shared: bool, new: bool) -> bool:
    """Whether a SUBSCRIBE gets the filter's retained messages: retain handling 0 always, 1 for a new
    subscription only, 2 never; a new shared subscription never (MQTT 5.0, 4.8.2)."""
    return not shared and (retain_handling == 0 or (retain_handling == 1 and new))


def keeps_retained(qos: int, *, persistent: bool) -> bool:
    """Whether a retained message a SUBSCRIBE sends at ``qos`` (the lower of the subscription's and the message's)
    goes through the session's outbox, kept until the client acknowledges it: at QoS 1 and 2 in a persistent
    session, where it is session state like any other delivery (MQTT 4.4). Otherwise it is written at once and
    kept nowhere (at QoS 0 nothing is owed; a session that ends with its connection has no next connection)."""
    return qos > 0 and persistent
