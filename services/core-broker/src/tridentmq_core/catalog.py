"""Addresses and queues: creating them (by request, by a send, by an operator), changing a queue's expiry,
and deleting them (by request, when idle for ``expires_ms``, when auto-deleted, and auto-created addresses
nobody uses any more). What is durable is recorded in the store as it changes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tridentmq_core.address_settings import AddressSettingsRepository, ResolvedAddressSettings
from tridentmq_core.audit_events import AuditEvents
from tridentmq_core.checks import (
    BrokerError,
    compiled_filter,
    require_create,
    require_delete,
    routing_type,
    valid_address,
    valid_queue_name,
)
from tridentmq_core.deadlines import Deadlines
from tridentmq_core.queues import DeliverySink, LinkSession, MemoryGauge, PagerFactory, Queue, QueueActivity
from tridentmq_core.routes import Address, Routes, routing_kinds
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.base import Store
from tridentmq_core.timers import Timers
from tridentmq_shared.link.codec import MAX_FIELD_INT
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import M_DURABLE, M_ID, MAX_TIME_MS, RoutingType, WireMessage

log = logging.getLogger("tridentmq.core.broker")

#: The separator of a fully qualified queue name, ``address::queue``.
FQQN_SEPARATOR = "::"


class Catalog:
    #: Where the queues report what happens to their messages: set by the broker before any queue is made
    #: (what it reports to needs the catalog in turn).
    sink: DeliverySink

    def __init__(
        self,
        settings: CoreSettings,
        address_settings: AddressSettingsRepository,
        *,
        store: Store,
        routes: Routes,
        timers: Timers,
        audit: AuditEvents,
        dirty: set[LinkSession],
        memory: MemoryGauge,
        activity: QueueActivity,
        to_dispatch: set[Queue],
        pager_factory: PagerFactory | None,
    ) -> None:
        self.settings = settings
        self.address_settings = address_settings
        self.store = store  # the broker swaps it for a memory store while it restores
        self.routes = routes
        self.addresses = routes.addresses
        self.queues: dict[str, Queue] = {}
        self._timers = timers
        self._audit = audit
        self._dirty = dirty
        self._memory = memory
        self._activity = activity
        self._to_dispatch = to_dispatch
        self._pager_factory = pager_factory
        self.bindings_version = 0  # bumped whenever a queue or a consumer comes or goes
        # Durable queues whose records are not safe yet → the store's token for each, in the order written: a
        # node that crashed meanwhile comes back without them, so other nodes are not told of them until then.
        self.unsynced: dict[str, int] = {}
        self.written_token = 0  # the store's token of the last address or queue record written (0: none yet)
        self.auto_created_by: dict[str, int] = {}  # user → addresses its publishes auto-created, still existing
        self.paused_addresses: set[str] = set()  # paused by an operator: their queues (new ones too) deliver none
        self._idle: Deadlines[Queue] = Deadlines()  # queues with expires_ms and no consumer → deletion time
        # Auto-created addresses without queues → when to look at them again (see ``_check_unused_address``).
        self._unused_addresses: Deadlines[str] = Deadlines()
        self.on_address_deleted: Callable[[str], None] = lambda _name: None

    # ------------------------------------------------------------------ durability of what is made
    def _written(self, token: int) -> int:
        if token:
            self.written_token = token
        return token

    def synced(self, token: int) -> None:
        """The store made its records safe up to ``token``: the durable queues that became safe with them are
        bindings the other nodes may be told of now."""
        unsynced = self.unsynced
        while unsynced:
            name, written = next(iter(unsynced.items()))
            if written > token:
                break
            del unsynced[name]
            if (queue := self.queues.get(name)) is not None:
                self.bindings_changed(queue)

    def bindings_changed(self, queue: Queue) -> None:
        """``queue`` was made or deleted, or a consumer of it came or went: routing caches and the other nodes of
        a cluster learn of it."""
        self.bindings_version += 1
        self._activity.bindings.note(queue)

    # ------------------------------------------------------------------ addresses
    def ensure_address(self, name: str, kinds: set[RoutingType], *, auto_created: bool, durable: bool = True) -> bool:
        """Create the address, or add ``kinds`` to it; True if it was created. Not ``durable``: for a
        non-durable queue, which no restart brings back, so it is journaled only once a durable one needs it
        (an MQTT device's lock and topic addresses, made and deleted at every connect)."""
        existing = self.addresses.get(name)
        if existing is not None:
            changed = not kinds <= existing.routing_types
            if changed:
                existing.routing_types = routing_kinds(existing.routing_types | kinds)
                self.routes.address_changed(name)
            if (changed and existing.journaled) or (durable and not existing.journaled):
                existing.journaled = True
                self._written(
                    self.store.add_address(
                        name, tuple(sorted(existing.routing_types)), auto_created=existing.auto_created
                    )
                )
            return False
        valid_address(name, wildcards=True)
        self.addresses[name] = Address(name, kinds, auto_created=auto_created, journaled=durable)
        if durable:
            self._written(self.store.add_address(name, tuple(sorted(kinds)), auto_created=auto_created))
        self.routes.address_changed(name)
        return True

    def create_address(self, name: str, kinds: set[RoutingType]) -> bool:
        """A client's or operator's CREATE_ADDRESS: the address is there on purpose, never auto-deleted, also
        when it was auto-created before (journaled so). True if it was created."""
        address = self.addresses.get(name)
        if address is not None and address.auto_created:
            address.auto_created = False
            address.journaled = False  # journaled anew below, as kept
            self._unused_addresses.cancel(name)
            self._release_creator(address)
        return self.ensure_address(name, kinds, auto_created=False)

    def delete_address(self, name: str, now_ms: int) -> None:
        address = self.addresses.get(name)
        if address is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"address {name!r} does not exist")
        if address.queues:
            raise BrokerError(ErrorCode.INVALID, f"address {name!r} still has queues")
        del self.addresses[name]
        self._unused_addresses.cancel(name)
        self._release_creator(address)
        if address.journaled:
            self.store.delete_address(name)  # journaled: it stays deleted after a restart
        self.routes.address_deleted(name)
        self.on_address_deleted(name)

    def _release_creator(self, address: Address) -> None:
        """The address no longer counts against the cap of the user whose publish auto-created it."""
        if address.creator is not None:
            left = self.auto_created_by.get(address.creator, 0) - 1
            if left > 0:
                self.auto_created_by[address.creator] = left
            else:
                self.auto_created_by.pop(address.creator, None)
            address.creator = None

    def auto_create(self, address: str, routing: int, creator: str | None, now_ms: int) -> None:
        """What a send creates (Artemis auto-create): the address if missing, and for an anycast send the
        queue named after the address if missing, even on an existing address whose queue was auto-deleted.
        ``creator``: the user whose publish it is (counted against their cap), None for the node's own."""
        refusal = self.send_refusal(address, routing)
        if refusal is not None:
            raise refusal
        settings = self.address_settings.resolve(address)
        kind = self.routes.send_kind(address, routing, settings)
        if address not in self.addresses:
            self.ensure_address(address, {kind}, auto_created=True)
            if creator is not None:
                self.addresses[address].creator = creator
                self.auto_created_by[creator] = self.auto_created_by.get(creator, 0) + 1
        if kind is RoutingType.ANYCAST and settings.auto_create_queues and self.routes.lacks_anycast_queue(address):
            self.create_queue(
                address,
                address,
                kind,
                durable=True,
                auto_created=True,
                now_ms=now_ms,
                auto_delete=settings.auto_delete_queues,
            )
        created = self.addresses[address]
        if created.auto_created and not created.queues:
            self.watch_unused_address(address, now_ms)

    def send_refusal(self, address: str, routing: int) -> BrokerError | None:
        """Why a send to ``address`` cannot create what it needs (see ``auto_create``), or None: the address is
        missing and may not be auto-created, or its queue would take the name of a queue bound elsewhere."""
        settings = self.address_settings.resolve(address)
        if address not in self.addresses and not settings.auto_create_addresses:
            return BrokerError(ErrorCode.NOT_FOUND, f"address {address!r} does not exist")
        kind = self.routes.send_kind(address, routing, settings)
        taken = self.queues.get(address)
        if (
            taken is not None
            and kind is RoutingType.ANYCAST
            and settings.auto_create_queues
            and self.routes.lacks_anycast_queue(address)
        ):
            text = f"queue {address!r} exists on address {taken.address!r}: a send to {address!r} cannot make its queue"
            return BrokerError(ErrorCode.EXISTS, text)
        return None

    # An address a publish created keeps no queue when nobody subscribes (a multicast topic): without this it
    # would stay, journaled, for ever (one per topic ever published). It is deleted once it has had no queue
    # and no publish for auto_delete_addresses_delay_ms, looked at no more often than every expiry scan. A
    # publish is seen without a cost on the publish path: the address's cached routes are dropped when it is
    # looked at, and a publish puts them back.
    def watch_unused_address(self, name: str, now_ms: int) -> None:
        settings = self.address_settings.resolve(name)
        if settings.auto_delete_addresses and name not in self._unused_addresses:
            wait = max(settings.auto_delete_addresses_delay_ms, self.settings.broker.expiry_scan_ms)
            self._unused_addresses.set(name, now_ms + wait)

    def _check_unused_address(self, name: str, now_ms: int) -> None:
        address = self.addresses.get(name)
        if address is None or address.queues or not address.auto_created:
            return  # gone, or in use again (its last queue's deletion watches it anew)
        if self.routes.forget_address(name):  # used since it was last looked at: look again later
            self.watch_unused_address(name, now_ms)
        else:
            self.delete_address(name, now_ms)

    # ------------------------------------------------------------------ queues
    def create_queue_request(self, session: Session, spec: dict[str, Any], now_ms: int) -> dict[str, Any]:
        """A link's CREATE_QUEUE: create the queue, or say how the one of that name is (``passive``: only look)."""
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise BrokerError(ErrorCode.INVALID, "a queue needs a name")
        address = spec.get("address") or name
        if not isinstance(address, str):
            raise BrokerError(ErrorCode.INVALID, "the address is a string")
        routing = routing_type(spec.get("routing_type", RoutingType.ANYCAST))
        temporary = bool(spec.get("temporary", False))
        durable = bool(spec.get("durable", True)) and not temporary  # a temporary queue is never durable
        expires_ms = spec.get("expires_ms")
        if expires_ms is not None and (type(expires_ms) is not int or not -1 <= expires_ms <= MAX_TIME_MS):
            raise BrokerError(ErrorCode.INVALID, f"expires_ms is an integer, -1 (never) to {MAX_TIME_MS}")
        existing = self.queues.get(name)
        if spec.get("passive") is True:  # only look: nothing is created or changed
            if existing is None:
                return {"created": False, "exists": False, "queue": name, "address": address}  # and elsewhere?
            expires_ms = None
        if existing is not None:
            if existing.address != address or existing.routing_type is not routing:
                raise BrokerError(
                    ErrorCode.EXISTS,
                    f"queue {name!r} exists on address {existing.address!r} as {existing.routing_type.name.lower()}",
                )
            if expires_ms is not None and expires_ms != existing.expires_ms:
                self._change_expiry(session, existing, expires_ms, now_ms)
            return {
                "created": False,
                "queue": name,
                "address": address,
                "expires_ms": existing.expires_ms,
                "filter": existing.filter.text if existing.filter is not None else None,
                "consumers": sum(not c.forwarder for c in existing.consumers),
            }
        valid_queue_name(name)
        valid_address(address, wildcards=True)
        require_create(session.principal, address, durable=durable, address_exists=address in self.addresses)
        lvq = spec.get("last_value_key")
        max_consumers = spec.get("max_consumers", -1)
        if (
            (lvq is not None and not isinstance(lvq, str))
            or type(max_consumers) is not int
            or not -1 <= max_consumers <= MAX_FIELD_INT
        ):
            raise BrokerError(ErrorCode.INVALID, "last_value_key is a string, max_consumers an integer -1 or more")
        self.create_queue(
            name,
            address,
            routing,
            durable=durable,
            now_ms=now_ms,
            filter_text=spec.get("filter"),
            temporary=temporary,
            exclusive=bool(spec.get("exclusive", False)),
            last_value_key=lvq,
            max_consumers=max_consumers,
            auto_delete=bool(spec.get("auto_delete", False)),
            expires_ms=-1 if expires_ms is None else expires_ms,
            owner=session if temporary else None,
        )
        return {"created": True, "queue": name, "address": address}

    def pages(self, spec: dict[str, Any]) -> bool:
        """Whether the durable queue a journal's ``spec`` describes pages (recovery leaves its messages on disk
        until the queue takes them back, which pages them as at run time)."""
        return self._pages(self.address_settings.resolve(spec["address"]), spec.get("last_value_key"))

    def _pages(self, settings: ResolvedAddressSettings, last_value_key: str | None) -> bool:
        # A last-value queue holds one message per key, and replacing one or browsing them by key needs them all
        # in memory: paged, a newer value would not replace an older one, and browsers would miss them.
        return (
            self._pager_factory is not None
            and settings.address_full_policy == "PAGE"
            and settings.max_size_bytes >= 0
            and last_value_key is None
        )

    def create_queue(
        self,
        name: str,
        address: str,
        routing: RoutingType,
        *,
        durable: bool,
        now_ms: int,
        auto_created: bool = False,
        auto_delete: bool = False,
        filter_text: Any = None,
        temporary: bool = False,
        exclusive: bool = False,
        last_value_key: str | None = None,
        max_consumers: int = -1,
        expires_ms: int = -1,
        owner: Session | None = None,
    ) -> Queue:
        existing = self.queues.get(name)
        if existing is not None:  # one name, one queue: a second one would orphan the first and its messages
            raise BrokerError(ErrorCode.EXISTS, f"queue {name!r} exists on address {existing.address!r}")
        if address == name:  # one string, not two equal ones (an MQTT session's lock queue, say)
            address = name
        selector = compiled_filter(filter_text)
        settings = self.address_settings.resolve(address)
        # Where addresses are auto-created, one made for a queue goes with the last of its queues, as one a
        # publish made (Artemis' auto-delete-addresses): else every MQTT client id and device topic ever seen
        # would stay for ever.
        auto = auto_created or settings.auto_create_addresses
        # One that stays without queues (not auto-created) is journaled, whatever its first queue.
        self.ensure_address(address, {routing}, auto_created=auto, durable=durable or not auto)
        paging = self._pages(settings, last_value_key)
        queue = Queue(
            name,
            address,
            routing,
            sink=self.sink,
            dirty=self._dirty,
            memory=self._memory,
            activity=self._activity,
            durable=durable,
            filter=selector,
            temporary=temporary,
            exclusive=exclusive,
            last_value_key=last_value_key,
            max_consumers=max_consumers,
            auto_created=auto_created,
            auto_delete=auto_delete,
            expires_ms=expires_ms,
            owner=owner,
            page_limit=settings.max_size_bytes if paging else -1,
            pager_factory=self._pager_factory,
        )
        queue.paused = address in self.paused_addresses
        self.queues[name] = queue
        self.routes.bind(queue)
        self.bindings_changed(queue)
        if owner is not None:
            owner.add_temporary_queue(name)
        if durable:
            token = self._written(self.store.add_queue(queue_spec(queue)))
            if token:
                self.unsynced.pop(name, None)  # one made again goes to the end: the tokens stay in order
                self.unsynced[name] = token
        self.start_idle_clock(queue, now_ms)
        log.debug("queue created", extra={"queue": name, "address": address, "routing": routing.name})
        return queue

    def queue(self, name: str) -> Queue:
        """The queue of that name (or fully qualified name), or a not-found refusal."""
        queue = self.queues.get(name.rpartition(FQQN_SEPARATOR)[2])
        if queue is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"queue {name!r} does not exist")
        return queue

    def delete_queue(self, queue: Queue, now_ms: int) -> None:
        """Delete ``queue`` with its messages; its consumers are told (CONSUMER_CLOSED not-found)."""
        for consumer in list(queue.consumers):
            consumer.session.consumers.pop(consumer.id, None)
            for message, _ in queue.remove_consumer(consumer):
                queue.settle(message)  # the queue goes away with what its consumers held
            consumer.session.conn.consumer_closed(consumer.id, ErrorCode.NOT_FOUND, f"queue {queue.name!r} was deleted")
            self._dirty.add(consumer.session)
        queue.purge()
        del self.queues[queue.name]
        self._activity.changed.note(queue)  # its rates go with it
        self.bindings_changed(queue)
        address = self.routes.unbind(queue)
        self._to_dispatch.discard(queue)
        self._idle.cancel(queue)
        if queue.owner is not None:
            queue.owner.temporary_queues.pop(queue.name, None)
        if queue.durable:
            self._written(self.store.delete_queue(queue.name))
        if address is not None and address.auto_created and not address.queues:
            settings = self.address_settings.resolve(address.name)
            if settings.auto_delete_addresses and settings.auto_delete_addresses_delay_ms <= 0:
                self.delete_address(address.name, now_ms)
            else:
                self.watch_unused_address(address.name, now_ms)

    def maybe_auto_delete(self, queue: Queue, now_ms: int) -> None:
        if (
            queue.auto_delete
            and not queue.paused  # an operator's hand is on it: deleted, its next publish would make it unpaused
            and not queue.consumers
            and not len(queue)
            and not queue.in_flight  # acknowledged in a transaction still open, after its consumer went
            and queue.name in self.queues
            and not self._timers.holds(queue)  # a delayed or scheduled message of the queue
        ):
            self.delete_queue(queue, now_ms)

    def take_messages(
        self,
        queue: Queue,
        predicate: Callable[[WireMessage], bool],
        limit: int,
        reason: str,
        now_ms: int,
        before_acknowledging: Callable[[list[WireMessage]], None] | None = None,
    ) -> list[WireMessage]:
        """Take up to ``limit`` (-1: all) queued messages matching ``predicate`` out of ``queue`` for good (an
        operator's move): their journal records are acknowledged and each is audited as ``msg.acked``
        with ``reason``. In-flight and paged messages stay. ``before_acknowledging`` gets them first (a move
        journals their copies there: a crash then leaves both, never neither)."""
        left = [limit]

        def wanted(message: WireMessage) -> bool:
            if left[0] == 0 or not predicate(message):
                return False
            left[0] -= 1
            return True

        taken = queue.remove_where(wanted)
        if before_acknowledging is not None:
            before_acknowledging(taken)
        self._settle_taken(queue, taken, reason, now_ms)
        return taken

    def purge_queue(self, queue: Queue, now_ms: int, predicate: Callable[[WireMessage], bool] | None = None) -> int:
        """Drop the messages of ``queue`` that ``predicate`` picks, queued or waiting for their time (scheduled, or
        a delayed redelivery); without one, every such message and the paged ones too. In-flight ones stay
        with their consumers."""
        if predicate is None:
            paged = [message for message, _, state in queue.browse_messages() if state == "paged"]
            taken = [*queue.purge(), *paged]
        else:
            taken = queue.remove_where(predicate)
        for message, redelivery in self._timers.take(queue, predicate or (lambda _m: True)):
            if redelivery:
                queue.settle(message)  # its bytes were still the queue's
            taken.append(message)
        self._settle_taken(queue, taken, "purged", now_ms)
        return len(taken)

    def _settle_taken(self, queue: Queue, taken: list[WireMessage], reason: str, now_ms: int) -> None:
        self._activity.changed.note(queue)  # scheduled messages taken leave no other trace in it
        if queue.durable:
            ids = [message[M_ID] for message in taken if message[M_DURABLE]]
            if ids:
                self.store.acknowledge(queue.name, ids)
        for message in taken:
            if self._audit.covers(message):
                self._audit.message(now_ms, "msg.acked", message, queue, reason=reason)

    def set_paused(self, queue: Queue, paused: bool) -> None:
        queue.paused = paused
        if not paused:
            self._to_dispatch.add(queue)
            self._activity.changed.note(queue)  # an auto-delete queue emptied while paused goes now

    # ------------------------------------------------------------------ expiry of idle queues
    def _change_expiry(self, session: Session, queue: Queue, expires_ms: int, now_ms: int) -> None:
        """A new expires_ms for an existing queue. It can get the queue deleted, so it takes the right to
        delete it. An idle queue keeps the idle time it has (none if it had no expiry until now)."""
        require_delete(session, queue)
        due = self._idle.get(queue)
        idle_since = now_ms if due is None else due - queue.expires_ms
        queue.expires_ms = expires_ms
        self._idle.cancel(queue)
        self.start_idle_clock(queue, idle_since)
        if queue.durable:
            self._written(self.store.add_queue(queue_spec(queue)))  # a re-recorded spec replaces the old one
        log.debug("queue expiry changed", extra={"queue": queue.name, "expires_ms": expires_ms})

    def start_idle_clock(self, queue: Queue, since_ms: int) -> None:
        """With an expiry, and no consumer left (browsers aside), the queue is idle from ``since_ms``."""
        if queue.expires_ms >= 0 and self.queues.get(queue.name) is queue and all(c.browse for c in queue.consumers):
            self._idle.set(queue, since_ms + queue.expires_ms)

    def stop_idle_clock(self, queue: Queue) -> None:
        self._idle.cancel(queue)  # a consumer came

    def tick(self, now_ms: int) -> None:
        """Delete the auto-created addresses nobody used and the queues idle for their ``expires_ms``."""
        for name in self._unused_addresses.pop_due(now_ms):
            self._check_unused_address(name, now_ms)
        for queue in self._idle.pop_due(now_ms):
            log.info(
                "queue expired",
                extra={
                    "queue": queue.name,
                    "address": queue.address,
                    "expires_ms": queue.expires_ms,
                    "messages": len(queue),
                },
            )
            self._audit.emit(
                now_ms,
                "queue.expired",
                queue=queue.name,
                address=queue.address,
                expires_ms=queue.expires_ms,
                messages=len(queue),
            )
            self.delete_queue(queue, now_ms)


def queue_spec(queue: Queue) -> dict[str, Any]:
    """What the store records of a durable queue."""
    return {
        "name": queue.name,
        "address": queue.address,
        "routing_type": int(queue.routing_type),
        "filter": queue.filter.text if queue.filter is not None else None,
        "exclusive": queue.exclusive,
        "last_value_key": queue.last_value_key,
        "max_consumers": queue.max_consumers,
        "auto_created": queue.auto_created,
        "auto_delete": queue.auto_delete,
        "expires_ms": queue.expires_ms,
    }
