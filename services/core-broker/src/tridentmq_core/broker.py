"""The broker: link events in, deliveries and store commands out. Pure: no I/O, no clock (``now_ms`` is
passed in), so every rule here is testable without a socket.

The server shell feeds each connection's events to ``handle`` and afterwards calls ``flush_dispatch``
and writes ``conn.data_to_send()`` of every session in ``dirty``. Publishes are routed per message but
queues dispatch once per batch, so a frame of 256 publishes costs one dispatch pass per queue.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

from tridentmq_core.address_settings import AddressSettingsRepository, ResolvedAddressSettings
from tridentmq_core.audit import AuditSink
from tridentmq_core.balancer import Balancer, Remote
from tridentmq_core.deadlines import Deadlines
from tridentmq_core.dedup import DuplicateIdCache, TransferIds
from tridentmq_core.forwarding import (
    DEDUP_PREFIX,
    FORWARD_PROPERTY,
    HOME_PREFIX,
    MOVES_PROPERTY,
    ForwardHeader,
    encode_header,
    numbered_header,
)
from tridentmq_core.latency import SMALL_BUCKETS, SMALL_MS, LatencyHistogram, bucket_of
from tridentmq_core.outlet import Outlet
from tridentmq_core.queues import MESSAGE_OVERHEAD, Consumer, LinkSession, MemoryGauge, PagerFactory, Queue
from tridentmq_core.redistribution import MAX_RESIDENCE_FACTOR, Arrivals, Redistributor
from tridentmq_core.router import AddressIndex, AddressTrie, InvalidAddress, validate_address
from tridentmq_core.security import Permission, Principal
from tridentmq_core.selector import Selector, SelectorError, compile_selector
from tridentmq_core.sessions import Session, Transaction
from tridentmq_core.settings import CoreSettings
from tridentmq_core.store.base import DurableSnapshot, Store
from tridentmq_core.store.memory import MemoryStore
from tridentmq_core.store.recovery import RecoveredState
from tridentmq_core.wills import Will, Wills
from tridentmq_core.write_through import Unsent, WriteThrough
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import BYTE_CREDIT_VERSION, MAX_FIELD_INT
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.message import (
    HOME_PROPERTY,
    M_ADDRESS,
    M_BODY,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_PROTOCOL,
    M_ROUTING,
    M_SCHEDULED,
    M_TIMESTAMP,
    MAX_TIME_MS,
    ROUTING_DEFAULT,
    RoutingType,
    WireMessage,
    check_message,
)

log = logging.getLogger("tridentmq.core.broker")

_UNCHECKED: Final[tuple[str, str]] = ("", "")  # marker: the send permission cache has no entry yet
_MULTICAST: Final = int(RoutingType.MULTICAST)
_ROUTINGS: Final = (ROUTING_DEFAULT, *(int(kind) for kind in RoutingType))  # every M_ROUTING a send may carry
_BOTH_KINDS: Final = frozenset((RoutingType.ANYCAST, RoutingType.MULTICAST))
_NO_LIMIT_YET: Final = (-2, "")  # marker: the address's size limit has not been looked up yet
_DEFERRED: Final = object()  # marker: a request whose reply is sent later (a commit waiting for the disk)

FQQN_SEPARATOR = "::"
#: Store-and-forward queues (one per connected cluster node) are named this plus the node id.
FORWARD_QUEUE_PREFIX = "$sys.cluster.sf."
ORIGINAL_ADDRESS = "_AMQ_ORIG_ADDRESS"
ORIGINAL_QUEUE = "_AMQ_ORIG_QUEUE"
ORIGINAL_REASON = "_AMQ_ORIG_REASON"
#: The audit id (``<node tag>-<id>``) a message was given where it was first accepted, carried by the copies
#: that move to other nodes (forwarded, redistributed) so their audit events name it as ``origin_message_id``.
ORIGIN_MESSAGE_ID = "_TMQ_ORIG_MESSAGE_ID"
MAX_WILL_KEY = 512


class Direct(IntEnum):
    """What a cluster connection did with a message offered to it directly (``Broker.send_direct``)."""

    REFUSED = 0  # the link cannot take it now: it goes to the forward queue
    SENT = 1
    HELD = 2  # waits in memory for the link's credit, and its producer's publish credit waits with it


_HELD = Direct.HELD  # a module constant: enum member access is slow on the forwarding path


class BrokerError(Exception):
    """A request the broker refuses; ``code`` is an ``ErrorCode`` and the text is shown to the client."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


class Address:
    __slots__ = ("auto_created", "creator", "name", "queues", "routing_types")

    def __init__(self, name: str, routing_types: set[RoutingType], *, auto_created: bool) -> None:
        self.name = name
        self.routing_types = routing_types
        self.auto_created = auto_created
        self.creator: str | None = None  # the user whose publish auto-created it (counted against their cap)
        self.queues: dict[str, Queue] = {}


@dataclass(slots=True)
class Counters:
    routed: int = 0
    unrouted: int = 0
    duplicates: int = 0
    acked: int = 0
    expired: int = 0
    dead_lettered: int = 0
    rejected: int = 0
    dropped: int = 0  # discarded by address-full-policy DROP
    forwarded: int = 0  # copies put in a store-and-forward queue for another node
    received: int = 0  # messages that came from another node
    redistributed: int = 0  # messages moved to another node's queue of the same name


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
        self.store = store
        self.audit = audit
        self.address_settings = AddressSettingsRepository(settings.address_settings)
        self._pager_factory = pager_factory  # None: no paging, PAGE then behaves as BLOCK
        self._paging_behind = paging_behind  # page writes lag the producers: withhold credit as for memory
        self.sessions: dict[str, Session] = {}
        self.addresses: dict[str, Address] = {}
        self.queues: dict[str, Queue] = {}
        self.counters = Counters()
        #: Since the node started: end-to-end latency (publish timestamp to a consumer's acknowledgement,
        #: auto-ack deliveries included) and time in queue (publish timestamp to each delivery), per node.
        self.latency: Final = LatencyHistogram()
        self.time_in_queue: Final = LatencyHistogram()
        self.dirty: Final[set[LinkSession]] = set()  # sessions with output to write; see take_dirty
        self.memory: Final = MemoryGauge()
        self.now_ms = 0  # time of the event being handled, for callbacks that are not handed it
        # Set by the server while durable writes cannot be made safe (disk nearly full, journal failed):
        # durable publishes are then refused with this (code, text) instead of being accepted unsafely.
        self.durable_refusal: tuple[str, str] | None = None
        #: The largest durable body the store can hold (a journal record fits one segment): at most the
        #: largest body accepted, lowered by the shell when the journal's segments are smaller.
        self.max_durable_body = settings.broker.max_message_bytes
        self._blocked: dict[Session, int] = {}  # publish credit withheld while over the memory limit
        self._blocked_on: dict[Session, set[str]] = {}  # … or while these addresses are over their size limit
        self._limits: dict[str, tuple[int, str] | None] = {}  # address → (max_size_bytes, policy), None: none
        self._memory_limit = settings.broker.max_memory_bytes
        self._trie: AddressTrie[Queue] = AddressTrie(cache_size=0)  # ``_routes`` is the cache of its matches
        # (address, routing) → (queues, simple); simple = no queue filter and at most one anycast queue,
        # so the queues can be used as they are without looking at the message.
        self._routes: dict[tuple[str, int], tuple[tuple[Queue, ...], bool]] = {}
        # The addresses with entries in ``_routes`` (or ``_splits``): a queue created or deleted on a pattern
        # drops the routes of the addresses that pattern matches, and only those (see ``_invalidate_routes``).
        self._routed = AddressIndex()
        self._kinds_cache: dict[tuple[str, int], frozenset[RoutingType]] = {}  # (address, routing) → ``_kinds``
        # (address, routing) → (local queues, other nodes' queues, the two binding versions it holds for): the
        # route and balance of a send whose split depends on no message, made once instead of per message.
        self._splits: dict[tuple[str, int], tuple[tuple[Queue, ...], Remote, int, int]] = {}
        self._anycast_rr: dict[str, int] = {}
        self._to_dispatch: set[Queue] = set()
        self._next_id = first_message_id
        self._dedup = DuplicateIdCache(
            int(settings.broker.dedup_window_seconds * 1000), settings.broker.dedup_max_entries
        )
        # Non-durable transfers from other nodes: a cheaper look-up, and not journaled (see TransferIds).
        self._transfers = TransferIds(
            int(settings.broker.dedup_window_seconds * 1000), settings.broker.dedup_max_entries
        )
        self._timers: list[tuple[int, int, Queue | None, WireMessage, int]] = []  # due, seq, queue, msg, count
        self._timer_seq = itertools.count()
        self._pending_confirms: dict[int, tuple[Session, int]] = {}
        self._pending_replies: dict[int, tuple[Session, int]] = {}  # token → (session, req_id) of a commit
        self._held_deliveries: dict[int, list[tuple[Consumer, int, WireMessage]]] = {}  # token → deliveries
        self._audit_all = audit_messages == "all"
        self._audit_durable = audit_messages in ("all", "durable")
        self._node_tag = node_id[:8]
        self.transfer_prefix = f"{node_id}:"  # + a message id: the id of a transfer to another node
        self._last_expiry_scan = 0
        self._idle: Deadlines[Queue] = Deadlines()  # queues with expires_ms and no consumer → deletion time
        self.wills = Wills()
        # Auto-created addresses without queues → when to look at them again (see ``_check_unused_address``).
        self._unused_addresses: Deadlines[str] = Deadlines()
        self.auto_created_by: dict[str, int] = {}  # user → addresses its publishes auto-created, still existing
        # Clustering (set by the cluster manager when the node clusters): load balancing over other nodes'
        # bindings, the handler of TOPOLOGY requests, and what the manager watches to report bindings.
        self.cluster: Balancer | None = None
        self.on_topology: Callable[[Session, dict[str, Any]], dict[str, Any]] | None = None
        # Takes over the reply to a request that changed this node's bindings (a queue or consumer made),
        # to send it once the other nodes route by the change; False: reply now.
        self.hold_reply: Callable[[Session, int, Any], bool] | None = None
        # High availability (set when the node is half of a pair or votes for pairs): REPLICATE, REPLICA_ACK
        # and VOTE go to it; a request it answers returns the reply.
        self.on_ha: Callable[[Session, ev.Event], Any] | None = None
        self.bindings_version = 0  # bumped whenever a queue or a consumer comes or goes
        self.forward_queues: dict[str, Queue] = {}  # connected node id → its store-and-forward queue
        self.arrivals = Arrivals()  # when messages that came from another node arrived (minimum residence)
        # Offers a message to a connected node, bypassing its forward queue: the confirm token of a durable
        # message written through (0 for a non-durable one), and the producer's session when the message may
        # wait for the link's credit (holding that producer's credit back meanwhile).
        self.send_direct: Callable[[str, WireMessage, int, Session | None], Direct] | None = None
        self._next_through_token = -1  # written-through messages count down: store tokens are positive
        self._publisher: Session | None = None  # whose publishes ``_publish_batch`` is accepting
        self._withheld = 0  # how many of them wait for a cluster connection (their credit comes back later)
        # Where durable publishes written through went, noted before they leave (see write_through).
        self.write_through: WriteThrough[Session] = WriteThrough()
        self._aliases: dict[int, list[int]] = {}  # confirm token → tokens of duplicates that wait for it
        self.paused_addresses: set[str] = set()  # paused by an operator: their queues (new ones too) deliver none
        store.attach(self.on_durable)

    # ------------------------------------------------------------------ sessions
    def open_session(
        self, conn: Outlet, conn_id: str, principal: Principal, peer: str, client_name: str, now_ms: int
    ) -> Session:
        session = Session(conn, conn_id, principal, peer, client_name, now_ms)
        self.sessions[conn_id] = session
        self._emit(now_ms, "conn.opened", conn_id=conn_id, client_id=client_name, protocol="link")
        return session

    def close_session(self, session: Session, now_ms: int) -> None:
        """The link is gone: requeue its unacknowledged messages, drop its transactions and temp queues."""
        if self.sessions.pop(session.conn_id, None) is None:
            return
        self.now_ms = now_ms
        for consumer in list(session.consumers.values()):
            self._remove_consumer(session, consumer, now_ms)
        for tx in session.txs.values():
            self._rollback_acks(tx, now_ms)
        session.txs.clear()
        for name in list(session.temporary_queues):
            if name in self.queues:
                self._delete_queue(self.queues[name], now_ms)
        self.dirty.discard(session)
        self._blocked.pop(session, None)
        self._blocked_on.pop(session, None)
        self._pending_confirms = {t: v for t, v in self._pending_confirms.items() if v[0] is not session}
        self._pending_replies = {t: v for t, v in self._pending_replies.items() if v[0] is not session}
        will = self.wills.release(session, now_ms)
        if will is not None:
            self._publish_will(will, now_ms)
        self._emit(now_ms, "conn.closed", conn_id=session.conn_id, client_id=session.client_name)

    def number_from(self, first: int) -> None:
        """Give messages ids from ``first`` on at least: a backup that takes over numbers its messages after
        every id its primary may have used without leaving it in the journal (written through, or
        acknowledged and compacted away), so no two messages of a pair share an id in the audit stream."""
        self._next_id = max(self._next_id, first)

    def assume_identity(self, node_id: str) -> None:
        """A backup taking over its pair's node id (before anything was restored or connected)."""
        self.node_id = node_id
        self._node_tag = node_id[:8]
        self.transfer_prefix = f"{node_id}:"  # + a message id: the id of a transfer to another node

    # ------------------------------------------------------------------ event entry point
    def handle(self, session: Session, events: Iterable[ev.Event], now_ms: int) -> None:
        self.now_ms = now_ms
        conn = session.conn
        for event in events:
            match event:
                case ev.Publishes(ops):
                    self._publish_batch(session, ops, now_ms)
                case ev.Acks(ops):
                    for _, consumer_id, tx_id, ids in ops:
                        self._ack(session, consumer_id, tx_id, ids, now_ms)
                case ev.Nacks(ops):
                    for _, consumer_id, ids, mode in ops:
                        self._nack(session, consumer_id, ids, NackMode(mode), now_ms)
                case ev.Flow(consumer_id, credit, credit_bytes):
                    self._flow(session, consumer_id, credit, credit_bytes)
                case ev.ReplicaAck():
                    if self.on_ha is not None:
                        self.on_ha(session, event)
                case ev.Closed():
                    self.close_session(session, now_ms)
                case _:
                    req_id: int = getattr(event, "req_id", 0)
                    try:
                        version = self.bindings_version
                        result = self._request(session, event, now_ms)
                        if result is _DEFERRED:
                            pass
                        elif (
                            version == self.bindings_version
                            or self.hold_reply is None
                            or not self.hold_reply(session, req_id, result)
                        ):
                            conn.reply(req_id, result)
                    except BrokerError as exc:
                        conn.error(req_id, exc.code, exc.text)
                    self.dirty.add(session)

    def _request(self, session: Session, event: ev.Event, now_ms: int) -> Any:
        match event:
            case ev.Subscribe(_, consumer_id, queue_name, credit, options):
                return self._subscribe(session, consumer_id, queue_name, credit, options, now_ms)
            case ev.Topology(_, info):
                if self.on_topology is None:
                    raise BrokerError(ErrorCode.INVALID, "this node is not part of a cluster")
                return self.on_topology(session, info)
            case ev.Replicate() | ev.VoteRequested():
                if self.on_ha is None or not session.principal.cluster:
                    raise BrokerError(ErrorCode.INVALID, "this node takes no part in high availability")
                return self.on_ha(session, event)
            case ev.Unsubscribe(_, consumer_id):
                consumer = self._consumer(session, consumer_id)
                self._remove_consumer(session, consumer, now_ms)
                return None
            case ev.CreateQueue(_, spec):
                return self._create_queue_request(session, spec, now_ms)
            case ev.DeleteQueue(_, name):
                queue = self._queue(name)
                self._check_delete(session, queue)
                self._delete_queue(queue, now_ms)
                return None
            case ev.CreateAddress(_, name, routing_types):
                self._require(session, Permission.CREATE_ADDRESS, name)
                kinds = {self._routing_type(r) for r in routing_types} or {RoutingType.ANYCAST}
                created = self._ensure_address(name, kinds, auto_created=False)
                return {"created": created}
            case ev.DeleteAddress(_, name):
                self._require(session, Permission.DELETE_ADDRESS, name)
                self._delete_address(name, now_ms)
                return None
            case ev.TxBegin(_, tx_id):
                if tx_id in session.txs:
                    raise BrokerError(ErrorCode.EXISTS, f"transaction {tx_id} is already open")
                session.txs[tx_id] = Transaction()
                return None
            case ev.TxCommit(req_id, tx_id):
                token = self._commit(session, self._tx(session, tx_id), now_ms)
                del session.txs[tx_id]
                if token:  # the reply waits until the whole transaction is on disk
                    self._pending_replies[token] = (session, req_id)
                    return _DEFERRED
                return None
            case ev.TxRollback(_, tx_id):
                self._rollback_acks(self._tx(session, tx_id), now_ms)
                del session.txs[tx_id]
                return None
            case ev.SetWill(_, key, message, delay_ms, publish_pending):
                self._set_will(session, key, message, delay_ms, publish_pending, now_ms)
                return None
        raise BrokerError(ErrorCode.UNEXPECTED, f"unexpected operation {type(event).__name__}")

    # ------------------------------------------------------------------ wills
    def _set_will(
        self,
        session: Session,
        key: str | None,
        message: WireMessage | None,
        delay_ms: int,
        publish_pending: bool,
        now_ms: int,
    ) -> None:
        if key is None:  # a nil will: clear this link's own, nothing else
            self.wills.drop(session)
            return
        if not key or len(key) > MAX_WILL_KEY:
            raise BrokerError(ErrorCode.INVALID, f"a will key is a string of 1 to {MAX_WILL_KEY} characters")
        if not 0 <= delay_ms <= MAX_TIME_MS:
            raise BrokerError(ErrorCode.INVALID, f"a will's delay_ms is within 0..{MAX_TIME_MS}")
        owner = self.wills.user(key)
        if owner is not None and owner != session.principal.name:
            raise BrokerError(ErrorCode.FORBIDDEN, f"the will under key {key!r} belongs to another user")
        if message is not None:
            self._check_will_message(session, message)  # before anything changes: a refusal leaves all as it was
        self.wills.drop(session)
        pending, holder = self.wills.take_key(key)
        if pending is not None and publish_pending:
            self._publish_will(pending, now_ms)
        elif pending is not None:
            log.debug("pending will cancelled", extra={"will_key": key})
        if holder is not None:
            log.debug("will taken over", extra={"will_key": key, "conn": holder.conn_id})
        if message is not None:
            self.wills.hold(session, Will(key, message, delay_ms, session.conn_id, session.principal.name))

    def _check_will_message(self, session: Session, message: WireMessage) -> None:
        """Refuse a will its link could not publish now, with the code a REJECT would carry."""
        problem = check_message(message, session.conn.max_properties)
        if problem is not None:
            raise BrokerError(ErrorCode.INVALID, problem)
        address = message[M_ADDRESS]
        refusal = self._check_send(session, address)
        if refusal is None and (
            address not in self.addresses or (message[M_ROUTING] != _MULTICAST and address not in self.queues)
        ):
            refusal = self._creation_problem(session, message)
        max_bytes = self.max_durable_body if message[M_DURABLE] else self.settings.broker.max_message_bytes
        if refusal is None and len(message[M_BODY]) > max_bytes:
            refusal = (ErrorCode.RESOURCE_LIMIT, f"message body exceeds {max_bytes} bytes")
        if refusal is not None:
            raise BrokerError(*refusal)

    def _publish_will(self, will: Will, now_ms: int) -> None:
        """Route a will like a publish (its permissions were checked when it was set)."""
        message = list(will.message)
        message[M_ID] = 0
        message[M_TIMESTAMP] = 0  # a fresh id and timestamp, as for any publish
        address = message[M_ADDRESS]
        refusal = self.durable_refusal if message[M_DURABLE] else None
        if refusal is None:
            try:
                self._accept_message(message, now_ms)
            except BrokerError as exc:
                refusal = (exc.code, exc.text)
        if refusal is not None:
            log.warning("will dropped", extra={"will_key": will.key, "address": address, "reason": refusal[1]})
            return
        log.debug("will published", extra={"will_key": will.key, "address": address})
        self._emit(now_ms, "will.published", key=will.key, address=address, conn_id=will.conn_id)

    def discard_wills(self) -> None:
        """The node is stopping: its links close because of that, not because their clients went away, so
        no will is published. Pending wills are kept in memory only and would be lost anyway."""
        self.wills.discard(self.sessions.values())

    # ------------------------------------------------------------------ publishing
    def _publish_batch(self, session: Session, ops: list[list[Any]], now_ms: int) -> None:
        conn = session.conn
        send_ok = session.send_ok
        max_bytes, max_durable = self.settings.broker.max_message_bytes, self.max_durable_body
        accept = self._accept_from_cluster if session.principal.cluster else self._accept_published
        self._publisher, self._withheld = session, 0
        confirm = conn.confirm
        addresses = self.addresses
        limits = self._limits
        full: set[str] = set()  # addresses over their size limit with the BLOCK policy
        for _, seq, tx_id, message in ops:
            address = message[M_ADDRESS]
            problem = send_ok.get(address, _UNCHECKED)
            if problem is _UNCHECKED:
                problem = self._check_send(session, address)
            if problem is None and (
                address not in addresses or (message[M_ROUTING] != _MULTICAST and address not in self.queues)
            ):
                problem = self._creation_problem(session, message)
            if problem is None and message[M_DURABLE] and self.durable_refusal is not None:
                problem = self.durable_refusal
            if problem is None and len(message[M_BODY]) > (max_durable if message[M_DURABLE] else max_bytes):
                limit_bytes = max_durable if message[M_DURABLE] else max_bytes
                problem = (ErrorCode.RESOURCE_LIMIT, f"message body exceeds {limit_bytes} bytes")
            if problem is None:
                limit = limits.get(address, _NO_LIMIT_YET)
                if limit is _NO_LIMIT_YET:
                    limit = self._address_limit(address)
                if limit is not None and self._address_bytes(address) >= limit[0]:
                    if limit[1] == "FAIL":
                        text = f"address {address!r} is full ({limit[0]} bytes, address-full-policy FAIL)"
                        problem = (ErrorCode.RESOURCE_LIMIT, text)
                    elif limit[1] == "DROP":
                        self.counters.dropped += 1
                        confirm(seq)
                        continue
                    else:
                        full.add(address)
            if problem is not None:
                self._reject(conn, seq, *problem)
                if tx_id and tx_id in session.txs:
                    session.txs[tx_id].failed = session.txs[tx_id].failed or problem
                continue
            if tx_id:
                tx = session.txs.get(tx_id)
                if tx is None:
                    self._reject(conn, seq, ErrorCode.NOT_FOUND, f"no open transaction {tx_id}")
                    continue
                tx.publishes.append(message)
                conn.confirm(seq)  # staged; the commit reply is what makes it count
                continue
            try:
                token = accept(message, now_ms)
            except BrokerError as exc:
                self._reject(conn, seq, exc.code, exc.text)
                continue
            if token:
                self._pending_confirms[token] = (session, seq)
            else:
                confirm(seq)
        self._publisher = None
        credit = len(ops) - self._withheld  # the held ones' comes with ``return_publish_credit``
        if self.memory.used < self._memory_limit and not full and not self._paging_behind():
            conn.grant_publish_credit(credit)
        else:
            if not self._blocked:
                log.warning(
                    "memory, address or paging limit reached: producers are blocked until it clears",
                    extra={
                        "used": self.memory.used,
                        "limit": self._memory_limit,
                        "full_addresses": ",".join(sorted(full)),
                        "paging_behind": self._paging_behind(),
                    },
                )
            self._blocked[session] = self._blocked.get(session, 0) + credit
            if full:
                self._blocked_on.setdefault(session, set()).update(full)
        self.dirty.add(session)

    def _address_limit(self, address: str) -> tuple[int, str] | None:
        settings = self.address_settings.resolve(address)
        policy = settings.address_full_policy
        if policy == "PAGE":  # the queues page by themselves; without a pager it degrades to BLOCK
            policy = "BLOCK" if self._pager_factory is None else ""
        limit = (settings.max_size_bytes, policy) if settings.max_size_bytes >= 0 and policy else None
        if len(self._limits) > 100_000:
            self._limits.clear()
        self._limits[address] = limit
        return limit

    def _address_bytes(self, address: str) -> int:
        existing = self.addresses.get(address)
        return sum(q.bytes for q in existing.queues.values()) if existing is not None else 0

    def return_publish_credit(self, session: Session, credit: int) -> None:
        """Publishes of ``session`` held for a cluster connection's credit went out: it may send as many more
        (once unblocked, if the node is blocking producers)."""
        if self.sessions.get(session.conn_id) is not session:
            return
        if session in self._blocked:
            self._blocked[session] += credit
        else:
            session.conn.grant_publish_credit(credit)
            self.dirty.add(session)

    def _unblock_producers(self) -> None:
        """Give blocked producers their credit back once memory, and every address they filled, is under 90 %."""
        if not self._blocked or self.memory.used * 10 >= self._memory_limit * 9 or self._paging_behind():
            return
        for session in list(self._blocked):
            still_full = [
                a
                for a in self._blocked_on.get(session, ())
                if (limit := self._address_limit(a)) is not None and self._address_bytes(a) * 10 >= limit[0] * 9
            ]
            if still_full:
                continue
            session.conn.grant_publish_credit(self._blocked.pop(session))
            self._blocked_on.pop(session, None)
            self.dirty.add(session)
        if not self._blocked:
            log.info("producers resume", extra={"used": self.memory.used})

    def _check_send(self, session: Session, address: str) -> tuple[str, str] | None:
        """Why ``session`` may not send to ``address`` (code, text), or None; cached per link."""
        problem: tuple[str, str] | None = None
        try:
            validate_address(address, allow_wildcards=False)
        except InvalidAddress as exc:
            problem = (ErrorCode.INVALID, str(exc))
        else:
            if not session.principal.allowed(Permission.SEND, address):
                problem = (ErrorCode.FORBIDDEN, f"user {session.principal.name!r} may not send to {address!r}")
        if len(session.send_ok) > 10_000:
            session.send_ok.clear()
        session.send_ok[address] = problem
        return problem

    def _creation_problem(self, session: Session, message: WireMessage) -> tuple[str, str] | None:
        """A publish to an address that does not exist yet will auto-create it (and, for anycast, a durable
        queue of the same name): the sender needs the permissions for that too."""
        address = message[M_ADDRESS]
        settings = self.address_settings.resolve(address)
        needed = []
        principal = session.principal
        if address not in self.addresses:
            if not settings.auto_create_addresses:
                return (ErrorCode.NOT_FOUND, f"address {address!r} does not exist")
            needed.append(Permission.CREATE_ADDRESS)
        kind = self._send_kind(address, message[M_ROUTING], settings)
        if kind is RoutingType.ANYCAST and settings.auto_create_queues and self._lacks_anycast_queue(address):
            needed.append(Permission.CREATE_DURABLE_QUEUE)
        for permission in needed:
            if not principal.allowed(permission, address):
                text = f"user {principal.name!r} lacks permission {permission.value} to auto-create {address!r}"
                return (ErrorCode.FORBIDDEN, text)
        cap = self.settings.broker.max_auto_created_addresses_per_user
        if (
            address not in self.addresses
            and cap > 0
            and not principal.cluster
            and self.auto_created_by.get(principal.name, 0) >= cap
        ):
            text = (
                f"user {principal.name!r} already has {cap} auto-created addresses in use "
                f"(broker.max_auto_created_addresses_per_user): {address!r} is not created"
            )
            return (ErrorCode.RESOURCE_LIMIT, text)
        return None

    def _reject(self, conn: Outlet, seq: int, code: str, text: str) -> None:
        self.counters.rejected += 1
        conn.reject(seq, code, text)

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
                return self._send_home(message, home, now_ms)
        return self._accept_message(message, now_ms, through=True)

    def _send_home(self, message: WireMessage, home: str, now_ms: int) -> int:
        """A publish its producer sends again after its link to node ``home`` dropped unconfirmed: ``home`` may
        have stored it. It goes there (stored here until that node confirms it, for however long it is down),
        and that node routes it as its own publish under the producer's duplicate id: a copy it holds makes
        this one a duplicate, where routing it here would deliver both as new messages. A node gone for
        ``cluster.node_gone_ms`` has it routed again from here (``reroute_forward_queue``)."""
        if self._dedup.seen(message[M_DEDUP], now_ms):
            self.counters.duplicates += 1
            return 0  # sent again to this node too: on its way home already
        message[M_ID] = self._next_id
        self._next_id += 1
        if not message[M_TIMESTAMP]:
            message[M_TIMESTAMP] = now_ms
        if (message[M_DURABLE] and self._audit_durable) or self._audit_all:
            self._emit_message(now_ms, "msg.sent", message, None)
        self.counters.routed += 1
        return self._forward(message, home, (), 1, now_ms, home=True)

    def _accept_message(self, message: WireMessage, now_ms: int, *, through: bool = False) -> int:
        """Route a message into its queues; returns a token when the confirm must wait: a store token, or with
        ``through`` a negative one that another node's confirm releases (see ``_forward``)."""
        dedup_id = message[M_DEDUP]
        if dedup_id is not None and self._dedup.seen(dedup_id, now_ms):
            self.counters.duplicates += 1
            pending = self.write_through.token_of(dedup_id) if through else None
            if pending is None:
                return 0  # already accepted once: confirm again, store nothing
            alias = self._next_through_token  # the first is only on its way to another node: wait with it
            self._next_through_token -= 1
            self._aliases.setdefault(pending, []).append(alias)
            return alias
        cluster = self.cluster
        if through and dedup_id is not None and self.write_through.targets and cluster is not None:
            sent_to = self.write_through.target(dedup_id)
            if sent_to is not None and cluster.bindings.knows(sent_to):
                # Written through by an earlier life of this node, whose producer missed the confirm: to the
                # same node again, where the transfer id makes it a duplicate if that node got it.
                return self._admit(message, (), now_ms, {sent_to: ()}, through=True)
        if cluster is not None:
            key = (message[M_ADDRESS], message[M_ROUTING])
            split = self._splits.get(key)
            if split is not None and split[2] == self.bindings_version and split[3] == cluster.bindings.version:
                return self._admit(message, split[0], now_ms, split[1], through=through)
        remote_too = cluster is not None and cluster.has_remote(message[M_ADDRESS])
        try:
            queues = self._route(message, now_ms, create=True, pick=not remote_too)
        except BrokerError:
            if dedup_id is not None:
                self._dedup.forget(dedup_id)  # refused, so a retry is not a duplicate
            raise
        if remote_too:
            assert cluster is not None
            kinds = self._kinds(message[M_ADDRESS], message[M_ROUTING])
            whole = self._routes[key][1]  # a simple route: ``queues`` are all of them, not this message's
            queues, remote = cluster.balance(
                message, message[M_ADDRESS], queues, kinds, self.bindings_version, whole=whole
            )
            if whole and cluster.fixed(message[M_ADDRESS], kinds):  # the same for every message
                if len(self._splits) > 10_000:
                    self._splits.clear()
                self._splits[key] = (queues, remote, self.bindings_version, cluster.bindings.version)
            if remote:
                return self._admit(message, queues, now_ms, remote, through=through)
        return self._admit(message, queues, now_ms)

    def _accept_from_cluster(self, message: WireMessage, now_ms: int) -> int:
        """A message another node forwarded here: it goes to the queues it was meant for, or on towards its
        target node, never balanced again (that would let it circle)."""
        raw = message[M_PROPS].pop(FORWARD_PROPERTY, None)
        if raw is None:
            return self._accept_message(message, now_ms)  # a plain publish over a cluster connection
        moves = message[M_PROPS].pop(MOVES_PROPERTY, 0)
        if type(moves) is not int or not 0 <= moves <= 1_000:
            moves = 0  # not ours to trust beyond a number: it only lengthens a residence
        try:
            header = ForwardHeader.decode(raw)
        except ValueError as exc:
            raise BrokerError(ErrorCode.INVALID, str(exc)) from None
        producer_dedup = header.producer_dedup
        if producer_dedup is not None:
            return self._accept_home(message, header, producer_dedup, now_ms)
        number = message[M_ID]  # the message's id on the sending node
        numbered = header.numbered and not message[M_DURABLE]  # lost with this node anyway: in no journal
        if numbered:
            message[M_DEDUP] = None
            duplicate = self._transfers.seen(header.dedup_id, number, now_ms)
        else:
            dedup_id = message[M_DEDUP] = DEDUP_PREFIX + header.transfer_id(number)
            duplicate = self._dedup.seen(dedup_id, now_ms)
        if duplicate:
            self.counters.duplicates += 1
            return 0  # a transfer re-sent after its link dropped: stored already
        if header.numbered and ((message[M_DURABLE] and self._audit_durable) or self._audit_all):
            # A redistributed message left its queue over there under the id it had (a forwarded copy carries
            # its origin already): that id is where it was first accepted.
            props = message[M_PROPS]
            if ORIGIN_MESSAGE_ID not in props:
                props[ORIGIN_MESSAGE_ID] = f"{header.dedup_id[:-1][:8]}-{number}"
        cluster = self.cluster
        try:
            if (
                header.target != self.node_id
                and cluster is not None
                and header.hops < cluster.bindings.max_hops
                and cluster.bindings.next_hop(header.target) is not None
            ):
                self.counters.received += 1
                return self._forward(message, header.target, header.queues, header.hops + 1, now_ms)  # a relay
            names = header.queues
            if len(names) == 1:  # the usual case, without a generator per message
                queue = self.queues.get(names[0])
                queues: tuple[Queue, ...] = () if queue is None else (queue,)
            else:
                queues = tuple(q for name in names if (q := self.queues.get(name)) is not None)
            if not queues:  # gone meanwhile (or a relay that cannot reach the target): route it here by address
                queues = self._route(message, now_ms, create=True)
        except BrokerError:  # refused: sending it again (a redistribution retried later) is no duplicate
            if numbered:
                self._transfers.forget(header.dedup_id, number)
            else:
                self._dedup.forget(dedup_id)
            raise
        self.counters.received += 1
        token = self._admit(message, queues, now_ms, delivered=header.delivered)
        if cluster is not None:
            self.arrivals.add(message[M_ID], now_ms, moves)
        return token

    def _accept_home(self, message: WireMessage, header: ForwardHeader, producer_dedup: str, now_ms: int) -> int:
        """A publish another node took in for this one (``_send_home``): routed as this node's own, under its
        producer's duplicate id (or passed on towards its home)."""
        message[M_DEDUP] = producer_dedup
        self.counters.received += 1
        cluster = self.cluster
        if (
            header.target != self.node_id
            and cluster is not None
            and header.hops < cluster.bindings.max_hops
            and cluster.bindings.next_hop(header.target) is not None
        ):
            return self._forward(message, header.target, (), header.hops + 1, now_ms, home=True)
        # As its producer's publish here would be: written through to another node under the producer's id, so
        # a copy this node wrote through there before it died (and forgot the id) makes it a duplicate.
        return self._accept_message(message, now_ms, through=True)

    def _admit(
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
        if (durable and self._audit_durable) or self._audit_all:
            self._emit_message(now_ms, "msg.sent", message, None)
        counters = self.counters
        if not queues and not remote:
            counters.unrouted += 1
            return 0
        counters.routed += 1
        token = 0
        if durable:
            durable_queues = tuple(q.name for q in queues if q.durable)
            if durable_queues:
                token = self.store.add_message(message, durable_queues)
        if remote:
            if through and not queues and len(remote) == 1:
                ((node_id, names),) = remote.items()
                token = self._forward(message, node_id, names, 1, now_ms, through=True)
            else:
                for node_id, names in remote.items():
                    # The journal syncs in order: the last record's token covers the earlier ones.
                    token = max(token, self._forward(message, node_id, names, 1, now_ms))
        if message[M_SCHEDULED] > now_ms:
            for queue in queues:
                self._schedule(message[M_SCHEDULED], queue, message, 0)
            return token
        to_dispatch = self._to_dispatch
        for queue in queues:
            if delivered:
                queue.restore(message, delivered)
            else:
                queue.add(message)
            if queue not in to_dispatch:
                to_dispatch.add(queue)
        return token

    def _forward(
        self,
        message: WireMessage,
        target: str,
        queues: tuple[str, ...],
        hops: int,
        now_ms: int,
        *,
        through: bool = False,
        home: bool = False,
    ) -> int:
        """Put a copy of ``message`` for node ``target`` in the store-and-forward queue of the connected node
        it goes through; the copy stays there until that node confirms it. Returns the store token.

        When that queue is empty (so order holds) and the link can take it now, the copy goes straight over
        the link instead. A non-durable one needs nothing on disk. A durable one may be written through
        (``through``): the producer's confirm then waits for the other node's, which comes once the message is
        safe there, and it is never journaled here; the returned token is negative and ``on_durable`` gets it
        with that confirm. If the link drops or the other node refuses it first, it is stored here after all
        (``requeue_forwards``, ``place_refused``) and confirmed once that is safe.

        With ``through`` the copy may also wait in memory for the link's credit, and its producer's publish
        credit with it: when the other node takes messages more slowly than producers send them, producers
        slow down to its pace rather than this node storing and forwarding every message. A cap below the
        producer's whole window would not do: under a lasting overload the overflow takes the queue, and
        the queue keeps every later message until it drains (measured: 71 % of a single node's durable
        rate across two nodes with no cap, 51 % with half the window).

        ``home``: a producer's publish for the node it was first sent to (``_send_home``), to be routed there
        under the producer's duplicate id."""
        assert self.cluster is not None
        via = self.cluster.bindings.next_hop(target) or target
        audit = (message[M_DURABLE] and self._audit_durable) or self._audit_all
        origin = (message[M_PROPS].get(ORIGIN_MESSAGE_ID) or f"{self._node_tag}-{message[M_ID]}") if audit else None
        copy = message if through else list(message)  # written through, it goes to that node only
        copy[M_ID] = self._next_id
        self._next_id += 1
        durable = copy[M_DURABLE]
        # A written-through message was stored nowhere here: if this node dies before the other confirms, the
        # producer sends it again to its next life, so the transfer's id must be the producer's (with this
        # node's, as two nodes' producers may use one id) to be a duplicate over there.
        producer_dedup = message[M_DEDUP] if durable and through else None
        if home:
            header = encode_header(target, (), hops, f"{HOME_PREFIX}{message[M_DEDUP]}")
        elif producer_dedup:
            header = encode_header(target, queues, hops, f"p:{self.transfer_prefix}{producer_dedup}")
        else:
            header = numbered_header(target, queues, hops, self.transfer_prefix)
        if through:  # the message itself, which goes nowhere else: its properties are its own to change
            copy[M_PROPS][FORWARD_PROPERTY] = header
            if origin is not None:
                copy[M_PROPS][ORIGIN_MESSAGE_ID] = origin
        elif origin is not None:
            copy[M_PROPS] = {**message[M_PROPS], FORWARD_PROPERTY: header, ORIGIN_MESSAGE_ID: origin}
        else:
            copy[M_PROPS] = {**message[M_PROPS], FORWARD_PROPERTY: header}
        self.counters.forwarded += 1
        waiting = self.forward_queues.get(via)
        if (through or not durable) and (waiting is None or not len(waiting)) and self.send_direct is not None:
            token = self._next_through_token if durable else 0
            publisher = self._publisher if through else None
            if producer_dedup or self.write_through.holds_for(via):
                # It leaves once the note of where it went is safe, later ones behind it (see write_through);
                # its producer's credit waits with it.
                self.write_through.hold(via, copy, token, publisher)
                self.memory.used += len(copy[M_BODY]) + MESSAGE_OVERHEAD
                taken = Direct.SENT if publisher is None else _HELD
            else:
                taken = self.send_direct(via, copy, token, publisher)
            if taken:
                if durable:
                    self._next_through_token -= 1
                    if producer_dedup:
                        self.write_through.track(producer_dedup, token)
                        self.write_through.note(producer_dedup, target, now_ms)
                if taken is _HELD:
                    self._withheld += 1
                if audit:
                    self._emit_message(
                        now_ms, "msg.forwarded", copy, None, target_node=target, target_queues=list(queues)
                    )
                return token
        forward_queue = self.forward_queue(via, now_ms)
        token = self.store.add_message(copy, (forward_queue.name,)) if durable else 0
        forward_queue.add(copy)
        self._to_dispatch.add(forward_queue)
        if audit:
            self._emit_message(
                now_ms, "msg.forwarded", copy, forward_queue, target_node=target, target_queues=list(queues)
            )
        return token

    def _send_held(self, unsent: list[Unsent[Session]], now_ms: int) -> None:
        """Send, in order, what waited for its note (see ``_forward``). What the link cannot take now goes to
        the forward queue, a durable one stored here, its producer's confirm waiting for that."""
        returned: dict[Session, int] = {}
        for via, message, token, publisher in unsent:
            self.memory.used -= len(message[M_BODY]) + MESSAGE_OVERHEAD
            queue = self.forward_queues.get(via)
            taken = Direct.REFUSED
            if (queue is None or not len(queue)) and self.send_direct is not None:
                taken = self.send_direct(via, message, token, publisher)
            if not taken:
                queue = self.forward_queue(via, now_ms)
                if message[M_DURABLE]:
                    self._pass_confirm(token, self.store.add_message(message, (queue.name,)))
                queue.add(message)
                self._to_dispatch.add(queue)
            if publisher is not None and taken is not _HELD:  # a held one's comes when the link takes it
                returned[publisher] = returned.get(publisher, 0) + 1
        for publisher, credit in returned.items():
            self.return_publish_credit(publisher, credit)

    def forward_queue(self, node_id: str, now_ms: int) -> Queue:
        """The store-and-forward queue of a connected node (created on first use, durable)."""
        queue = self.forward_queues.get(node_id)
        if queue is None:
            name = FORWARD_QUEUE_PREFIX + node_id
            queue = self.queues.get(name) or self._create_queue(
                name, name, RoutingType.ANYCAST, durable=True, now_ms=now_ms
            )
            self.forward_queues[node_id] = queue
        return queue

    def reroute_forward_queue(self, node_id: str, now_ms: int, *, forgotten: bool = False) -> int:
        """``node_id`` is gone: route what waits for it again, to the queues it was meant for, here or on the
        nodes that remain. A message for a subscription that exists nowhere else keeps waiting, or, when an
        operator forgot that node (``forgotten``), goes to its dead-letter address. Returns how many messages
        moved."""
        queue = self.queues.get(FORWARD_QUEUE_PREFIX + node_id)
        if queue is None or queue.consumers or not len(queue):
            return 0
        self.now_ms = now_ms
        kept: list[WireMessage] = []
        moved = 0
        for message in queue.remove_where(lambda _m: True):
            try:
                header = ForwardHeader.decode(message[M_PROPS].get(FORWARD_PROPERTY))
            except ValueError:
                header = ForwardHeader(node_id, (), 0, "")
            copy = list(message)
            copy[M_PROPS] = {k: v for k, v in message[M_PROPS].items() if k != FORWARD_PROPERTY}
            if header.producer_dedup is not None:  # sent home, it is routed here under its producer's id after all
                self._dedup.forget(header.producer_dedup)
            else:
                copy[M_DEDUP] = None
            if not self._place(copy, header.queues, now_ms):
                if not forgotten:
                    kept.append(message)
                    continue
                settings = self.address_settings.resolve(copy[M_ADDRESS])
                self._to_dead_letter_address(queue, copy, f"node forgotten: {node_id}", settings, now_ms)
                if message[M_DURABLE]:
                    self.store.acknowledge(queue.name, [message[M_ID]])
                continue
            moved += 1
            if message[M_DURABLE]:
                self.store.acknowledge(queue.name, [message[M_ID]])  # after the copy's record: never neither
        for message in kept:
            queue.add(message)
        return moved

    def requeue_forwards(self, node_id: str, messages: list[tuple[WireMessage, int]], now_ms: int) -> None:
        """Messages sent straight to ``node_id``, with their confirm tokens, whose link dropped before it
        confirmed them: they wait in its forward queue like the others (after them: the one exception to their
        order). A durable one is stored now, and its producer's confirm waits for that instead."""
        queue = self.forward_queue(node_id, now_ms)
        for message, token in messages:
            if message[M_DURABLE]:
                self._pass_confirm(token, self.store.add_message(message, (queue.name,)))
            queue.add(message)
        self._to_dispatch.add(queue)

    def _pass_confirm(self, token: int, new_token: int) -> None:
        """The confirm that waited for ``token`` (and those of its duplicates) waits for ``new_token`` now
        (none: they go at once)."""
        if not token:
            return
        dedup_id = self.write_through.forget(token)
        aliases = self._aliases.pop(token, None) if self._aliases else None
        waiting = self._pending_confirms.pop(token, None)
        if new_token:
            if waiting is not None:
                self._pending_confirms[new_token] = waiting
            if aliases:
                self._aliases.setdefault(new_token, []).extend(aliases)
            if dedup_id is not None:  # duplicates keep waiting, now for the disk here
                self.write_through.track(dedup_id, new_token)
            return
        if waiting is not None:
            session, seq = waiting
            session.conn.confirm(seq)
            self.dirty.add(session)
        for alias in aliases or ():
            self._pass_confirm(alias, 0)

    def _refuse_confirm(self, token: int, code: str, text: str, dedup_id: str | None = None) -> bool:
        """Reject the publish whose confirm waited for ``token`` (and its duplicates'), forgetting its
        duplicate id so that it may be sent again; False if none waited."""
        self.write_through.forget(token)
        if dedup_id is not None:
            self._dedup.forget(dedup_id)
        waiting = self._pending_confirms.pop(token, None)
        if waiting is not None:
            self._reject(waiting[0].conn, waiting[1], code, text)
            self.dirty.add(waiting[0])
        aliases = self._aliases.pop(token, None) if self._aliases else None
        for alias in aliases or ():
            self._refuse_confirm(alias, code, text)
        return waiting is not None or bool(aliases)

    def place_refused(
        self,
        message: WireMessage,
        now_ms: int,
        token: int = 0,
        code: str = "",
        text: str = "",
        origin: Queue | None = None,
    ) -> None:
        """A message sent straight to another node, which refused it (``code``, ``text``): deliver it here
        instead. ``token``: the producer's confirm that waits for it (written through), now for its storage
        here; or, when it has no queue here either, the producer learns the other node's refusal."""
        try:
            header = ForwardHeader.decode(message[M_PROPS].get(FORWARD_PROPERTY))
        except ValueError:
            header = ForwardHeader("", (), 0, "")
        copy = list(message)
        copy[M_PROPS] = {k: v for k, v in message[M_PROPS].items() if k != FORWARD_PROPERTY}
        if not token:  # written through, it keeps its producer's id: stored here, a resend is a duplicate
            copy[M_DEDUP] = None
        local = tuple(q for name in header.queues if (q := self.queues.get(name)) is not None)
        try:
            queues = local or self._route(copy, now_ms, create=True)
        except BrokerError as exc:
            if not (token and self._refuse_confirm(token, exc.code, exc.text, message[M_DEDUP])):
                log.warning("refused forwarded message dropped", extra={"reason": exc.text})
            return
        if (
            not queues
            and token
            and self._refuse_confirm(token, code or ErrorCode.INVALID, text or "refused by its node", message[M_DEDUP])
        ):
            return  # no queue here either, and its producer is still waiting: tell it
        if not queues and origin is not None:  # confirmed long ago, from a forward queue: never drop it
            settings = self.address_settings.resolve(copy[M_ADDRESS])
            self._to_dead_letter_address(origin, copy, f"refused: {text or code}", settings, now_ms)
            return
        self._pass_confirm(token, self._admit(copy, queues, now_ms))

    def reroute_refused(
        self, session: Session, consumer: Consumer, message_id: int, now_ms: int, code: str = "", text: str = ""
    ) -> None:
        """The node a forwarded message was for refused it: deliver it here, by its queues or its address, or
        to the dead-letter address when it has neither."""
        taken = consumer.queue.take(consumer, message_id)
        if taken is None:
            return
        self.place_refused(taken[0], now_ms, code=code, text=text, origin=consumer.queue)
        self._settle_acked(consumer.queue, taken[0], now_ms)
        consumer.credit += 1

    def _place(self, message: WireMessage, names: tuple[str, ...], now_ms: int) -> bool:
        """Admit a message for the queues named ``names``: local ones, else another node's of that name; with
        no names, route it by its address. False when no queue of those names exists anywhere."""
        if not names:
            self._accept_message(message, now_ms)
            return True
        local = tuple(q for name in names if (q := self.queues.get(name)) is not None)
        remote: dict[str, list[str]] = {}
        if self.cluster is not None:
            for name in names:
                if name not in self.queues:
                    reachable = [b for b in self.cluster.bindings.for_queue(name) if b.reachable]
                    if reachable:
                        remote.setdefault(min(reachable, key=lambda b: b.distance).node_id, []).append(name)
        if not local and not remote:
            return False
        self._admit(message, local, now_ms, {node_id: tuple(queues) for node_id, queues in remote.items()})
        return True

    def add_forwarder(self, session: Session, consumer: Consumer) -> None:
        """Attach a consumer that moves messages to another node (a cluster connection's)."""
        consumer.queue.add_consumer(consumer)
        session.consumers[consumer.id] = consumer
        self._to_dispatch.add(consumer.queue)

    def offer_again(self, queue: Queue) -> None:
        """Dispatch ``queue`` at the next flush although nothing changed in it: a consumer passed over
        messages it may take now."""
        self._to_dispatch.add(queue)

    def remove_forwarder(self, session: Session, consumer: Consumer, now_ms: int) -> None:
        if session.consumers.get(consumer.id) is consumer:
            self._remove_consumer(session, consumer, now_ms)

    def settle_forwarded(self, session: Session, consumer: Consumer, ids: list[int], now_ms: int) -> None:
        """The other node confirmed these: they are its now. Frees the forwarding window for as many."""
        if session.consumers.get(consumer.id) is not consumer:
            return
        queue = consumer.queue
        journaled: list[int] = []
        for message_id in ids:
            taken = queue.take(consumer, message_id)
            if taken is None:
                continue
            if not queue.name.startswith(FORWARD_QUEUE_PREFIX):  # moved out of a queue: redistributed
                self.counters.redistributed += 1
                if self._audit_all or (self._audit_durable and taken[0][M_DURABLE]):
                    self._emit_message(now_ms, "msg.redistributed", taken[0], queue, target_node=session.client_name)
            self._settle_acked(queue, taken[0], now_ms, journaled)
        if journaled:
            self.store.acknowledge(queue.name, journaled)
        if type(consumer) is Redistributor:
            consumer.confirmed(len(ids))
        else:
            consumer.credit += len(ids)
        self._to_dispatch.add(queue)

    def on_durable(self, token: int) -> None:
        """The store made the message behind ``token`` safe, or (a negative token) the node it was written
        through to confirmed it: confirm it to its producer."""
        held = self._held_deliveries.pop(token, None)
        if held is not None:
            for consumer, delivery_count, message in held:
                self._send_delivery(consumer, delivery_count, message)
        waiting = self._pending_confirms.pop(token, None)
        if waiting is not None:
            session, seq = waiting
            session.conn.confirm(seq)
            self.dirty.add(session)
        committed = self._pending_replies.pop(token, None)
        if committed is not None:
            session, req_id = committed
            session.conn.reply(req_id, None)
            self.dirty.add(session)
        self.write_through.forget(token)
        if token > 0 and (unsent := self.write_through.noted(token)):
            self._send_held(unsent, self.now_ms)
        if self._aliases:
            for alias in self._aliases.pop(token, ()):
                self.on_durable(alias)

    def _route(self, message: WireMessage, now_ms: int, *, create: bool, pick: bool = True) -> tuple[Queue, ...]:
        """The local queues that get ``message``; ``pick``: one of several anycast queues, in turn (else all
        that take it: the cluster's balancer takes the turn, over them and other nodes' queues together)."""
        address = message[M_ADDRESS]
        routing = message[M_ROUTING]
        key = (address, routing)
        route = self._routes.get(key)
        if route is None:
            if create:
                self._auto_create(address, routing, now_ms)
            queues = self._compute_route(address, routing)
            simple = (
                all(q.filter is None for q in queues)
                and sum(q.routing_type is RoutingType.ANYCAST for q in queues) <= 1
            )
            route = self._routes[key] = (queues, simple)
            self._routed.add(address)
        queues, simple = route
        if simple:
            return queues
        filtered = tuple(q for q in queues if q.filter is None or q.accepts(message))
        anycast = [q for q in filtered if q.routing_type is RoutingType.ANYCAST]
        if len(anycast) <= 1 or not pick:
            return filtered
        # Anycast means one queue gets it: round-robin over the anycast queues that match.
        turn = self._anycast_rr.get(address, 0)
        self._anycast_rr[address] = turn + 1
        chosen = anycast[turn % len(anycast)]
        return tuple(q for q in filtered if q.routing_type is RoutingType.MULTICAST or q is chosen)

    def _send_kind(self, address: str, routing: int, settings: ResolvedAddressSettings) -> RoutingType:
        """The routing type a send resolves to: its own, else the address's (anycast if it has both)."""
        if routing != ROUTING_DEFAULT:
            return RoutingType(routing)
        existing = self.addresses.get(address)
        if existing is None or len(existing.routing_types) == 2:
            return settings.default_routing_type
        return next(iter(existing.routing_types))

    def _auto_create(self, address: str, routing: int, now_ms: int) -> None:
        """What a send creates (Artemis auto-create): the address if missing, and for an anycast send the
        queue named after the address if missing, even on an existing address whose queue was auto-deleted."""
        settings = self.address_settings.resolve(address)
        kind = self._send_kind(address, routing, settings)
        if address not in self.addresses:
            if not settings.auto_create_addresses:
                raise BrokerError(ErrorCode.NOT_FOUND, f"address {address!r} does not exist")
            self._ensure_address(address, {kind}, auto_created=True)
            publisher = self._publisher
            if publisher is not None and not publisher.principal.cluster:
                user = self.addresses[address].creator = publisher.principal.name
                self.auto_created_by[user] = self.auto_created_by.get(user, 0) + 1
        if kind is RoutingType.ANYCAST and settings.auto_create_queues and self._lacks_anycast_queue(address):
            self._create_queue(
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
            self._watch_unused_address(address, now_ms)

    def _lacks_anycast_queue(self, address: str) -> bool:
        existing = self.addresses.get(address)
        return existing is None or not any(q.routing_type is RoutingType.ANYCAST for q in existing.queues.values())

    def _compute_route(self, address: str, routing: int) -> tuple[Queue, ...]:
        kinds = self._kinds(address, routing)
        return tuple(q for q in self._trie.match(address) if q.routing_type in kinds)

    def _kinds(self, address: str, routing: int) -> frozenset[RoutingType]:
        """The routing types a send reaches: its own, else the address's (the default type if it has both).
        Cached with the routes: a forwarding node asks for every message."""
        key = (address, routing)
        kinds = self._kinds_cache.get(key)
        if kinds is None:
            if routing != ROUTING_DEFAULT:
                kinds = frozenset((RoutingType(routing),))
            else:
                own = self.addresses.get(address)
                kinds = frozenset(own.routing_types) if own is not None else _BOTH_KINDS
                if len(kinds) == 2:
                    kinds = frozenset((self.address_settings.resolve(address).default_routing_type,))
            if len(self._kinds_cache) > 100_000:
                self._kinds_cache.clear()
            self._kinds_cache[key] = kinds
        return kinds

    def _invalidate_routes(self, pattern: str) -> None:
        """Drop the cached routes that a queue created or deleted on ``pattern`` (an address or a wildcard
        pattern) can change: those of the addresses it matches. A new address among 100,000 costs a few
        dictionary operations instead of every route being made again on the next publish to it."""
        for address in self._routed.remove_matching(pattern):
            for routing in _ROUTINGS:
                key = (address, routing)
                self._routes.pop(key, None)
                self._splits.pop(key, None)

    def _forget_all_routes(self) -> None:
        """Every route, for a change that can alter any of them (the address settings' default routing type)."""
        self._routes.clear()
        self._kinds_cache.clear()
        self._splits.clear()
        self._routed.clear()

    def _address_changed(self, address: str) -> None:
        """The address's own routing types changed (it came, went or gained a type): its kinds and routes."""
        for routing in _ROUTINGS:
            self._kinds_cache.pop((address, routing), None)
        if self._routed.discard(address):
            for routing in _ROUTINGS:
                key = (address, routing)
                self._routes.pop(key, None)
                self._splits.pop(key, None)

    # ------------------------------------------------------------------ consuming
    def _subscribe(
        self, session: Session, consumer_id: int, queue_name: str, credit: int, options: dict[str, Any], now_ms: int
    ) -> dict[str, Any]:
        if consumer_id in session.consumers:
            raise BrokerError(ErrorCode.EXISTS, f"consumer id {consumer_id} is in use on this link")
        if credit > self.settings.broker.max_consumer_credit:
            raise BrokerError(ErrorCode.INVALID, f"credit above {self.settings.broker.max_consumer_credit}")
        browse = bool(options.get("browse", False))
        credit_bytes = options.get("credit_bytes", 0)
        if type(credit_bytes) is not int or credit_bytes < 0:
            raise BrokerError(ErrorCode.INVALID, "credit_bytes is a non-negative integer")
        if session.conn.version < BYTE_CREDIT_VERSION:
            credit_bytes = 0  # a version 1 FLOW cannot give bytes back
        selector = self._compile(options.get("selector"))
        address_name, _, queue_part = queue_name.rpartition(FQQN_SEPARATOR)
        queue_name = queue_part if address_name else queue_name
        queue = self.queues.get(queue_name)
        if queue is None:
            address = address_name or str(options.get("address") or queue_name)
            self._validate(address, wildcards=True)
            settings = self.address_settings.resolve(address)
            if not settings.auto_create_queues:
                raise BrokerError(ErrorCode.NOT_FOUND, f"queue {queue_name!r} does not exist")
            routing = self._routing_type(options.get("routing_type", RoutingType.ANYCAST))
            durable = bool(options.get("durable", routing is RoutingType.ANYCAST))
            self._require(session, Permission.BROWSE if browse else Permission.CONSUME, address)
            self._check_create(session, address, durable)
            queue = self._create_queue(
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
        self._require(session, Permission.BROWSE if browse else Permission.CONSUME, queue.address)
        active = [c for c in queue.consumers if not c.browse]
        if not browse and 0 <= queue.max_consumers <= len(active):
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
            self._idle.cancel(queue)  # a consumer stops the expiry clock
            self.bindings_version += 1
        self._to_dispatch.add(queue)
        self._emit(
            now_ms,
            "consumer.opened",
            conn_id=session.conn_id,
            consumer_id=str(consumer_id),
            queue=queue.name,
            address=queue.address,
        )
        return {"queue": queue.name, "address": queue.address, "routing_type": int(queue.routing_type)}

    def _remove_consumer(self, session: Session, consumer: Consumer, now_ms: int) -> None:
        queue = consumer.queue
        self.bindings_version += 1
        session.consumers.pop(consumer.id, None)
        if consumer in queue.consumers:
            self._requeue(queue, queue.remove_consumer(consumer), now_ms)
            self._to_dispatch.add(queue)
        self._emit(now_ms, "consumer.closed", conn_id=session.conn_id, consumer_id=str(consumer.id), queue=queue.name)
        if not consumer.browse:
            self._start_idle_clock(queue, now_ms)
        self._maybe_auto_delete(queue, now_ms)

    def _requeue(self, queue: Queue, unacked: list[tuple[WireMessage, int]], now_ms: int) -> None:
        """Messages a departed consumer never acknowledged: back to the head of the queue, except those that
        have used up their delivery attempts (a message that crashes every consumer must not loop for ever)."""
        settings = self.address_settings.resolve(queue.address)
        attempts = settings.max_delivery_attempts
        for message, count in unacked:
            if 0 <= attempts <= count:
                self._dead_letter(queue, message, "max_deliveries", settings, now_ms)
            else:
                queue.return_message(message, count)

    def _flow(self, session: Session, consumer_id: int, credit: int, credit_bytes: int) -> None:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            return  # a flow racing an unsubscribe
        consumer.add_credit(credit, credit_bytes, self.settings.broker.max_consumer_credit)
        self._to_dispatch.add(consumer.queue)

    def _ack(self, session: Session, consumer_id: int, tx_id: int, ids: list[int], now_ms: int) -> None:
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
                self._settle_acked(queue, taken[0], now_ms, journaled, consumer)
        if journaled:
            self.store.acknowledge(queue.name, journaled)
        if queue.paged:
            self._to_dispatch.add(queue)  # acks free room: read pages back

    def _settle_acked(
        self,
        queue: Queue,
        message: WireMessage,
        now_ms: int,
        journaled: list[int] | None = None,
        consumer: Consumer | None = None,
    ) -> None:
        queue.settle(message)
        queue.acked += 1
        if consumer is not None:  # a client's acknowledgement (not a forward's confirmation)
            self.latency.record(now_ms - message[M_TIMESTAMP])
        self.on_acked(queue, message, now_ms, journaled, consumer)

    def _nack(self, session: Session, consumer_id: int, ids: list[int], mode: NackMode, now_ms: int) -> None:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            self._async_error(session, ErrorCode.NOT_FOUND, f"nack for unknown consumer {consumer_id}")
            return
        queue = consumer.queue
        for message_id in ids:
            taken = queue.take(consumer, message_id)
            if taken is not None:
                self._return(queue, taken[0], taken[1], mode, now_ms)
        self._to_dispatch.add(queue)

    def _return(self, queue: Queue, message: WireMessage, count: int, mode: NackMode, now_ms: int) -> None:
        """A delivery failed (``count`` = its delivery count): requeue, delay, or dead-letter."""
        if mode is NackMode.RELEASE:
            queue.return_message(message, count - 1)
            return
        settings = self.address_settings.resolve(queue.address)
        if self._audit_all or (self._audit_durable and message[M_DURABLE]):
            self._emit_message(now_ms, "msg.nacked", message, queue, delivery_count=count)
        attempts = settings.max_delivery_attempts
        if mode is NackMode.REJECT or 0 <= attempts <= count:
            reason = "rejected" if mode is NackMode.REJECT else "max_deliveries"
            self._dead_letter(queue, message, reason, settings, now_ms)
            return
        delay = settings.redelivery_delay(count)
        if delay > 0:
            self._schedule(now_ms + delay, queue, message, count)
        else:
            queue.return_message(message, count)

    def _consumer(self, session: Session, consumer_id: int) -> Consumer:
        consumer = session.consumers.get(consumer_id)
        if consumer is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"no consumer {consumer_id} on this link")
        return consumer

    def _async_error(self, session: Session, code: str, text: str) -> None:
        session.conn.error(0, code, text)
        self.dirty.add(session)

    # ------------------------------------------------------------------ transactions
    def _tx(self, session: Session, tx_id: int) -> Transaction:
        tx = session.txs.get(tx_id)
        if tx is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"no open transaction {tx_id}")
        return tx

    def _commit(self, session: Session, tx: Transaction, now_ms: int) -> int:
        """Apply a transaction; returns the store's token for it (0: safe already)."""
        if tx.failed is not None:
            code, text = tx.failed
            raise BrokerError(code, f"transaction is rollback-only: a publish in it was refused ({text})")
        # All or nothing: refuse before applying anything. A missing address that may not be auto-created
        # is the only reason _accept_message refuses; failing half-way would leave the transaction open
        # with part of it applied, and a retried commit would apply that part twice.
        for message in tx.publishes:
            address = message[M_ADDRESS]
            if address not in self.addresses and not self.address_settings.resolve(address).auto_create_addresses:
                raise BrokerError(ErrorCode.NOT_FOUND, f"address {address!r} does not exist")
        self.store.begin_transaction()
        try:
            for message in tx.publishes:
                self._accept_message(message, now_ms)
            for consumer, message_id in tx.acks:
                taken = consumer.queue.take(consumer, message_id)
                if taken is not None:
                    self._settle_acked(consumer.queue, taken[0], now_ms, None, consumer)
        finally:
            token = self.store.commit_transaction()
        return token

    def _rollback_acks(self, tx: Transaction, now_ms: int) -> None:
        for consumer, message_id in tx.acks:
            taken = consumer.queue.take(consumer, message_id)
            if taken is not None:
                self._return(consumer.queue, taken[0], taken[1], NackMode.REDELIVER, now_ms)
                self._to_dispatch.add(consumer.queue)

    # ------------------------------------------------------------------ addresses and queues
    def _validate(self, address: str, *, wildcards: bool) -> None:
        try:
            validate_address(address, allow_wildcards=wildcards)
        except InvalidAddress as exc:
            raise BrokerError(ErrorCode.INVALID, str(exc)) from None

    def _routing_type(self, value: Any) -> RoutingType:
        try:
            return RoutingType(value)
        except ValueError:
            raise BrokerError(ErrorCode.INVALID, f"unknown routing type {value!r}") from None

    def _compile(self, text: Any) -> Selector | None:
        if text is None or text == "":
            return None
        if not isinstance(text, str):
            raise BrokerError(ErrorCode.INVALID, "a selector is a string")
        try:
            return compile_selector(text)
        except SelectorError as exc:
            raise BrokerError(ErrorCode.INVALID, f"bad selector: {exc}") from None

    def _require(self, session: Session, permission: Permission, address: str) -> None:
        principal = session.principal
        if not principal.allowed(permission, address):
            text = f"user {principal.name!r} lacks permission {permission.value} on {address!r}"
            refused = principal.refused_address(permission, address)
            if refused is not None and refused != address:  # a filter: say which address it would reach
                text += f" (it matches {refused!r})"
            raise BrokerError(ErrorCode.FORBIDDEN, text)

    def _check_delete(self, session: Session, queue: Queue) -> None:
        if queue.temporary and queue.owner is not session:
            raise BrokerError(ErrorCode.FORBIDDEN, f"temporary queue {queue.name!r} belongs to another link")
        if queue.owner is not session:
            kind = Permission.DELETE_DURABLE_QUEUE if queue.durable else Permission.DELETE_NON_DURABLE_QUEUE
            self._require(session, kind, queue.address)

    def _check_create(self, session: Session, address: str, durable: bool) -> None:
        if address not in self.addresses:
            self._require(session, Permission.CREATE_ADDRESS, address)
        self._require(
            session, Permission.CREATE_DURABLE_QUEUE if durable else Permission.CREATE_NON_DURABLE_QUEUE, address
        )

    def _ensure_address(self, name: str, kinds: set[RoutingType], *, auto_created: bool) -> bool:
        existing = self.addresses.get(name)
        if existing is not None:
            if not kinds <= existing.routing_types:
                existing.routing_types |= kinds
                self.store.add_address(name, tuple(sorted(existing.routing_types)), auto_created=existing.auto_created)
                self._address_changed(name)
            return False
        self._validate(name, wildcards=True)
        self.addresses[name] = Address(name, set(kinds), auto_created=auto_created)
        self.store.add_address(name, tuple(sorted(kinds)), auto_created=auto_created)
        self._address_changed(name)
        return True

    def _create_queue_request(self, session: Session, spec: dict[str, Any], now_ms: int) -> dict[str, Any]:
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise BrokerError(ErrorCode.INVALID, "a queue needs a name")
        address = spec.get("address") or name
        if not isinstance(address, str):
            raise BrokerError(ErrorCode.INVALID, "the address is a string")
        routing = self._routing_type(spec.get("routing_type", RoutingType.ANYCAST))
        temporary = bool(spec.get("temporary", False))
        durable = bool(spec.get("durable", True)) and not temporary  # a temporary queue is never durable
        expires_ms = spec.get("expires_ms")
        if expires_ms is not None and (type(expires_ms) is not int or not -1 <= expires_ms <= MAX_TIME_MS):
            raise BrokerError(ErrorCode.INVALID, f"expires_ms is an integer, -1 (never) to {MAX_TIME_MS}")
        existing = self.queues.get(name)
        if spec.get("passive") is True:  # only look: nothing is created or changed
            if existing is None:
                return {"created": False, "exists": False, "queue": name}
            expires_ms = None
        if existing is not None:
            if existing.address != address or existing.routing_type is not routing:
                raise BrokerError(
                    ErrorCode.EXISTS,
                    f"queue {name!r} exists on address {existing.address!r} as {existing.routing_type.name.lower()}",
                )
            if expires_ms is not None and expires_ms != existing.expires_ms:
                self._change_expiry(session, existing, expires_ms, now_ms)
            reply = {
                "created": False,
                "queue": name,
                "address": address,
                "expires_ms": existing.expires_ms,
                "filter": existing.filter.text if existing.filter is not None else None,
                "consumers": sum(not c.forwarder for c in existing.consumers),
            }
            return self._say_elsewhere(reply, name, address)
        self._validate(address, wildcards=True)
        self._check_create(session, address, durable)
        lvq = spec.get("last_value_key")
        max_consumers = spec.get("max_consumers", -1)
        if (
            (lvq is not None and not isinstance(lvq, str))
            or type(max_consumers) is not int
            or not -1 <= max_consumers <= MAX_FIELD_INT
        ):
            raise BrokerError(ErrorCode.INVALID, "last_value_key is a string, max_consumers an integer -1 or more")
        self._create_queue(
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
        return self._say_elsewhere({"created": True, "queue": name, "address": address}, name, address)

    def _say_elsewhere(self, reply: dict[str, Any], name: str, address: str) -> dict[str, Any]:
        """``reply`` naming (``elsewhere``) the other nodes that hold a queue of that name and address too, and
        perhaps messages of it: a consumer here makes redistribution bring them over (a node scaling down
        counts until it is gone: its messages are on their way to wherever there are consumers)."""
        if self.cluster is not None:
            bindings = self.cluster.bindings
            holders = {b.node_id for b in bindings.for_queue(name) if b.address == address}
            elsewhere = sorted(holders.union(bindings.moving(name, address)))
            if elsewhere:
                reply["elsewhere"] = elsewhere
        return reply

    def _change_expiry(self, session: Session, queue: Queue, expires_ms: int, now_ms: int) -> None:
        """A new expires_ms for an existing queue. It can get the queue deleted, so it takes the right to
        delete it. An idle queue keeps the idle time it has (none if it had no expiry until now)."""
        self._check_delete(session, queue)
        due = self._idle.get(queue)
        idle_since = now_ms if due is None else due - queue.expires_ms
        queue.expires_ms = expires_ms
        self._idle.cancel(queue)
        self._start_idle_clock(queue, idle_since)
        if queue.durable:
            self.store.add_queue(self._queue_spec(queue))  # a re-recorded spec replaces the old one
        log.debug("queue expiry changed", extra={"queue": queue.name, "expires_ms": expires_ms})

    def _start_idle_clock(self, queue: Queue, since_ms: int) -> None:
        """With an expiry, and no consumer left (browsers aside), the queue is idle from ``since_ms``."""
        if queue.expires_ms >= 0 and self.queues.get(queue.name) is queue and all(c.browse for c in queue.consumers):
            self._idle.set(queue, since_ms + queue.expires_ms)

    def _expire_queue(self, queue: Queue, now_ms: int) -> None:
        log.info(
            "queue expired",
            extra={
                "queue": queue.name,
                "address": queue.address,
                "expires_ms": queue.expires_ms,
                "messages": len(queue),
            },
        )
        self._emit(
            now_ms,
            "queue.expired",
            queue=queue.name,
            address=queue.address,
            expires_ms=queue.expires_ms,
            messages=len(queue),
        )
        self._delete_queue(queue, now_ms)

    def _create_queue(
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
        selector = self._compile(filter_text)
        self._ensure_address(address, {routing}, auto_created=auto_created)
        settings = self.address_settings.resolve(address)
        paging = settings.address_full_policy == "PAGE" and settings.max_size_bytes >= 0
        queue = Queue(
            name,
            address,
            routing,
            sink=self,
            dirty=self.dirty,
            memory=self.memory,
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
        self.addresses[address].queues[name] = queue
        self._trie.add(address, queue)
        self._invalidate_routes(address)
        self.bindings_version += 1
        if owner is not None:
            owner.temporary_queues.add(name)
        if durable:
            self.store.add_queue(self._queue_spec(queue))
        self._start_idle_clock(queue, now_ms)
        log.debug("queue created", extra={"queue": name, "address": address, "routing": routing.name})
        return queue

    def _queue(self, name: str) -> Queue:
        queue = self.queues.get(name.rpartition(FQQN_SEPARATOR)[2])
        if queue is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"queue {name!r} does not exist")
        return queue

    def _delete_queue(self, queue: Queue, now_ms: int) -> None:
        for consumer in list(queue.consumers):
            consumer.session.consumers.pop(consumer.id, None)
            for message, _ in queue.remove_consumer(consumer):
                queue.settle(message)  # the queue goes away with what its consumers held
            consumer.session.conn.consumer_closed(consumer.id, ErrorCode.NOT_FOUND, f"queue {queue.name!r} was deleted")
            self.dirty.add(consumer.session)
        queue.purge()
        del self.queues[queue.name]
        self.bindings_version += 1
        address = self.addresses.get(queue.address)
        if address is not None:
            address.queues.pop(queue.name, None)
        self._trie.remove(queue.address, queue)
        self._to_dispatch.discard(queue)
        self._idle.cancel(queue)
        if queue.owner is not None:
            queue.owner.temporary_queues.discard(queue.name)
        if queue.durable:
            self.store.delete_queue(queue.name)
        self._invalidate_routes(queue.address)
        if address is not None and address.auto_created and not address.queues:
            settings = self.address_settings.resolve(address.name)
            if settings.auto_delete_addresses and settings.auto_delete_addresses_delay_ms <= 0:
                self._delete_address(address.name, now_ms)
            else:
                self._watch_unused_address(address.name, now_ms)

    def _delete_address(self, name: str, now_ms: int) -> None:
        address = self.addresses.get(name)
        if address is None:
            raise BrokerError(ErrorCode.NOT_FOUND, f"address {name!r} does not exist")
        if address.queues:
            raise BrokerError(ErrorCode.INVALID, f"address {name!r} still has queues")
        del self.addresses[name]
        self._anycast_rr.pop(name, None)
        self._limits.pop(name, None)
        self._unused_addresses.cancel(name)
        if address.creator is not None:
            left = self.auto_created_by.get(address.creator, 0) - 1
            if left > 0:
                self.auto_created_by[address.creator] = left
            else:
                self.auto_created_by.pop(address.creator, None)
        self.store.delete_address(name)  # journaled: it stays deleted after a restart
        self._address_changed(name)

    # ------------------------------------------------------------------ unused auto-created addresses
    # An address a publish created keeps no queue when nobody subscribes (a multicast topic): without this it
    # would stay, journaled, for ever (one per topic ever published). It is deleted once it has had no queue
    # and no publish for auto_delete_addresses_delay_ms, looked at no more often than every expiry scan. A
    # publish is seen without a cost on the publish path: the address's cached routes are dropped when it is
    # looked at, and a publish puts them back.
    def _watch_unused_address(self, name: str, now_ms: int) -> None:
        settings = self.address_settings.resolve(name)
        if settings.auto_delete_addresses and name not in self._unused_addresses:
            wait = max(settings.auto_delete_addresses_delay_ms, self.settings.broker.expiry_scan_ms)
            self._unused_addresses.set(name, now_ms + wait)

    def _check_unused_address(self, name: str, now_ms: int) -> None:
        address = self.addresses.get(name)
        if address is None or address.queues or not address.auto_created:
            return  # gone, or in use again (its last queue's deletion watches it anew)
        published = False
        for routing in _ROUTINGS:
            key = (name, routing)
            published |= self._routes.pop(key, None) is not None
            self._kinds_cache.pop(key, None)
            published |= self._splits.pop(key, None) is not None
        self._routed.discard(name)
        if published:  # used since it was last looked at: look again later
            self._watch_unused_address(name, now_ms)
        else:
            self._delete_address(name, now_ms)

    def _maybe_auto_delete(self, queue: Queue, now_ms: int) -> None:
        if (
            queue.auto_delete
            and not queue.consumers
            and not len(queue)
            and queue.name in self.queues
            and not any(timer[2] is queue for timer in self._timers)
        ):
            self._delete_queue(queue, now_ms)  # (a timer holds a delayed or scheduled message of the queue)

    # ------------------------------------------------------------------ dead letters, expiry, timers
    def _dead_letter(
        self, queue: Queue, message: WireMessage, reason: str, settings: ResolvedAddressSettings, now_ms: int
    ) -> None:
        queue.settle(message)
        if message[M_DURABLE] and queue.durable:
            self.store.acknowledge(queue.name, [message[M_ID]])
        self._to_dead_letter_address(queue, message, reason, settings, now_ms)

    def _to_dead_letter_address(
        self, queue: Queue, message: WireMessage, reason: str, settings: ResolvedAddressSettings, now_ms: int
    ) -> None:
        """Count, audit and divert a message that died in ``queue`` (already taken out of it)."""
        queue.dead_lettered += 1
        self.counters.dead_lettered += 1
        self._emit_message(now_ms, "msg.dead_lettered", message, queue, reason=reason)
        self._divert(queue, message, settings.dead_letter_address, reason, now_ms)

    def on_acked(
        self,
        queue: Queue,
        message: WireMessage,
        now_ms: int | None = None,
        journaled: list[int] | None = None,
        consumer: Consumer | None = None,
    ) -> None:
        """Called for every acknowledged message (also by queues for auto-ack and last-value replacement).
        ``journaled``: a batch's ids, to which the id is added for one record at the end, instead of a record;
        ``consumer``: the one that acknowledged it (named in the audit event)."""
        if now_ms is None:
            now_ms = self.now_ms
        self.counters.acked += 1
        if message[M_DURABLE]:
            if queue.durable:
                if journaled is None:
                    self.store.acknowledge(queue.name, [message[M_ID]])
                else:
                    journaled.append(message[M_ID])
            if self._audit_durable:
                self._emit_acked(now_ms, message, queue, consumer)
        elif self._audit_all:
            self._emit_acked(now_ms, message, queue, consumer)

    def _emit_acked(self, now_ms: int, message: WireMessage, queue: Queue, consumer: Consumer | None) -> None:
        if consumer is None:  # auto-ack and last-value replacement: no acknowledging consumer
            self._emit_message(now_ms, "msg.acked", message, queue)
        else:
            self._emit_message(
                now_ms,
                "msg.acked",
                message,
                queue,
                conn_id=consumer.session.conn_id,
                consumer_id=str(consumer.id),
                client_id=consumer.session.client_name,
            )

    def deliver_durable(self, queue: Queue, attempts: list[tuple[Consumer, int, WireMessage]]) -> None:
        """Record a dispatch's delivery attempts (consumer, delivery count, message), and send the deliveries
        only once the record is safe: after a crash a message then comes back flagged as redelivered, never
        looking like a first delivery."""
        token = self.store.update_delivery_counts(
            queue.name, [attempt[2][M_ID] for attempt in attempts], [attempt[1] for attempt in attempts]
        )
        if token:
            self._held_deliveries.setdefault(token, []).extend(attempts)
        else:
            for consumer, delivery_count, message in attempts:
                self._send_delivery(consumer, delivery_count, message)

    def _send_delivery(self, consumer: Consumer, delivery_count: int, message: WireMessage) -> None:
        session = consumer.session
        if session.consumers.get(consumer.id) is not consumer or message[M_ID] not in consumer.in_flight:
            return  # the consumer left meanwhile: the message went back to its queue
        session.conn.deliver(consumer.id, delivery_count, message)
        self.dirty.add(session)

    def on_delivered(self, queue: Queue, consumer: Consumer, delivery_count: int, message: WireMessage) -> None:
        """Audit a delivery to a consumer (``msg.delivered``), when message events cover the message, and
        time it (with an auto-ack consumer the delivery is the acknowledgement)."""
        waited = self.now_ms - message[M_TIMESTAMP]
        if 0 <= waited < SMALL_MS:  # inlined LatencyHistogram.record: once per delivery, twice with auto-ack
            index = SMALL_BUCKETS[waited]
            times = self.time_in_queue
            times.counts[index] += 1
            times.sum_ms += waited
            if consumer.auto_ack:
                times = self.latency
                times.counts[index] += 1
                times.sum_ms += waited
        else:
            index = bucket_of(waited)
            self.time_in_queue.add(index, waited)
            if consumer.auto_ack:
                self.latency.add(index, waited)
        if self._audit_all or (self._audit_durable and message[M_DURABLE]):
            session = consumer.session
            self.audit.emit_delivered(
                self.now_ms * 1000,
                queue.name,
                message[M_ADDRESS],
                f"{self._node_tag}-{message[M_ID]}",
                len(message[M_BODY]),
                message[M_PROTOCOL] or "link",
                message[M_TIMESTAMP] * 1000,
                delivery_count,
                session.conn_id,
                str(consumer.id),
                session.client_name,
                message[M_PROPS].get(ORIGIN_MESSAGE_ID),
            )

    def on_pages_ready(self, queue: Queue) -> None:
        """Paged messages were read back from disk (the shell flushes after calling this)."""
        if self.queues.get(queue.name) is queue:
            self._to_dispatch.add(queue)

    def on_expired(self, queue: Queue, message: WireMessage) -> None:
        queue.expired += 1
        self.counters.expired += 1
        if message[M_DURABLE] and queue.durable:
            self.store.acknowledge(queue.name, [message[M_ID]])
        now_ms = self.now_ms
        self._emit_message(now_ms, "msg.expired", message, queue, reason="ttl")
        settings = self.address_settings.resolve(queue.address)
        self._divert(queue, message, settings.expiry_address, "expired", now_ms)

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
        if target not in self.addresses and self.address_settings.resolve(target).auto_create_dead_letter_resources:
            self._create_queue(target, target, RoutingType.ANYCAST, durable=True, now_ms=now_ms)
        try:
            self._accept_message(copy, now_ms)
        except BrokerError as exc:
            log.warning("message dropped", extra={"queue": queue.name, "reason": exc.text})

    def _schedule(self, due_ms: int, queue: Queue | None, message: WireMessage, count: int) -> None:
        heapq.heappush(self._timers, (due_ms, next(self._timer_seq), queue, message, count))

    def tick(self, now_ms: int) -> None:
        """Periodic work: scheduled and delayed redeliveries, delayed wills, idle queues, expiry scan, dedup
        window."""
        self.now_ms = now_ms
        timers = self._timers
        while timers and timers[0][0] <= now_ms:
            _, _, queue, message, count = heapq.heappop(timers)
            if queue is not None and self.queues.get(queue.name) is queue:
                if count:
                    queue.return_message(message, count)
                else:
                    queue.add(message)
                self._to_dispatch.add(queue)
            elif queue is not None and count:
                queue.settle(message)  # a delayed redelivery for a deleted queue: release what it held
        for will in self.wills.due(now_ms):
            self._publish_will(will, now_ms)
        for name in self._unused_addresses.pop_due(now_ms):
            self._check_unused_address(name, now_ms)
        for expired in self._idle.pop_due(now_ms):
            self._expire_queue(expired, now_ms)
        self.arrivals.forget_before(now_ms - self.settings.cluster.min_residence_ms * MAX_RESIDENCE_FACTOR)
        if now_ms - self._last_expiry_scan >= self.settings.broker.expiry_scan_ms:
            self._last_expiry_scan = now_ms
            for queue in list(self.queues.values()):
                queue.expire_due(now_ms)
                if queue.paged:
                    self._to_dispatch.add(queue)  # read pages back even if no consumer event comes
                if queue.added:  # emptied by expiry or dead-lettering, not merely waiting for its first use
                    self._maybe_auto_delete(queue, now_ms)
            self._dedup.expire(now_ms)
            self._transfers.expire(now_ms)
        self.flush_dispatch(now_ms)

    def restore(self, state: RecoveredState, now_ms: int) -> None:
        """Rebuild addresses, durable queues and their messages from a recovered journal, writing nothing
        back to the store. Message ids continue after the highest recovered one. Every queue starts idle at
        ``now_ms``: one with an expiry gets its full time again."""
        self.now_ms = now_ms
        store, self.store = self.store, MemoryStore()
        try:
            for name, (kinds, auto_created) in state.addresses.items():
                self._ensure_address(name, {RoutingType(k) for k in kinds}, auto_created=auto_created)
            for name, spec in state.queues.items():
                queue = self._create_queue(
                    name,
                    spec["address"],
                    RoutingType(spec["routing_type"]),
                    durable=True,
                    now_ms=self.now_ms,
                    filter_text=spec.get("filter"),
                    exclusive=bool(spec.get("exclusive")),
                    last_value_key=spec.get("last_value_key"),
                    max_consumers=int(spec.get("max_consumers", -1)),
                    auto_created=bool(spec.get("auto_created")),
                    auto_delete=bool(spec.get("auto_delete")),
                    expires_ms=int(spec.get("expires_ms", -1)),
                )
                # By id, which grows with publish order: a compaction writes the older messages it copies
                # after the ones published while it ran.
                for message_id, count in sorted(state.references.get(name, {}).items()):
                    message = state.messages[message_id]
                    if message[M_SCHEDULED] > self.now_ms:
                        self._schedule(message[M_SCHEDULED], queue, message, 0)  # not due yet
                    else:
                        queue.restore(message, count)
        finally:
            self.store = store
        for message in state.messages.values():
            self._next_id = max(self._next_id, message[M_ID] + 1)
        for dedup_id, arrived in state.dedup_ids.items():  # oldest first, acknowledged messages' ones too
            self._dedup.remember(dedup_id, arrived)
        self.write_through.restore(state.through_ids)
        self._dedup.expire(self.now_ms)
        for address in self.addresses.values():  # journals written before auto-delete hold unused ones too
            if address.auto_created and not address.queues:
                self._watch_unused_address(address.name, now_ms)

    def durable_snapshot(self) -> DurableSnapshot:
        """The live durable state as records would rebuild it: what journal compaction copies forward."""
        queues = [q for q in self.queues.values() if q.durable]
        names = {q.address for q in queues}
        messages: dict[int, tuple[WireMessage, list[str], list[int]]] = {}

        def owe(queue: Queue, message: WireMessage, count: int) -> None:
            if message[M_DURABLE]:
                entry = messages.setdefault(message[M_ID], (message, [], []))
                entry[1].append(queue.name)
                entry[2].append(count)

        for queue in queues:
            for message, count in queue.live_messages():
                owe(queue, message, count)
        for _, _, held, message, count in self._timers:  # scheduled and delayed redeliveries
            if held is not None and held.durable and self.queues.get(held.name) is held:
                owe(held, message, count)
        return DurableSnapshot(
            addresses=[
                (a.name, sorted(int(r) for r in a.routing_types), a.auto_created)
                for a in self.addresses.values()
                if a.name in names
            ],
            queues=[self._queue_spec(q) for q in queues],
            messages=list(messages.values()),
            dedup_ids=self.write_through.to_remember(self._dedup.entries()),
            through_ids=self.write_through.snapshot(),
        )

    @staticmethod
    def _queue_spec(queue: Queue) -> dict[str, Any]:
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

    def take_dirty(self) -> list[LinkSession]:
        """Sessions with output to write since the last call. The set is cleared in place, never
        replaced: every queue holds a reference to it."""
        dirty = list(self.dirty)
        self.dirty.clear()
        return dirty

    def flush_dispatch(self, now_ms: int) -> None:
        self.now_ms = now_ms
        if unsent := self.write_through.end_turn(self.store):
            self._send_held(unsent, now_ms)
        self._unblock_producers()
        while self._to_dispatch:
            pending, self._to_dispatch = self._to_dispatch, set()
            for queue in pending:
                queue.dispatch(now_ms)

    # ------------------------------------------------------------------ operators (see operations.py)
    def create_queue(
        self,
        name: str,
        address: str,
        routing: RoutingType,
        *,
        durable: bool,
        now_ms: int,
        filter_text: str | None,
        exclusive: bool,
        last_value_key: str | None,
        max_consumers: int,
    ) -> Queue:
        """An operator's queue (BrokerError when the name, address or filter is bad)."""
        self._validate(address, wildcards=True)
        return self._create_queue(
            name,
            address,
            routing,
            durable=durable,
            now_ms=now_ms,
            filter_text=filter_text,
            exclusive=exclusive,
            last_value_key=last_value_key,
            max_consumers=max_consumers,
        )

    def delete_queue(self, queue: Queue, now_ms: int) -> None:
        """Delete ``queue`` with its messages; its consumers are told (CONSUMER_CLOSED not-found)."""
        self._delete_queue(queue, now_ms)

    def take_messages(
        self, queue: Queue, predicate: Callable[[WireMessage], bool], limit: int, reason: str, now_ms: int
    ) -> list[WireMessage]:
        """Take up to ``limit`` (-1: all) queued messages matching ``predicate`` out of ``queue`` for good (an
        operator's purge or move): their journal records are acknowledged and each is audited as ``msg.acked``
        with ``reason``. In-flight and paged messages stay."""
        left = [limit]

        def wanted(message: WireMessage) -> bool:
            if left[0] == 0 or not predicate(message):
                return False
            left[0] -= 1
            return True

        taken = queue.remove_where(wanted)
        self._settle_taken(queue, taken, reason, now_ms)
        return taken

    def purge_queue(self, queue: Queue, now_ms: int) -> int:
        """Drop every queued and paged message of ``queue`` (in-flight ones stay with their consumers)."""
        paged = [message for message, _, state in queue.browse_messages() if state == "paged"]
        taken = queue.purge()
        self._settle_taken(queue, [*taken, *paged], "purged", now_ms)
        return len(taken) + len(paged)

    def _settle_taken(self, queue: Queue, taken: list[WireMessage], reason: str, now_ms: int) -> None:
        if queue.durable:
            ids = [message[M_ID] for message in taken if message[M_DURABLE]]
            if ids:
                self.store.acknowledge(queue.name, ids)
        for message in taken:
            if (message[M_DURABLE] and self._audit_durable) or self._audit_all:
                self._emit_message(now_ms, "msg.acked", message, queue, reason=reason)

    def place_copy(self, message: WireMessage, queue: Queue, origin_id: str, now_ms: int) -> None:
        """Put ``message`` (a new copy: id 0) into ``queue`` alone, stored and audited like a publish; when its
        events are audited it names ``origin_id`` (the audit id of the message it copies, or of that one's
        origin) as its origin, as a forwarded message does."""
        if (message[M_DURABLE] and self._audit_durable) or self._audit_all:
            message[M_PROPS].setdefault(ORIGIN_MESSAGE_ID, origin_id)
        self._admit(message, (queue,), now_ms)

    def publish(self, message: WireMessage, now_ms: int) -> None:
        """Accept a message the node itself sends (an operator's), routed by its address like a publish."""
        self._accept_message(message, now_ms)

    def set_paused(self, queue: Queue, paused: bool) -> None:
        queue.paused = paused
        if not paused:
            self._to_dispatch.add(queue)

    def address_settings_changed(self) -> None:
        """The address settings were changed at run time: forget what was derived from them."""
        self._limits.clear()
        self._forget_all_routes()

    # ------------------------------------------------------------------ audit
    def _emit(self, now_ms: int, event: str, **fields: object) -> None:
        self.audit.emit(now_ms * 1000, event, fields)

    def _emit_message(
        self, now_ms: int, event: str, message: WireMessage, queue: Queue | None, **fields: object
    ) -> None:
        origin = message[M_PROPS].get(ORIGIN_MESSAGE_ID)
        if origin is not None:
            fields["origin_message_id"] = origin
        self.audit.emit_message(
            now_ms * 1000,
            event,
            queue.name if queue is not None else None,
            message[M_ADDRESS],
            f"{self._node_tag}-{message[M_ID]}",
            len(message[M_BODY]),
            message[M_PROTOCOL] or "link",
            message[M_TIMESTAMP] * 1000,
            fields,
        )
