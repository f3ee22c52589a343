"""The in-memory store: nothing survives a restart, every write is "safe" at once."""

from __future__ import annotations

from typing import Any

from tridentmq_core.store.base import Completion
from tridentmq_shared.message import WireMessage


class MemoryStore:
    def attach(self, on_durable: Completion) -> None:
        self._on_durable = on_durable

    def add_address(self, name: str, routing_types: tuple[int, ...], *, auto_created: bool) -> int:
        return 0

    def delete_address(self, name: str) -> None:
        pass

    def add_queue(self, spec: dict[str, Any]) -> int:
        return 0

    def delete_queue(self, name: str) -> int:
        return 0

    def add_message(self, message: WireMessage, queues: tuple[str, ...], counts: list[int] | None = None) -> int:
        return 0

    def acknowledge(self, queue: str, message_ids: list[int]) -> None:
        pass

    def update_delivery_counts(self, queue: str, message_ids: list[int], counts: list[int]) -> int:
        return 0

    def note_through(self, entries: list[tuple[str, str, int]]) -> int:
        return 0

    def begin_transaction(self) -> None:
        pass

    def commit_transaction(self) -> int:
        return 0
