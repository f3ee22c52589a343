"""Drive a pure ``Broker`` the way the server shell does: client codec -> bytes -> server codec -> broker.

Every simulated client owns a ``LinkConnection(Role.CLIENT)`` and the matching server-side connection.
``Harness.sync`` moves what every client queued to the broker, flushes dispatch and moves what the broker
queued back to every client, where deliveries are filed per consumer and confirms/rejects per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tridentmq_core import queues, router, sessions
from tridentmq_core.audit import NullAuditSink
from tridentmq_core.broker import Broker
from tridentmq_core.queues import LinkSession, PagerFactory
from tridentmq_core.security import SecurityManager
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.memory import MemoryStore
from tridentmq_shared.link import codec
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import UNBOUNDED_BYTES, LinkConnection, Role, State
from tridentmq_shared.link.ops import PROTOCOL_VERSIONS, ErrorCode, NackMode
from tridentmq_shared.message import M_BODY, M_ID, M_PROPS, RoutingType, WireMessage, new_message

BASE_MS = 1_700_000_000_000
PUBLISH_WINDOW = 1000
ANYCAST = int(RoutingType.ANYCAST)
MULTICAST = int(RoutingType.MULTICAST)


@dataclass(frozen=True)
class Delivery:
    consumer_id: int
    count: int
    message: WireMessage

    @property
    def body(self) -> bytes:
        return bytes(self.message[M_BODY])

    @property
    def id(self) -> int:
        return int(self.message[M_ID])

    @property
    def props(self) -> dict[str, Any]:
        return dict(self.message[M_PROPS])


def ids(deliveries: list[Delivery]) -> list[int]:
    return [d.id for d in deliveries]


def bodies(deliveries: list[Delivery]) -> list[bytes]:
    return [d.body for d in deliveries]


class Client:
    def __init__(
        self,
        harness: Harness,
        name: str,
        user: str | None,
        password: str | None,
        peer: str,
        publish_bytes: int = UNBOUNDED_BYTES,
        versions: tuple[int, ...] = PROTOCOL_VERSIONS,
    ) -> None:
        self.h = harness
        self.name = name
        self.conn = LinkConnection(Role.CLIENT, versions=versions)
        self.server = LinkConnection(Role.SERVER)
        self.conn.hello(user, password, name)
        hello = self.server.receive_data(self.conn.data_to_send(), harness.now_s)
        assert len(hello) == 1
        assert isinstance(hello[0], ev.HelloReceived)
        principal = harness.security.authenticate(hello[0].user, hello[0].password, peer)
        conn_id = f"conn-{len(harness.clients) + 1}"
        self.server.accept(harness.broker.node_id, conn_id, PUBLISH_WINDOW, 0.0, publish_bytes=publish_bytes)
        self.session: Session = harness.broker.open_session(self.server, conn_id, principal, peer, name, harness.now_ms)
        welcomed = self.conn.receive_data(self.server.data_to_send(), harness.now_s)
        assert isinstance(welcomed[0], ev.Welcomed)
        assert self.conn.state is State.OPEN
        self.inbox: list[ev.Event] = []  # everything but deliveries, confirms and rejects
        self.got: dict[int, list[Delivery]] = {}
        self.confirmed: set[int] = set()
        self.rejected: dict[int, ev.Rejected] = {}

    # ------------------------------------------------------------------ plumbing
    def receive(self, events: list[ev.Event]) -> None:
        for event in events:
            match event:
                case ev.Deliveries(ops):
                    for _, consumer_id, count, message in ops:
                        self.got.setdefault(consumer_id, []).append(Delivery(consumer_id, count, message))
                case ev.Confirms(ranges):
                    for first, last in ranges:
                        self.confirmed.update(range(first, last + 1))
                case ev.Rejected(seq, _, _):
                    self.rejected[seq] = event
                case ev.PublishCreditGranted():
                    pass
                case _:
                    self.inbox.append(event)

    def take(self, consumer_id: int) -> list[Delivery]:
        """Deliveries received for ``consumer_id`` since the last call."""
        self.h.sync()
        return self.got.pop(consumer_id, [])

    def events(self, kind: type[Any]) -> list[Any]:
        """Pop the received events of one type."""
        found = [e for e in self.inbox if isinstance(e, kind)]
        self.inbox = [e for e in self.inbox if not isinstance(e, kind)]
        return found

    def _answer(self, req_id: int) -> ev.Reply | ev.RequestFailed:
        self.h.sync()
        found = [e for e in self.inbox if isinstance(e, ev.Reply | ev.RequestFailed) and e.req_id == req_id]
        assert len(found) == 1, self.inbox
        self.inbox.remove(found[0])
        return found[0]

    # ------------------------------------------------------------------ requests (synced)
    def create_queue(
        self, name: str, address: str | None = None, routing: int = ANYCAST, **spec: Any
    ) -> ev.Reply | ev.RequestFailed:
        full = {"name": name, "address": address or name, "routing_type": routing, **spec}
        return self._answer(self.conn.create_queue(full))

    def delete_queue(self, name: str, *, everywhere: bool = False) -> ev.Reply | ev.RequestFailed:
        return self._answer(self.conn.delete_queue(name, everywhere=everywhere))

    def subscribe(self, queue: str, /, credit: int = 100, **options: Any) -> tuple[int, ev.Reply | ev.RequestFailed]:
        credit_bytes = options.pop("credit_bytes", 0)
        req_id, consumer_id = self.conn.subscribe(queue, credit, options, credit_bytes)
        return consumer_id, self._answer(req_id)

    def consumer(self, queue: str, /, credit: int = 100, **options: Any) -> int:
        """Subscribe and insist that it worked."""
        consumer_id, answer = self.subscribe(queue, credit, **options)
        assert isinstance(answer, ev.Reply), answer
        return consumer_id

    def unsubscribe(self, consumer_id: int) -> ev.Reply | ev.RequestFailed:
        return self._answer(self.conn.unsubscribe(consumer_id))

    def tx_begin(self, tx_id: int) -> ev.Reply | ev.RequestFailed:
        return self._answer(self.conn.tx_begin(tx_id))

    def tx_commit(self, tx_id: int) -> ev.Reply | ev.RequestFailed:
        return self._answer(self.conn.tx_commit(tx_id))

    def tx_rollback(self, tx_id: int) -> ev.Reply | ev.RequestFailed:
        return self._answer(self.conn.tx_rollback(tx_id))

    def set_will(
        self,
        key: str,
        message: WireMessage | None,
        *,
        delay_ms: int = 0,
        publish_pending: bool = False,
        own: bool | None = None,
        retain: dict[str, Any] | None = None,
        everywhere: bool | None = None,
    ) -> ev.Reply | ev.RequestFailed:
        will: dict[str, Any] = {
            "key": key,
            "message": message,
            "delay_ms": delay_ms,
            "publish_pending": publish_pending,
        }
        if own is not None:
            will["own"] = own
        if retain is not None:
            will["retain"] = retain
        if everywhere is not None:
            will["everywhere"] = everywhere
        return self._answer(self.conn.set_will(will))

    def clear_will(self) -> ev.Reply | ev.RequestFailed:
        return self._answer(self.conn.set_will(None))

    # ------------------------------------------------------------------ messages
    def publish(self, address: str, body: bytes, *, tx: int = 0, sync: bool = True, **fields: Any) -> int:
        seq = self.conn.publish(new_message(address, body, **fields), tx)
        if sync:
            self.h.sync()
        return seq

    def send_all(self, address: str, payloads: list[bytes], **fields: Any) -> list[int]:
        seqs = [self.publish(address, body, sync=False, **fields) for body in payloads]
        self.h.sync()
        assert all(s in self.confirmed for s in seqs), (seqs, self.rejected)
        return seqs

    def ack(self, consumer_id: int, ids: list[int], tx: int = 0) -> None:
        self.conn.ack(consumer_id, ids, tx)
        self.h.sync()

    def nack(self, consumer_id: int, ids: list[int], mode: NackMode = NackMode.REDELIVER) -> None:
        self.conn.nack(consumer_id, ids, mode)
        self.h.sync()

    def flow(self, consumer_id: int, credit: int, credit_bytes: int = 0) -> None:
        self.conn.flow(consumer_id, credit, credit_bytes)
        self.h.sync()

    def close(self) -> None:
        self.conn.close(ErrorCode.SHUTDOWN, "bye")
        self.h.sync()

    def drop(self) -> None:
        """The connection is lost without a CLOSE (what the server shell reports on a reset socket)."""
        self.h.broker.close_session(self.session, self.h.now_ms)
        self.h.sync()


class Harness:
    def __init__(self, settings: CoreSettings | None = None, pager_factory: PagerFactory | None = None) -> None:
        self.settings = settings or CoreSettings()
        self.security = SecurityManager(self.settings.users, self.settings.permissions)
        self.broker = Broker(
            "node-1",
            self.settings,
            store=MemoryStore(),
            audit=NullAuditSink(),
            first_message_id=1,
            pager_factory=pager_factory,
        )
        self.now_ms = BASE_MS
        self.clients: list[Client] = []

    @property
    def now_s(self) -> float:
        return self.now_ms / 1000

    def connect(
        self,
        name: str = "client",
        user: str | None = None,
        password: str | None = None,
        peer: str = "127.0.0.1",
        publish_bytes: int = UNBOUNDED_BYTES,
        versions: tuple[int, ...] = PROTOCOL_VERSIONS,
    ) -> Client:
        """A client of the link protocol ``versions`` offers (the newest by default)."""
        client = Client(self, name, user, password, peer, publish_bytes, versions)
        self.clients.append(client)
        return client

    def sync(self) -> None:
        """Client output -> broker -> flush_dispatch -> server output -> clients."""
        broker = self.broker
        for client in self.clients:
            data = client.conn.data_to_send()
            if data:
                broker.handle(client.session, client.server.receive_data(data, self.now_s), self.now_ms)
        broker.flush_dispatch(self.now_ms)
        self._drain()
        self._check_invariants()

    def tick(self, now_ms: int) -> None:
        """Advance the clock to ``now_ms`` and run the broker's timers."""
        assert now_ms >= self.now_ms
        self.now_ms = now_ms
        self.broker.tick(now_ms)
        self._drain()
        self._check_invariants()

    def _check_invariants(self) -> None:
        """Each queue keeps its count of in-flight messages instead of summing them: it must be the sum. The
        shared empty containers that queues, consumers, trie nodes and codecs hold until their first entry must
        still be empty (a write into one would be a write into all)."""
        for queue in self.broker.queues.values():
            assert queue.in_flight == sum(len(c.in_flight) for c in queue.consumers), queue.name
            # An idle queue or consumer holds the shared empty containers, not emptied ones of its own.
            assert queue._count == sum(len(level) for level in queue._levels), queue.name
            assert queue._count or queue._levels is queues._NO_LEVELS, queue.name
            assert all(c.in_flight or c.in_flight is queues._NO_IN_FLIGHT for c in queue.consumers), queue.name
        shared = (
            queues._NO_COUNTS,
            queues._NO_GROUPS,
            queues._NO_LAST_VALUES,
            queues._NO_SUPERSEDED,
            queues._NO_ATTEMPTS,
            queues._NO_IN_FLIGHT,
            sessions._NO_TXS,
            sessions._NO_TEMPORARY_QUEUES,
            sessions._NO_SEND_CHECKS,
            router._NOTHING,
            codec._NO_CONSUMERS,
        )
        assert not any(shared), shared

    def _drain(self) -> None:
        """Write what the broker marked as having output, exactly as the server shell does: output the
        broker forgot to mark stays unsent and fails the test."""
        by_session: dict[LinkSession, Client] = {client.session: client for client in self.clients}
        for session in self.broker.take_dirty():
            client = by_session.get(session)
            if client is None:
                continue
            data = client.server.data_to_send()
            if data:
                client.receive(client.conn.receive_data(data, self.now_s))


def ok(answer: ev.Reply | ev.RequestFailed) -> Any:
    assert isinstance(answer, ev.Reply), answer
    return answer.result


def failed(answer: ev.Reply | ev.RequestFailed, code: str) -> str:
    assert isinstance(answer, ev.RequestFailed), answer
    assert answer.code == code, answer
    return answer.text


class RecordingAudit:
    def __init__(self) -> None:
        self.events: list[tuple[int, str, dict[str, object]]] = []

    def emit(self, ts_us: int, event: str, fields: Mapping[str, object]) -> None:
        self.events.append((ts_us, event, dict(fields)))

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
        fields = {
            "address": address,
            "message_id": message_id,
            "size": size,
            "protocol": protocol,
            "sent_ts_us": sent_ts_us,
            "queue": queue,
            **extra,
        }
        self.emit(ts_us, event, {key: value for key, value in fields.items() if value is not None})

    def tick(self, ts_us: int) -> None:
        pass

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
        self.emit_message(
            ts_us,
            "msg.delivered",
            queue,
            address,
            message_id,
            size,
            protocol,
            sent_ts_us,
            {
                "delivery_count": delivery_count,
                "conn_id": conn_id,
                "consumer_id": consumer_id,
                "client_id": client_id,
                "origin_message_id": origin_message_id,
            },
        )

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
        self.emit_message(
            ts_us,
            "msg.acked",
            queue,
            address,
            message_id,
            size,
            protocol,
            sent_ts_us,
            {
                "conn_id": conn_id,
                "consumer_id": consumer_id,
                "client_id": client_id,
                "origin_message_id": origin_message_id,
            },
        )

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def of(self, event: str) -> list[tuple[int, dict[str, object]]]:
        return [(ts, fields) for ts, name, fields in self.events if name == event]


class RecordingStore(MemoryStore):
    """The memory store, remembering the queue specs, messages, acks, delivery attempts and written-through
    publishes the broker asked it to persist. With ``hold_attempts`` (``hold_notes``, ``hold_messages``,
    ``hold_queues``), delivery attempts (notes of written-through publishes, messages, queues) are safe only when
    the test completes their token."""

    def __init__(
        self,
        *,
        hold_attempts: bool = False,
        hold_notes: bool = False,
        hold_messages: bool = False,
        hold_queues: bool = False,
    ) -> None:
        self.hold_messages = hold_messages
        self.hold_queues = hold_queues
        self.through: list[tuple[str, str, int]] = []  # publishes written through to another node
        self.note_tokens: list[int] = []  # with ``hold_notes``: one per call, apart from the attempts' tokens
        self.hold_notes = hold_notes
        self.specs: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.messages: list[WireMessage] = []
        self.acks: list[tuple[str, list[int]]] = []
        self.attempts: list[tuple[str, list[int], list[int]]] = []
        self.message_counts: list[tuple[tuple[str, ...], list[int]]] = []  # attempts stored with a message
        self.hold_attempts = hold_attempts

    def acknowledge(self, queue: str, message_ids: list[int]) -> None:
        self.acks.append((queue, list(message_ids)))

    def update_delivery_counts(self, queue: str, message_ids: list[int], counts: list[int]) -> int:
        self.attempts.append((queue, list(message_ids), list(counts)))
        return len(self.attempts) if self.hold_attempts else 0

    def note_through(self, entries: list[tuple[str, str, int]]) -> int:
        self.through.extend(entries)
        if not self.hold_notes:
            return 0
        self.note_tokens.append(1_000_000 + len(self.note_tokens))
        return self.note_tokens[-1]

    def add_queue(self, spec: dict[str, Any]) -> int:
        self.specs.append(dict(spec))
        return 3_000_000 + len(self.specs) if self.hold_queues else 0

    def delete_queue(self, name: str) -> int:
        self.deleted.append(name)
        return 4_000_000 + len(self.deleted) if self.hold_queues else 0

    def add_message(self, message: WireMessage, queues: tuple[str, ...], counts: list[int] | None = None) -> int:
        self.messages.append(message)
        if counts is not None:
            self.message_counts.append((queues, list(counts)))
        return 2_000_000 + len(self.messages) if self.hold_messages else 0


def recorded(
    settings: CoreSettings | None = None,
    *,
    hold_attempts: bool = False,
    hold_notes: bool = False,
    hold_messages: bool = False,
    hold_queues: bool = False,
) -> tuple[Harness, RecordingStore, RecordingAudit]:
    """A harness whose broker reports to a recording store and audit sink."""
    h = Harness(settings)
    store = RecordingStore(
        hold_attempts=hold_attempts, hold_notes=hold_notes, hold_messages=hold_messages, hold_queues=hold_queues
    )
    sink = RecordingAudit()
    h.broker = Broker("node-1", h.settings, store=store, audit=sink, first_message_id=1)
    return h, store, sink
