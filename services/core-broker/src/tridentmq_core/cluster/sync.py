"""Replies that wait until the other nodes know a binding: a subscribe is confirmed only once routable.

A client that creates a queue or opens a consumer on this node changes the bindings the other nodes route
by. Without waiting, a message published on another node right after the client was told "subscribed" (an
MQTT SUBACK, a STOMP receipt) is matched against the bindings that node had before, and may be routed
nowhere though acknowledged. So such a reply is held until every node connected to this one has applied
the change: the change goes out at once with a sync number, and each node acknowledges the highest number
it applied. A node whose connection closes is not waited for (it gets every binding again when it joins),
and neither is one that does not acknowledge within ``timeout_ms`` (logged: a bug or a node about to be
declared dead, never a client left hanging).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class HeldReply:
    reply: Callable[[], None]  # sends the reply to its client
    waiting_for: set[str]  # connection ids of the nodes that have not acknowledged yet
    deadline_ms: int


class BindingSync:
    """Held replies by sync number; pure bookkeeping, the cluster manager sends and receives."""

    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self.number = 0  # the last sync number handed out
        self.unsent = 0  # the highest number not sent to the other nodes yet (0: none)
        self._held: dict[int, HeldReply] = {}
        self.acked: dict[str, int] = {}  # connection id → the highest number it acknowledged

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, reply: Callable[[], None], peers: set[str], now_ms: int) -> int:
        """Hold ``reply`` until every connection in ``peers`` acknowledged the returned sync number."""
        self.number += 1
        self.unsent = self.number
        self._held[self.number] = HeldReply(reply, set(peers), now_ms + self.timeout_ms)
        return self.number

    def announce(self) -> int:
        """A sync number for the next change sent, with no reply held: the caller watches ``acked``."""
        self.number += 1
        self.unsent = self.number
        return self.number

    def acknowledged(self, peer: str, number: Any) -> None:
        """``peer`` applied every change up to sync ``number``."""
        if type(number) is not int:
            return
        if number > self.acked.get(peer, 0):
            self.acked[peer] = number
        for held_number, held in list(self._held.items()):
            if held_number > number:
                break  # numbers only grow: the rest were sent later
            held.waiting_for.discard(peer)
            if not held.waiting_for:
                del self._held[held_number]
                held.reply()

    def sweep(self, live_peers: set[str], now_ms: int) -> list[set[str]]:
        """Stop waiting for closed connections and for replies past their deadline; the peers given up on
        because of the deadline, one set per reply released late."""
        late = []
        for number, held in list(self._held.items()):
            held.waiting_for &= live_peers
            if held.waiting_for and now_ms >= held.deadline_ms:
                late.append(set(held.waiting_for))
                held.waiting_for.clear()
            if not held.waiting_for:
                del self._held[number]
                held.reply()
        return late
