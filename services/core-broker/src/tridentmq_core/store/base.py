"""The ``Store`` protocol: what the broker asks of persistence.

The broker calls these as state changes. ``add_message`` returns 0 when the message is already safe (the
memory store, always) or a token that the store later passes to the callback given to ``attach`` once the
write is safe (the journal's group commit); only then does the broker confirm the producer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tridentmq_shared.message import WireMessage

Completion = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class DurableSnapshot:
    """The broker's durable state at one instant, which a journal compaction writes as its new base."""

    addresses: list[tuple[str, list[int], bool]]  # name, routing types, auto-created
    queues: list[dict[str, Any]]
    messages: list[tuple[WireMessage, list[str], list[int]]]  # message, its queues, delivery count per queue
    dedup_ids: list[tuple[str, int]] = field(default_factory=list)  # remembered ids, arrival ms, oldest first
    through_ids: list[tuple[str, str, int]] = field(default_factory=list)  # see ``Store.note_through``


class Store(Protocol):
    def attach(self, on_durable: Completion) -> None:
        """``on_durable(token)`` is called when the write that returned ``token`` is safe."""

    def add_address(self, name: str, routing_types: tuple[int, ...], *, auto_created: bool) -> int:
        """Persist an address; 0 = already safe, else a token like ``add_message``'s."""

    def delete_address(self, name: str) -> None: ...
    def add_queue(self, spec: dict[str, Any]) -> int:
        """Persist a durable queue (or its changed spec); 0 = already safe, else a token like ``add_message``'s:
        the request that made it is answered, and other nodes told of it, only once it completes."""

    def delete_queue(self, name: str) -> int:
        """Record a durable queue's deletion; 0 = already safe, else a token like ``add_queue``'s (a crash before
        it completes brings the queue back, with its messages)."""

    def add_message(self, message: WireMessage, queues: tuple[str, ...], counts: list[int] | None = None) -> int:
        """Persist a durable message and its queue references; 0 = already safe, else a token. ``counts``: the
        delivery attempts it already had, per queue (moved or routed again from another node), in the same
        record, so that no crash keeps the message without them. Not within a transaction."""

    def acknowledge(self, queue: str, message_ids: list[int]) -> None: ...
    def update_delivery_counts(self, queue: str, message_ids: list[int], counts: list[int]) -> int:
        """Record delivery attempts; 0 = already safe, else a token like ``add_message``'s."""

    def note_through(self, entries: list[tuple[str, str, int]]) -> int:
        """Durable publishes written through to another node, stored nowhere here: (producer's dedup id, that
        node's id, arrival ms), for a resend to this node's next life. 0 = already safe, else a token like
        ``add_message``'s: the publishes leave only once it completes."""

    def begin_transaction(self) -> None:
        """The ``add_message`` and ``acknowledge`` calls up to ``commit_transaction`` are one unit: after a
        crash all of them count or none does. Their own tokens do not mean the unit is safe."""

    def commit_transaction(self) -> int:
        """End the unit; 0 = already safe (or nothing was written), else a token for all of it."""
