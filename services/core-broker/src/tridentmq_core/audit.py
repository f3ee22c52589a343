"""What the broker reports to the audit stream: the sink's interface (``AuditSink``) and the sink of a node whose
audit is off (``NullAuditSink``). The stream's files are written by ``audit_writer.FileAuditSink``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["SCHEMA_VERSION", "AuditSink", "NullAuditSink"]

#: The version every event carries (``v``).
SCHEMA_VERSION = 1


class AuditSink(Protocol):
    """Where the broker reports audit events."""

    def emit(self, ts_us: int, event: str, fields: Mapping[str, object]) -> None:
        """Record one event; ``fields`` whose value is None are omitted."""

    def emit_message(
        self,
        ts_us: int,
        event: str,
        queue: str | None,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        extra: Mapping[str, object],
    ) -> None:
        """Record a message event (two per durable message: the hot road): ``emit`` with these fields (none
        of them None but the queue, which is then left out) and ``extra``."""

    def emit_delivered(
        self,
        ts_us: int,
        queue: str,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        delivery_count: int,
        conn_id: str,
        consumer_id: str,
        client_id: str | None,
        origin_message_id: str | None = None,
    ) -> None:
        """Record a ``msg.delivered`` event (one per delivery: the hottest road, so no dict of extra fields)."""

    def emit_acked(
        self,
        ts_us: int,
        queue: str,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        conn_id: str | None,
        consumer_id: str | None,
        client_id: str | None,
        origin_message_id: str | None = None,
    ) -> None:
        """Record a ``msg.acked`` event (one per acknowledged message, as hot as ``emit_delivered``); the consumer
        fields are None when no consumer acknowledged it (auto-ack, a last-value replacement)."""

    def tick(self, ts_us: int) -> None:
        """Called about once a second: time-based roll and the ``node.heartbeat`` event."""

    def flush(self) -> None:
        """Hand the buffered events to the OS (a write, no fsync): called before confirms go out, so that the
        events of a confirmed message survive a kill of the process."""

    def close(self) -> None:
        """Seal the active segment (publish it) and stop."""


class NullAuditSink:
    """Audit disabled: every call does nothing."""

    def emit(self, ts_us: int, event: str, fields: Mapping[str, object]) -> None:
        """Ignore the event."""

    def emit_message(
        self,
        ts_us: int,
        event: str,
        queue: str | None,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        extra: Mapping[str, object],
    ) -> None:
        """Ignore the event."""

    def emit_delivered(
        self,
        ts_us: int,
        queue: str,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        delivery_count: int,
        conn_id: str,
        consumer_id: str,
        client_id: str | None,
        origin_message_id: str | None = None,
    ) -> None:
        """Ignore the event."""

    def emit_acked(
        self,
        ts_us: int,
        queue: str,
        address: str,
        message_id: str,
        size: int,
        protocol: str,
        sent_ts_us: int,
        conn_id: str | None,
        consumer_id: str | None,
        client_id: str | None,
        origin_message_id: str | None = None,
    ) -> None:
        """Ignore the event."""

    def tick(self, ts_us: int) -> None:
        """Nothing to do."""

    def flush(self) -> None:
        """Nothing to do."""

    def close(self) -> None:
        """Nothing to do."""
