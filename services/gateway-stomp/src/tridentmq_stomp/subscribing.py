"""What a STOMP SUBSCRIBE asks of the core (no I/O, no link): the queue to consume, whether the gateway makes
it first, the consumer's window and where the selector applies.

- An anycast destination is consumed as it is: the queue of that name.
- A fully qualified queue name (``address::queue``, with ``/queue/`` or ``/topic/``) is that queue of the
  address, consumed as it is; the core makes a missing one on the address, durable, with the destination's
  routing type.
- A multicast one (``/topic/``) gets a subscription queue: a durable one named ``<client-id>.<name>`` with the
  ``durable-subscription-name`` (or ``activemq.subscriptionName``) header, which needs the CONNECT's
  ``client-id``; else a temporary one of this connection, gone with it.
- A selector filters the queue the gateway makes (only matching messages are kept for the subscription);
  on a queue it does not make, the consumer filters.
- The window is ``consumer-window-size`` (or ``activemq.prefetchSize``) within 1..``max_prefetch``, the
  gateway's ``prefetch`` when absent, and ``max_prefetch`` for 0 or below ("unlimited"); a value that is not
  an integer is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from tridentmq_shared.message import ROUTING_DEFAULT, RoutingType
from tridentmq_shared.names import name_problem
from tridentmq_stomp.convert import FQQN_SEPARATOR

_INTEGER = re.compile(r"-?[0-9]+")
_WINDOW_HEADERS = ("consumer-window-size", "activemq.prefetchSize")


@dataclass(frozen=True, slots=True)
class QueueToMake:
    name: str
    address: str
    durable: bool
    selector: str | None


@dataclass(frozen=True, slots=True)
class Plan:
    queue: str
    make: QueueToMake | None
    temporary: bool  # the queue is this connection's, deleted when the subscription ends
    window: int
    consumer_selector: str | None
    #: A fully qualified queue's routing type, for the core to make it with when it is missing (None: not one).
    routing: int | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """The SUBSCRIBE cannot be done: the ERROR frame's ``message`` and detail."""

    message: str
    detail: str


def durable_name(headers: Mapping[str, str]) -> str | None:
    return headers.get("durable-subscription-name") or headers.get("activemq.subscriptionName")


def window(headers: Mapping[str, str], prefetch: int, max_prefetch: int) -> int | None:
    """The subscription's window, or None when the client's header is not an integer."""
    asked = next((value for name in _WINDOW_HEADERS if (value := headers.get(name))), None)
    if asked is None:
        return prefetch
    if not _INTEGER.fullmatch(asked):
        return None
    if len(asked) > 10:  # beyond any window either way: as many as the gateway allows
        return max_prefetch
    size = int(asked)
    return min(size, max_prefetch) if size > 0 else max_prefetch


def plan(
    address: str,
    routing: int,
    headers: Mapping[str, str],
    *,
    client_id: str | None,
    temporary_queue: str,
    prefetch: int,
    max_prefetch: int,
) -> Plan | Refused:
    """``address`` and ``routing`` are the destination's; ``temporary_queue`` names the subscription queue of a
    non-durable multicast subscription."""
    selector = headers.get("selector") or None
    size = window(headers, prefetch, max_prefetch)
    if size is None:
        return Refused("invalid header", f"{' or '.join(_WINDOW_HEADERS)} must be an integer (0 or below: unlimited)")
    if FQQN_SEPARATOR in address:
        fully_qualified = None if routing == ROUTING_DEFAULT else routing
        return Plan(address, None, temporary=False, window=size, consumer_selector=selector, routing=fully_qualified)
    if routing != RoutingType.MULTICAST:
        return Plan(address, None, temporary=False, window=size, consumer_selector=selector)
    name = durable_name(headers)
    if name is None:
        make = QueueToMake(temporary_queue, address, durable=False, selector=selector)
        return Plan(temporary_queue, make, temporary=True, window=size, consumer_selector=None)
    if not client_id:
        return Refused("missing header", "a durable subscription needs client-id on CONNECT")
    queue = f"{client_id}.{name}"
    problem = name_problem(queue, "durable subscription queue (client-id.name)")
    if problem is not None:  # the core would refuse to make it: say so in STOMP's words
        return Refused("invalid header", problem)
    make = QueueToMake(queue, address, durable=True, selector=selector)
    return Plan(queue, make, temporary=False, window=size, consumer_selector=None)
