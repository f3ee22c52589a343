"""A session's QoS 1 and 2 PUBLISH packets to its client, as far as they need no I/O: the packet id a message
takes, whether the client already has it, which wait and in what order, and what the client's PUBACK, PUBREC
and PUBCOMP settle. The session writes the packets and acknowledges the core.

A message's packet id comes from its core id (``packet_id``): a message the core delivers again after a
reconnect comes back under the packet id the client knows. That is how a QoS 2 message whose PUBREC was
recorded is recognised and acknowledged to the core instead of being sent again (the client, which has
released nothing yet, would take it as a new message). Two messages whose ids collide wait for each other.

One core message has one id in every queue it is routed to, so a message matching two subscriptions of the
client comes from each of their queues under one id and one packet id. What the client has is therefore a
``Copy``: the message id and the subscription (its SUBSCRIBE's filter text) it came for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: A message for one subscription: its core id and the subscription's filter text (None in a session record
#: written before copies were told apart: then any subscription's copy of that message).
Copy = tuple[int, str | None]

#: Packet ids run from 1 to 65535 ([MQTT-2.2.1-3]: 0 is not one).
MAX_PACKET_ID = 0xFFFF


def packet_id(message_id: int) -> int:
    """The packet id of the core's message ``message_id``: the same every time the message comes."""
    return message_id % MAX_PACKET_ID + 1


class Outbound(Generic[T]):
    """The PUBLISH packets (of type ``T``) the client is to acknowledge, and those waiting to be sent."""

    __slots__ = ("_completed", "in_flight", "parked")

    def __init__(self) -> None:
        self.in_flight: dict[int, T] = {}  # packet id → what the client is to acknowledge
        # Waiting for the client's receive maximum or for a packet id in use, in the order they came (a list:
        # an empty deque is 600 bytes per connection, and this one is cut once per batch).
        self.parked: list[T] = []
        # The copies of QoS 2 flows completed on this connection (made when one is: an empty set is 216 bytes).
        self._completed: set[Copy] | None = None

    def client_has(self, message_id: int, subscription: str, released: dict[int, Copy]) -> bool:
        """Whether the client has this message already: its PUBREC is recorded in ``released`` (the session
        record's packet id → message id, kept across connections until the PUBCOMP), or its flow completed
        on this connection. The core delivers such a message again when its acknowledgement was lost (with
        a gateway or a link): it is to be acknowledged, not sent. Another subscription's copy is sent."""
        recorded = released.get(packet_id(message_id))
        if recorded is not None and recorded[0] == message_id and recorded[1] in (subscription, None):
            return True
        completed = self._completed
        return completed is not None and (message_id, subscription) in completed

    def must_wait(self) -> bool:
        """A new message waits behind those already waiting (the client gets them in the order they came)."""
        return bool(self.parked)

    def sent(self, packet: int, out: T) -> None:
        self.in_flight[packet] = out

    def acknowledged(self, packet: int) -> T | None:
        """PUBACK (or a PUBREC that refuses the message): the flow is over; what it settled, if known."""
        return self.in_flight.pop(packet, None)

    def completed(self, packet: int, released: dict[int, Copy]) -> Copy | None:
        """PUBCOMP: the packet id is free; the copy whose record leaves ``released`` (None: none)."""
        self.in_flight.pop(packet, None)
        copy = released.pop(packet, None)
        if copy is not None:
            if self._completed is None:
                self._completed = set()
            self._completed.add(copy)
        return copy

    def unpark(self, send: Callable[[T], bool]) -> int:
        """Offer the waiting packets to ``send`` in order until it takes one no more; how many it took."""
        parked = self.parked
        sent = 0
        for out in parked:
            if not send(out):
                break
            sent += 1
        if sent:
            del parked[:sent]
        return sent

    def clear(self) -> None:
        """The connection has ended: nothing is sent or acknowledged any more (what it held refers back to its
        session, which must not wait for the cyclic collector)."""
        self.in_flight.clear()
        self.parked = []

    def forget_parked(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Drop the waiting packets ``unwanted`` picks (those of a subscription that ends); returns them."""
        dropped = [out for out in self.parked if unwanted(out)]
        if dropped:
            self.parked = [out for out in self.parked if not unwanted(out)]
        return dropped
