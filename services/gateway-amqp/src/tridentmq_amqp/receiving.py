"""What a receiving link (the client's consumer) asks of the core, without I/O or proton: the queue it takes
from (the node's queue, a JMS shared subscription's, a durable subscription's, or a volatile one of this
connection), whether it browses, whether its messages are settled when sent, where its selector applies, and
the capability that tells the client what kind of node it attached to."""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from tridentmq_amqp import convert
from tridentmq_shared.message import ROUTING_DEFAULT


class QueueKind(enum.Enum):
    QUEUE = "queue"  # the node's own queue (anycast, or a fully qualified queue name)
    SHARED = "shared"  # a JMS 2.0 shared subscription: every link of that name shares one queue
    DURABLE_SUBSCRIPTION = "durable-subscription"  # found again by the client's container id and link name
    VOLATILE_SUBSCRIPTION = "volatile-subscription"  # this link's own, gone with the connection (temporary)


@dataclass(frozen=True, slots=True)
class Source:
    """What the client's source terminus asks for."""

    node: convert.Node  # its address, resolved (a dynamic source's temporary queue already made)
    capabilities: Collection[str]
    durable: bool  # terminus durability other than none, or expiry policy never
    copy: bool  # distribution mode copy: browse a queue (as in Artemis)
    settled: bool  # the client asked for pre-settled deliveries
    selector: str | None  # its JMS selector filter


@dataclass(frozen=True, slots=True)
class Plan:
    kind: QueueKind
    queue: str  # "" for a volatile subscription: the session names it
    routing: int  # the node's routing type: anycast unless the address or a capability says multicast
    durable: bool  # a subscription whose queue outlives the link (a durable or a durable shared one)
    browse: bool
    presettled: bool  # deliveries are settled when sent (browsing, or the client asked)
    queue_selector: str | None  # the subscription queue's filter (None: not a subscription, or none asked)
    consumer_selector: str | None  # the consumer's own filter
    announce: str | None  # the capability to put in the answer's source (None: the client named its own)


def plan(source: Source, *, container_id: str, link_name: str) -> Plan:
    node = source.node
    # Without a prefix or capability, a consumer takes from the anycast queue of that name (auto-created).
    routing = convert.ANYCAST if node.routing == ROUTING_DEFAULT else node.routing
    subscription = routing == convert.MULTICAST and node.queue is None
    if subscription and "shared" in source.capabilities:
        kind = QueueKind.SHARED
        queue = convert.shared_subscription_queue(
            container_id, link_name, shared_globally="global" in source.capabilities
        )
    elif subscription and source.durable:
        kind, queue = QueueKind.DURABLE_SUBSCRIPTION, convert.durable_subscription_queue(container_id, link_name)
    elif subscription:
        kind, queue = QueueKind.VOLATILE_SUBSCRIPTION, ""
    else:
        kind, queue = QueueKind.QUEUE, node.queue or node.address
    browse = source.copy and routing != convert.MULTICAST
    # A subscription's queue holds only what its selector picks. A volatile shared one's consumers filter too:
    # it may be another link's, made with another selector, until its last consumer leaves. A queue's
    # consumers each filter on their own.
    queue_filtered = subscription and (kind is not QueueKind.SHARED or source.durable)
    return Plan(
        kind,
        queue,
        routing,
        durable=subscription and source.durable,
        browse=browse,
        presettled=browse or source.settled,
        queue_selector=source.selector if subscription else None,
        consumer_selector=None if queue_filtered else source.selector,
        announce=None if source.capabilities else convert.capability_of(routing),
    )
