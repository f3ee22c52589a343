"""AMQP node addresses and capabilities ↔ core addresses, routing types and queues (pure functions).

An address is a core address as it is (``.`` delimited, ``*`` and ``#`` wildcards). Its routing type comes
from a prefix (``queue://``, ``topic://``, ``anycast://``, ``multicast://``, and RabbitMQ's ``/queue/`` and
``/topic/``), else from the terminus capabilities ``queue`` and ``topic`` (as Qpid JMS sends them), else
from the address itself (the core's default). ``address::queue`` (a fully qualified queue name) names one
queue of an address, for consumers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from tridentmq_shared.message import ROUTING_DEFAULT, TEMPORARY_ADDRESS_PREFIX, RoutingType
from tridentmq_shared.mqtt_queues import queue_name
from tridentmq_shared.names import name_problem

ANYCAST: Final = int(RoutingType.ANYCAST)
MULTICAST: Final = int(RoutingType.MULTICAST)
PREFIXES: Final = (
    ("queue://", ANYCAST),
    ("topic://", MULTICAST),
    ("anycast://", ANYCAST),
    ("multicast://", MULTICAST),
    ("/queue/", ANYCAST),
    ("/topic/", MULTICAST),
)
#: Capabilities that say a node's kind (Qpid JMS sends the type of the destination: a temporary topic is a topic).
CAPABILITIES: Final = {"queue": ANYCAST, "topic": MULTICAST, "temporary-queue": ANYCAST, "temporary-topic": MULTICAST}
FQQN_SEPARATOR: Final = "::"
#: The connection capability by which a client (Qpid JMS with a client id) asks that no other connection have
#: its container id meanwhile; the gateway offers it back when it holds the id.
SOLE_CONNECTION: Final = "sole-connection-for-container"
#: The queues that mark a container id as held (``container_id_lock``); ``$`` keeps them out of reach of
#: wildcard subscriptions.
CONTAINER_ID_LOCK_PREFIX: Final = "$amqp.lock."


class ConversionError(ValueError):
    """An address the gateway cannot map (the attach is refused with ``amqp:invalid-field``)."""


@dataclass(frozen=True, slots=True)
class Node:
    address: str
    routing: int  # RoutingType, or ROUTING_DEFAULT: whatever the address has
    queue: str | None = None  # the queue of a fully qualified queue name


def resolve(address: str, capabilities: Iterable[str] = ()) -> Node:
    """The core node an AMQP source or target address names."""
    routing = ROUTING_DEFAULT
    for prefix, prefixed in PREFIXES:
        if address.startswith(prefix):
            address, routing = address[len(prefix) :], prefixed
            break
    else:
        for capability in capabilities:
            if capability in CAPABILITIES:
                routing = CAPABILITIES[capability]
                break
    queue = None
    if FQQN_SEPARATOR in address:
        address, _, queue = address.partition(FQQN_SEPARATOR)
        if not queue:
            raise ConversionError("a fully qualified queue name needs a queue after '::'")
        checked_name(queue, "queue name")
    if not address:
        raise ConversionError("the address is empty")
    return Node(checked_name(address), routing, queue)


def checked_name(name: str, kind: str = "address") -> str:
    """``name`` if it keeps the rules of every core name, else the attach is refused (``amqp:invalid-field``)
    here rather than by the core, or not at all: a NUL or other control character, or too long."""
    problem = name_problem(name, kind)
    if problem is not None:
        raise ConversionError(problem)
    return name


def capability_of(routing: int) -> str | None:
    """The capability that tells a client what kind of node it attached to."""
    return "topic" if routing == MULTICAST else "queue" if routing == ANYCAST else None


def durable_subscription_queue(container_id: str, link_name: str) -> str:
    """The queue of a durable subscription: the client's container id and the link name (the JMS client id
    and subscription name), as in Artemis, so that a reconnecting client finds it again."""
    return f"{container_id}.{link_name}"


def container_id_lock(container_id: str) -> str:
    """The queue whose existence on the core says a connection holds ``container_id`` (see ``id_locks``). Named
    as the other gateways' locks are (readable, then a hash): any container id makes a name within the core's
    rules."""
    return queue_name(CONTAINER_ID_LOCK_PREFIX, container_id, "")


def shared_subscription_queue(container_id: str, link_name: str, *, shared_globally: bool) -> str:
    """The queue of a JMS 2.0 shared subscription. Qpid JMS names each link ``<subscription>``, then
    ``<subscription>|2`` ... for more consumers on one connection (``|volatile1`` ... when not durable); the
    name before ``|`` is the subscription's. Its client id (the container id) scopes it, unless the client
    set none (capability ``global``)."""
    name = link_name.split("|", 1)[0]
    return name if shared_globally else durable_subscription_queue(container_id, name)


def temporary_address(connection_id: str, number: int) -> str:
    """The address of a dynamic node (a temporary queue of this connection)."""
    return f"{TEMPORARY_ADDRESS_PREFIX}amqp.{connection_id}.{number}"
