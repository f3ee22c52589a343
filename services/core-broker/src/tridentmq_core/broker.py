"""The broker: link events in, deliveries and store commands out. Pure: no I/O, no clock (``now_ms`` is
passed in), so every rule here is testable without a socket.

The server shell feeds each connection's events to ``handle`` and afterwards calls ``flush_dispatch``
and writes ``conn.data_to_send()`` of every session in ``dirty``. Publishes are routed per message but
queues dispatch once per batch, so a frame of 256 publishes costs one dispatch pass per queue.

This module coordinates; each concern is a part in a module named after it:

- ``admission``: which publishes are taken, and the producer credit that paces them;
- ``routes`` and ``catalog``: the addresses and queues, and which queues a send reaches;
- ``consuming`` and ``transactions``: consumers, acknowledgements, transactions;
- ``deliveries``: what becomes of what the queues deliver (they report to it);
- ``confirms``: producers' confirms waiting for the disk or for another node;
- ``forwarder``: messages to and from other cluster nodes;
- ``dead_letters``, ``timers``, ``will_keeper``, ``audit_events``, and ``durable_state`` (restore and snapshot).

The broker itself takes each link's events, routes and admits each accepted message, and keeps the time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Final

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.admission import Admission
from tridentmq_core.audit import AuditSink
from tridentmq_core.audit_events import ORIGIN_MESSAGE_ID, AuditEvents
from tridentmq_core.balancer import Balancer, Remote
from tridentmq_core.catalog import FQQN_SEPARATOR, Catalog
from tridentmq_core.checks import BrokerError, require, require_delete, routing_type
from tridentmq_core.confirms import Confirms
from tridentmq_core.consuming import Consuming
from tridentmq_core.counters import Counters
from tridentmq_core.dead_letters import DeadLetters
from tridentmq_core.dedup import DuplicateIdCache
from tridentmq_core.deliveries import Deliveries
from tridentmq_core.durable_state import DurableState
from tridentmq_core.forwarder import Forwarder
from tridentmq_core.latency import LatencyHistogram
from tridentmq_core.outlet import Outlet
from tridentmq_core.queues import Consumer, LinkSession, MemoryGauge, PagerFactory, Queue, QueueActivity
from tridentmq_core.redistribution import MAX_RESIDENCE_FACTOR
from tridentmq_core.routes import Routes
from tridentmq_core.security import Permission, Principal
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.base import DurableSnapshot, Store
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_core.timers import Timers
from tridentmq_core.transactions import Transactions
from tridentmq_core.will_keeper import WillKeeper
from tridentmq_core.write_through import WriteThrough
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import MAKE_AND_SUBSCRIBE_VERSION
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.message import (
    HOME_PROPERTY,
    M_ADDRESS,
    M_DEDUP,
    M_DURABLE,
    M_ID,
    M_PROPS,
    M_ROUTING,
    M_SCHEDULED,
    M_TIMESTAMP,
    RoutingType,
    WireMessage,
)

_DEFERRED: Final = object()  # marker: a request whose reply is sent later (a commit waiting for the disk)


#: The conditions of a SUBSCRIBE that makes its queue (option ``if``): none, ``made`` here by it, ``new`` to the
#: cluster.
_SUBSCRIBE_IF: Final = (None, "made", "new")


class Broker:
    def __init__(
        self,
        node_id: str,
        settings: CoreSettings,
        *,
        store: Store,
        audit: AuditSink,
        first_message_id: int,
        audit_messages: str = "durable",
        pager_factory: PagerFactory | None = None,
        paging_behind: Callable[[], bool] = lambda: False,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.address_settings = address_settings = AddressSettingsRepository(settings.address_settings)
        self.sessions: dict[str, Session] = {}
        self._closing: dict[str, list[Consumer]] = {}  # sessions closing a slice at a time: their consumers left
        self.counters = counters = Counters()
        #: Since the node started: end-to-end latency (publish timestamp to a consumer's acknowledgement,
        #: auto-ack deliveries included) and time in queue (publish timestamp to each delivery), per node.
        self.latency: Final = LatencyHistogram()
        self.time_in_queue: Final = LatencyHistogram()
        self.dirty: Final[set[LinkSession]] = set()  # sessions with output to write; see take_dirty
        self.memory: Final = MemoryGauge()
        self.activity: Final = QueueActivity()
        self._changed_since_scan = self.activity.changed.reader()
        self.to_dispatch: Final[set[Queue]] = set()  # queues to dispatch at the next flush
        self.transfer_prefix = f"{node_id}:"  # + a message id: the id of a transfer to another node
        self._next_id = first_message_id
        self._store = store
        self._last_expiry_scan = 0
        self._on_route_miss = self._create_for_send  # bound once: routing passes it per message
        # Clustering (set by the cluster manager when the node clusters): load balancing over other nodes'
        # bindings, and the handler of TOPOLOGY requests.
        self.cluster: Balancer | None = None
        self.on_topology: Callable[[Session, dict[str, Any]], dict[str, Any]] | None = None
        # Takes over the reply to a request that changed this node's bindings (a queue or consumer made),
        # to send it once the other nodes route by the change; False: reply now.
        self.hold_reply: Callable[[Session, int, Any], bool] | None = None
        # What waits for the store's records to be safe (replies to requests that made or deleted durable
        # addresses and queues), by the token it waits for; and the last token known safe.
        self._after_sync: dict[int, list[Callable[[], None]]] = {}
        self._safe_upto = 0
        # Deletes a queue's namesakes on the given other nodes, then replies to the request (DELETE_QUEUE_EVERYWHERE).
        self.delete_elsewhere: Callable[[Session, int, str, list[str]], None] | None = None
        # High availability (set when the node is half of a pair or votes for pairs): REPLICATE, REPLICA_ACK
        # and VOTE go to it; a request it answers returns the reply.
        self.on_ha: Callable[[Session, ev.Event], Any] | None = None

        dedup_ms = int(settings.broker.dedup_window_seconds * 1000)
        self._dedup = dedup = DuplicateIdCache(dedup_ms, settings.broker.dedup_max_entries)
        self.events = events = AuditEvents(audit, node_id, audit_messages)
        self.timers = timers = Timers()
        self.routes = routes = Routes(address_settings)
        self.catalog = catalog = Catalog(
            settings,
            address_settings,
            store=store,
            routes=routes,
            timers=timers,
            audit=events,
            dirty=self.dirty,
            memory=self.memory,
            activity=self.activity,
            to_dispatch=self.to_dispatch,
            pager_factory=pager_factory,
        )
        self.addresses = routes.addresses
        self.queues = catalog.queues
        # Where durable publishes written through went, noted before they leave (see write_through).
        self.write_through: WriteThrough[Session] = WriteThrough()
        self.confirms = confirms = Confirms(
            write_through=self.write_through, dedup=dedup, dirty=self.dirty, counters=counters
        )
        self.admission = admission = Admission(
            settings,
            address_settings,
            catalog=catalog,
            routes=routes,
            counters=counters,
            memory=self.memory,
            dirty=self.dirty,
            sessions=self.sessions,
            confirms=confirms,
            paging=pager_factory is not None,
            paging_behind=paging_behind,
        )
        catalog.on_address_deleted = admission.forget_limit
        self.dead_letters = dead_letters = DeadLetters(
            address_settings, store=store, counters=counters, catalog=catalog, audit=events, accept=self.accept_message
        )
        self.deliveries = deliveries = Deliveries(
            store=store,
            dead_letters=dead_letters,
            audit=events,
            counters=counters,
            latency=self.latency,
            time_in_queue=self.time_in_queue,
            queues=catalog.queues,
            dirty=self.dirty,
            to_dispatch=self.to_dispatch,
        )
        catalog.sink = deliveries
        self.consuming = consuming = Consuming(
            settings,
            address_settings,
            store=store,
            catalog=catalog,
            dead_letters=dead_letters,
            timers=timers,
            audit=events,
            deliveries=deliveries,
            to_dispatch=self.to_dispatch,
            dirty=self.dirty,
        )
        self.transactions = Transactions(
            address_settings,
            max_open=settings.broker.max_open_transactions,
            store=store,
            catalog=catalog,
            consuming=consuming,
            deliveries=deliveries,
            accept=self.accept_message,
            to_dispatch=self.to_dispatch,
        )
        self.forwarder = Forwarder(
            self,
            address_settings,
            store=store,
            catalog=catalog,
            admission=admission,
            deliveries=deliveries,
            dead_letters=dead_letters,
            confirms=confirms,
            write_through=self.write_through,
            dedup=dedup,
            audit=events,
            counters=counters,
            memory=self.memory,
            to_dispatch=self.to_dispatch,
            dedup_window_ms=dedup_ms,
            dedup_max_entries=settings.broker.dedup_max_entries,
        )
        self.durable_state = DurableState(catalog=catalog, timers=timers, dedup=dedup, write_through=self.write_through)
        self.wills = WillKeeper(
            settings, admission=admission, catalog=catalog, audit=events, accept=self.accept_message
        )
        store.attach(self.on_durable)

    @property
    def store(self) -> Store:
        return self._store

    @store.setter
    def store(self, store: Store) -> None:
        """The shell swaps the store in once the journal is recovered (and ``restore`` swaps one in meanwhile)."""
        self._store = store
        parts = (self.catalog, self.dead_letters, self.deliveries, self.consuming, self.transactions, self.forwarder)
        for part in parts:
            part.store = store

    @property
    def audit(self) -> AuditSink:
        return self.events.sink

    @audit.setter
    def audit(self, sink: AuditSink) -> None:
        """The shell swaps the audit sink in once the node knows the id it serves as."""
        self.events.sink = sink

    @property
    def now_ms(self) -> int:
        """The time of the event being handled, for the queues' callbacks, which are not handed it."""
        return self.deliveries.now_ms

    @now_ms.setter
    def now_ms(self, now_ms: int) -> None:
        self.deliveries.now_ms = now_ms

    @property
    def bindings_version(self) -> int:
        """Bumped whenever a queue or a consumer comes or goes."""
        return self.catalog.bindings_version

    # ------------------------------------------------------------------ sessions
    def open_session(
        self, conn: Outlet, conn_id: str, principal: Principal, peer: str, client_name: str, now_ms: int
    ) -> Session:
        session = Session(conn, conn_id, principal, peer, client_name, now_ms)
        self.sessions[conn_id] = session
        self.events.emit(now_ms, "conn.opened", conn_id=conn_id, client_id=client_name, protocol="link")
        return session

    def close_session(self, session: Session, now_ms: int, *, at_most: int | None = None) -> bool:
        """The link is gone: requeue its unacknowledged messages, drop its transactions and temp queues.

        With ``at_most``, at most that many of its consumers go in this call: False says that more are left, and
        the caller calls again (in a later turn of its loop) until True (after ``links_lost``, which stops the
        consumers at once). An MQTT gateway's service link holds the lock of each of its clients' sessions, and
        closing one with 18,815 consumers held the node for 0.1 s. The session takes no more requests from the
        first call."""
        if self.sessions.pop(session.conn_id, None) is not None:
            self._closing[session.conn_id] = list(reversed(session.consumers.values()))
        left = self._closing.get(session.conn_id)
        if left is None:
            return True  # closed before
        self.now_ms = now_ms
        for _ in range(len(left) if at_most is None else min(at_most, len(left))):
            consumer = left.pop()
            if session.consumers.get(consumer.id) is consumer:  # not closed meanwhile (its queue deleted, say)
                self.consuming.remove(session, consumer, now_ms)
        if left:
            return False
        del self._closing[session.conn_id]
        for tx in session.drop_transactions():
            self.transactions.undo(tx, now_ms)
        for name in list(session.temporary_queues):
            if name in self.queues:
                self.catalog.delete_queue(self.queues[name], now_ms)
        self.dirty.discard(session)
        self.admission.forget(session)
        self.confirms.forget(session)
        self.wills.closed(session, now_ms)
        self.events.emit(now_ms, "conn.closed", conn_id=session.conn_id, client_id=session.client_name)
        return True

    def links_lost(self, sessions: Iterable[Session], now_ms: int) -> None:
        """These sessions' links are lost, and they end over the turns after (``close_session``). Until then
        nothing more is handed to their consumers, and their wills are published now (or start their delay): as
        when they all ended at once, a client that reconnects meanwhile through another link gets its
        subscriptions' next messages, not its old consumer, and finds the old connection's will gone out."""
        self.now_ms = now_ms
        for session in sessions:
            for consumer in session.consumers.values():
                consumer.credit = consumer.parked_credit = 0  # every dispatch path skips it as it is
            self.wills.closed(session, now_ms)

    def number_from(self, first: int) -> None:
        """Give messages ids from ``first`` on at least: a backup that takes over numbers its messages after
        every id its primary may have used without leaving it in the journal (written through, or
        acknowledged and compacted away), so no two messages of a pair share an id in the audit stream."""
        self._next_id = max(self._next_id, first)

    def assume_identity(self, node_id: str) -> None:
        """A backup taking over its pair's node id (before anything was restored or connected)."""
        self.node_id = node_id
        self.events.tag = node_id[:8]
        self.transfer_prefix = f"{node_id}:"

    def new_message_id(self) -> int:
        message_id = self._next_id
        self._next_id += 1
        return message_id

    # ------------------------------------------------------------------ event entry point
    def handle(self, session: Session, events: Iterable[ev.Event], now_ms: int) -> None:
        self.now_ms = now_ms
        conn = session.conn
        consuming = self.consuming
        for event in events:
            match event:
                case ev.Publishes(ops):
                    accept = self.forwarder.accept_from_cluster if session.principal.cluster else self._accept_published
                    self.admission.take(session, ops, accept, now_ms)
                case ev.Acks(ops):
                    for _, consumer_id, tx_id, ids in ops:
                        consuming.ack(session, consumer_id, tx_id, ids, now_ms)
                case ev.Nacks(ops):
                    for _, consumer_id, ids, mode in ops:
                        consuming.nack(session, consumer_id, ids, NackMode(mode), now_ms)
                case ev.Flow(consumer_id, credit, credit_bytes):
                    consuming.flow(session, consumer_id, credit, credit_bytes)
                case ev.ReplicaAck():
                    if self.on_ha is not None:
                        self.on_ha(session, event)
                case ev.Closed():
                    self.close_session(session, now_ms)
                case _:
                    req_id: int = getattr(event, "req_id", 0)
                    catalog = self.catalog
                    try:
                        version, written = catalog.bindings_version, catalog.written_token
                        result = self._request(session, event, now_ms)
                        if result is _DEFERRED:
                            pass
                        elif catalog.written_token != written:
                            # What it made is answered for once it is safe: a crash before would lose it.
                            self.when_safe(catalog.written_token, partial(self._reply_if_open, session, req_id, result))
                        else:
                            self._reply(session, req_id, result, changed=version != catalog.bindings_version)
                    except BrokerError as exc:
                        conn.error(req_id, exc.code, exc.text)
                    self.dirty.add(session)

    def _reply(self, session: Session, req_id: int, result: Any, *, changed: bool) -> None:
        """Answer a request; one that ``changed`` this node's bindings once the other nodes route by it."""
        if not changed or self.hold_reply is None or not self.hold_reply(session, req_id, result):
            session.conn.reply(req_id, result)

    def _reply_if_open(self, session: Session, req_id: int, result: Any) -> None:
        if session.conn_id in self.sessions:
            self._reply(session, req_id, result, changed=True)
            self.dirty.add(session)

    def when_safe(self, token: int, then: Callable[[], None]) -> None:
        """Run ``then`` once the store's records up to ``token`` (``Catalog.written_token``) are safe: at once
        if they are."""
        if token <= self._safe_upto:
            then()
        else:
            self._after_sync.setdefault(token, []).append(then)

    def _request(self, session: Session, event: ev.Event, now_ms: int) -> Any:
        catalog = self.catalog
        match event:
            case ev.Subscribe(_, consumer_id, queue_name, credit, options):
                if session.conn.version >= MAKE_AND_SUBSCRIBE_VERSION and ("queue" in options or "if" in options):
                    return self._make_and_subscribe(session, consumer_id, queue_name, credit, options, now_ms)
                return self.consuming.subscribe(session, consumer_id, queue_name, credit, options, now_ms)
            case ev.Topology(_, info):
                if self.on_topology is None:
                    raise BrokerError(ErrorCode.INVALID, "this node is not part of a cluster")
                return self.on_topology(session, info)
            case ev.Replicate() | ev.VoteRequested():
                if self.on_ha is None or not session.principal.cluster:
                    raise BrokerError(ErrorCode.INVALID, "this node takes no part in high availability")
                return self.on_ha(session, event)
            case ev.Unsubscribe(_, consumer_id):
                self.consuming.remove(session, self.consuming.consumer(session, consumer_id), now_ms)
                return None
            case ev.CreateQueue(_, spec):
                return self._create_queue(session, spec, now_ms)
            case ev.DeleteQueue(_, name):
                queue = catalog.queue(name)
                require_delete(session, queue)
                catalog.delete_queue(queue, now_ms)
                return None
            case ev.DeleteQueueEverywhere(req_id, name):
                return self._delete_everywhere(session, req_id, name, now_ms)
            case ev.CreateAddress(_, name, routing_types):
                require(session.principal, Permission.CREATE_ADDRESS, name)
                kinds = {routing_type(r) for r in routing_types} or {RoutingType.ANYCAST}
                return {"created": catalog.create_address(name, kinds)}
            case ev.DeleteAddress(_, name):
                require(session.principal, Permission.DELETE_ADDRESS, name)
                catalog.delete_address(name, now_ms)
                return None
            case ev.TxBegin(_, tx_id):
                self.transactions.begin(session, tx_id)
                return None
            case ev.TxCommit(req_id, tx_id):
                token = self.transactions.commit(session, tx_id, now_ms)
                if token:  # the reply waits until the whole transaction is on disk
                    self.confirms.reply_when_done(token, session, req_id)
                    return _DEFERRED
                return None
            case ev.TxRollback(_, tx_id):
                self.transactions.rollback(session, tx_id, now_ms)
                return None
            case ev.SetWill(_, key, message, delay_ms, publish_pending, own, retain, everywhere):
                self.wills.set(
                    session,
                    key,
                    message,
                    delay_ms,
                    publish_pending,
                    now_ms,
                    own=own,
                    retain=retain,
                    everywhere=everywhere,
                )
                return None
        raise BrokerError(ErrorCode.UNEXPECTED, f"unexpected operation {type(event).__name__}")

    def _create_queue(self, session: Session, spec: dict[str, Any], now_ms: int) -> dict[str, Any]:
        if spec.get("describe") is True:
            return self._describe_queue(spec.get("name"))
        reply = self.catalog.create_queue_request(session, spec, now_ms)
        return self._say_elsewhere(reply) if "address" in reply else reply

    def _describe_queue(self, name: Any) -> dict[str, Any]:
        """A CREATE_QUEUE with ``describe``: the queue of that name here and its namesakes on other nodes, whatever
        their addresses and routing types, so that a gateway replaces or deletes a durable subscription's queue
        only when every queue of its name is one (a plain queue's name may be a subscription's: ``<client id>.
        <name>``). Creates and changes nothing, and needs no right, as a passive look."""
        if not isinstance(name, str) or not name:
            raise BrokerError(ErrorCode.INVALID, "a queue needs a name")
        queue = self.catalog.queues.get(name)
        reply: dict[str, Any] = {"created": False, "exists": queue is not None, "queue": name}
        if queue is not None:
            reply.update(
                address=queue.address,
                routing_type=int(queue.routing_type),
                temporary=queue.temporary,
                consumers=sum(not c.forwarder for c in queue.consumers),
            )
        if self.cluster is not None:
            namesakes = self.cluster.bindings.for_queue(name)
            if namesakes:
                reply["elsewhere_routing_types"] = sorted({b.routing for b in namesakes})
        return reply

    def _make_and_subscribe(
        self, session: Session, consumer_id: int, queue_name: str, credit: int, options: dict[str, Any], now_ms: int
    ) -> dict[str, Any]:
        """A version 4 SUBSCRIBE with option ``queue``: CREATE_QUEUE with that spec, then the subscribe, in one
        request (the answer's ``made`` is CREATE_QUEUE's). With ``if``, the subscribe only when the queue was
        ``made`` by this request, or is ``new``: made, and no other node holds one of its name (the answer is
        then ``made`` alone). The subscribe's own fields are checked before anything is made."""
        spec, condition = options.get("queue"), options.get("if")
        if type(spec) is not dict or spec.get("name") != queue_name or spec.get("passive"):
            raise BrokerError(ErrorCode.INVALID, "queue is the CREATE_QUEUE spec of the queue subscribed to")
        if condition not in _SUBSCRIBE_IF:
            raise BrokerError(ErrorCode.INVALID, "if is made or new")
        terms = self.consuming.terms(session, consumer_id, credit, options)
        made = self._create_queue(session, spec, now_ms)
        if (condition is not None and not made["created"]) or (condition == "new" and "elsewhere" in made):
            return {"made": made}
        reply = self.consuming.subscribe(session, consumer_id, queue_name, credit, options, now_ms, terms)
        reply["made"] = made
        return reply

    def _delete_everywhere(self, session: Session, req_id: int, name: str, now_ms: int) -> Any:
        """Delete the queue here and its namesakes on the other nodes (a session's queue that moved with its
        client, whose copy left behind would keep its messages and hand them over again). Each copy needs the
        right to delete it; the reply waits until the other nodes answered, so that a queue made again next
        cannot draw a copy's messages over before that copy is gone. A peer deletes its own only."""
        short = name.rpartition(FQQN_SEPARATOR)[2]
        queue = self.catalog.queues.get(short)
        elsewhere = [] if self.cluster is None or session.principal.cluster else self.cluster.bindings.for_queue(short)
        if queue is None and not elsewhere:
            raise BrokerError(ErrorCode.NOT_FOUND, f"queue {name!r} does not exist")
        if queue is not None:
            require_delete(session, queue)
        for binding in elsewhere:
            kind = Permission.DELETE_DURABLE_QUEUE if binding.durable else Permission.DELETE_NON_DURABLE_QUEUE
            require(session.principal, kind, binding.address)
        if queue is not None:
            self.catalog.delete_queue(queue, now_ms)
        if not elsewhere or self.delete_elsewhere is None:
            return None
        self.delete_elsewhere(session, req_id, short, sorted({b.node_id for b in elsewhere}))
        return _DEFERRED

    def _say_elsewhere(self, reply: dict[str, Any]) -> dict[str, Any]:
        """``reply`` naming (``elsewhere``) the other nodes that hold a queue of that name and address too, and
        perhaps messages of it: a consumer here makes redistribution bring them over (a node scaling down
        counts until it is gone: its messages are on their way to wherever there are consumers)."""
        if self.cluster is not None:
            name, address = reply["queue"], reply["address"]
            bindings = self.cluster.bindings
            holders = {b.node_id for b in bindings.for_queue(name) if b.address == address}
            elsewhere = sorted(holders.union(bindings.moving(name, address)))
            if elsewhere:
                reply["elsewhere"] = elsewhere
        return reply

    # ------------------------------------------------------------------ routing and admitting
    def _accept_published(self, message: WireMessage, now_ms: int) -> int:
        """A producer's publish: its confirm may wait for another node's (a durable message written through)."""
        props = message[M_PROPS]
        if props and HOME_PROPERTY in props:
            home = props.pop(HOME_PROPERTY)
            cluster = self.cluster
            if (
                type(home) is str
                and home != self.node_id
                and cluster is not None
                and message[M_DURABLE]
                and message[M_DEDUP] is not None
                and cluster.bindings.knows(home)
            ):
                return self.forwarder.send_home(message, home, now_ms)
        return self.accept_message(message, now_ms, through=True)

    def accept_message(self, message: WireMessage, now_ms: int, *, through: bool = False, delivered: int = 0) -> int:
        """Route a message into its queues; returns a token when the confirm must wait: a store token, or with
        ``through`` a negative one that another node's confirm releases (see ``forwarder``). ``delivered``: the
        delivery attempts it may have had already (see ``admit``)."""
        dedup_id = message[M_DEDUP]
        if dedup_id is not None and self._dedup.seen(dedup_id, now_ms):
            self.counters.duplicates += 1
            return self.confirms.duplicate(dedup_id)  # stored nothing: confirmed with the first, once it is safe
        if not message[M_TIMESTAMP]:
            message[M_TIMESTAMP] = now_ms  # before routing: a queue filter sees the JMSTimestamp consumers will
        cluster = self.cluster
        if through and dedup_id is not None and self.write_through.targets and cluster is not None:
            sent_to = self.write_through.target(dedup_id)
            if sent_to is not None and cluster.bindings.knows(sent_to):
                # Written through by an earlier life of this node, whose producer missed the confirm: to the
                # same node again, where the transfer id makes it a duplicate if that node got it.
                return self.admit(message, (), now_ms, {sent_to: ()}, delivered, through=True)
        routes = self.routes
        if cluster is not None:
            key = (message[M_ADDRESS], message[M_ROUTING])
            split = routes.splits.get(key)
            if split is not None and split[2] == self.catalog.bindings_version and split[3] == cluster.bindings.version:
                return self.admit(message, split[0], now_ms, split[1], delivered, through=through)
        remote_too = cluster is not None and cluster.has_remote(message[M_ADDRESS])
        try:
            queues = routes.route(message, now_ms, pick=not remote_too, on_miss=self._on_route_miss)
        except BrokerError:
            if dedup_id is not None:
                self._dedup.forget(dedup_id)  # refused, so a retry is not a duplicate
            raise
        if remote_too:
            assert cluster is not None
            version = self.catalog.bindings_version
            kinds = routes.kinds(message[M_ADDRESS], message[M_ROUTING])
            whole = routes.cache[key][1]  # a simple route: ``queues`` are all of them, not this message's
            queues, remote = cluster.balance(message, message[M_ADDRESS], queues, kinds, version, whole=whole)
            if whole and cluster.fixed(message[M_ADDRESS], kinds):  # the same for every message
                routes.remember_split(key, queues, remote, version, cluster.bindings.version)
            if remote:
                return self.admit(message, queues, now_ms, remote, delivered, through=through)
        return self.admit(message, queues, now_ms, None, delivered)

    def route(self, message: WireMessage, now_ms: int) -> tuple[Queue, ...]:
        """The local queues that get ``message``, creating what a send to its address creates."""
        return self.routes.route(message, now_ms, on_miss=self._on_route_miss)

    def _create_for_send(self, address: str, routing: int, now_ms: int) -> None:
        publisher = self.admission.publisher
        creator = publisher.principal.name if publisher is not None and not publisher.principal.cluster else None
        self.catalog.auto_create(address, routing, creator, now_ms)

    def admit(
        self,
        message: WireMessage,
        queues: tuple[Queue, ...],
        now_ms: int,
        remote: Remote | None = None,
        delivered: int = 0,
        *,
        through: bool = False,
    ) -> int:
        """Store a routed message in its local queues and the store-and-forward queues of ``remote``;
        ``delivered``: delivery attempts it had on another node (its next delivery counts on from them);
        ``through``: a message for one other node only (none here) may be written through to it."""
        message[M_ID] = self._next_id
        self._next_id += 1
        if not message[M_TIMESTAMP]:
            message[M_TIMESTAMP] = now_ms
        durable = message[M_DURABLE]
        events = self.events
        if events.all or (durable and events.durable):
            events.sent(now_ms, message)
        counters = self.counters
        if not queues and not remote:
            counters.unrouted += 1
            return 0
        counters.routed += 1
        token = 0
        if durable:
            durable_queues = tuple(q.name for q in queues if q.durable)
            if durable_queues:
                # With its attempts elsewhere, if any: a restart or failover before its next delivery keeps its flag.
                counts = [delivered] * len(durable_queues) if delivered else None
                token = self._store.add_message(message, durable_queues, counts)
        if remote:
            forward = self.forwarder.forward
            if through and not queues and len(remote) == 1:
                ((node_id, names),) = remote.items()
                token = forward(message, node_id, names, 1, now_ms, through=True, delivered=delivered)
            else:
                for node_id, names in remote.items():
                    # The journal syncs in order: the last record's token covers the earlier ones.
                    token = max(token, forward(message, node_id, names, 1, now_ms, delivered=delivered))
        if token > 0 and message[M_DEDUP] is not None:
            self.confirms.track(message[M_DEDUP], token)  # a duplicate arriving before the sync waits for it
        if message[M_SCHEDULED] > now_ms:
            for queue in queues:
                self.timers.schedule(message[M_SCHEDULED], queue, message, delivered)
            return token
        to_dispatch = self.to_dispatch
        for queue in queues:
            if delivered:
                queue.restore(message, delivered)
            else:
                queue.add(message)
            if queue not in to_dispatch:
                to_dispatch.add(queue)
        return token

    def on_durable(self, token: int) -> None:
        """The store made the message behind ``token`` safe, or (a negative token) the node it was written
        through to confirmed it: send the deliveries that waited for it and confirm it to its producer."""
        self.deliveries.release(token)
        aliases = self.confirms.done(token)
        if self.catalog.unsynced:
            self.catalog.synced(token)
        self._safe_upto = max(self._safe_upto, token)  # the store completes its tokens in order
        if self._after_sync:  # (on_durable runs for every durable message: nothing more when none waits)
            for then in self._after_sync.pop(token, ()):
                then()
        if token > 0 and (unsent := self.write_through.noted(token)):
            self.forwarder.send_held(unsent, self.now_ms)
        for alias in aliases:
            self.on_durable(alias)

    # ------------------------------------------------------------------ time and dispatch
    def tick(self, now_ms: int) -> None:
        """Periodic work: scheduled and delayed redeliveries, delayed wills, idle queues, expiry scan, dedup
        window, selector scans cut at their limit."""
        self.now_ms = now_ms
        queues = self.queues
        for queue, message, count, redelivery in self.timers.pop_due(now_ms):
            if queue is not None and queues.get(queue.name) is queue:
                if redelivery:
                    queue.return_message(message, count)
                else:
                    queue.restore(message, count)  # a moved or recovered one counts on from its attempts
                self.to_dispatch.add(queue)
            elif queue is not None and redelivery:
                queue.settle(message)  # a delayed redelivery for a deleted queue: release what it held
        self.wills.tick(now_ms)
        self.catalog.tick(now_ms)
        self.forwarder.arrivals.forget_before(now_ms - self.settings.cluster.min_residence_ms * MAX_RESIDENCE_FACTOR)
        if now_ms - self._last_expiry_scan >= self.settings.broker.expiry_scan_ms:
            self._last_expiry_scan = now_ms
            self._scan_queues(now_ms)
            self._dedup.expire(now_ms)
            self.forwarder.transfers.expire(now_ms)
        self.deliveries.resume_scans()
        self.flush_dispatch(now_ms)

    def _scan_queues(self, now_ms: int) -> None:
        """Expire what is due, read paged messages back even if no consumer event comes, and delete the
        auto-delete queues that the going of their messages left empty (expiry, dead-lettering, an operator's
        purge): in the queues that may need it, not in all of them."""
        queues, timed = self.queues, self.activity.timed
        for queue in list(timed):
            if queues.get(queue.name) is not queue or not queue.timed:
                timed.discard(queue)
                continue
            queue.expire_due(now_ms)
            if queue.paged:
                self.to_dispatch.add(queue)
        for queue in self._changed_since_scan.take():
            if queue.added and queues.get(queue.name) is queue:  # not merely waiting for its first use
                self.catalog.maybe_auto_delete(queue, now_ms)

    def take_dirty(self) -> list[LinkSession]:
        """Sessions with output to write since the last call. The set is cleared in place, never
        replaced: every queue holds a reference to it."""
        dirty = list(self.dirty)
        self.dirty.clear()
        return dirty

    def flush_dispatch(self, now_ms: int) -> None:
        self.now_ms = now_ms
        if unsent := self.write_through.end_turn(self._store):
            self.forwarder.send_held(unsent, now_ms)
        self.admission.unblock()
        to_dispatch = self.to_dispatch  # shared with the parts: emptied in place, never replaced
        while to_dispatch:
            pending = list(to_dispatch)
            to_dispatch.clear()
            for queue in pending:
                queue.dispatch(now_ms)
            for browser in self.deliveries.take_ended_browsers():
                session = self.sessions.get(browser.session.conn_id)
                if session is not None and session.consumers.get(browser.id) is browser:
                    self.consuming.remove(session, browser, now_ms)

    def offer_again(self, queue: Queue) -> None:
        """Dispatch ``queue`` at the next flush although nothing changed in it: a consumer passed over
        messages it may take now."""
        self.to_dispatch.add(queue)

    def reroute_forward_queue(self, node_id: str, now_ms: int, *, forgotten: bool = False) -> int:
        """See ``Forwarder.reroute_forward_queue``: outside of any link's events, so the time is set here."""
        self.now_ms = now_ms
        return self.forwarder.reroute_forward_queue(node_id, now_ms, forgotten=forgotten)

    # ------------------------------------------------------------------ what the node itself sends
    def publish(self, message: WireMessage, now_ms: int) -> None:
        """Accept a message the node itself sends (an operator's), routed by its address like a publish."""
        self.accept_message(message, now_ms)

    def place_copy(self, message: WireMessage, queue: Queue, origin_id: str, now_ms: int) -> None:
        """Put ``message`` (a new copy: id 0) into ``queue`` alone, stored and audited like a publish; when its
        events are audited it names ``origin_id`` (the audit id of the message it copies, or of that one's
        origin) as its origin, as a forwarded message does."""
        if self.events.covers(message):
            message[M_PROPS].setdefault(ORIGIN_MESSAGE_ID, origin_id)
        self.admit(message, (queue,), now_ms)

    def address_settings_changed(self) -> None:
        """The address settings were changed at run time: forget what was derived from them."""
        self.admission.settings_changed()
        self.routes.forget_all()

    # ------------------------------------------------------------------ recovery and compaction
    def restore(self, state: RecoveredState, now_ms: int, load: Callable[[int], WireMessage] | None = None) -> None:
        """Rebuild addresses, durable queues and their messages from a recovered journal, writing nothing
        back to the store (``load`` reads back those left in the journal). Message ids continue after the
        highest recovered one."""
        self.now_ms = now_ms
        store, self.store = self.store, MemoryStore()
        try:
            self._next_id = max(self._next_id, self.durable_state.restore(state, now_ms, load))
        finally:
            self.store = store

    def durable_snapshot(self) -> DurableSnapshot:
        """The live durable state as records would rebuild it: what journal compaction copies forward."""
        return self.durable_state.snapshot()
