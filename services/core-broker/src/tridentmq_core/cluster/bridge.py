"""A cluster connection (``Bridge``): this node's link to one other node, logged in with the cluster
credentials. It joins with a TOPOLOGY request and applies the bindings and members the other node answers
and pushes; it consumes this node's store-and-forward queue for that node (and, while redistribution runs,
the queues being moved), acknowledging each message only when the other node has confirmed it; and it
sends messages written through. What it asks of the node's cluster manager is ``BridgeHost``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any, Final, Protocol

from tridentmq_core.broker import Broker
from tridentmq_core.forwarder import Direct
from tridentmq_core.forwarding import FORWARD_PROPERTY, MOVES_PROPERTY, marked_resent, numbered_header
from tridentmq_core.node_links import node_link, watch_close
from tridentmq_core.queues import MESSAGE_OVERHEAD, Consumer
from tridentmq_core.redistribution import Redistributor
from tridentmq_core.security import Principal
from tridentmq_core.sessions import Session
from tridentmq_core.settings import CoreSettings
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.peer import PeerLink
from tridentmq_shared.message import M_BODY, M_ID, M_PROPS, MAX_PROPERTIES, WireMessage
from tridentmq_shared.runtime import wall_ms
from tridentmq_shared.supervision import spawn

log = logging.getLogger("tridentmq.core.cluster")

FORWARDER_ID: Final = 1  # consumer id of a bridge's store-and-forward consumer; redistributors count up from 2
LEAVING_DRAIN_POLL_S: Final = 0.02  # how often a node scaling down is checked for what it has not confirmed
_SENT, _HELD = Direct.SENT, Direct.HELD  # module constants: enum member access is slow per message


class BridgeHost(Protocol):
    """What a cluster connection asks of its node's cluster manager (``manager.ClusterManager``)."""

    broker: Broker
    settings: CoreSettings
    node_id: str
    name: str
    bridges_by_node: dict[str, Bridge]
    on_fenced: Callable[[str], None]

    def schedule_flush(self) -> None: ...
    def join_info(self) -> dict[str, Any]: ...
    def bridge_answered(self) -> None: ...
    def bridge_up(self, bridge: Bridge, reply: dict[str, Any]) -> bool: ...
    def bridge_down(self, bridge: Bridge, *, was_up: bool = True) -> None: ...
    def retire(self, bridge: Bridge) -> None: ...
    def apply_update(self, bridge: Bridge, update: dict[str, Any]) -> None: ...
    def last_copies(self, node_id: str) -> int: ...
    def refused(self, bridge: Bridge, consumer: Consumer, message_id: int, code: str = "", text: str = "") -> None: ...


class BridgeOutlet:
    """The outlet of a bridge's session on the broker side: what the broker 'sends' to it goes straight to the
    bridge instead of onto a socket."""

    version = 0  # no link was negotiated: nothing of a later protocol version is used on it
    max_properties = MAX_PROPERTIES

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    def deliver(self, consumer_id: int, delivery_count: int, message: WireMessage) -> None:
        self.bridge.forward(consumer_id, message, delivery_count - 1)

    def consumer_closed(self, consumer_id: int, code: str, text: str) -> None:
        self.bridge.consumer_closed(consumer_id)

    # Nothing else the broker answers concerns a bridge.
    def reply(self, req_id: int, result: Any = None) -> None: ...
    def error(self, req_id: int, code: str, text: str) -> None: ...
    def confirm(self, seq: int) -> None: ...
    def reject(self, seq: int, code: str, text: str) -> None: ...
    def grant_publish_credit(self, credit: int) -> None: ...
    def browse_done(self, consumer_id: int) -> None: ...
    def topology_update(self, update: dict[str, Any]) -> None: ...


class Bridge:
    """The cluster connection from this node to one other node."""

    def __init__(self, manager: BridgeHost, host: str, port: int) -> None:
        self.manager = manager
        self.host = host
        self.port = port
        self.node_id = ""  # learned from the other node's WELCOME
        self.name = ""
        self.state = "connecting"  # connecting, up, down, refused, duplicate, standby (a passive backup)
        self.reason = ""
        self.down_since = time.monotonic()
        self.leaving = False  # the other node is scaling down: send it nothing new
        self.client: PeerLink | None = None
        self.session: Session | None = None
        self.consumers: dict[int, Consumer] = {}
        self._next_consumer = FORWARDER_ID + 1
        # Waiting for the link's publish credit: forwards (consumer, message id, message, None), and messages
        # held for a producer (None, confirm token, message, the producer's session).
        self._waiting: deque[tuple[Consumer | None, int, WireMessage, Session | None]] = deque()
        self._confirmed: dict[Consumer, list[int]] = {}
        # Sent and awaiting the other node's confirm, by publish sequence number: (consumer, message id, None),
        # or, for a message sent without a forward queue, (None, its confirm token or 0 if non-durable, it).
        self._sent: dict[int, tuple[Consumer | None, int, WireMessage | None]] = {}
        self._tokens_released = False  # a confirm released a producer's confirm (``on_durable``): flush
        self._stopping = False
        # Binding changes read before the join's answer was taken in (the same read may hold both): applied
        # right after it, else the change would be missing here until that binding changed again.
        self._early: list[dict[str, Any]] | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def up(self) -> bool:
        return self.state == "up"

    def start(self) -> None:
        self.task = spawn(self._run(), f"bridge-{self.address}")

    async def stop(self) -> None:
        self._stopping = True
        client = self.client
        if client is not None:
            await client.close()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        settings = self.manager.settings.cluster
        delay = settings.retry_interval_ms / 1000
        longest = settings.max_retry_interval_ms / 1000
        while not self._stopping:
            try:
                await self._connect_once()
                delay = settings.retry_interval_ms / 1000
            except LinkRequestError as exc:
                if exc.code == ErrorCode.UNAUTHENTICATED:
                    self.note_refused(exc.text)
                elif exc.code == ErrorCode.NOT_ACTIVE:  # a passive backup: it joins once it takes over
                    self.state, self.reason = "standby", exc.text
                elif isinstance(exc.__cause__, ssl.SSLError):  # certificates that do not fit: say so, once
                    self.note_refused(exc.text)
                else:
                    self._failed(str(exc))
            except (OSError, TimeoutError) as exc:
                self._failed(str(exc) or type(exc).__name__)
            finally:
                self._teardown()
            self.manager.bridge_answered()
            if self.state == "duplicate":
                return  # another bridge serves that node
            # A refusal will not fix itself quickly: retry, but slowly (an operator may be fixing it).
            await asyncio.sleep(longest if self.state == "refused" else delay)
            delay = min(delay * settings.retry_multiplier, longest)

    def _failed(self, reason: str) -> None:
        if self.state != "refused":
            self.state = "down"
        self.reason = reason
        log.debug("cluster connection failed", extra={"to": self.address, "reason": reason})

    def note_refused(self, reason: str, level: int = logging.ERROR) -> None:
        """Log a refusal once, not at every retry."""
        if self.state != "refused" or self.reason != reason:
            log.log(level, "cluster connection refused", extra={"to": self.address, "reason": reason})
        self.state = "refused"
        self.reason = reason

    async def _connect_once(self) -> None:
        manager = self.manager
        client = node_link(manager.settings, self.host, self.port, f"cluster:{manager.name}", connect_timeout=2.0)
        closed, why = watch_close(client)
        client.on_topology = self._on_update
        client.on_settled = self._on_settled
        client.on_confirms = self._on_confirms
        client.on_rejected = self._on_rejected
        self.client = client
        await client.connect()
        if client.node_id == manager.node_id and manager.settings.ha.policy != "none":
            # The other copy of this pair, active there (a failover or a failback moves the pair's node id
            # between addresses): the epochs decide which copy serves; nothing for an operator to fix.
            self.note_refused(
                f"another copy of this pair serves at this address (epoch {client.node_epoch})", logging.INFO
            )
            await client.close()
            return
        if client.node_id == manager.node_id:
            self.note_refused(
                "the node at this address has this node's id (a copied data directory?); remove one "
                "node's node.id to give it a new identity"
            )
            await client.close()
            return
        other = manager.bridges_by_node.get(client.node_id)
        if other is not None and other is not self:
            if other.up:
                self.state = "duplicate"
                await client.close()
                return
            manager.retire(other)  # the node moved here (a backup took over): this connection serves it now
        self.node_id = client.node_id
        manager.bridges_by_node[self.node_id] = self
        self._early = []
        try:
            reply = await client.topology({"join": manager.join_info()})
        except LinkRequestError as exc:
            if exc.code == ErrorCode.FENCED:
                manager.on_fenced(f"{self.address} refused this node's join: {exc.text}")
            self.note_refused(f"join refused: {exc.text}")
            await client.close()
            return
        finally:
            early, self._early = self._early, None
        if not manager.bridge_up(self, reply):
            await client.close()
            return
        for update in early:
            self._take_update(update)
        await closed.wait()
        if why and why[0].code == ErrorCode.SHUTDOWN:
            log.info("cluster connection closed: the other node stopped", extra={"to": self.address})
        elif not self._stopping:
            log.warning(
                "cluster connection lost",
                extra={"to": self.address, "node_id": self.node_id, "reason": why[0].text if why else ""},
            )

    def _on_update(self, update: dict[str, Any]) -> None:
        if self.up:
            self._take_update(update)
        elif self._early is not None:
            self._early.append(update)

    def _take_update(self, update: dict[str, Any]) -> None:
        self.manager.apply_update(self, update)
        sync = update.get("sync")
        client = self.client
        if type(sync) is int and client is not None:  # the other node holds replies until we route by it
            if self.leaving:
                spawn(self._acknowledge_when_delivered(client, sync), f"bridge-sync-{self.address}")
            else:
                spawn(_acknowledge_sync(client, sync), f"bridge-sync-{self.address}")

    async def _acknowledge_when_delivered(self, client: PeerLink, number: int) -> None:
        """The other node scales down and stops once we acknowledged: first let it confirm what we still send
        it (its store-and-forward queue here, messages written through, what our redistributors and scale-down
        movers sent it), or what reached it after its last look for messages to move would be stranded there.
        Nothing new goes to it once its bindings went (and those movers stopped): those of its durable queues
        of which it holds the only copy known here go only once another copy is known (``last_copies``)."""
        manager = self.manager
        queue = manager.broker.forwarder.forward_queues.get(self.node_id)
        while client is self.client:
            moving = any(
                isinstance(c, Redistributor) and (not c.stopped or c.in_flight) for c in self.consumers.values()
            )
            if (
                not moving
                and not self.in_transit
                and not manager.last_copies(self.node_id)
                and (queue is None or not (len(queue) or queue.in_flight or queue.paged))
            ):
                await _acknowledge_sync(client, number)
                return
            await asyncio.sleep(LEAVING_DRAIN_POLL_S)

    def open_session(self, principal: Principal) -> None:
        broker = self.manager.broker
        now_ms = wall_ms()
        self.session = broker.open_session(
            BridgeOutlet(self), f"bridge-{self.node_id[:8]}", principal, self.address, f"cluster:{self.node_id}", now_ms
        )
        queue = broker.forwarder.forward_queue(self.node_id, now_ms)
        forwarder = Consumer(FORWARDER_ID, self.session, queue, self.manager.settings.cluster.forward_window)
        forwarder.forwarder = True
        self.consumers[FORWARDER_ID] = forwarder
        broker.consuming.add_forwarder(self.session, forwarder)
        self.state = "up"
        self.manager.bridge_answered()
        self.reason = ""  # a failure from before (the node was not up yet at our start) is not why it is up
        self.leaving = False

    def add_redistributor(self, make: Callable[[int, Session], Redistributor]) -> Redistributor | None:
        if self.session is None:
            return None
        consumer = make(self._next_consumer, self.session)
        self._next_consumer += 1
        self.consumers[consumer.id] = consumer
        self.manager.broker.consuming.add_forwarder(self.session, consumer)
        return consumer

    def remove_consumer(self, consumer: Consumer) -> None:
        self.consumers.pop(consumer.id, None)
        if self.session is not None:
            self.manager.broker.consuming.remove_forwarder(self.session, consumer, wall_ms())

    def consumer_closed(self, consumer_id: int) -> None:
        """The broker deleted the queue under a consumer of ours."""
        self.consumers.pop(consumer_id, None)

    def _teardown(self) -> None:
        manager = self.manager
        was_up = self.session is not None  # (a failed try to reconnect was never up)
        if self.session is not None:
            # Unconfirmed forwards go back to their queues: sent again, one the other node stored is a duplicate
            # there; a move it stored stays there as well, flagged (it counts the move as a delivery attempt).
            manager.broker.close_session(self.session, wall_ms())
            self.session = None
            manager.schedule_flush()
        self.consumers.clear()
        held = [
            (message, token, publisher)
            for consumer, token, message, publisher in self._waiting
            if consumer is None and publisher is not None
        ]
        self._waiting.clear()
        self._confirmed.clear()
        # Messages sent straight and not confirmed, then those held for credit, wait in the forward queue for
        # the next link.
        unconfirmed = [(m, token) for _, token, m in self._sent.values() if m is not None]
        unsent = [(message, token) for message, token, _ in held]
        memory = manager.broker.memory  # counted again by the queue they go to
        memory.used -= sum(len(message[M_BODY]) + MESSAGE_OVERHEAD for message, _ in unconfirmed + unsent)
        if self.node_id:
            forwarder = manager.broker.forwarder
            if unconfirmed:
                forwarder.requeue_forwards(self.node_id, unconfirmed, wall_ms(), sent=True)
            if unsent:
                forwarder.requeue_forwards(self.node_id, unsent, wall_ms(), sent=False)
        for _, _, publisher in held:
            manager.broker.admission.return_credit(publisher, 1)
        if unconfirmed or unsent:
            manager.schedule_flush()
        self._sent.clear()
        if self.node_id and manager.bridges_by_node.get(self.node_id) is self:
            manager.bridge_down(self, was_up=was_up)
        if self.state == "up":
            self.state = "down"
            self.down_since = time.monotonic()
        self.client = None

    # ------------------------------------------------------------------ forwarding
    def forward(self, consumer_id: int, message: WireMessage, delivered: int = 0) -> None:
        """The broker handed a message to one of our consumers: send it to the other node. ``delivered``:
        the delivery attempts it had before this one (which is no attempt: it only moves)."""
        consumer = self.consumers.get(consumer_id)
        client = self.client
        if consumer is None or client is None:
            return  # torn down meanwhile: the broker takes the message back with the session
        if isinstance(consumer, Redistributor):
            consumer.moved += 1
            outgoing = list(message)
            # The queue is part of the transfer id: a topic's message is in several subscription queues under
            # one id, and each queue's copy that moves to the same node is a transfer of its own, no duplicate.
            node_part = f"{self.manager.broker.transfer_prefix}{consumer.queue.name}:"
            header = numbered_header(consumer.target.node_id, (consumer.queue.name,), 1, node_part, delivered)
            moves = self.manager.broker.forwarder.arrivals.moves(message[M_ID]) + 1
            outgoing[M_PROPS] = {**message[M_PROPS], FORWARD_PROPERTY: header, MOVES_PROPERTY: moves}
        else:  # a store-and-forward queue's, sent as it was stored (its header made once, for every attempt)
            outgoing = marked_resent(message) if delivered else message
        if not client.body_fits(outgoing):  # its frame would break the link: refused as the other node would
            asyncio.get_running_loop().call_soon(self._refuse_too_big, consumer, message[M_ID])
            return
        seq = -1 if self._waiting else client.send_if_open(outgoing)
        if seq < 0:
            self._wait((consumer, message[M_ID], outgoing, None), client)
            return
        # No future per message: ``_on_confirms`` takes the confirms in ranges, one call per read.
        self._sent[seq] = (consumer, message[M_ID], None)

    def _refuse_too_big(self, consumer: Consumer, message_id: int) -> None:
        """A message larger than the other node's link takes (nodes may differ in ``broker.max_message_bytes``):
        handled as that node's refusal, after the dispatch that handed it over."""
        if self.consumers.get(consumer.id) is consumer:
            reason = "larger than the other node's link takes"
            log.warning(
                "forwarded message refused",
                extra={"to": self.address, "code": ErrorCode.RESOURCE_LIMIT, "reason": reason},
            )
            self.manager.refused(self, consumer, message_id, ErrorCode.RESOURCE_LIMIT, reason)

    def _wait(self, entry: tuple[Consumer | None, int, WireMessage, Session | None], client: PeerLink) -> None:
        self._waiting.append(entry)
        if len(self._waiting) == 1:
            # Supervised: a sender that died of a bug would leave what waits behind it for good.
            spawn(self._send_waiting(client), f"bridge-send-{self.address}")

    def send_direct(self, message: WireMessage, token: int, publisher: Session | None) -> Direct:
        """Send a message for the other node at once, not through the forward queue (the broker offers it only
        when that queue is empty, so order holds): a non-durable one needs nothing on disk, a durable one is
        written through (its producer's confirm waits for ``token``, released when the other node confirms),
        and it saves the queue's bookkeeping. When the link has no credit now, a message with a ``publisher``
        waits here for it, up to the forwarding window (the broker holds that producer's credit back until
        it goes); any other then takes the queue."""
        client = self.client
        if self.state != "up" or client is None or not client.body_fits(message):
            return Direct.REFUSED
        seq = -1 if self._waiting else client.send_if_open(message)
        if seq >= 0:
            self._sent[seq] = (None, token, message)
            taken = _SENT
        elif publisher is None or len(self._waiting) >= self.manager.settings.cluster.forward_window:
            return Direct.REFUSED
        else:
            self._wait((None, token, message, publisher), client)
            taken = _HELD
        # In no queue until it is confirmed, but in memory: counted, so that the memory limit sees it.
        self.manager.broker.memory.used += len(message[M_BODY]) + MESSAGE_OVERHEAD
        return taken

    @property
    def in_transit(self) -> bool:
        """Whether messages sent (or waiting to be sent) over this connection await the other node's confirm."""
        return bool(self._sent or self._waiting)

    def _on_confirms(self, ranges: list[tuple[int, int]]) -> None:
        sent, consumers, confirmed = self._sent, self.consumers, self._confirmed
        broker = self.manager.broker
        freed = 0
        for first, last in ranges:
            for entry in map(sent.pop, range(first, last + 1), repeat(None)):
                if entry is None:
                    continue
                consumer, number, direct = entry
                if direct is not None:  # sent directly: in no queue, but counted in memory until now
                    freed += len(direct[M_BODY]) + MESSAGE_OVERHEAD
                    if number:  # the confirm token of a message written through: safe over there now
                        broker.on_durable(number)
                        self._tokens_released = True
                elif consumer is not None and consumers.get(consumer.id) is consumer:
                    ids = confirmed.get(consumer)
                    if ids is None:
                        confirmed[consumer] = [number]
                    else:
                        ids.append(number)
        if freed:
            broker.memory.used -= freed
            self._tokens_released = True  # a flush lets producers blocked on the memory limit go on

    def _on_rejected(self, seq: int, code: str, text: str) -> None:
        """Refused by the other node (its limits, a queue that went): the message stays here."""
        entry = self._sent.pop(seq, None)
        if entry is None:
            return
        log.warning("forwarded message refused", extra={"to": self.address, "code": code, "reason": text})
        consumer, number, direct = entry
        if consumer is not None:
            if self.consumers.get(consumer.id) is consumer:
                self.manager.refused(self, consumer, number, code, text)
        elif direct is not None:
            self.manager.broker.memory.used -= len(direct[M_BODY]) + MESSAGE_OVERHEAD
            self.manager.broker.forwarder.place_refused(direct, wall_ms(), number, code, text)
            self._tokens_released = True

    def _on_settled(self) -> None:
        if self._confirmed:
            self._settle()
        elif self._tokens_released:
            self.manager.schedule_flush()
        self._tokens_released = False

    async def _send_waiting(self, client: PeerLink) -> None:
        broker = self.manager.broker
        try:
            while self._waiting and client is self.client:
                await client.wait_for_credit()
                released: dict[Session, int] = {}
                try:
                    waiting, sent = self._waiting, self._sent
                    while waiting:
                        consumer, number, outgoing, publisher = waiting[0]
                        seq = client.send_if_open(outgoing)
                        if seq < 0:
                            break
                        # A forward queue's or redistributor's message stays in its queue; a direct one here.
                        sent[seq] = (consumer, number, None) if consumer is not None else (None, number, outgoing)
                        if publisher is not None:
                            released[publisher] = released.get(publisher, 0) + 1
                        waiting.popleft()  # once sent: a failure leaves it for the teardown
                finally:
                    for publisher, count in released.items():
                        broker.admission.return_credit(publisher, count)
                    if released:
                        self.manager.schedule_flush()
        except LinkRequestError:
            pass  # the connection went: _teardown gave the messages back

    def _settle(self) -> None:
        session = self.session
        if session is None:
            return
        now_ms = wall_ms()
        broker = self.manager.broker
        for consumer, ids in self._confirmed.items():
            broker.forwarder.settle_forwarded(session, consumer, ids, now_ms)
        self._confirmed.clear()
        self.manager.schedule_flush()


async def _acknowledge_sync(client: PeerLink, number: int) -> None:
    with contextlib.suppress(LinkRequestError):  # a connection that went: the other node stops waiting
        await client.topology({"synced": number})
