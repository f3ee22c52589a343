"""The ``Store`` backed by the journal: every durable change becomes a record; a durable message's token
completes when the writer thread has synced its record."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from tridentmq_core.store.base import Completion
from tridentmq_core.store.journal import Journal
from tridentmq_core.store.records import RecordType
from tridentmq_shared.message import WireMessage


class JournalStore:
    def __init__(self, journal: Journal, call_in_loop: Callable[[Callable[[], None]], object]) -> None:
        """``call_in_loop`` runs a callable on the event loop thread (``loop.call_soon_threadsafe``)."""
        self.journal = journal
        self._call_in_loop = call_in_loop
        self._waiting: deque[int] = deque()
        self._on_durable: Completion = lambda _token: None
        journal.on_synced = self._synced_in_writer

    def attach(self, on_durable: Completion) -> None:
        self._on_durable = on_durable

    def add_address(self, name: str, routing_types: tuple[int, ...]) -> None:
        self.journal.append(RecordType.ADD_ADDRESS, [name, list(routing_types)])

    def delete_address(self, name: str) -> None:
        self.journal.append(RecordType.DELETE_ADDRESS, [name])

    def add_queue(self, spec: dict[str, Any]) -> None:
        self.journal.append(RecordType.ADD_QUEUE, [spec])

    def delete_queue(self, name: str) -> None:
        self.journal.append(RecordType.DELETE_QUEUE, [name])

    def add_message(self, message: WireMessage, queues: tuple[str, ...]) -> int:
        token = self.journal.append(RecordType.MESSAGE, [message, list(queues)])
        self._waiting.append(token)
        return token

    def acknowledge(self, queue: str, message_id: int) -> None:
        self.journal.append(RecordType.ACK, [queue, message_id])

    def update_delivery_count(self, queue: str, message_id: int, count: int) -> int:
        token = self.journal.append(RecordType.DELIVERY_COUNT, [queue, message_id, count])
        self._waiting.append(token)
        return token

    def _synced_in_writer(self, upto: int) -> None:
        self._call_in_loop(lambda: self._complete(upto))

    def _complete(self, upto: int) -> None:
        waiting = self._waiting
        while waiting and waiting[0] <= upto:
            self._on_durable(waiting.popleft())
