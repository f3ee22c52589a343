"""What happens to messages the queues deliver: the queues' ``DeliverySink``. A durable delivery goes out once
its delivery count is safe; each delivery is timed and audited; an acknowledged message is counted,
journaled and audited; an expired one goes to the dead letters' expiry handling."""

from __future__ import annotations

from tridentmq_core.audit_events import AuditEvents
from tridentmq_core.counters import Counters
from tridentmq_core.dead_letters import DeadLetters
from tridentmq_core.latency import SMALL_BUCKETS, SMALL_MS, LatencyHistogram, bucket_of
from tridentmq_core.queues import Consumer, LinkSession, Queue
from tridentmq_core.store.base import Store
from tridentmq_shared.link.codec import MAKE_AND_SUBSCRIBE_VERSION
from tridentmq_shared.message import M_DURABLE, M_ID, M_TIMESTAMP, WireMessage


class Deliveries:
    def __init__(
        self,
        *,
        store: Store,
        dead_letters: DeadLetters,
        audit: AuditEvents,
        counters: Counters,
        latency: LatencyHistogram,
        time_in_queue: LatencyHistogram,
        queues: dict[str, Queue],
        dirty: set[LinkSession],
        to_dispatch: set[Queue],
    ) -> None:
        self.store = store
        self.now_ms = 0  # the broker's: the queues call back without a time
        self._dead_letters = dead_letters
        self._audit = audit
        self._counters = counters
        self._latency = latency
        self._time_in_queue = time_in_queue
        self._queues = queues
        self._dirty = dirty
        self._to_dispatch = to_dispatch
        self._held: dict[int, list[tuple[Consumer, int, WireMessage]]] = {}  # store token → deliveries
        self._ended_browsers: list[Consumer] | None = None
        self._scans_cut: set[Queue] = set()

    # ------------------------------------------------------------------ the queues' sink
    def deliver_durable(self, queue: Queue, attempts: list[tuple[Consumer, int, WireMessage]]) -> None:
        """Record a dispatch's delivery attempts (consumer, delivery count, message), and send the deliveries
        only once the record is safe: after a crash a message then comes back flagged as redelivered, never
        looking like a first delivery."""
        recorded = [attempt for attempt in attempts if attempt[2][M_DURABLE]] if queue.durable else []
        token = (
            self.store.update_delivery_counts(
                queue.name, [attempt[2][M_ID] for attempt in recorded], [attempt[1] for attempt in recorded]
            )
            if recorded
            else 0
        )
        if not token and self._held:
            # Only messages that wait behind their consumer's held deliveries: they go with the newest record
            # waiting (records are safe in the order they were written).
            token = next(reversed(self._held))
        if token:
            self._held.setdefault(token, []).extend(attempts)
        else:
            for consumer, delivery_count, message in attempts:
                self._send(consumer, delivery_count, message)

    def on_delivered(self, queue: Queue, consumer: Consumer, delivery_count: int, message: WireMessage) -> None:
        """Audit a delivery to a consumer (``msg.delivered``), when message events cover the message, and
        time it (with an auto-ack consumer the delivery is the acknowledgement)."""
        waited = self.now_ms - message[M_TIMESTAMP]
        if 0 <= waited < SMALL_MS:  # inlined LatencyHistogram.record: once per delivery, twice with auto-ack
            index = SMALL_BUCKETS[waited]
            times = self._time_in_queue
            times.counts[index] += 1
            times.sum_ms += waited
            if consumer.auto_ack:
                times = self._latency
                times.counts[index] += 1
                times.sum_ms += waited
        else:
            index = bucket_of(waited)
            self._time_in_queue.add(index, waited)
            if consumer.auto_ack:
                self._latency.add(index, waited)
        audit = self._audit
        if audit.all or (audit.durable and message[M_DURABLE]):
            audit.delivered(self.now_ms, queue, consumer, delivery_count, message)

    def on_acked(self, queue: Queue, message: WireMessage) -> None:
        """Auto-ack and last-value replacement: gone for good like an acknowledged message."""
        self.acked(queue, message, self.now_ms)

    def on_expired(self, queue: Queue, message: WireMessage) -> None:
        self._dead_letters.expired(queue, message, self.now_ms)

    def on_browse_done(self, queue: Queue, consumer: Consumer) -> None:
        """A browser saw the whole queue. From link protocol version 4 that ends it: it goes once the dispatch is
        over (see ``take_ended_browsers``), and its client sends no UNSUBSCRIBE."""
        if consumer.session.conn.version >= MAKE_AND_SUBSCRIBE_VERSION:
            if self._ended_browsers is None:
                self._ended_browsers = []
            self._ended_browsers.append(consumer)

    def take_ended_browsers(self) -> list[Consumer]:
        ended, self._ended_browsers = self._ended_browsers, None
        return ended or []

    def on_scan_cut(self, queue: Queue) -> None:
        """A dispatch stopped at the scan limit with consumers still ready: it goes on at the next tick, not in
        this flush, so that no flush scans a long queue whole."""
        self._scans_cut.add(queue)

    def resume_scans(self) -> None:
        """At a tick: dispatch again the queues whose scan was cut (see ``on_scan_cut``)."""
        if self._scans_cut:
            for queue in self._scans_cut:
                if self._queues.get(queue.name) is queue:
                    self._to_dispatch.add(queue)
            self._scans_cut.clear()

    def on_pages_ready(self, queue: Queue) -> None:
        """Paged messages were read back from disk (the shell flushes after calling this)."""
        if self._queues.get(queue.name) is queue:
            self._to_dispatch.add(queue)

    # ------------------------------------------------------------------ outcomes
    def release(self, token: int) -> None:
        """The delivery counts recorded under ``token`` are safe: send those deliveries."""
        held = self._held.pop(token, None)
        if held is not None:
            for consumer, delivery_count, message in held:
                self._send(consumer, delivery_count, message)

    def settle(
        self,
        queue: Queue,
        message: WireMessage,
        now_ms: int,
        journaled: list[int] | None = None,
        consumer: Consumer | None = None,
    ) -> None:
        """``message``, taken from ``queue``, is done with: acknowledged by ``consumer``, or confirmed by the
        node it moved to (no consumer)."""
        queue.settle(message)
        queue.acked += 1
        if queue.paged:
            self._to_dispatch.add(queue)  # it freed room: read pages back (an ack batch, a commit, a move)
        if consumer is not None:  # a client's acknowledgement (not a forward's confirmation)
            self._latency.record(now_ms - message[M_TIMESTAMP])
        self.acked(queue, message, now_ms, journaled, consumer)

    def acked(
        self,
        queue: Queue,
        message: WireMessage,
        now_ms: int,
        journaled: list[int] | None = None,
        consumer: Consumer | None = None,
    ) -> None:
        """Count, journal and audit an acknowledged message. ``journaled``: a batch's ids, to which the id is
        added for one record at the end, instead of a record; ``consumer``: the one that acknowledged it (named
        in the audit event)."""
        self._counters.acked += 1
        audit = self._audit
        if message[M_DURABLE]:
            if queue.durable:
                if journaled is None:
                    self.store.acknowledge(queue.name, [message[M_ID]])
                else:
                    journaled.append(message[M_ID])
            if audit.durable:
                audit.acked(now_ms, message, queue, consumer)
        elif audit.all:
            audit.acked(now_ms, message, queue, consumer)

    def _send(self, consumer: Consumer, delivery_count: int, message: WireMessage) -> None:
        consumer.held -= 1
        session = consumer.session
        if session.consumers.get(consumer.id) is not consumer or message[M_ID] not in consumer.in_flight:
            return  # the consumer left meanwhile: the message went back to its queue
        session.conn.deliver(consumer.id, delivery_count, message)
        self._dirty.add(session)
