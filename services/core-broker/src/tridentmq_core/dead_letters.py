"""Messages that die in a queue (rejected, out of delivery attempts, refused everywhere) and messages that
expire: counted, audited, and sent on as a copy to the address's dead-letter or expiry address, with where
they came from and why in ``_AMQ_ORIG_ADDRESS``, ``_AMQ_ORIG_QUEUE`` and ``_AMQ_ORIG_REASON`` (as in Artemis)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tridentmq_core.address_settings import AddressSettingsRepository, ResolvedAddressSettings
from tridentmq_core.audit_events import AuditEvents
from tridentmq_core.catalog import Catalog
from tridentmq_core.checks import BrokerError
from tridentmq_core.counters import Counters
from tridentmq_core.queues import Queue
from tridentmq_core.store.base import Store
from tridentmq_shared.message import (
    M_ADDRESS,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_ROUTING,
    M_SCHEDULED,
    RoutingType,
    WireMessage,
)

log = logging.getLogger("tridentmq.core.broker")

ORIGINAL_ADDRESS = "_AMQ_ORIG_ADDRESS"
ORIGINAL_QUEUE = "_AMQ_ORIG_QUEUE"
ORIGINAL_REASON = "_AMQ_ORIG_REASON"


class DeadLetters:
    def __init__(
        self,
        address_settings: AddressSettingsRepository,
        *,
        store: Store,
        counters: Counters,
        catalog: Catalog,
        audit: AuditEvents,
        accept: Callable[[WireMessage, int], object],
    ) -> None:
        self.address_settings = address_settings
        self._counters = counters
        self.store = store
        self._catalog = catalog
        self._audit = audit
        self._accept = accept  # routes a message like a publish (BrokerError if it cannot be)

    def dead_letter(
        self, queue: Queue, message: WireMessage, reason: str, settings: ResolvedAddressSettings, now_ms: int
    ) -> None:
        """``message`` dies in ``queue``, where it still is (its consumer took it out, not the queue)."""
        queue.settle(message)
        self.send_to_dead_letter_address(queue, message, reason, settings, now_ms)
        if message[M_DURABLE] and queue.durable:
            # After the copy's record: a crash between the two leaves it in both queues, never in neither.
            self.store.acknowledge(queue.name, [message[M_ID]])

    def send_to_dead_letter_address(
        self, queue: Queue, message: WireMessage, reason: str, settings: ResolvedAddressSettings, now_ms: int
    ) -> None:
        """Count, audit and divert a message that died in ``queue`` (already taken out of it)."""
        queue.dead_lettered += 1
        self._counters.dead_lettered += 1
        self._audit.message(now_ms, "msg.dead_lettered", message, queue, reason=reason)
        self._divert(queue, message, settings.dead_letter_address, reason, now_ms)

    def expired(self, queue: Queue, message: WireMessage, now_ms: int) -> None:
        """``message`` outlived its expiration in ``queue`` (taken out of it)."""
        queue.expired += 1
        self._counters.expired += 1
        self._audit.message(now_ms, "msg.expired", message, queue, reason="ttl")
        settings = self.address_settings.resolve(queue.address)
        self._divert(queue, message, settings.expiry_address, "expired", now_ms)
        if message[M_DURABLE] and queue.durable:
            self.store.acknowledge(queue.name, [message[M_ID]])  # after the copy's record: never neither

    def _divert(self, queue: Queue, message: WireMessage, target: str | None, reason: str, now_ms: int) -> None:
        """Send a copy of a dead or expired message to ``target`` with its origin recorded."""
        if not target or target == queue.address:
            # Expired messages go silently without an expiry address, as in Artemis; dead letters do not.
            log.log(
                logging.DEBUG if reason == "expired" else logging.WARNING,
                "message dropped",
                extra={"queue": queue.name, "reason": reason, "message_id": message[M_ID]},
            )
            return
        copy = list(message)
        copy[M_ID] = 0
        copy[M_ADDRESS] = target
        copy[M_ROUTING] = int(RoutingType.ANYCAST)
        copy[M_EXPIRATION] = 0
        copy[M_SCHEDULED] = 0
        copy[M_DEDUP] = None
        copy[M_PROPS] = {
            **message[M_PROPS],
            ORIGINAL_ADDRESS: message[M_ADDRESS],
            ORIGINAL_QUEUE: queue.name,
            ORIGINAL_REASON: reason,
        }
        catalog = self._catalog
        try:
            if (
                target not in catalog.addresses
                and self.address_settings.resolve(target).auto_create_dead_letter_resources
            ):
                catalog.create_queue(target, target, RoutingType.ANYCAST, durable=True, now_ms=now_ms)
            self._accept(copy, now_ms)
        except BrokerError as exc:
            log.warning("message dropped", extra={"queue": queue.name, "reason": exc.text})
