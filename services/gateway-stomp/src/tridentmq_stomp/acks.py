"""Which messages a client's ACK or NACK settles, by the subscription's ack mode (no I/O, no link).

A subscription in a client ack mode keeps the MESSAGE frames it sent that the client has not acknowledged
yet, in delivery order. ``client`` is cumulative: an ACK settles its message and every one delivered before it
on that subscription. ``client-individual`` settles one message. A failover can deliver a message again
before the client acknowledged the frame from the lost link: both frames carry the same ack header, and the
ACK of each frame is accepted. ``auto`` keeps nothing: a message is settled once it is written.

An ack header is ``<subscription key>-<message id>``. STOMP 1.0 and 1.1 clients acknowledge by
``message-id`` (the same message id), with the ``subscription`` header when they have it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

AUTO = "auto"
CLIENT = "client"
CLIENT_INDIVIDUAL = "client-individual"

_DIGITS = re.compile(r"[0-9]{1,20}")  # str.isdigit() also accepts digits that int() cannot read


class Unacked:
    """The frames of one subscription that wait for the client's ACK or NACK."""

    __slots__ = ("frames", "key", "mode", "subscription_id")

    def __init__(self, subscription_id: str, key: int, mode: str) -> None:
        self.subscription_id = subscription_id
        self.key = key  # a number of the connection's, unique among its subscriptions
        self.mode = mode
        self.frames: dict[int, int] = {}  # message id -> its frames not acknowledged, in delivery order

    def ack_header(self, message_id: int) -> str:
        return f"{self.key}-{message_id}"

    def delivered(self, message_ids: Iterable[int]) -> bool:
        """Frames of these messages were written; True when they are settled at once (``auto``)."""
        if self.mode == AUTO:
            return True
        frames = self.frames
        for message_id in message_ids:
            frames[message_id] = frames.get(message_id, 0) + 1
        return False

    def settle(self, message_id: int) -> list[int]:
        """The messages an ACK or NACK of ``message_id``'s frame settles (``message_id`` must be waiting)."""
        frames = self.frames
        if self.mode == CLIENT:  # cumulative: everything delivered up to this one
            ids = []
            for pending in list(frames):
                ids.append(pending)
                del frames[pending]
                if pending == message_id:
                    break
            return ids
        count = frames.pop(message_id)
        if count > 1:
            frames[message_id] = count - 1
        return [message_id]  # for either frame: the core settles the copy it has out, if any


def locate(subscriptions: Iterable[Unacked], ack: str, subscription_id: str | None) -> tuple[Unacked, int] | None:
    """The subscription and message an ACK or NACK names (its ``id`` header, and its ``subscription`` header
    for a message id), or None when no frame waits for it."""
    key, dash, number = ack.partition("-")
    if dash:  # our ack header
        if not (_DIGITS.fullmatch(key) and _DIGITS.fullmatch(number)):
            return None
        for unacked in subscriptions:
            if unacked.key == int(key) and int(number) in unacked.frames:
                return unacked, int(number)
        return None
    if not _DIGITS.fullmatch(ack):
        return None
    message_id = int(ack)  # a message-id (STOMP 1.0 and 1.1)
    for unacked in subscriptions:
        if subscription_id in (None, unacked.subscription_id) and message_id in unacked.frames:
            return unacked, message_id
    return None
