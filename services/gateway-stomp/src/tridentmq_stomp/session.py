"""One STOMP client connection: the codec, the client's own link to the core, its subscriptions and
transactions.

Frames are handled strictly in order by the shared session driver's worker; reading the socket pauses while
too many wait, so a flood of SENDs is held back by the core's publish credit all the way to the client's TCP connection.
Receipts go out in the order of their frames, each once its frame is done (a SEND's once the core
confirmed it: for a persistent message, once it is on disk). Each subscription's consumer calls back to send
MESSAGE frames while the socket keeps up and, in the client ack modes, while fewer than its prefetch are
unacknowledged. Nothing is kept here that the core does not also know: when the connection ends its link
closes, and the core returns unacknowledged messages to their queues and drops temporary ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from tridentmq_shared import id_locks
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.gateway import Wire
from tridentmq_shared.link.client import Consumer, LinkClient, queue_spec
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import M_ID, RoutingType
from tridentmq_shared.runtime import random_hex
from tridentmq_shared.session_driver import HANDLING_BUGS, SessionDriver, close_now, core_unavailable_log
from tridentmq_stomp import convert, subscribing
from tridentmq_stomp.acks import AUTO, Unacked, locate
from tridentmq_stomp.convert import TEMP_QUEUE_PREFIX
from tridentmq_stomp.protocol import events as ev
from tridentmq_stomp.protocol.connection import State, StompServerConnection
from tridentmq_stomp.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_stomp.protocol.frames import Limits
from tridentmq_stomp.receipts import FrameError, Receipts, refusal
from tridentmq_stomp.settings import StompSettings

log = logging.getLogger("tridentmq.stomp")

SERVER_NAME = "TridentMQ/0.1"
#: ERROR ``message`` headers for the core's refusals of a request.
_ERROR_NAMES = {
    ErrorCode.FORBIDDEN: "permission denied",
    ErrorCode.NOT_FOUND: "not found",
    ErrorCode.INVALID: "invalid request",
    ErrorCode.RESOURCE_LIMIT: "resource limit",
    ErrorCode.EXISTS: "already exists",
}


class Counters:
    """Gateway-wide counters for /metrics."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.frames_received = 0
        self.messages_published = 0
        self.messages_delivered = 0
        self.errors = 0


@dataclass(eq=False)
class Subscription:
    id: str
    destination: str
    queue: str
    acks: Unacked  # its frames waiting for the client's ACK or NACK (client ack modes)
    consumer: Consumer
    temporary: bool
    shown_destination: str | None = None  # MESSAGE's destination when the address would not say it (temp queues)
    routing: int = RoutingType.ANYCAST  # of the queue it takes from
    durable: bool = False  # a durable subscription: its queue is the one the gateway made under its name
    stopped: bool = False
    drain: asyncio.Task[None] | None = None  # waits for the client to read what was written, while it does not


class StompSession:
    def __init__(self, settings: StompSettings, core_links: CoreLinks, wire: Wire, counters: Counters) -> None:
        limits = settings.stomp
        self.settings = settings
        self.core_links = core_links
        self.wire = wire
        self.counters = counters
        self.id = random_hex(16)  # unique across gateway replicas: it names temporary queues
        self.conn = StompServerConnection(
            Limits(limits.max_frame_bytes, limits.max_headers, limits.max_header_bytes),
            heartbeat=(limits.heartbeat_send_ms, limits.heartbeat_receive_ms),
            min_heartbeat_ms=limits.min_heartbeat_ms,
            connect_timeout=limits.connect_timeout_ms / 1000,
            max_connect_bytes=limits.max_connect_bytes,
            now=time.monotonic(),
        )
        self.link: PipelinedLink | None = None
        self.client_id: str | None = None
        self.client_id_lock: str | None = None  # the queue that holds client_id for this connection, if any
        self.subscriptions: dict[str, Subscription] = {}
        self.temporary_queues: set[str] = set()  # addresses of this connection's /temp-queue/ destinations
        self.transactions: dict[str, int] = {}
        self._keys = itertools.count(1)
        self.receipts: Receipts[asyncio.Future[None]] = Receipts()
        # An ERROR is on its way (it waits for the answers of the frames before it): later frames are ignored.
        self._failing = False
        self._gone = False  # the client's socket closed: nothing more is written to it
        self._loop = asyncio.get_running_loop()
        # Frames are handled while the client does not read, up to pending_bytes of answers waiting for it (its
        # deliveries wait for the socket): a client that sends a burst before it reads is not deadlocked.
        self._driver = SessionDriver(
            self,
            wire,
            "stomp",
            max_events=limits.pending_frames,
            max_bytes=limits.pending_bytes,
            max_unread=limits.pending_bytes,
        )
        self._arm_timer()  # the CONNECT's deadline
        counters.connections_total += 1

    # ------------------------------------------------------------------ input from the client
    def feed(self, data: bytes) -> None:
        if self._closed:
            return
        events = self.conn.receive_data(data, time.monotonic())
        self.counters.frames_received += len(events)
        # Nothing more is read from a client not logged in yet.
        final = not data or (bool(events) and type(events[-1]) is ev.Disconnect)  # handled even while not reading
        self._driver.receive(events, len(data), hold=self.conn.state is State.CONNECTING, final=final)

    async def wait_closed(self) -> None:
        await self._driver.wait_closed()

    @property
    def _closed(self) -> bool:
        return self._driver.closed

    def connection_lost(self) -> None:
        """The socket closed: end the session (the link's close returns unacked messages). At once, what
        waited for the client to read (woken by the socket's end) is no longer written, where it would count
        as delivered: the clean-up gives it back uncounted."""
        self._gone = True
        self._driver.connection_lost(ev.ConnectionClosed())

    # ------------------------------------------------------------------ the frame worker (SessionHooks)
    handled_errors: tuple[type[Exception], ...] = (
        LinkRequestError,
        convert.ConversionError,
        LocalProtocolError,
        *HANDLING_BUGS,
    )

    def handle_error(self, event: ev.Event, error: Exception) -> None:
        if isinstance(error, LinkRequestError):
            self._link_error(event, error)
        elif isinstance(error, convert.ConversionError):
            self._error("invalid header", str(error), getattr(event, "receipt", None))
        else:  # a bug of ours, not the client's fault: say so and end this connection only
            log.error("stomp session failed", exc_info=error, extra={"peer": self.wire.peer})
            self._error("internal error", "the gateway failed to handle this frame", None)

    def before_handle(self) -> None:
        """What the frames before one that waits produced goes out first."""
        self._drain_receipts()
        self._flush()

    after_batch = before_handle

    def reading_paused(self) -> None:
        self.conn.reading_paused()  # the client's heart-beats wait in the socket meanwhile

    def reading_resumed(self) -> None:
        self.conn.reading_resumed(time.monotonic())
        self._arm_timer()  # the client's heart-beats are due again

    def handle_now(self, event: ev.Event) -> bool:
        """Handle the frames that need no waiting (ACK, NACK, and a SEND while the core's window is open)
        without a coroutine each: at tens of thousands of frames a second that is most of the cost."""
        if self._failing:
            return True  # after an ERROR's frame, nothing more is done
        if isinstance(event, ev.Ack):
            self._ack(event)
            return True
        if not isinstance(event, ev.Send):
            return False
        link = self._link()
        headers = event.headers
        if (
            event.transaction is not None
            or event.destination.startswith(TEMP_QUEUE_PREFIX)
            or headers.get("reply-to", "").startswith(TEMP_QUEUE_PREFIX)
        ):
            return False
        address, routing = convert.destination_to_address(event.destination, headers.get("destination-type"))
        confirmed = link.try_send(convert.to_message(address, routing, headers, event.body))
        if confirmed is None:  # no credit now: the frame goes the slow way, which waits for it
            return False
        self._published(confirmed, event.receipt)
        return True

    async def handle(self, event: ev.Event) -> None:
        """The other frames (ACK and NACK always go through ``_handle_now``)."""
        if self._failing and not isinstance(event, ev.ConnectionClosed):
            return
        match event:
            case ev.Connect():
                await self._connect(event)
            case ev.Send():
                await self._send(event)
            case ev.Subscribe():
                await self._subscribe(event)
                self._receipt_now(event.receipt)
            case ev.Unsubscribe():
                await self._unsubscribe(event)
                self._receipt_now(event.receipt)
            case ev.Transaction():
                await self._transaction(event)
                self._receipt_now(event.receipt)
            case ev.Disconnect():
                await self._disconnect(event)
            case ev.ConnectionClosed():
                if not self._gone:  # only the client's sending side closed: answer what it sent, then close
                    await self._settle_receipts()
                    self._flush()
                self._driver.end()
            case ev.ProtocolViolation():
                log.info(
                    "stomp protocol error",
                    extra={"peer": self.wire.peer, "error": event.message, "detail": event.detail[:200]},
                )
                self.counters.errors += 1
                await self._settle_receipts()  # the frames before it are answered first
                self.conn.reject(event)

    async def _connect(self, event: ev.Connect) -> None:
        link = self.core_links.client(
            user=event.login, password=event.passcode, client_name=f"stomp {self.wire.peer}", client_host=self.wire.host
        )
        try:
            await link.connect()
        except LinkRequestError as exc:
            if exc.code == ErrorCode.UNAUTHENTICATED:
                log.info("stomp login refused", extra={"peer": self.wire.peer, "user": event.login})
                self._refuse("authentication failed", "bad login or passcode")
            else:
                if core_unavailable_log.first():
                    log.warning("core unavailable", extra={"peer": self.wire.peer, "reason": exc.text})
                self._refuse("server unavailable", "the broker cannot be reached; try again")
            return
        self.link = link  # from here the clean-up closes it, whatever ends the session
        client_id = event.headers.get("client-id") or None
        if client_id is not None and not await self._hold_client_id(link, client_id):
            return
        link.on_closed = self._link_closed
        link.on_settled = self._settled
        self.client_id = client_id
        self.conn.accept(self.id, SERVER_NAME, time.monotonic())
        self.wire.logged_in()
        self._arm_timer()  # the heart-beats' deadlines

    def _refuse(self, message: str, detail: str) -> None:
        """Answer the CONNECT with an ERROR; the session ends (its clean-up closes the link, if one was opened)."""
        self.conn.refuse(message, detail)
        self.counters.errors += 1
        self._driver.end()

    async def _hold_client_id(self, link: LinkClient, client_id: str) -> bool:
        """Make ``client_id`` this connection's, as ActiveMQ does (see ``id_locks``): no other connection, through
        any gateway, may have it meanwhile. False: the CONNECT is refused."""
        name = convert.client_id_lock(client_id)
        try:
            held = await id_locks.hold(link, name)
        except LinkRequestError as exc:
            log.info("stomp client id not held", extra={"peer": self.wire.peer, "reason": exc.text})
            if exc.code == ErrorCode.FORBIDDEN:
                rights = f"createAddress and createNonDurableQueue on {convert.CLIENT_ID_LOCK_PREFIX}#"
                self._refuse("permission denied", f"a client-id needs {rights}: {exc.text}")
            elif isinstance(exc, LinkClosedError):
                self._refuse("server unavailable", "the broker cannot be reached; try again")
            else:
                self._refuse(_ERROR_NAMES.get(exc.code, "request failed"), exc.text)
            return False
        if held:
            self.client_id_lock = name
            return True
        log.info("stomp client id in use", extra={"peer": self.wire.peer, "client_id": client_id[:200]})
        # ActiveMQ's words in the body (its ERROR's message header says them); the header stays a fixed text.
        self._refuse("client id in use", f"Client: {client_id} already connected")
        return False

    async def _release_client_id(self) -> None:
        """Free the client id now: the link's close would too, but only after the DISCONNECT's RECEIPT, and a
        client that connects again at once must find it free."""
        name, self.client_id_lock = self.client_id_lock, None
        if name is not None:
            await id_locks.release(self._link(), name)

    def _link(self) -> PipelinedLink:
        assert self.link is not None  # the codec only lets frames through after CONNECTED
        return self.link

    async def _resolve(self, destination: str, destination_type: str | None) -> tuple[str, int]:
        """(address, routing) of a destination; ``/temp-queue/x`` is this connection's temporary queue
        ``tmp.<connection>.x``, created on first use and deleted by the core when the connection ends."""
        if not destination.startswith(convert.TEMP_QUEUE_PREFIX):
            return convert.destination_to_address(destination, destination_type)
        address = convert.temporary_address(self.id, destination)
        if address not in self.temporary_queues:
            await self._link().create_queue(address, address, routing_type=RoutingType.ANYCAST, temporary=True)
            self.temporary_queues.add(address)
        return address, int(RoutingType.ANYCAST)

    async def _send(self, event: ev.Send) -> None:
        address, routing = await self._resolve(event.destination, event.headers.get("destination-type"))
        headers = event.headers
        reply_to = headers.get("reply-to")
        if reply_to is not None and reply_to.startswith(convert.TEMP_QUEUE_PREFIX):
            # Whoever answers must reach this connection's queue, under a name that works for them too.
            reply_address, _ = await self._resolve(reply_to, None)
            headers = {**headers, "reply-to": convert.QUEUE_PREFIX + reply_address}
        message = convert.to_message(address, routing, headers, event.body)
        tx_id = self._tx(event.transaction, event.receipt) if event.transaction else 0
        if tx_id < 0:
            return
        self._published(await self._link().send(message, tx_id), event.receipt)

    def _published(self, future: asyncio.Future[None], receipt: str | None) -> None:
        self.counters.messages_published += 1
        self.receipts.after(future, receipt)  # answered by _settled once the core confirms or refuses

    def _settled(self) -> None:
        """The link read confirms or refusals of SENDs: send what is now answerable, in order."""
        self._drain_receipts()
        self._flush()

    async def _subscribe(self, event: ev.Subscribe) -> None:
        if event.id in self.subscriptions:
            self._error("duplicate subscription", f"subscription id {event.id[:40]!r} is in use", event.receipt)
            return
        most = self.settings.stomp.max_subscriptions
        if len(self.subscriptions) >= most:  # what a client that stops reading holds grows with them
            self._error("resource limit", f"at most {most} subscriptions on one connection", event.receipt)
            return
        headers = event.headers
        address, routing = await self._resolve(event.destination, headers.get("destination-type"))
        limits = self.settings.stomp
        plan = subscribing.plan(
            address,
            routing,
            headers,
            client_id=self.client_id,
            temporary_queue=f"stomp.{self.id}.{next(self._keys)}",
            prefetch=limits.prefetch,
            max_prefetch=limits.max_prefetch,
        )
        if isinstance(plan, subscribing.Refused):
            self._error(plan.message, plan.detail, event.receipt)
            return
        make = plan.make
        if make is not None and make.durable:
            # A durable subscription has one subscriber, as in ActiveMQ and JMS: a second one would split its
            # messages, and one with another topic or selector would delete it under the first.
            active = next((s for s in self.subscriptions.values() if s.durable and s.queue == make.name), None)
            if active is not None:
                name = subscribing.durable_name(headers)
                detail = (
                    f"Durable consumer is in use for client: {self.client_id} and subscriptionName: {name} "
                    f"(subscription id {active.id!r} of this connection)"
                )
                self._error("duplicate subscription", detail, event.receipt)
                return
        link = self._link()
        window: dict[str, Any] = {
            "credit": plan.window,
            "selector": plan.consumer_selector,
            "credit_on_settle": event.ack != AUTO,
            "credit_bytes": self.settings.core.consumer_window_bytes,
        }
        if make is not None and not make.durable:  # this connection's own queue: made and consumed in one request
            spec = queue_spec(
                make.name,
                make.address,
                routing_type=RoutingType.MULTICAST,
                durable=False,
                temporary=True,
                filter=make.selector,
            )
            _, consumer = await link.make_and_subscribe(spec, **window)
        else:
            if make is not None:
                await _create_durable(link, make)
            # A fully qualified queue the core makes is a named queue: durable, like any queue of an address.
            if plan.routing is not None:
                window.update(routing_type=plan.routing, durable=True)
            consumer = await link.subscribe(plan.queue, **window)
        shown = event.destination if event.destination.startswith(convert.TEMP_QUEUE_PREFIX) else None
        acks = Unacked(event.id, next(self._keys), event.ack)
        durable = plan.make is not None and plan.make.durable
        subscription = Subscription(
            event.id,
            event.destination,
            plan.queue,
            acks,
            consumer,
            plan.temporary,
            shown,
            durable=durable,
            routing=RoutingType.MULTICAST if routing == RoutingType.MULTICAST else RoutingType.ANYCAST,
        )
        self.subscriptions[event.id] = subscription
        consumer.on_wake = lambda: self._pump(subscription)
        # What came with the subscribe's answer goes out a turn later: after the SUBSCRIBE's RECEIPT when no
        # earlier SEND's RECEIPT is still awaited (the RECEIPT waits in line behind those, the messages do not).
        self._loop.call_soon(self._pump, subscription)

    async def _unsubscribe(self, event: ev.Unsubscribe) -> None:
        subscription = (
            self.subscriptions.get(event.id)
            if event.id is not None
            else next((s for s in self.subscriptions.values() if s.destination == event.destination), None)
        )
        durable = subscribing.durable_name(event.headers)
        if subscription is None and durable is not None and self.client_id:
            # As with ActiveMQ: a durable subscription is ended by name, whether this connection consumes it
            # (under another id) or not (an earlier connection made it). Its queue is this client id's.
            queue = convert.checked_name(f"{self.client_id}.{durable}", "durable subscription queue (client-id.name)")
            subscription = next((s for s in self.subscriptions.values() if s.durable and s.queue == queue), None)
            if subscription is None and await self._end_durable(queue):
                return
        if subscription is None:
            self._error("no such subscription", f"{event.id or event.destination!r} is not subscribed", event.receipt)
            return
        del self.subscriptions[subscription.id]
        await self._stop(subscription)
        if subscription.temporary:
            await self._link().delete_queue(subscription.queue)
        elif subscription.durable and durable is not None:  # ended for good
            # With its copies on other nodes the client came through, or a later subscription of that name
            # would draw the ended one's messages over. A queue it only consumed is never deleted.
            await self._link().delete_queue(subscription.queue, everywhere=True)

    async def _end_durable(self, queue: str) -> bool:
        """Delete the durable subscription queue ``queue`` (on every node); False when there is none (a queue of
        that name that is no subscription's is none: it and its messages stay)."""
        link = self._link()
        if await link.not_a_subscription(queue) is not None:
            return False
        try:
            await link.delete_queue(queue, everywhere=True)
        except LinkRequestError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                return False
            raise
        return True

    async def _stop(self, subscription: Subscription) -> None:
        self._stop_pump(subscription)
        with contextlib.suppress(LinkRequestError):
            subscription.consumer.release_unsent()
            await subscription.consumer.close()

    def _ack(self, event: ev.Ack) -> None:
        found = locate((s.acks for s in self.subscriptions.values()), event.id, event.subscription)
        if found is None:
            self._error("unknown ack id", f"{event.id[:60]!r} names no unacknowledged message", event.receipt)
            return
        tx_id = self._tx(event.transaction, event.receipt) if event.transaction is not None else 0
        if tx_id < 0:
            return
        acks, message_id = found
        ids = acks.settle(message_id)
        consumer = self.subscriptions[acks.subscription_id].consumer
        receipt = event.receipt
        if receipt is not None and (event.nack or not tx_id):
            # A RECEIPT says the broker has the acknowledgement: it waits for the core's answer (for a durable
            # message, until the ack is on disk), in the order of the frames. Without one, nothing waits.
            answer = consumer.nack_answered(ids) if event.nack else consumer.ack_answered(ids)
            self.receipts.after(self._acknowledged(answer), receipt)
            return
        if event.nack:
            consumer.nack_ids(ids, NackMode.REDELIVER)  # at once, even within a transaction
        else:
            consumer.ack_ids(ids, tx_id)  # with a transaction: at its commit (whose receipt waits for the core)
        self._receipt_now(receipt)

    def _acknowledged(self, answer: asyncio.Future[None]) -> asyncio.Future[None]:
        """The outcome a receipted ACK or NACK waits for: done with the core's ``answer``, failed with the
        ERROR to send instead of the RECEIPT when the core refused it or the link dropped before it came (the
        messages then went back to their queue, unless only the answer was lost: a RECEIPT could be a lie)."""
        outcome: asyncio.Future[None] = self._loop.create_future()

        def answered(future: asyncio.Future[None]) -> None:
            error = future.exception() if not future.cancelled() else LinkClosedError(ErrorCode.EOF, "cancelled")
            if error is None:
                outcome.set_result(None)
            elif isinstance(error, LinkClosedError):
                detail = f"the broker did not confirm the acknowledgement ({error.text}): it may come again"
                outcome.set_exception(FrameError("server unavailable", detail))
            elif isinstance(error, LinkRequestError):
                outcome.set_exception(FrameError(_ERROR_NAMES.get(error.code, "request failed"), error.text))
            else:
                outcome.set_exception(error)
            if self._closed:  # nobody reads it: taken, so asyncio does not report it unretrieved
                outcome.exception()
            else:
                self._settled()  # its RECEIPT (or ERROR), and those of the frames after it, may go now

        answer.add_done_callback(answered)
        return outcome

    def _tx(self, name: str, receipt: str | None) -> int:
        tx_id = self.transactions.get(name)
        if tx_id is None:
            self._error("no such transaction", f"transaction {name[:40]!r} was not begun", receipt)
            return -1
        return tx_id

    async def _transaction(self, event: ev.Transaction) -> None:
        link = self._link()
        if event.command == "BEGIN":
            if event.transaction in self.transactions:
                self._error("transaction exists", f"{event.transaction[:40]!r} is already open", event.receipt)
                return
            self.transactions[event.transaction] = await link.begin()
            return
        tx_id = self._tx(event.transaction, event.receipt)
        if tx_id < 0:
            return
        del self.transactions[event.transaction]
        if event.command == "COMMIT":
            # Not while a SEND before it may still be refused: its ERROR comes first and the transaction, not
            # committed, ends with the connection (a client that sends it again must not find it committed).
            await self._settle_receipts()
            if self._failing:
                return
            await link.commit(tx_id)
        else:
            await link.rollback(tx_id)

    async def _settle_receipts(self) -> None:
        """Wait for the core's answers to every SEND so far, and send their receipts (or errors)."""
        pending = self.receipts.outstanding()
        if pending:
            await asyncio.wait(pending)
        self._drain_receipts()

    async def _disconnect(self, event: ev.Disconnect) -> None:
        await self._settle_receipts()
        await self._release_client_id()
        if event.receipt is not None and not self.conn.closed:
            self.conn.receipt(event.receipt)
        self._flush()
        self._driver.end()

    # ------------------------------------------------------------------ deliveries
    def _pump(self, subscription: Subscription) -> None:
        """MESSAGE frames while the client reads. The consumer calls this when deliveries arrive (no task per
        subscription); while the client does not read what was written they wait in the consumer, whose credit
        then stops the core, and a task waits for the client to drain. In the client modes the core's credit
        comes back only with the client's ACK or NACK, so at most the prefetch is out; in auto mode a message
        counts as consumed once it is written to the client (until then the core keeps it: a gateway that dies
        loses nothing)."""
        if self._closed or self._gone or subscription.stopped or subscription.drain is not None:
            return
        if not self.wire.writable():
            subscription.drain = self._loop.create_task(self._pump_when_drained(subscription))
            return
        try:
            self._write_batch(subscription)
        except LinkRequestError as exc:
            if not self._closed:  # no frame's answer: the subscription's end, now
                self._send_error("subscription ended", exc.text, None)
                self._end()
        except Exception:  # as a task's failure would: this connection ends, the gateway goes on
            log.exception("stomp subscription failed", extra={"peer": self.wire.peer})
            self._end()

    async def _pump_when_drained(self, subscription: Subscription) -> None:
        await self.wire.drained()
        subscription.drain = None
        self._pump(subscription)

    def _stop_pump(self, subscription: Subscription) -> None:
        subscription.stopped = True
        subscription.consumer.on_wake = None
        if subscription.drain is not None:
            subscription.drain.cancel()

    def _write_batch(self, subscription: Subscription) -> None:
        consumer = subscription.consumer
        batch = consumer.take_batch()
        if not batch:
            if consumer.closed is not None:
                raise consumer.closed
            return
        if self.conn.closed:
            return
        ids = []
        acks = subscription.acks
        for count, message in batch:
            message_id = message[M_ID]
            ids.append(message_id)
            headers = convert.message_headers(
                message,
                subscription.id,
                acks.ack_header(message_id),
                count,
                subscription.shown_destination,
                queue_routing=subscription.routing,
            )
            self.conn.message(headers, convert.body_of(message))
        if acks.delivered(ids):
            consumer.ack_ids(ids)
        self.counters.messages_delivered += len(batch)
        self._flush()

    # ------------------------------------------------------------------ output
    def _receipt_now(self, receipt: str | None) -> None:
        self.receipts.done(receipt)

    def _drain_receipts(self) -> None:
        """Answer finished frames in order: a RECEIPT, or an ERROR for a refused SEND."""
        for receipt, error in self.receipts.answerable():
            if self.conn.closed:
                continue
            if error is not None:
                self._send_error(*refusal(error), receipt)
            elif receipt is not None:
                self.conn.receipt(receipt)

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.wire.write(data)
            self.conn.sent(time.monotonic())
        if self.conn.closed:
            self._end()

    def _end(self) -> None:
        """End the session wherever that is noticed (an ERROR sent, the link lost, a missed heart-beat): the
        worker may be waiting for credit, a confirm or a drained socket, so it is cancelled, and its
        clean-up closes the link (the core takes back unacknowledged messages) and the socket."""
        self._driver.end()

    def _error(self, message: str, detail: str, receipt: str | None) -> None:
        """Refuse the frame being handled: its ERROR follows the answers of the frames before it (a SEND's
        RECEIPT once the core confirmed it), and no frame after it is done."""
        if self._failing:
            return
        self._failing = True
        failed = self._loop.create_future()
        failed.set_exception(FrameError(message, detail))
        self.receipts.after(failed, receipt)
        self._drain_receipts()
        self._flush()

    def _send_error(self, message: str, detail: str, receipt: str | None) -> None:
        """The ERROR frame now; the connection ends once it is written."""
        self._failing = True
        log.info("stomp error sent", extra={"peer": self.wire.peer, "error": message, "detail": detail[:200]})
        self.counters.errors += 1
        self.conn.error(message, detail, receipt)
        self._flush()

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        log.info(
            "stomp protocol error", extra={"peer": self.wire.peer, "error": exc.message, "detail": exc.detail[:200]}
        )
        self.counters.errors += 1
        self._flush()

    def _link_error(self, event: ev.Event, exc: LinkRequestError) -> None:
        self._error(_ERROR_NAMES.get(exc.code, "request failed"), exc.text, getattr(event, "receipt", None))

    def _link_closed(self, error: LinkRequestError) -> None:
        if not self._closed:  # now: the answers the frames before it wait for are not coming
            self._send_error("server unavailable", f"the link to the broker closed: {error.text}", None)

    # ------------------------------------------------------------------ heart-beats and the end
    def _arm_timer(self) -> None:
        """Wait for the codec's next deadline: CONNECT in time, then heart-beats both ways."""
        deadline = self.conn.next_deadline()
        self._driver.arm_timer(None if deadline is None else deadline - time.monotonic(), self._deadline)

    def _deadline(self) -> None:
        if self._closed:
            return
        try:
            self.conn.handle_timeout(time.monotonic())
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        self._flush()
        self._arm_timer()

    async def abort(self) -> None:
        """The clean-up is overdue (``SessionDriver``): the link and the socket close now."""
        await close_now(self.link, self.wire)

    async def clean_up(self) -> None:
        for subscription in self.subscriptions.values():
            self._stop_pump(subscription)
            with contextlib.suppress(LinkRequestError):  # never written: no failed delivery (``release_unsent``)
                subscription.consumer.release_unsent()
        if self.link is not None:
            self.link.on_closed = self.link.on_settled = None
            await self.link.close()  # the core returns unacked messages and drops temporary queues
        self.receipts.drop()
        self.wire.close()


async def _create_durable(link: LinkClient, queue: subscribing.QueueToMake) -> None:
    """Create a durable subscription's queue on a multicast address. One that exists already is kept, unless
    its topic or selector changed: then, as in JMS, it is a new subscription and the old one's messages go."""
    selector = queue.selector
    options: dict[str, Any] = {"filter": selector} if selector else {}
    try:
        found = await link.create_queue(
            queue.name, queue.address, routing_type=RoutingType.MULTICAST, durable=True, **options
        )
    except LinkRequestError as exc:
        if exc.code != ErrorCode.EXISTS:
            raise
        found = {"created": False, "filter": "-"}  # on another topic, or a queue of its own
    if not found.get("created") and (found.get("filter") or None) != (selector or None):
        refusal = await link.not_a_subscription(queue.name)
        if refusal is not None:  # never deleted for a subscription, with its messages
            raise LinkRequestError(ErrorCode.EXISTS, refusal)
        await link.delete_queue(queue.name, everywhere=True)
        await link.create_queue(queue.name, queue.address, routing_type=RoutingType.MULTICAST, durable=True, **options)
