"""Consumers and their deliveries' outcomes: subscribing (auto-creating the queue when allowed), credit,
acknowledgements, negative acknowledgements (release, redeliver later, reject), and what a departed consumer
held going back to its queue."""

from __future__ import annotations

from typing import Any, NamedTuple

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.audit_events import AuditEvents
from tridentmq_core.catalog import FQQN_SEPARATOR, Catalog
from tridentmq_core.checks import (
    BrokerError,
    compiled_filter,
    require,
    require_create,
    routing_type,
    valid_address,
    valid_queue_name,
)
from tridentmq_core.dead_letters import DeadLetters
from tridentmq_core.deliveries import Deliveries
from tridentmq_core.queues import Consumer, LinkSession, Queue
from tridentmq_core.security import Permission
from tridentmq_core.selector import Selector
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.base import Store
from tridentmq_core.timers import Timers
from tridentmq_shared.link.codec import BYTE_CREDIT_VERSION
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.message import RoutingType, WireMessage


class Terms(NamedTuple):
    browse: bool
    credit_bytes: int  # 0: the window is in messages only
    selector: Selector | None


#: What a cluster connection had out when it dropped counts as a failed delivery for its dead-lettering only
#: once per this many drops: a link that flaps is no consumer that fails.
LINK_DROPS_PER_ATTEMPT = 10


class Consuming:
    def __init__(
        self,
        settings: CoreSettings,
        address_settings: AddressSettingsRepository,
        *,
        store: Store,
        catalog: Catalog,
        dead_letters: DeadLetters,
        timers: Timers,
        audit: AuditEvents,
        deliveries: Deliveries,
        to_dispatch: set[Queue],
        dirty: set[LinkSession],
    ) -> None:
        self.settings = settings
        self.address_settings = address_settings
        self.store = store
        self._catalog = catalog
        self._dead_letters = dead_letters
        self._timers = timers
        self._audit = audit
        self._deliveries = deliveries
        self._to_dispatch = to_dispatch
        self._dirty = dirty

    def terms(self, session: Session, consumer_id: int, credit: int, options: dict[str, Any]) -> Terms:
        """A SUBSCRIBE's own fields and options, checked before its queue is looked at or made."""
        if consumer_id in session.consumers:
            raise BrokerError(ErrorCode.EXISTS, f"consumer id {consumer_id} is in use on this link")
        if credit > self.settings.broker.max_consumer_credit:
            raise BrokerError(ErrorCode.INVALID, f"credit above {self.settings.broker.max_consumer_credit}")
        credit_bytes = options.get("credit_bytes", 0)
        if type(credit_bytes) is not int or credit_bytes < 0:
            raise BrokerError(ErrorCode.INVALID, "credit_bytes is a non-negative integer")
        if session.conn.version < BYTE_CREDIT_VERSION:
            credit_bytes = 0  # a version 1 FLOW cannot give bytes back
        return Terms(bool(options.get("browse", False)), credit_bytes, compiled_filter(options.get("selector")))

    def subscribe(
        self,
        session: Session,
        consumer_id: int,
        queue_name: str,
        credit: int,
        options: dict[str, Any],
        now_ms: int,
        terms: Terms | None = None,
    ) -> dict[str, Any]:
        """A SUBSCRIBE (``terms``: its options as ``terms`` checked them already)."""
        browse, credit_bytes, selector = terms or self.terms(session, consumer_id, credit, options)
        principal = session.principal
        catalog = self._catalog
        address_name, _, queue_part = queue_name.rpartition(FQQN_SEPARATOR)
        queue_name = queue_part if address_name else queue_name
        queue = catalog.queues.get(queue_name)
        if queue is None:
            address = address_name or str(options.get("address") or queue_name)
            valid_queue_name(queue_name)
            valid_address(address, wildcards=True)
            settings = self.address_settings.resolve(address)
            # ``create: false``: the queue must exist as made (a lock queue whose expiry may delete it between
            # its creation and this subscribe must not come back as a plain queue without its spec).
            if not settings.auto_create_queues or options.get("create") is False:
                raise BrokerError(ErrorCode.NOT_FOUND, f"queue {queue_name!r} does not exist")
            routing = routing_type(options.get("routing_type", RoutingType.ANYCAST))
            durable = bool(options.get("durable", routing is RoutingType.ANYCAST))
            require(principal, Permission.BROWSE if browse else Permission.CONSUME, address)
            require_create(principal, address, durable=durable, address_exists=address in catalog.addresses)
            queue = catalog.create_queue(
                queue_name,
                address,
                routing,
                durable=durable,
                auto_created=True,
                auto_delete=settings.auto_delete_queues,
                now_ms=now_ms,
            )
        elif address_name and queue.address != address_name:
            raise BrokerError(ErrorCode.NOT_FOUND, f"queue {queue_name!r} is not bound to {address_name!r}")
        require(principal, Permission.BROWSE if browse else Permission.CONSUME, queue.address)
        if not browse and 0 <= queue.max_consumers <= sum(not c.browse for c in queue.consumers):
            raise BrokerError(ErrorCode.RESOURCE_LIMIT, f"queue {queue.name!r} has its maximum of consumers")
        consumer = Consumer(
            consumer_id,
            session,
            queue,
            credit,
            selector=selector,
            auto_ack=bool(options.get("auto_ack", False)),
            browse=browse,
        )
        if credit_bytes:
            consumer.limit_bytes(credit_bytes)
        queue.add_consumer(consumer)
        session.consumers[consumer_id] = consumer
        if not browse:
            catalog.stop_idle_clock(queue)
            catalog.bindings_changed(queue)
        self._to_dispatch.add(queue)
        self._audit.emit(
            now_ms,
            "consumer.opened",
            conn_id=session.conn_id,
            consumer_id=str(consumer_id),
            queue=queue.name,
            address=queue.address,
        )
        return {"queue": queue.name, "address": queue.address, "routing_type": int(queue.routing_type)}

    def consumer(self, session: Session, consumer_id: int) -> Consumer:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"no consumer {consumer_id} on this link")
        return consumer

    def add_forwarder(self, session: Session, consumer: Consumer) -> None:
        """Attach a consumer that moves messages to another node (a cluster connection's)."""
        consumer.queue.add_consumer(consumer)
        session.consumers[consumer.id] = consumer
        self._to_dispatch.add(consumer.queue)

    def remove_forwarder(self, session: Session, consumer: Consumer, now_ms: int) -> None:
        if session.consumers.get(consumer.id) is consumer:
            self.remove(session, consumer, now_ms)

    def remove(self, session: Session, consumer: Consumer, now_ms: int) -> None:
        """The consumer goes: what it held goes back to its queue (or dead-letters, out of attempts)."""
        queue = consumer.queue
        catalog = self._catalog
        if not consumer.browse:  # a browser is in no binding (see subscribe)
            catalog.bindings_changed(queue)
        session.consumers.pop(consumer.id, None)
        if consumer in queue.consumers:
            # What an open transaction of the session acknowledged stays with it: its commit settles it, its
            # rollback gives it back (requeued now, the commit would find nothing to acknowledge: a duplicate).
            held = frozenset(i for tx in session.txs.values() for c, i in tx.acks if c is consumer)
            unacked = queue.remove_consumer(consumer, held)
            self._requeue(queue, unacked, now_ms, attempts_count=not consumer.forwarder)
            self._to_dispatch.add(queue)
        self._audit.emit(
            now_ms, "consumer.closed", conn_id=session.conn_id, consumer_id=str(consumer.id), queue=queue.name
        )
        if not consumer.browse:
            catalog.start_idle_clock(queue, now_ms)
        catalog.maybe_auto_delete(queue, now_ms)

    def _requeue(
        self, queue: Queue, unacked: list[tuple[WireMessage, int]], now_ms: int, *, attempts_count: bool = True
    ) -> None:
        """Messages a departed consumer never acknowledged: back to the head of the queue, except those that
        have used up their delivery attempts (a message that crashes every consumer must not loop for ever).
        A cluster connection's consumer that goes (``attempts_count`` False) failed no delivery: its link
        dropped, and what it moved or forwarded keeps its count (its next delivery is flagged) but is
        dead-lettered only after ``LINK_DROPS_PER_ATTEMPT`` times as many drops (one that breaks the link
        each time it is sent must not stall what waits behind it for ever)."""
        settings = self.address_settings.resolve(queue.address)
        attempts = settings.max_delivery_attempts
        if not attempts_count and attempts > 0:
            attempts *= LINK_DROPS_PER_ATTEMPT
        for message, count in unacked:
            if 0 <= attempts <= count:
                self._dead_letters.dead_letter(queue, message, "max_deliveries", settings, now_ms)
            else:
                queue.return_message(message, count)

    def flow(self, session: Session, consumer_id: int, credit: int, credit_bytes: int) -> None:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            return  # a flow racing an unsubscribe
        consumer.add_credit(credit, credit_bytes, self.settings.broker.max_consumer_credit)
        self._to_dispatch.add(consumer.queue)

    def ack(self, session: Session, consumer_id: int, tx_id: int, ids: list[int], now_ms: int) -> None:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            self._async_error(session, ErrorCode.NOT_FOUND, f"ack for unknown consumer {consumer_id}")
            return
        if tx_id:
            tx = session.txs.get(tx_id)
            if tx is None:
                self._async_error(session, ErrorCode.NOT_FOUND, f"ack in unknown transaction {tx_id}")
                return
            tx.acks.extend((consumer, message_id) for message_id in ids if message_id in consumer.in_flight)
            return
        queue = consumer.queue
        journaled: list[int] = []
        for message_id in ids:
            taken = queue.take(consumer, message_id)
            if taken is not None:
                self._deliveries.settle(queue, taken[0], now_ms, journaled, consumer)
        if journaled:
            self.store.acknowledge(queue.name, journaled)

    def nack(self, session: Session, consumer_id: int, ids: list[int], mode: NackMode, now_ms: int) -> None:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            self._async_error(session, ErrorCode.NOT_FOUND, f"nack for unknown consumer {consumer_id}")
            return
        queue = consumer.queue
        for message_id in ids:
            taken = queue.take(consumer, message_id)
            if taken is not None:
                self.give_back(queue, taken[0], taken[1], mode, now_ms)
        self._to_dispatch.add(queue)

    def give_back(self, queue: Queue, message: WireMessage, count: int, mode: NackMode, now_ms: int) -> None:
        """A delivery failed (``count`` = its delivery count): requeue, delay, or dead-letter."""
        if mode is NackMode.RELEASE:
            queue.return_message(message, count - 1)
            return
        settings = self.address_settings.resolve(queue.address)
        if self._audit.covers(message):
            self._audit.message(now_ms, "msg.nacked", message, queue, delivery_count=count)
        attempts = settings.max_delivery_attempts
        if mode is NackMode.REJECT or 0 <= attempts <= count:
            reason = "rejected" if mode is NackMode.REJECT else "max_deliveries"
            self._dead_letters.dead_letter(queue, message, reason, settings, now_ms)
            return
        delay = settings.redelivery_delay(count)
        if delay > 0:
            self._timers.delay(now_ms + delay, queue, message, count)
        else:
            queue.return_message(message, count)

    def _async_error(self, session: Session, code: str, text: str) -> None:
        session.conn.error(0, code, text)
        self._dirty.add(session)
