"""Messages between cluster nodes: sending copies towards the node whose queues get them (through a
store-and-forward queue per connected node, or straight over the link), taking in what other nodes send,
and placing again what a node refused or what waited for a node that is gone.

The broker routes and admits; this module decides how a copy travels and what happens when it cannot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import IntEnum
from typing import Final, Protocol

from tridentmq_core.address_settings import AddressSettingsRepository
from tridentmq_core.admission import Admission
from tridentmq_core.audit_events import ORIGIN_MESSAGE_ID, AuditEvents
from tridentmq_core.balancer import Balancer, Remote
from tridentmq_core.catalog import Catalog
from tridentmq_core.checks import BrokerError
from tridentmq_core.confirms import Confirms
from tridentmq_core.counters import Counters
from tridentmq_core.dead_letters import DeadLetters
from tridentmq_core.dedup import DuplicateIdCache, TransferIds
from tridentmq_core.deliveries import Deliveries
from tridentmq_core.forwarding import (
    DEDUP_PREFIX,
    FORWARD_PROPERTY,
    HOME_PREFIX,
    MOVES_PROPERTY,
    ForwardHeader,
    encode_header,
    numbered_header,
)
from tridentmq_core.queues import MESSAGE_OVERHEAD, Consumer, MemoryGauge, Queue
from tridentmq_core.redistribution import Arrivals, Redistributor
from tridentmq_core.sessions import Session
from tridentmq_core.store.base import Store
from tridentmq_core.write_through import Unsent, WriteThrough
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import (
    M_ADDRESS,
    M_BODY,
    M_DEDUP,
    M_DURABLE,
    M_ID,
    M_PROPS,
    M_ROUTING,
    M_TIMESTAMP,
    RoutingType,
    WireMessage,
)

log = logging.getLogger("tridentmq.core.broker")

#: Store-and-forward queues (one per connected cluster node) are named this plus the node id.
FORWARD_QUEUE_PREFIX = "$sys.cluster.sf."


class Direct(IntEnum):
    """What a cluster connection did with a message offered to it directly (``Forwarder.send_direct``)."""

    REFUSED = 0  # the link cannot take it now: it goes to the forward queue
    SENT = 1
    HELD = 2  # waits in memory for the link's credit, and its producer's publish credit waits with it


_HELD: Final = Direct.HELD  # a module constant: enum member access is slow on the forwarding path

#: Offers a message to a connected node, bypassing its forward queue: the confirm token of a durable message
#: written through (0 for a non-durable one), and the producer's session when the message may wait for the
#: link's credit (holding that producer's credit back meanwhile).
SendDirect = Callable[[str, WireMessage, int, Session | None], Direct]


class Placing(Protocol):
    """What the forwarder asks of the broker: routing and admitting a message here."""

    @property
    def node_id(self) -> str: ...
    @property
    def transfer_prefix(self) -> str: ...
    @property
    def cluster(self) -> Balancer | None: ...
    def new_message_id(self) -> int: ...
    def route(self, message: WireMessage, now_ms: int) -> tuple[Queue, ...]: ...
    def accept_message(
        self, message: WireMessage, now_ms: int, *, through: bool = False, delivered: int = 0
    ) -> int: ...
    def admit(
        self,
        message: WireMessage,
        queues: tuple[Queue, ...],
        now_ms: int,
        remote: Remote | None = None,
        delivered: int = 0,
        *,
        through: bool = False,
    ) -> int: ...


class Forwarder:
    def __init__(
        self,
        host: Placing,
        address_settings: AddressSettingsRepository,
        *,
        store: Store,
        catalog: Catalog,
        admission: Admission,
        deliveries: Deliveries,
        dead_letters: DeadLetters,
        confirms: Confirms,
        write_through: WriteThrough[Session],
        dedup: DuplicateIdCache,
        audit: AuditEvents,
        counters: Counters,
        memory: MemoryGauge,
        to_dispatch: set[Queue],
        dedup_window_ms: int,
        dedup_max_entries: int,
    ) -> None:
        self._host = host
        self.address_settings = address_settings
        self.store = store
        self._catalog = catalog
        self._admission = admission
        self._deliveries = deliveries
        self._dead_letters = dead_letters
        self._confirms = confirms
        self.write_through = write_through
        self._dedup = dedup
        self._audit = audit
        self._counters = counters
        self._memory = memory
        self._to_dispatch = to_dispatch
        # Non-durable transfers from other nodes: a cheaper look-up, and not journaled (see TransferIds).
        self.transfers = TransferIds(dedup_window_ms, dedup_max_entries)
        self.forward_queues: dict[str, Queue] = {}  # connected node id → its store-and-forward queue
        self.arrivals = Arrivals()  # when messages that came from another node arrived (minimum residence)
        self.send_direct: SendDirect | None = None  # set by the cluster manager

    # ------------------------------------------------------------------ taking in
    def send_home(self, message: WireMessage, home: str, now_ms: int) -> int:
        """A publish its producer sends again after its link to node ``home`` dropped unconfirmed: ``home`` may
        have stored it. It goes there (stored here until that node confirms it, for however long it is down),
        and that node routes it as its own publish under the producer's duplicate id: a copy it holds makes
        this one a duplicate, where routing it here would deliver both as new messages. A node gone for
        ``cluster.node_gone_ms`` has it routed again from here (``reroute_forward_queue``)."""
        if self._dedup.seen(message[M_DEDUP], now_ms):
            self._counters.duplicates += 1
            return self._confirms.duplicate(message[M_DEDUP])  # sent again to this node too: confirmed with the first
        message[M_ID] = self._host.new_message_id()
        if not message[M_TIMESTAMP]:
            message[M_TIMESTAMP] = now_ms
        if self._audit.covers(message):
            self._audit.sent(now_ms, message)
        self._counters.routed += 1
        return self._confirms.track(message[M_DEDUP], self.forward(message, home, (), 1, now_ms, home=True))

    def accept_from_cluster(self, message: WireMessage, now_ms: int) -> int:
        """A message another node forwarded here: it goes to the queues it was meant for, or on towards its
        target node, never balanced again (that would let it circle)."""
        host = self._host
        raw = message[M_PROPS].pop(FORWARD_PROPERTY, None)
        if raw is None:
            return host.accept_message(message, now_ms)  # a plain publish over a cluster connection
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
        number = message[M_ID]  # the sending node's id of it: the numbered header's transfer id is made of it
        numbered = header.numbered and not message[M_DURABLE]  # lost with this node anyway: in no journal
        if numbered:
            message[M_DEDUP] = None
            duplicate = self.transfers.seen(header.dedup_id, number, now_ms)
        else:
            dedup_id = message[M_DEDUP] = DEDUP_PREFIX + header.transfer_id(number)
            duplicate = self._dedup.seen(dedup_id, now_ms)
        if duplicate:
            self._counters.duplicates += 1
            # A transfer re-sent after its link dropped: stored already, safe once the first copy is (a
            # numbered one is in no journal).
            return 0 if numbered else self._confirms.duplicate(dedup_id)
        if header.numbered and self._audit.covers(message):
            # A redistributed message left its queue over there under the id it had (a forwarded copy carries
            # its origin already): that id is where it was first accepted.
            props = message[M_PROPS]
            if ORIGIN_MESSAGE_ID not in props:
                props[ORIGIN_MESSAGE_ID] = f"{header.dedup_id[:-1][:8]}-{number}"
        cluster = host.cluster
        queues_by_name = self._catalog.queues
        try:
            if (
                header.target != host.node_id
                and cluster is not None
                and header.hops < cluster.bindings.max_hops
                and cluster.bindings.next_hop(header.target) is not None
            ):
                self._counters.received += 1
                token = self.forward(  # a relay
                    message, header.target, header.queues, header.hops + 1, now_ms, delivered=header.delivered
                )
                return token if numbered else self._confirms.track(dedup_id, token)
            names = header.queues
            if len(names) == 1:  # the usual case, without a generator per message
                queue = queues_by_name.get(names[0])
                queues: tuple[Queue, ...] = () if queue is None else (queue,)
            else:
                queues = tuple(q for name in names if (q := queues_by_name.get(name)) is not None)
            if not queues and not (names and message[M_ROUTING] == RoutingType.MULTICAST):
                # Gone meanwhile (or a relay that cannot reach the target): route it here by its address. Not a
                # multicast message for named subscriptions: this node's others had their copies (as on one
                # node, a message for a subscription deleted meanwhile is gone with it).
                queues = host.route(message, now_ms)
        except BrokerError:  # refused: sending it again (a redistribution retried later) is no duplicate
            if numbered:
                self.transfers.forget(header.dedup_id, number)
            else:
                self._dedup.forget(dedup_id)
            raise
        self._counters.received += 1
        # A move (redistribution, scale-down) counts as a delivery attempt here, as it does on the node it left:
        # should this node's confirm be lost (the link drops first), that node takes its copy back and delivers
        # it again, flagged, while this one delivers the copy it stored, which must be flagged as well. Once: a
        # message that keeps moving does not use up its attempts. A forwarded publish is never taken back (its
        # sender sends it again, a duplicate here), so it counts nothing.
        delivered = max(header.delivered, 1) if moves else header.delivered
        token = host.admit(message, queues, now_ms, delivered=delivered)
        if cluster is not None:
            self.arrivals.add(message[M_ID], now_ms, moves)
        return token

    def _accept_home(self, message: WireMessage, header: ForwardHeader, producer_dedup: str, now_ms: int) -> int:
        """A publish another node took in for this one (``send_home``): routed as this node's own, under its
        producer's duplicate id (or passed on towards its home)."""
        host = self._host
        message[M_DEDUP] = producer_dedup
        self._counters.received += 1
        cluster = host.cluster
        if (
            header.target != host.node_id
            and cluster is not None
            and header.hops < cluster.bindings.max_hops
            and cluster.bindings.next_hop(header.target) is not None
        ):
            return self.forward(
                message, header.target, (), header.hops + 1, now_ms, home=True, delivered=header.delivered
            )
        # As its producer's publish here would be: written through to another node under the producer's id, so
        # a copy this node wrote through there before it died (and forgot the id) makes it a duplicate.
        return host.accept_message(message, now_ms, through=True)

    # ------------------------------------------------------------------ sending on
    def forward(
        self,
        message: WireMessage,
        target: str,
        queues: tuple[str, ...],
        hops: int,
        now_ms: int,
        *,
        through: bool = False,
        home: bool = False,
        delivered: int = 0,
    ) -> int:
        """Put a copy of ``message`` for node ``target`` in the store-and-forward queue of the connected node
        it goes through; the copy stays there until that node confirms it. Returns the store token.

        When that queue is empty (so order holds) and the link can take it now, the copy goes straight over
        the link instead. A non-durable one needs nothing on disk. A durable one may be written through
        (``through``): the producer's confirm then waits for the other node's, which comes once the message is
        safe there, and it is never journaled here; the returned token is negative and the broker's
        ``on_durable`` gets it with that confirm. If the link drops or the other node refuses it first, it is
        stored here after all (``requeue_forwards``, ``place_refused``) and confirmed once that is safe.

        With ``through`` the copy may also wait in memory for the link's credit, and its producer's publish
        credit with it: when the other node takes messages more slowly than producers send them, producers
        slow down to its pace rather than this node storing and forwarding every message. A cap below the
        producer's whole window would not do: under a lasting overload the overflow takes the queue, and
        the queue keeps every later message until it drains (measured: 71 % of a single node's durable
        rate across two nodes with no cap, 51 % with half the window).

        ``home``: a producer's publish for the node it was first sent to (``send_home``), to be routed there
        under the producer's duplicate id. ``delivered``: the delivery attempts it may have had already (a copy
        routed again from a node declared gone), so that the other node flags its next delivery."""
        host = self._host
        cluster = host.cluster
        assert cluster is not None
        via = cluster.bindings.next_hop(target) or target
        audit = self._audit
        covered = audit.all or (audit.durable and message[M_DURABLE])  # inlined ``covers``: once per copy
        origin = audit.origin(message) if covered else None
        copy = message if through else list(message)  # written through, it goes to that node only
        copy[M_ID] = host.new_message_id()
        durable = copy[M_DURABLE]
        # A written-through message was stored nowhere here: if this node dies before the other confirms, the
        # producer sends it again to its next life, so the transfer's id must be the producer's (with this
        # node's, as two nodes' producers may use one id) to be a duplicate over there.
        producer_dedup = message[M_DEDUP] if durable and through else None
        if home:
            header = encode_header(target, (), hops, f"{HOME_PREFIX}{message[M_DEDUP]}", delivered)
        elif producer_dedup:
            header = encode_header(target, queues, hops, f"p:{host.transfer_prefix}{producer_dedup}", delivered)
        else:
            header = numbered_header(target, queues, hops, host.transfer_prefix, delivered)
        if through:  # the message itself, which goes nowhere else: its properties are its own to change
            copy[M_PROPS][FORWARD_PROPERTY] = header
            if origin is not None:
                copy[M_PROPS][ORIGIN_MESSAGE_ID] = origin
        elif origin is not None:
            copy[M_PROPS] = {**message[M_PROPS], FORWARD_PROPERTY: header, ORIGIN_MESSAGE_ID: origin}
        else:
            copy[M_PROPS] = {**message[M_PROPS], FORWARD_PROPERTY: header}
        self._counters.forwarded += 1
        waiting = self.forward_queues.get(via)
        send_direct = self.send_direct
        if (through or not durable) and (waiting is None or not len(waiting)) and send_direct is not None:
            confirms = self._confirms
            token = confirms.through_token if durable else 0
            publisher = self._admission.publisher if through else None
            if producer_dedup or self.write_through.holds_for(via):
                # It leaves once the note of where it went is safe, later ones behind it (see write_through);
                # its producer's credit waits with it.
                self.write_through.hold(via, copy, token, publisher)
                self._memory.used += len(copy[M_BODY]) + MESSAGE_OVERHEAD
                taken = Direct.SENT if publisher is None else _HELD
            else:
                taken = send_direct(via, copy, token, publisher)
            if taken:
                if durable:
                    confirms.through_token -= 1
                    if producer_dedup:
                        self.write_through.track(producer_dedup, token)
                        self.write_through.note(producer_dedup, target, now_ms)
                if taken is _HELD:
                    self._admission.withheld += 1
                if covered:
                    audit.message(now_ms, "msg.forwarded", copy, None, target_node=target, target_queues=list(queues))
                return token
        forward_queue = self.forward_queue(via, now_ms)
        token = self.store.add_message(copy, (forward_queue.name,)) if durable else 0
        forward_queue.add(copy)
        self._to_dispatch.add(forward_queue)
        if covered:
            audit.message(now_ms, "msg.forwarded", copy, forward_queue, target_node=target, target_queues=list(queues))
        return token

    def send_held(self, unsent: list[Unsent[Session]], now_ms: int) -> None:
        """Send, in order, what waited for its note (see ``forward``). What the link cannot take now goes to
        the forward queue, a durable one stored here, its producer's confirm waiting for that."""
        returned: dict[Session, int] = {}
        for via, message, token, publisher in unsent:
            self._memory.used -= len(message[M_BODY]) + MESSAGE_OVERHEAD
            queue = self.forward_queues.get(via)
            taken = Direct.REFUSED
            if (queue is None or not len(queue)) and self.send_direct is not None:
                taken = self.send_direct(via, message, token, publisher)
            if not taken:
                queue = self.forward_queue(via, now_ms)
                if message[M_DURABLE]:
                    self._confirms.pass_on(token, self.store.add_message(message, (queue.name,)))
                queue.add(message)
                self._to_dispatch.add(queue)
            if publisher is not None and taken is not _HELD:  # a held one's comes when the link takes it
                returned[publisher] = returned.get(publisher, 0) + 1
        for publisher, credit in returned.items():
            self._admission.return_credit(publisher, credit)

    def forward_queue(self, node_id: str, now_ms: int) -> Queue:
        """The store-and-forward queue of a connected node (created on first use, durable)."""
        queue = self.forward_queues.get(node_id)
        if queue is None:
            name = FORWARD_QUEUE_PREFIX + node_id
            queue = self._catalog.queues.get(name)  # restored from the journal, perhaps empty (a falsy queue)
            if queue is None:
                queue = self._catalog.create_queue(name, name, RoutingType.ANYCAST, durable=True, now_ms=now_ms)
            self.forward_queues[node_id] = queue
        return queue

    def requeue_forwards(
        self, node_id: str, messages: list[tuple[WireMessage, int]], now_ms: int, *, sent: bool
    ) -> None:
        """Messages for ``node_id``, with their confirm tokens, that its link dropped before it confirmed them:
        they wait in its forward queue like the others (after them: the one exception to their order). A
        durable one is stored now, and its producer's confirm waits for that instead. Those ``sent`` (not only
        held for credit) may be on that node, delivered even: they count a delivery attempt, so that if that
        node is declared gone and they are routed again from here, their next delivery is flagged."""
        queue = self.forward_queue(node_id, now_ms)
        attempts = 1 if sent else 0
        counts = [attempts] if sent else None  # journaled with it, or a restart would forget the attempt
        for message, token in messages:
            if message[M_DURABLE]:
                self._confirms.pass_on(token, self.store.add_message(message, (queue.name,), counts))
            queue.restore(message, attempts)
        self._to_dispatch.add(queue)

    def settle_forwarded(self, session: Session, consumer: Consumer, ids: list[int], now_ms: int) -> None:
        """The other node confirmed these: they are its now. Frees the forwarding window for as many."""
        if session.consumers.get(consumer.id) is not consumer:
            return
        queue = consumer.queue
        journaled: list[int] = []
        audit = self._audit
        for message_id in ids:
            taken = queue.take(consumer, message_id)
            if taken is None:
                continue
            if not queue.name.startswith(FORWARD_QUEUE_PREFIX):  # moved out of a queue: redistributed
                self._counters.redistributed += 1
                if audit.covers(taken[0]):
                    audit.message(now_ms, "msg.redistributed", taken[0], queue, target_node=session.client_name)
            self._deliveries.settle(queue, taken[0], now_ms, journaled)
        if journaled:
            self.store.acknowledge(queue.name, journaled)
        if type(consumer) is Redistributor:
            consumer.confirmed(len(ids))
        else:
            consumer.credit += len(ids)
        self._to_dispatch.add(queue)

    # ------------------------------------------------------------------ placing again
    def reroute_forward_queue(self, node_id: str, now_ms: int, *, forgotten: bool = False) -> int:
        """``node_id`` is gone: route what waits for it again, to the queues it was meant for, here or on the
        nodes that remain. A message for a subscription that exists nowhere else keeps waiting, or, when an
        operator forgot that node (``forgotten``), goes to its dead-letter address. Returns how many messages
        moved."""
        queue = self._catalog.queues.get(FORWARD_QUEUE_PREFIX + node_id)
        if queue is None or queue.consumers or not len(queue):
            return 0
        kept: list[tuple[WireMessage, int]] = []
        moved = 0
        for message, attempts in queue.take_all():
            try:
                header = ForwardHeader.decode(message[M_PROPS].get(FORWARD_PROPERTY))
            except ValueError:
                header = ForwardHeader(node_id, (), 0, "")
            copy = list(message)
            copy[M_PROPS] = {k: v for k, v in message[M_PROPS].items() if k != FORWARD_PROPERTY}
            if header.producer_dedup is not None:  # sent home, it is routed here under its producer's id after all
                self._dedup.forget(header.producer_dedup)
                # Its producer sent it home first, and lost the link before the confirm: it may be there.
                attempts = max(attempts, 1)
            else:
                copy[M_DEDUP] = None
            # One that was sent (and not confirmed) may have been delivered over there: its next delivery is
            # flagged, wherever it goes now. One attempt, however often it was sent: moving is no delivery
            # failure, and must not bring it closer to the dead-letter address.
            if not self._place(copy, header.queues, now_ms, min(attempts, 1)):
                if not forgotten:
                    kept.append((message, attempts))
                    continue
                settings = self.address_settings.resolve(copy[M_ADDRESS])
                self._dead_letters.send_to_dead_letter_address(
                    queue, copy, f"node forgotten: {node_id}", settings, now_ms
                )
                if message[M_DURABLE]:
                    self.store.acknowledge(queue.name, [message[M_ID]])
                continue
            moved += 1
            if message[M_DURABLE]:
                self.store.acknowledge(queue.name, [message[M_ID]])  # after the copy's record: never neither
        for message, attempts in kept:
            queue.restore(message, attempts)
        return moved

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
        queues_by_name = self._catalog.queues
        local = tuple(q for name in header.queues if (q := queues_by_name.get(name)) is not None)
        confirms = self._confirms
        # A multicast message for named subscriptions is for those only: routed here by its address, it would be
        # a second copy for this node's subscriptions, which had theirs when it was published.
        for_subscriptions = bool(header.queues) and copy[M_ROUTING] == RoutingType.MULTICAST
        try:
            queues = local or (() if for_subscriptions else self._host.route(copy, now_ms))
        except BrokerError as exc:
            if not (token and confirms.refuse(token, exc.code, exc.text, message[M_DEDUP])):
                log.warning("refused forwarded message dropped", extra={"reason": exc.text})
            return
        if (
            not queues
            and token
            and confirms.refuse(token, code or ErrorCode.INVALID, text or "refused by its node", message[M_DEDUP])
        ):
            return  # no queue here either, and its producer is still waiting: tell it
        if not queues and origin is not None:  # confirmed long ago, from a forward queue: never drop it
            settings = self.address_settings.resolve(copy[M_ADDRESS])
            self._dead_letters.send_to_dead_letter_address(origin, copy, f"refused: {text or code}", settings, now_ms)
            return
        confirms.pass_on(token, self._host.admit(copy, queues, now_ms))

    def reroute_refused(self, consumer: Consumer, message_id: int, now_ms: int, code: str = "", text: str = "") -> None:
        """The node a forwarded message was for refused it: deliver it here, by its queues or its address, or
        to the dead-letter address when it has neither."""
        taken = consumer.queue.take(consumer, message_id)
        if taken is None:
            return
        self.place_refused(taken[0], now_ms, code=code, text=text, origin=consumer.queue)
        self._deliveries.settle(consumer.queue, taken[0], now_ms)
        consumer.credit += 1

    def _place(self, message: WireMessage, names: tuple[str, ...], now_ms: int, delivered: int = 0) -> bool:
        """Admit a message for the queues named ``names``: local ones, else another node's of that name; with
        no names, route it by its address. False when no queue of those names exists anywhere. ``delivered``:
        the delivery attempts it may have had already."""
        host = self._host
        if not names:
            host.accept_message(message, now_ms, delivered=delivered)
            return True
        queues_by_name = self._catalog.queues
        local = tuple(q for name in names if (q := queues_by_name.get(name)) is not None)
        remote: dict[str, list[str]] = {}
        cluster = host.cluster
        if cluster is not None:
            for name in names:
                if name not in queues_by_name:
                    reachable = [b for b in cluster.bindings.for_queue(name) if b.reachable]
                    if reachable:
                        remote.setdefault(min(reachable, key=lambda b: b.distance).node_id, []).append(name)
        if not local and not remote:
            return False
        host.admit(message, local, now_ms, {node_id: tuple(queues) for node_id, queues in remote.items()}, delivered)
        return True
