"""asyncio client of the internal link: requests, publishing with confirms, consumers with credit.

A thin shell around ``LinkConnection``: output is written once per event-loop iteration, so a burst of
publishes becomes one frame. A client may know several core nodes (a ``Topology``, possibly shared with
other clients and following the cluster's membership): it connects to the one its load-balancing policy
picks. When the connection drops (not closed by us) the client fails over: it reconnects with exponential
backoff, to another live node first, re-creates its temporary queues, re-sends its will, re-creates its
consumers and re-sends every unconfirmed publish; durable messages carry a producer id + sequence dedup id
(stamped here when absent), so a re-send is never stored twice. Meanwhile the application's publishes and
requests wait rather than fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, ClassVar, Final, Protocol, Self, TypeVar, cast

from tridentmq_shared.light_event import LightEvent
from tridentmq_shared.link import events as ev
from tridentmq_shared.link.codec import DEFAULT_HEARTBEAT_MS, MAKE_AND_SUBSCRIBE_VERSION, LinkConnection, Role, State
from tridentmq_shared.link.errors import (
    LinkClosedError,
    LinkError,
    LinkRequestError,
    LocalProtocolError,
    SharedLinksRefusedError,
)
from tridentmq_shared.link.failover import FATAL, ReconnectPolicy, Unconfirmed, connect_first, homed, reach_backup
from tridentmq_shared.link.ops import PROTOCOL_VERSIONS, ErrorCode, NackMode
from tridentmq_shared.link.topology import Endpoint, LoadBalancing, Topology
from tridentmq_shared.log_window import FloodLog
from tridentmq_shared.message import (
    LINK_DEDUP_PREFIX,
    M_BODY,
    M_DEDUP,
    M_DURABLE,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    RoutingType,
    WireMessage,
)
from tridentmq_shared.runtime import random_hex
from tridentmq_shared.tls import ClientTls

_P = TypeVar("_P", bound=asyncio.Protocol)


class ChannelOpener(Protocol):
    """Opens a session's link as a channel of a shared link (``channels.SharedLinks``, a gateway's)."""

    def open_now(self, host: str, port: int, protocol_factory: Callable[[], _P]) -> tuple[asyncio.Transport, _P] | None:
        """The channel at once when no wait is needed (its shared link is up), else None: then ``open``."""
        ...

    async def open(self, host: str, port: int, protocol_factory: Callable[[], _P]) -> tuple[asyncio.Transport, _P]:
        """Raises as a connection would, or ``SharedLinksRefusedError`` (then the client connects directly)."""
        ...


class FlushHost(Protocol):
    """The shared link a session's link travels on, which writes that link's output with its own."""

    def flush_later(self, client: LinkClient) -> None:
        """Write ``client``'s queued output, then the shared link's, at the end of this loop turn."""
        ...


log = logging.getLogger("tridentmq.link.client")
#: A shared link that fails over restores the consumers of every session it carries: when their queues went
#: with the old link (an MQTT session's lock), 30,000 sessions each logged their own line.
unrestored_log = FloodLog(
    60.0, log, logging.WARNING, "more consumers not restored after a reconnect (their sessions were told)"
)
_OPEN = State.OPEN  # a module constant: enum member access is slow on the publish path

#: Write as soon as this many operations are queued, so a long burst streams instead of piling up into
#: one huge frame that the peer can only start on once it has all of it.
EARLY_WRITE_OPERATIONS = 256
#: ... or this many bytes of message bodies (large messages).
EARLY_WRITE_BYTES = 1024 * 1024
#: A consumer's credit goes back to the server in this many parts of its window: a top-up at every quarter
#: keeps at least three quarters of the window on the way (at every half, a gateway relaying to a client that
#: acknowledges each message drained measurably slower: docs/benchmarks.md, MQTT gateway).
CREDIT_TOP_UP_PARTS = 4
#: How long ``close`` waits for the server to close its side after ours.
CLOSE_TIMEOUT = 5.0
#: Queue definitions remembered to re-create a consumer's queue on another node after a failover.
MAX_REMEMBERED_QUEUES = 1024


class Delivery:
    """One message handed to a consumer (a plain slotted class: one is made per message)."""

    __slots__ = ("consumer", "delivery_count", "message")

    def __init__(self, consumer: Consumer, delivery_count: int, message: WireMessage) -> None:
        self.consumer = consumer
        self.delivery_count = delivery_count
        self.message = message

    @property
    def id(self) -> int:
        return int(self.message[M_ID])

    @property
    def body(self) -> bytes:
        return bytes(self.message[M_BODY])

    @property
    def properties(self) -> dict[str, Any]:
        return dict(self.message[M_PROPS])

    @property
    def redelivered(self) -> bool:
        return self.delivery_count > 1


_SETTLING: Final = (ev.Confirms, ev.Rejected)


class Consumer:
    """Deliveries of one subscription. Credit is topped up as the application takes messages, or, with
    ``credit_on_settle``, as it acknowledges or gives them back: then no more than the window is ever
    out of the queue, whoever holds it (a gateway relaying to a slow client, say). With ``window_bytes``
    the window is bounded in body bytes as well (one message may pass it)."""

    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = (
        "_buffer",
        "_on",
        "_taken",
        "_taken_bytes",
        "_unsettled",
        "_waiter",
        "bound_to",
        "browse_done",
        "client",
        "closed",
        "consumer_id",
        "credit_on_settle",
        "on_wake",
        "options",
        "queue",
        "spec",
        "window",
        "window_bytes",
    )

    def __init__(
        self,
        client: LinkClient,
        queue: str,
        credit: int,
        options: dict[str, Any],
        credit_on_settle: bool = False,
        window_bytes: int = 0,
    ) -> None:
        self.client = client
        self.queue = queue
        self.window = credit
        self.window_bytes = window_bytes
        self.credit_on_settle = credit_on_settle
        self.options = options
        self.consumer_id = 0
        self.spec: dict[str, Any] | None = None  # the CREATE_QUEUE of its queue on this link, if any
        #: Without ``spec``: the address and routing type of its queue as the node said, to make the queue
        #: again after a failover to a node that lacks it (kept only then: tens of thousands of these live).
        self.bound_to: tuple[Any, Any] | None = None
        self._on: LinkConnection | None = None  # the connection it is subscribed on
        self.browse_done = False
        self.closed: LinkRequestError | None = None
        # Raw DELIVER operations, wrapped when taken: a list made by the first (an empty one is 56 bytes, and
        # tens of thousands of consumers wait idle), taken whole.
        self._buffer: list[list[Any]] | None = None
        self._taken = 0
        self._taken_bytes = 0
        # With credit_on_settle: message id -> body size of each message taken on this link and not yet
        # settled. Settling anything else (a delivery of a link lost since) returns no credit: the node
        # granted a whole new window when the consumer was restored.
        self._unsettled: dict[int, int] = {}
        self._waiter: asyncio.Future[None] | None = None
        #: Called instead of waking a waiter when deliveries arrive or the consumer closes: its holder then
        #: takes them with ``take_batch`` from the callback, and keeps no task waiting on ``get_batch``.
        self.on_wake: Callable[[], None] | None = None

    def subscribed(self, answer: Any) -> None:
        """The node's answer to its SUBSCRIBE."""
        if self.spec is None and isinstance(answer, dict) and "address" in answer:
            self.bound_to = (answer["address"], answer.get("routing_type"))

    def _wake(self) -> None:
        if self.on_wake is not None:
            try:
                self.on_wake()
            except Exception:  # its holder's bug must not break the link every other holder shares
                log.exception("a consumer's wake-up callback failed", extra={"queue": self.queue})
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, timeout: float | None) -> bool:
        """Wait until deliveries are buffered: False at the end of a browse or after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._buffer:
            if self.closed is not None:
                raise self.closed
            if self.browse_done:
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._waiter = self.client._event_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._waiter, remaining)
        return True

    def _took(self, count: int, messages: Iterable[WireMessage]) -> None:
        if not self.credit_on_settle:
            self._credit(count, sum(len(m[M_BODY]) for m in messages) if self.window_bytes else 0)
        else:
            unsettled = self._unsettled
            for message in messages:
                unsettled[message[M_ID]] = len(message[M_BODY])

    def _settled(self, message_ids: list[int]) -> None:
        if self.credit_on_settle:
            unsettled = self._unsettled
            sizes = [unsettled.pop(i) for i in message_ids if i in unsettled]
            if sizes:
                self._credit(len(sizes), sum(sizes) if self.window_bytes else 0)

    def _credit(self, count: int, nbytes: int) -> None:
        self._taken += count
        self._taken_bytes += nbytes
        if self._taken * CREDIT_TOP_UP_PARTS >= self.window or (
            self.window_bytes and self._taken_bytes * CREDIT_TOP_UP_PARTS >= self.window_bytes
        ):
            self.client._flow(self, self._taken, self._taken_bytes)
            self._taken = self._taken_bytes = 0

    async def get(self, timeout: float | None = None) -> Delivery | None:
        """The next delivery; None at the end of a browse or after ``timeout`` seconds."""
        while True:
            if not self._buffer and not await self._wait(timeout):
                return None
            assert self._buffer is not None
            _, _, count, message = self._buffer.pop(0)
            self._took(1, (message,))
            if not message[M_EXPIRATION] or self._kept_unexpired([(count, message)]):
                return Delivery(self, count, message)

    async def get_batch(self, timeout: float | None = None) -> list[tuple[int, WireMessage]]:
        """Everything buffered at once as (delivery count, message) pairs, for high-rate consumers;
        empty at the end of a browse or after ``timeout``."""
        while True:
            if not self._buffer and not await self._wait(timeout):
                return []
            batch = self.take_batch()
            if batch:  # (else all of it expired here: wait on)
                return batch

    def peek(self) -> list[WireMessage]:
        """The messages buffered now, left where they are."""
        return [op[3] for op in self._buffer or ()]

    def take_batch(self) -> list[tuple[int, WireMessage]]:
        """What is buffered now as (delivery count, message) pairs, without waiting (see ``on_wake``)."""
        buffer, self._buffer = self._buffer, None
        if not buffer:
            return []
        batch = [(op[2], op[3]) for op in buffer]
        self._took(len(batch), (message for _, message in batch))
        if any(message[M_EXPIRATION] for _, message in batch):  # rare: most messages never expire
            return self._kept_unexpired(batch)
        return batch

    def _kept_unexpired(self, batch: list[tuple[int, WireMessage]]) -> list[tuple[int, WireMessage]]:
        """``batch`` without the messages that expired while buffered here (a gateway's prefetch, ahead of its
        client's credit), which are not handed on, as Artemis's client does and MQTT asks ([MQTT-3.3.2-5]): a
        consumer's go back to the queue uncounted, where the node expires them (to the expiry address); an
        auto-ack consumer's are dropped (consumed already), a browser's skipped."""
        now_ms = int(time.time() * 1000)
        expired = [message[M_ID] for _, message in batch if 0 < message[M_EXPIRATION] <= now_ms]
        if not expired:
            return batch
        if not (self.options.get("browse") or self.options.get("auto_ack")) and self.closed is None:
            self.nack_ids(expired, NackMode.RELEASE)
        gone = set(expired)
        return [(count, message) for count, message in batch if message[M_ID] not in gone]

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delivery]:
        while (delivery := await self.get()) is not None:
            yield delivery

    def ack(self, *deliveries: Delivery, tx_id: int = 0) -> None:
        self.ack_ids([d.id for d in deliveries], tx_id)

    def ack_ids(self, message_ids: list[int], tx_id: int = 0) -> None:
        """Acknowledge by message id (for batches taken with ``get_batch``)."""
        self.client._ack(self, message_ids, tx_id)
        self._settled(message_ids)

    def nack(self, *deliveries: Delivery, mode: NackMode = NackMode.REDELIVER) -> None:
        self.nack_ids([d.id for d in deliveries], mode)

    def nack_ids(self, message_ids: list[int], mode: NackMode = NackMode.REDELIVER) -> None:
        """Give messages back by message id (for batches taken with ``get_batch``)."""
        self.client._nack(self, message_ids, mode)
        self._settled(message_ids)

    def ack_answered(self, message_ids: list[int]) -> asyncio.Future[None]:
        """``ack_ids``, and a future done once the node has applied the acknowledgement and, for a durable
        message, made it as safe as a commit (see ``LinkClient.settle_answered``)."""
        return self.client.settle_answered(self, message_ids)

    def nack_answered(self, message_ids: list[int], mode: NackMode = NackMode.REDELIVER) -> asyncio.Future[None]:
        """``nack_ids``, and a future done once the node has handled the NACK."""
        return self.client.settle_answered(self, message_ids, mode)

    def release_unsent(self, taken: Iterable[int] = ()) -> None:
        """When the consumer is about to end (closed, or its link): give back, uncounted, the messages the
        application took and never handed on (``taken``: a gateway's, waiting for its client's window) and
        those still buffered here. Closing returns what a consumer holds as failed deliveries: a client that
        reconnects often to a backlog, taking a little each time, would have the rest dead-lettered without
        its ever being delivered. What was handed on and not settled still counts. No credit comes back for
        them: nothing more is wanted."""
        buffer, self._buffer = self._buffer, None
        if self.options.get("browse") or self.options.get("auto_ack") or self.closed is not None:
            return  # shown, not taken; consumed once sent; or ended in the core already
        ids = [*taken, *(op[3][M_ID] for op in buffer or ())]
        if not ids:
            return
        if self.credit_on_settle:
            for message_id in ids:
                self._unsettled.pop(message_id, None)
        # Newest first, as the core returns a closed consumer's: each goes back to the head of its queue.
        self.client._nack(self, sorted(ids, reverse=True), NackMode.RELEASE)

    async def close(self) -> None:
        await self.client._unsubscribe(self)


class _Protocol(asyncio.Protocol):
    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = ("client", "gone", "transport", "writable")

    def __init__(self, client: LinkClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        # Cleared while the transport's write buffer is above its high-water mark: publishers wait, so the
        # loop keeps turning (writing, reading confirms, heartbeating) instead of buffering without bound.
        self.writable = LightEvent(is_set=True)
        self.gone = LightEvent()  # set once the connection is closed both ways

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        self.client._received(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()  # waiters wake and find the link gone
        self.gone.set()
        self.client._lost(self, exc)
        # A shared link's channel refers back to this protocol: dropping the channel breaks that cycle, so that a
        # session's link is freed with the session rather than by the cyclic collector.
        self.transport = None


class LinkClient:
    """A connection to a core node. Use ``async with LinkClient(...) as client``.

    The nodes it may use are ``endpoints`` (else ``host``, ``port``), or a ``topology`` shared with other
    clients; ``load_balancing`` picks among them when the client makes its own topology. With
    ``follow_topology`` the client asks its node for the cluster's members after each (re)connect and keeps
    the topology up to date from the node's pushes (one such client per process is enough)."""

    #: The link protocol versions offered (a subclass may offer fewer, to act as an older client).
    versions: ClassVar[tuple[int, ...]] = PROTOCOL_VERSIONS

    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = (
        "_closing",
        "_conn",
        "_connecting",
        "_consumers",
        "_credit_waiters",
        "_dedup_seq",
        "_error",
        "_flush_scheduled",
        "_heartbeat_task",
        "_loop",
        "_opened",
        "_pending_bytes",
        "_protocol",
        "_queue_specs",
        "_reconnecting",
        "_requests",
        "_unconfirmed",
        "_unsent",
        "_will",
        "acting_for",
        "channels",
        "client_host",
        "client_name",
        "connect_timeout",
        "failovers",
        "flush_with",
        "follow_topology",
        "forgive_own_stalls",
        "heartbeat_ms",
        "host",
        "node_epoch",
        "node_id",
        "nodes",
        "on_channels",
        "on_closed",
        "on_confirms",
        "on_rejected",
        "on_settled",
        "password",
        "port",
        "producer_id",
        "reconnect",
        "tls",
        "user",
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 61616,
        *,
        endpoints: Sequence[Endpoint] | None = None,
        topology: Topology | None = None,
        load_balancing: str | LoadBalancing = LoadBalancing.ROUND_ROBIN,
        follow_topology: bool = False,
        user: str | None = None,
        password: str | None = None,
        client_name: str = "tridentmq-client",
        client_host: str | None = None,
        acting_for: str | None = None,
        heartbeat_ms: int = DEFAULT_HEARTBEAT_MS,
        reconnect: ReconnectPolicy | None = None,
        connect_timeout: float = 5.0,
        tls: ClientTls | None = None,
        channels: ChannelOpener | None = None,
        forgive_own_stalls: bool = False,
    ) -> None:
        #: The nodes this client may use.
        self.nodes = topology or Topology(list(endpoints) if endpoints else [(host, port)], load_balancing)
        self.follow_topology = follow_topology
        self.host, self.port = self.nodes.seeds[0]  # the node connected to, once connected
        self.user = user
        self.password = password
        self.client_name = client_name
        self.acting_for = acting_for  # the user ``user`` opens the link for (a gateway's certificate login)
        self.client_host = client_host  # a gateway's client's address, for the core's loopback-only default
        self.heartbeat_ms = heartbeat_ms
        #: A stall of this process does not count as the node's silence (a gateway's links; see the codec).
        self.forgive_own_stalls = forgive_own_stalls
        self.reconnect = reconnect or ReconnectPolicy()
        self.connect_timeout = connect_timeout
        self.tls = tls  # connect with TLS (the core's link.tls)
        #: A gateway's shared links: this client's link is then a channel of one of them, not a connection.
        self.channels = channels
        self.node_id = ""
        self.node_epoch = 0  # the activation epoch the node announced (HA)
        self.failovers = 0  # reconnects that succeeded
        self.producer_id = random_hex(16)
        self._dedup_seq = 0  # durable publishes given a dedup id so far (an int: a count() is 56 bytes)
        # The loop, kept: asyncio.get_running_loop() makes a getpid() system call each time, a fifth of a
        # gateway's CPU when it is called per message.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: LinkConnection | None = None
        self._protocol: _Protocol | None = None
        self._opened: asyncio.Future[None] | None = None
        self._connecting = False
        self._requests: dict[int, asyncio.Future[Any]] = {}
        # seq → (message, transaction, confirm future) of publishes the server has not confirmed yet
        self._unconfirmed: dict[int, Unconfirmed] = {}
        # publishes of a lost connection still to be re-sent, in order
        # (lists: an empty deque is 600 bytes, and a gateway has a link client per client connection)
        self._unsent: list[Unconfirmed] = []
        self._consumers: dict[int, Consumer] = {}
        # CREATE_QUEUE specs by queue name, oldest first (a dict: an OrderedDict is twice the size)
        self._queue_specs: dict[str, dict[str, Any]] = {}
        self._will: dict[str, Any] | None = None  # the will the server accepted, re-sent after a reconnect
        self._credit_waiters: list[asyncio.Future[None]] = []
        self._flush_scheduled = False
        #: The shared link this session's link travels on (a channel): its flush writes this one's output, in
        #: the same loop turn, rather than this one writing into it a turn before it writes the socket.
        self.flush_with: FlushHost | None = None
        self._pending_bytes = 0  # body bytes queued since the last write
        self._closing = False
        self._reconnecting: asyncio.Task[None] | None = None
        self._error: LinkRequestError | None = None
        #: Called once the link is closed for good (lost and not reconnecting, or refused, or closed by us).
        self.on_closed: Callable[[LinkRequestError], None] | None = None
        #: Called after each read that confirmed or rejected publishes (their futures are done by then): one
        #: call for many messages, cheaper than a done-callback on each future.
        self.on_settled: Callable[[], None] | None = None
        #: For publishes made with ``send_if_open``: called with each batch of confirmed sequence ranges and
        #: with each rejection (sequence, code, text), before ``on_settled``.
        self.on_confirms: Callable[[list[tuple[int, int]]], None] | None = None
        self.on_rejected: Callable[[int, str, str], None] | None = None
        #: Called with the (channel id, bytes) the server sent for the sessions this link carries.
        self.on_channels: Callable[[list[tuple[int, bytes]]], None] | None = None

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ connection
    async def connect(self) -> None:
        await self._connect_with_retries(self.reconnect.initial_attempts)
        if self.follow_topology:
            try:
                self._learn(await self._members())
            except LinkRequestError as exc:
                if exc.code != ErrorCode.INVALID:
                    raise
                self.nodes.not_clustered()

    @property
    def connected(self) -> bool:
        """The link is up now (not closed, not lost, not between a loss and a resume)."""
        conn = self._conn  # set at the start of each attempt: open only once the node welcomed it
        return conn is not None and conn.state is _OPEN and not self._closing

    @property
    def _resuming(self) -> bool:
        task = self._reconnecting
        return task is not None and not task.done()

    async def _connect_with_retries(self, attempts: int, failed: Endpoint | None = None) -> None:
        self._connecting = True
        try:
            await connect_first(self.nodes, self.reconnect, self._open, self._stop_if_closed, attempts, failed)
        finally:
            self._connecting = False

    async def _open(self, host: str, port: int) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.host, self.port = host, port
        self.flush_with = None  # set again by the shared link that carries this attempt, if one does
        conn = LinkConnection(
            Role.CLIENT,
            heartbeat_ms=self.heartbeat_ms,
            forgive_own_stalls=self.forgive_own_stalls,
            versions=self.versions,
        )
        self._conn = conn
        self._error = None
        self._opened = loop.create_future()
        # Lost before the HELLO was sent, the open fails at once and nobody awaits this outcome.
        self._opened.add_done_callback(_take_outcome)
        transport: asyncio.Transport
        if self.channels is not None:
            try:
                # At once while the shared link is up: no task to wait on (asyncio.wait_for makes one).
                opened = self.channels.open_now(host, port, lambda: _Protocol(self))
                if opened is None:
                    opened = await asyncio.wait_for(
                        self.channels.open(host, port, lambda: _Protocol(self)), self.connect_timeout
                    )
                transport, protocol = opened
            except SharedLinksRefusedError:
                transport, protocol = await self._connect_directly(host, port)
        else:
            transport, protocol = await self._connect_directly(host, port)
        self._protocol = protocol
        self._abort_if_closed(transport)
        if transport.is_closing():
            # Reset by the peer between the connect and now (a node dying or turning a link away): writing
            # would raise RuntimeError with uvloop, which is no connection error, and end the caller.
            self._abandon(protocol, transport)
            raise ConnectionResetError(f"{host}:{port} closed the connection at once")
        conn.hello(self.user, self.password, self.client_name, self.client_host, self.acting_for)
        transport.write(conn.data_to_send())
        # A timer on the future rather than asyncio.wait_for: every session link of a gateway makes this
        # handshake, and wait_for costs a waiter future, callbacks and a wake-up more.
        timer = loop.call_later(self.connect_timeout, _time_out, self._opened)
        try:
            await self._opened
        except BaseException:
            self._abandon(protocol, transport)
            raise
        finally:
            timer.cancel()
        self._abort_if_closed(transport)
        if self._conn is not conn:  # lost right after the WELCOME
            raise ConnectionError("connection lost")
        if not self.nodes.saw(self.node_id, self.node_epoch):
            # A copy of the node that another took over from (a paused or cut-off old primary): not ours.
            self._abandon(protocol, transport)
            raise LinkClosedError(
                ErrorCode.FENCED,
                f"{host}:{port} is node {self.node_id} at epoch "
                f"{self.node_epoch}; epoch {self.nodes.epochs[self.node_id]} "
                f"replaced it",
            )
        self._opened = None  # done with: tens of thousands of clients would keep a future each
        if conn.next_deadline() is not None:  # a channel of a shared link has no heartbeats: its link's count
            self._heartbeat_task = asyncio.create_task(self._heartbeat(conn))
            self._heartbeat_task.add_done_callback(self._task_ended)

    def _abandon(self, protocol: _Protocol, transport: asyncio.Transport) -> None:
        """Close the connection of an attempt that failed: the attempt reports the failure, so its loss, which
        comes a loop turn later (once the attempt is over), is no loss of the link to resume from. Taken for
        one, a login the gateway had given up on (no answer in time) reconnected for ever with no client behind
        it, and a storm of wrong passwords filled the node's handshakes with them for good."""
        if self._protocol is protocol:
            self._protocol = None
            self._conn = None
        transport.abort()

    def _stop_if_closed(self) -> None:
        """``close`` cancels a resume, but on Python 3.11 ``asyncio.wait_for`` can swallow that cancellation
        (when what it waited for completes at the same moment): a resume that goes on must not try the nodes
        for ever, keeping its owner's shutdown waiting."""
        if self._closing:
            raise LinkClosedError(ErrorCode.EOF, "the client was closed")

    def _abort_if_closed(self, transport: asyncio.Transport) -> None:
        """A connection made for a client closed meanwhile: close() cancelled the resume it belongs to, but
        asyncio.wait_for (Python 3.11) can let a connection through all the same. Unwanted, it would keep
        its consumers' messages out of their queue for as long as it lives (found by the randomised run)."""
        if self._closing:
            transport.abort()
            raise LinkClosedError(ErrorCode.EOF, "the client was closed")

    async def _connect_directly(self, host: str, port: int) -> tuple[asyncio.Transport, _Protocol]:
        context = self.tls.context() if self.tls is not None else None
        loop = self._event_loop()
        return await asyncio.wait_for(
            loop.create_connection(lambda: _Protocol(self), host, port, ssl=context), self.connect_timeout
        )

    async def _heartbeat(self, conn: LinkConnection) -> None:
        while conn is self._conn:
            deadline = conn.next_deadline()
            if deadline is None:
                return
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            if conn is not self._conn:
                return
            try:
                conn.handle_timeout(time.monotonic())
            except LinkError as exc:
                log.warning("link to %s:%s dead: %s", self.host, self.port, exc.text)
                self._write_now()
                if self._protocol is not None:
                    self._drop(self._protocol, abort=True)
                return
            self._schedule_flush()

    async def close(self) -> None:
        self._closing = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        conn, protocol = self._conn, self._protocol
        if conn is not None and protocol is not None and protocol.transport is not None:
            conn.close(ErrorCode.EOF, "client closing")
            self._write_now()
            transport = protocol.transport
            if transport.can_write_eof() and not transport.is_closing():
                # Half-close and read on until the server closes its side. Closing a socket that still has
                # unread input (the server's confirms keep coming) resets it, and the server then drops what
                # it had not read yet: the last publishes before this close.
                try:
                    transport.write_eof()
                except OSError:  # the server is gone already: nothing left to save
                    pass
                else:
                    await protocol.gone.wait(CLOSE_TIMEOUT)
            elif not transport.is_closing():
                # TLS (and a shared link's channel) has no half-close: the server closes the link once it has
                # read our CLOSE.
                await protocol.gone.wait(CLOSE_TIMEOUT)
            transport.close()
            # A TLS close takes a round trip (close_notify) before the socket goes: see it through.
            if not protocol.gone.is_set() and not await protocol.gone.wait(CLOSE_TIMEOUT):
                transport.abort()
        self._fail_all(LinkClosedError(ErrorCode.EOF, "the client was closed"))

    def _received(self, protocol: _Protocol, data: bytes) -> None:
        conn = self._conn
        if protocol is not self._protocol or conn is None:
            return
        try:
            events = conn.receive_data(data, time.monotonic())
        except LinkError as exc:
            log.warning("protocol error from %s:%s: %s", self.host, self.port, exc)
            self._write_now()
            self._drop(protocol)
            return
        settled = False
        for event in events:
            self._dispatch(event)
            settled = settled or type(event) in _SETTLING
        if settled and self.on_settled is not None:
            self.on_settled()
        if conn.channel_data:
            received, conn.channel_data = conn.channel_data, None
            if self.on_channels is not None:
                self.on_channels(received)
        if conn.pending_operations:  # what handling it queued (most reads queue nothing: no empty flush)
            self._schedule_flush()

    def _dispatch(self, event: ev.Event) -> None:
        match event:
            case ev.Deliveries(ops):
                consumers = self._consumers
                woken = set()
                for op in ops:
                    consumer = consumers.get(op[1])
                    if consumer is not None:
                        if consumer._buffer is None:
                            consumer._buffer = [op]
                        else:
                            consumer._buffer.append(op)
                        woken.add(consumer)
                for consumer in woken:
                    consumer._wake()
            case ev.Confirms(ranges):
                if self.on_confirms is not None:
                    self.on_confirms(ranges)
                if not self._unconfirmed:
                    return
                for first, last in ranges:
                    for seq in range(first, last + 1):
                        entry = self._unconfirmed.pop(seq, None)
                        if entry is not None and not entry[2].done():
                            entry[2].set_result(None)
            case ev.PublishCreditGranted():
                while self._credit_waiters and self._conn is not None and self._conn.can_publish:
                    waiter = self._credit_waiters.pop(0)
                    if not waiter.done():
                        waiter.set_result(None)
            case ev.Rejected(seq, code, text):
                entry = self._unconfirmed.pop(seq, None)
                if entry is not None:
                    if not entry[2].done():
                        entry[2].set_exception(LinkRequestError(code, text))
                elif self.on_rejected is not None:
                    self.on_rejected(seq, code, text)
            case ev.Reply(req_id, result):
                future = self._answered(req_id)
                if future is not None and not future.done():
                    future.set_result(result)
            case ev.RequestFailed(req_id, code, text):
                future = self._answered(req_id)
                if future is not None and not future.done():
                    future.set_exception(LinkRequestError(code, text))
                elif req_id == 0:
                    log.warning("server reported: %s: %s", code, text)
            case ev.Welcomed(_, node_id, _, _, _, epoch):
                self.node_id = sys.intern(node_id)  # one string for the node, not a copy per client
                self.node_epoch = epoch
                if self._opened is not None and not self._opened.done():
                    self._opened.set_result(None)
            case ev.ConsumerClosed(consumer_id, code, text):
                consumer = self._consumers.pop(consumer_id, None)
                if consumer is not None:
                    consumer.closed = LinkRequestError(code, text)
                    consumer._wake()
            case ev.BrowseDone(consumer_id):
                consumers = self._consumers
                conn = self._conn
                ended = conn is not None and conn.version >= MAKE_AND_SUBSCRIBE_VERSION  # the node forgot it
                consumer = consumers.pop(consumer_id, None) if ended else consumers.get(consumer_id)
                if consumer is not None:
                    if ended:
                        consumer._on = None  # nothing to close
                    consumer.browse_done = True
                    consumer._wake()
            case ev.TopologyUpdate(update):
                if self.follow_topology:
                    self._learn(update)
                self._peer_event(event)
            case ev.ReplicaRecords():
                self._peer_event(event)
            case ev.Closed(code, text):
                self._error = LinkClosedError(code, text)
                if self._opened is not None and not self._opened.done():
                    self._opened.set_exception(self._error)
                log.info("server closed the link: %s: %s", code, text)
                if self._protocol is not None and not self._connecting and code not in FATAL:
                    # A node that stops serving (failback, shutdown, isolation) says so before its socket
                    # goes: the link is lost from here, not from when the socket closes.
                    self._drop(self._protocol)

    def _answered(self, req_id: int) -> asyncio.Future[Any] | None:
        """The future of a request the node answered. A dict keeps the room it once needed: an idle client's
        empty one is made anew (tens of thousands of clients, mostly idle once their session is set up)."""
        requests = self._requests
        future = requests.pop(req_id, None)
        if not requests:
            self._requests = {}
        return future

    def _peer_event(self, event: ev.TopologyUpdate | ev.ReplicaRecords) -> None:
        """What a node sends only to its peers (``peer.PeerLink``): an application client has none."""

    def _drop(self, protocol: _Protocol, *, abort: bool = False) -> None:
        """End a connection found dead or closed by its node, and count it lost now: its socket's own end
        comes a loop turn later, and an ack or send in between must wait for the resume (as in a failover)
        rather than raise the old connection's error to the application."""
        if protocol.transport is not None:
            if abort:
                protocol.transport.abort()
            else:
                protocol.transport.close()
        self._lost(protocol, None)

    def _lost(self, protocol: _Protocol, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return
        self._conn = None
        self._protocol = None
        if self._connecting:  # inside connect() or a reconnect attempt: it reports the failure itself
            if self._opened is not None and not self._opened.done():
                self._opened.set_exception(ConnectionError("connection lost during the handshake"))
            return
        if self._closing or (self._error is not None and self._error.code in FATAL):
            self._fail_all(self._error or LinkClosedError(ErrorCode.EOF, "connection lost"))
            return
        error = LinkClosedError(ErrorCode.EOF, f"connection lost: {exc}" if exc else "connection lost")
        for future in self._requests.values():
            if not future.done():
                future.set_exception(error)
        self._requests.clear()
        if self.reconnect.attempts == 0:
            self._fail_all(self._error or error)  # the server's reason when it said one (shutdown, say)
            return
        # Unconfirmed publishes go again, before those a resume cut short had not re-sent yet.
        self._unsent[:0] = [homed(self._unconfirmed[seq], self.node_id) for seq in sorted(self._unconfirmed)]
        self._unconfirmed.clear()
        if self._reconnecting is not None:
            self._reconnecting.cancel()  # lost again while resuming: start over
        log.info("link to %s:%s lost, reconnecting", self.host, self.port)
        self._reconnecting = asyncio.get_running_loop().create_task(self._resume((self.host, self.port)))
        self._reconnecting.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A link's own task (heartbeat, resume) must not die half way unnoticed: one that failed (a bug) is
        logged with its traceback and the link ends, failing everything that waits on it."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("link task failed: the link is closed", exc_info=exc, extra={"task": task.get_name()})
        self._closing = True
        self._fail_all(LinkClosedError(ErrorCode.INTERNAL, f"the link failed: {type(exc).__name__}"))
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.abort()

    async def _resume(self, failed: Endpoint) -> None:
        """Reconnect, to another node first; restore what the old link had; re-send unconfirmed publishes in
        their order. The application's publishes and requests wait until this is done."""
        try:
            if not await self._reach_backup(failed):
                await self._connect_with_retries(self.reconnect.attempts, failed)
        except LinkClosedError as exc:
            self._fail_all(exc)
            return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # cancelled: by ``close``, a new loss (which starts another resume) or the loop's end
            # A CancelledError that no cancel() of this task raised (a future it awaited ended so): the resume
            # would end as cancelled and the link stay down without a word. End it for its owner, loudly.
            log.exception("link resume ended by a stray cancellation: the link is closed")
            self._closing = True  # no resume after this one
            self._fail_all(LinkClosedError(ErrorCode.EOF, "the link's resume was cancelled"))
            if self._protocol is not None and self._protocol.transport is not None:
                self._protocol.transport.abort()
            return
        conn = self._conn
        assert conn is not None
        if not conn.open:
            # Closed by its node with the WELCOME (it was stopping: every node of a cluster stopped at once): lost
            # again, and resumed again. Restored on it, the link failed for good, its task with a traceback.
            if self._protocol is not None:
                self._drop(self._protocol)
            return
        self.failovers += 1
        log.info("link resumed on %s:%s", self.host, self.port, extra={"node_id": self.node_id})
        self._restore(conn)
        while self._unsent:
            message, tx_id, future = self._unsent[0]
            if tx_id:  # its transaction died with the old link: re-sending it outside would be wrong
                self._unsent.pop(0)
                if not future.done():
                    future.set_exception(LinkClosedError(ErrorCode.EOF, "the link dropped; the transaction is lost"))
                continue
            await self._wait_credit()
            await self._wait_writable()
            conn = self._live()
            self._unsent.pop(0)
            self._unconfirmed[conn.publish(message)] = (message, 0, future)
            self._queued(conn, message)
        for waiter in self._credit_waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _reach_backup(self, failed: Endpoint) -> bool:
        self._connecting = True
        try:
            return await reach_backup(self.nodes, self.reconnect, self._open, self._stop_if_closed, failed)
        finally:
            self._connecting = False

    def _restore(self, conn: LinkConnection) -> None:
        """Everything the old link had set up, queued at once on the new one (the node answers in order): the
        will, queues, consumers (one refused is closed with the refusal) and the topology request."""
        if self._will is not None:
            # Within its delay the old link's will is pending under the same key: this cancels it.
            self._background(conn.set_will(self._will), self._will_resent)
        # The link's temporary queues went with it; a consumer's queue may not exist on this node.
        specs = {name: spec for name, spec in self._queue_specs.items() if spec.get("temporary")}
        specs.update((c.spec["name"], c.spec) for c in self._consumers.values() if c.spec is not None)
        for spec in specs.values():
            self._background(conn.create_queue(spec), _ignore_answer)
        # A browser that saw its whole queue is not browsed again (it is done: an older node's keeps it until
        # it is closed).
        old_consumers = [c for c in self._consumers.values() if not c.browse_done]
        self._consumers.clear()
        for consumer in old_consumers:
            consumer._buffer = None
            consumer._unsettled.clear()
            consumer._taken = consumer._taken_bytes = 0
            options = consumer.options
            if consumer.bound_to is not None:  # made again as it was, if it must be made
                options = {"address": consumer.bound_to[0], "routing_type": consumer.bound_to[1], **options}
            req_id, consumer.consumer_id = conn.subscribe(
                consumer.queue, consumer.window, options, consumer.window_bytes
            )
            consumer._on = conn
            self._consumers[consumer.consumer_id] = consumer
            self._background(req_id, functools.partial(self._resubscribed, consumer))
        if self.follow_topology:
            self._background(conn.topology({}), self._topology_answer)
        self._schedule_flush()

    def _background(self, req_id: int, done: Callable[[asyncio.Future[Any]], None]) -> None:
        """A request whose answer goes to ``done`` rather than to a caller."""
        future: asyncio.Future[Any] = self._event_loop().create_future()
        future.add_done_callback(done)
        self._requests[req_id] = future

    def _resubscribed(self, consumer: Consumer, future: asyncio.Future[Any]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is None:
            if not future.cancelled():
                consumer.subscribed(future.result())
            return
        if isinstance(error, LinkClosedError) or not isinstance(error, LinkRequestError):
            return  # lost again: the next resume subscribes it again
        if unrestored_log.first():
            log.warning(
                "consumer of %s not restored after a reconnect: %s (further ones counted once a minute)",
                consumer.queue,
                error,
            )
        if self._consumers.get(consumer.consumer_id) is consumer:
            del self._consumers[consumer.consumer_id]
        consumer.closed = error
        consumer._wake()

    def _will_resent(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("the server refused the will after a reconnect: %s", future.exception())

    def _topology_answer(self, future: asyncio.Future[Any]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is None and not future.cancelled():
            self._learn(future.result())
        elif isinstance(error, LinkRequestError) and error.code == ErrorCode.INVALID:
            self.nodes.not_clustered()

    def _learn(self, answer: Any) -> None:
        """Members from a TOPOLOGY answer or update."""
        members = answer.get("members") if isinstance(answer, dict) else None
        if isinstance(members, list) and self.nodes.update(members):
            log.info("cluster topology: %s", ", ".join(f"{h}:{p}" for h, p in self.nodes.endpoints))

    def _fail_all(self, error: LinkRequestError) -> None:
        self._error = error
        for future in self._requests.values():
            if not future.done():
                future.set_exception(error)
        self._requests.clear()
        for _, _, future in [*self._unconfirmed.values(), *self._unsent]:
            if not future.done():
                future.set_exception(error)
        self._unconfirmed.clear()
        self._unsent.clear()
        for waiter in self._credit_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._credit_waiters.clear()
        # Each consumer refers back to its link: once they are closed the link drops them, and an ended session's
        # link and consumers are freed with it rather than by the cyclic collector.
        consumers = list(self._consumers.values())
        self._consumers.clear()
        for consumer in consumers:
            consumer.closed = error
            consumer._wake()
        if self.on_closed is not None:
            callback, self.on_closed = self.on_closed, None
            callback(error)

    # ------------------------------------------------------------------ output
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if self.flush_with is not None:
                self.flush_with.flush_later(self)
            else:
                self._event_loop().call_soon(self._write_now)

    def _queued(self, conn: LinkConnection, message: WireMessage) -> None:
        """A publish was queued: write now past the early-write thresholds, else at the end of this turn."""
        self._pending_bytes += len(message[M_BODY])
        if conn.pending_operations >= EARLY_WRITE_OPERATIONS or self._pending_bytes >= EARLY_WRITE_BYTES:
            self._write_now()
        else:
            self._schedule_flush()

    def flush(self) -> None:
        """Write what is queued now rather than at the end of this loop iteration: for a caller that must
        know its acknowledgements are on their way before it tells anyone else (they reach the core even if
        this process dies right after)."""
        self._write_now()

    def _write_now(self) -> None:
        self._flush_scheduled = False
        self._pending_bytes = 0
        conn, protocol = self._conn, self._protocol
        if conn is None or protocol is None or protocol.transport is None or protocol.transport.is_closing():
            return
        try:
            data = conn.data_to_send()
        except LocalProtocolError as exc:  # an operation the server cannot take (a message's huge headers)
            log.error("link closed: %s", exc.text)  # noqa: TRY400 - not a bug: no traceback helps
            self._closing = True  # no reconnect: it would send the same operation again
            self._fail_all(LinkClosedError(exc.code, exc.text))
            protocol.transport.abort()
            return
        if data:
            protocol.transport.write(data)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def _live(self) -> LinkConnection:
        if self._conn is None or self._conn.state is not _OPEN:
            raise self._error or LinkClosedError(ErrorCode.EOF, "not connected")
        return self._conn

    # ------------------------------------------------------------------ requests
    async def _ready(self) -> LinkConnection:
        """The open connection, once a reconnection under way (with its re-sends) is over."""
        while (task := self._reconnecting) is not None and not task.done():
            await asyncio.wait([task])
        return self._live()

    def _ready_now(self) -> LinkConnection | None:
        """The open connection when no reconnection is under way (nearly always): what ``_ready`` returns,
        without a coroutine to await; None when ``_ready`` must be awaited."""
        conn, task = self._conn, self._reconnecting
        if conn is not None and conn.state is _OPEN and (task is None or task.done()):
            return conn
        return None

    async def _call(self, req_id: int) -> Any:
        future: asyncio.Future[Any] = self._event_loop().create_future()
        self._requests[req_id] = future
        self._schedule_flush()
        return await future

    async def _request(self, make: Callable[[LinkConnection], int], *, again: bool = True) -> Any:
        """Send the request ``make`` queues and wait for its answer. A request the link lost is made ``again``
        on the resumed link when doing it twice is harmless."""
        while True:
            try:
                return await self._call(make(self._ready_now() or await self._ready()))
            except LinkClosedError:
                if not (again and self._resuming):
                    raise

    async def create_address(
        self,
        address: str,
        routing_types: tuple[RoutingType, ...] = (RoutingType.ANYCAST,),
    ) -> dict[str, Any]:
        return dict(await self._request(lambda conn: conn.create_address(address, [int(r) for r in routing_types])))

    async def _members(self) -> dict[str, Any]:
        """The cluster's members (a TOPOLOGY request); its node pushes later changes."""
        result = await self._request(lambda conn: conn.topology({}))
        return dict(result) if isinstance(result, dict) else {}

    async def delete_address(self, address: str) -> None:
        await self._request(lambda conn: conn.delete_address(address), again=False)

    async def create_queue(
        self,
        name: str,
        address: str | None = None,
        *,
        routing_type: RoutingType = RoutingType.ANYCAST,
        durable: bool = True,
        **options: Any,
    ) -> dict[str, Any]:
        spec = queue_spec(name, address, routing_type=routing_type, durable=durable, **options)
        result = dict(await self._request(lambda conn: conn.create_queue(spec)))
        if not options.get("passive"):  # a look made nothing to make again
            self._remember(spec)
        return result

    async def not_a_subscription(self, name: str) -> str | None:
        """Why the queue ``name`` is no durable subscription's, which ending or replacing that subscription would
        delete: a queue of another routing type than multicast, or a temporary one, here or on another node.
        None when every queue of that name is a subscription's (or there is none). A subscription's queue is
        named ``<client id>.<subscription name>``, which a plain queue may be named too."""
        found = await self.create_queue(name, passive=True, describe=True)
        multicast = int(RoutingType.MULTICAST)
        if found.get("exists") and (found.get("routing_type") != multicast or found.get("temporary")):
            return f"queue {name!r} is a queue of its own, not a durable subscription's"
        if any(routing != multicast for routing in found.get("elsewhere_routing_types", ())):
            return f"queue {name!r} is a queue of its own on another node, not a durable subscription's"
        return None

    def _remember(self, spec: dict[str, Any]) -> None:
        """Keep a queue's spec to make the queue again on another node after a failover (a temporary one, or a
        consumer's)."""
        specs, name = self._queue_specs, spec["name"]
        specs.pop(name, None)  # to the end: the newest
        specs[name] = spec
        if len(specs) > MAX_REMEMBERED_QUEUES:
            del specs[next(iter(specs))]

    async def delete_queue(self, name: str, *, everywhere: bool = False) -> None:
        """Delete a queue of this node; with ``everywhere``, its namesakes on the other nodes of the cluster too
        (a session's queue that moved with its client: a copy left behind would keep its messages). A node of
        protocol version 2 deletes its own only."""
        self._queue_specs.pop(name.rpartition("::")[2], None)
        await self._request(lambda conn: conn.delete_queue(name, everywhere=everywhere), again=False)

    async def set_will(
        self,
        key: str,
        message: WireMessage | None,
        *,
        delay_ms: int = 0,
        publish_pending: bool = False,
        retain: tuple[str, dict[str, Any]] | None = None,
        everywhere: bool = False,
    ) -> None:
        """Set this link's will: ``message`` is published ``delay_ms`` after the link closes without clearing
        it. ``message`` None clears it. Either way a pending will under ``key`` (left by a closed link) is
        cancelled or, with ``publish_pending``, published now; with ``everywhere``, one pending on another node
        of the cluster too. ``retain`` (store address, key properties): the published will is copied to that
        store with those properties (a core that predates it ignores it). The will is re-sent after a
        reconnect, touching no pending will."""
        will: dict[str, Any] = {
            "key": key,
            "message": message,
            "delay_ms": delay_ms,
            "publish_pending": publish_pending,
        }
        if retain is not None and message is not None:
            will["retain"] = {"address": retain[0], "key": retain[1]}
        if everywhere:
            will["everywhere"] = True
        await self._request(lambda conn: conn.set_will(will))
        self._will = None if message is None else {**will, "publish_pending": False, "everywhere": False}

    async def delay_will(self, delay_ms: int) -> None:
        """Give this link's will a new delay: nothing when it has none, or when another link has taken its key
        over since (``own``; a core that predates it ignores it, as it does any key it does not know)."""
        will = self._will
        if will is not None:
            delayed = {**will, "delay_ms": delay_ms}
            await self._request(lambda conn: conn.set_will({**delayed, "own": True}))
            self._will = delayed

    async def clear_will(self) -> None:
        """Clear this link's will, touching no pending will."""
        await self._request(lambda conn: conn.set_will(None))
        self._will = None

    async def subscribe(
        self,
        queue: str,
        *,
        credit: int = 1000,
        selector: str | None = None,
        auto_ack: bool = False,
        browse: bool = False,
        credit_on_settle: bool = False,
        credit_bytes: int = 0,
        **options: Any,
    ) -> Consumer:
        """A consumer with a window of ``credit`` messages and, when ``credit_bytes`` > 0, that many body
        bytes (a slow reader of large messages then holds that much here, not the whole window). A browser
        (``browse``) ends with its browse: ``get`` and ``get_batch`` then return nothing."""
        opts = _subscribe_options(selector, options, auto_ack=auto_ack, browse=browse)
        consumer = Consumer(self, queue, credit, opts, credit_on_settle, credit_bytes)
        consumer.spec = self._queue_specs.get(queue.rpartition("::")[2])
        await self._subscribe(consumer, None)
        return consumer

    async def make_and_subscribe(
        self,
        spec: dict[str, Any],
        *,
        credit: int = 1000,
        selector: str | None = None,
        auto_ack: bool = False,
        credit_on_settle: bool = False,
        credit_bytes: int = 0,
        **options: Any,
    ) -> tuple[dict[str, Any], Consumer]:
        """Create the queue ``spec`` describes (see ``queue_spec``) and subscribe to it (options as
        ``subscribe``'s): one request from link protocol version 4, two before. Returns CREATE_QUEUE's answer
        and the consumer."""
        consumer = self._made_consumer(spec, credit, selector, auto_ack, credit_on_settle, credit_bytes, options)
        made, _ = await self._subscribe(consumer, spec)
        return made, consumer

    async def subscribe_if_made(
        self,
        spec: dict[str, Any],
        *,
        nowhere_else: bool = False,
        credit: int = 1000,
        selector: str | None = None,
        auto_ack: bool = False,
        credit_on_settle: bool = False,
        credit_bytes: int = 0,
        **options: Any,
    ) -> tuple[dict[str, Any], Consumer | None]:
        """As ``make_and_subscribe``, but the consumer only when this request made the queue (and, with
        ``nowhere_else``, no other node of the cluster holds one of its name). Otherwise CREATE_QUEUE's answer
        and None."""
        consumer = self._made_consumer(spec, credit, selector, auto_ack, credit_on_settle, credit_bytes, options)
        made, subscribed = await self._subscribe(consumer, spec, "new" if nowhere_else else "made")
        return made, consumer if subscribed else None

    def _made_consumer(
        self,
        spec: dict[str, Any],
        credit: int,
        selector: str | None,
        auto_ack: bool,
        credit_on_settle: bool,
        credit_bytes: int,
        options: dict[str, Any],
    ) -> Consumer:
        opts = _subscribe_options(selector, options, auto_ack=auto_ack)
        consumer = Consumer(self, spec["name"], credit, opts, credit_on_settle, credit_bytes)
        consumer.spec = spec
        return consumer

    async def _subscribe(
        self, consumer: Consumer, spec: dict[str, Any] | None, condition: str | None = None
    ) -> tuple[dict[str, Any], bool]:
        """Subscribe ``consumer``, making its queue from ``spec`` first if given, on the ``condition`` the link
        protocol's SUBSCRIBE option ``if`` names (``made``, ``new``). Returns CREATE_QUEUE's answer (empty
        without ``spec``) and whether the consumer was made."""
        made: dict[str, Any] = {}
        if spec is not None and (self._ready_now() or await self._ready()).version < MAKE_AND_SUBSCRIBE_VERSION:
            # An older node: CREATE_QUEUE, then a plain SUBSCRIBE (each made again on a resumed link).
            wanted = spec
            made = dict(await self._request(lambda conn: conn.create_queue(wanted)))
            self._remember(wanted)
            if not _made_as_asked(made, condition):
                return made, False
            spec = None
        while True:
            conn = self._ready_now() or await self._ready()
            consumer.consumer_id = 0  # an id of an earlier link may be another consumer's on this one
            options = consumer.options
            try:
                if spec is not None:
                    options = {**options, "queue": spec, "if": condition} if condition else {**options, "queue": spec}
                req_id, consumer.consumer_id = conn.subscribe(
                    consumer.queue, consumer.window, options, consumer.window_bytes
                )
                consumer._on = conn
                self._consumers[consumer.consumer_id] = consumer
                answer = await self._call(req_id)
            except LinkRequestError as exc:
                self._forget(consumer)
                conn.not_subscribed(consumer.consumer_id)
                if not (isinstance(exc, LinkClosedError) and self._resuming):
                    raise
                continue
            if isinstance(answer, dict) and "made" in answer:
                made = dict(answer["made"])
                if spec is not None:
                    self._remember(spec)
                if "queue" not in answer:  # not made as asked: no consumer either
                    self._forget(consumer)
                    conn.not_subscribed(consumer.consumer_id)
                    return made, False
            consumer.subscribed(answer)
            return made, True

    def _forget(self, consumer: Consumer) -> None:
        """Take ``consumer`` out of this link's consumers, if it is there under its id (after a failover its
        old id may be another consumer's)."""
        if self._consumers.get(consumer.consumer_id) is consumer:
            del self._consumers[consumer.consumer_id]

    async def _unsubscribe(self, consumer: Consumer) -> None:
        self._forget(consumer)
        conn = await self._ready()
        if consumer._on is not conn:
            return  # it went with the link it was on (or ended with its browse)
        try:
            await self._call(conn.unsubscribe(consumer.consumer_id))
        except LinkClosedError:
            if not self._resuming:
                raise
        except LinkRequestError as exc:
            # A version 4 browser may end on the node while this request is on its way.
            browser_ended = consumer.options.get("browse") and conn.version >= MAKE_AND_SUBSCRIBE_VERSION
            if not (browser_ended and exc.code == ErrorCode.NOT_FOUND):
                raise

    def _flow(self, consumer: Consumer, credit: int, credit_bytes: int) -> None:
        conn = self._conn
        if conn is not None and conn.state is _OPEN and consumer._on is conn:
            conn.flow(consumer.consumer_id, credit, credit_bytes)
            self._schedule_flush()

    def _settling(self, consumer: Consumer) -> LinkConnection | None:
        """The connection to ack or nack ``consumer``'s messages on; None while the link is being resumed: its
        messages went back to their queue with the old link (the node redelivers them, flagged)."""
        conn = self._conn
        if conn is not None and conn.state is _OPEN and consumer._on is conn:
            return conn
        if self._resuming:
            return None
        return self._live()

    def _ack(self, consumer: Consumer, ids: list[int], tx_id: int) -> None:
        conn = self._settling(consumer)
        if conn is not None:
            conn.ack(consumer.consumer_id, ids, tx_id)
            self._schedule_flush()

    def _nack(self, consumer: Consumer, ids: list[int], mode: NackMode) -> None:
        conn = self._settling(consumer)
        if conn is not None:
            conn.nack(consumer.consumer_id, ids, mode)
            self._schedule_flush()

    def settle_answered(self, consumer: Consumer, ids: list[int], nack: NackMode | None = None) -> asyncio.Future[None]:
        """Acknowledge (or, with ``nack``, give back) ``consumer``'s messages and return a future the node's
        answer completes. ACK and NACK have no answer of their own, so they travel inside a transaction begun
        and committed in the same write: the node handles a link's operations in order, and answers a COMMIT
        once the acknowledgements it applied are as safe as a publish's confirm (synced to disk, and held by
        an in-sync backup). A NACK, never transactional, goes in an empty one: its COMMIT is answered once the
        NACK was handled. The future fails (``LinkClosedError``) when the link is down or drops before the
        answer: the messages went back to their queue with it and will be delivered again."""
        future: asyncio.Future[None] = self._event_loop().create_future()
        conn = self._conn
        if conn is None or conn.state is not _OPEN or consumer._on is not conn:
            future.set_exception(
                LinkClosedError(ErrorCode.EOF, "the link dropped: the messages went back to their queue")
            )
            return future
        tx_id = conn.new_tx_id()
        self._background(conn.tx_begin(tx_id), _take_outcome)  # a refused BEGIN makes the COMMIT fail too
        if nack is None:
            conn.ack(consumer.consumer_id, ids, tx_id)
        else:
            conn.nack(consumer.consumer_id, ids, nack)
        self._requests[conn.tx_commit(tx_id)] = future
        future.add_done_callback(functools.partial(self._commit_answered, conn, tx_id))
        consumer._settled(ids)
        self._schedule_flush()
        return future

    def _commit_answered(self, conn: LinkConnection, tx_id: int, future: asyncio.Future[None]) -> None:
        """A COMMIT the node refused leaves its transaction open (a node that cannot write): roll it back, so
        its acknowledgements do not hold the messages until the link ends."""
        error = None if future.cancelled() else future.exception()
        refused = isinstance(error, LinkRequestError) and not isinstance(error, LinkClosedError)
        if refused and conn is self._conn and conn.state is _OPEN:
            self._background(conn.tx_rollback(tx_id), _take_outcome)
            self._schedule_flush()

    # ------------------------------------------------------------------ transactions
    # A transaction lives and dies with its link: after a failover its commit fails (not-found).
    async def begin(self) -> int:
        conn = await self._ready()
        tx_id = conn.new_tx_id()
        await self._call(conn.tx_begin(tx_id))
        return tx_id

    async def commit(self, tx_id: int) -> None:
        await self._request(lambda conn: conn.tx_commit(tx_id), again=False)

    async def rollback(self, tx_id: int) -> None:
        await self._request(lambda conn: conn.tx_rollback(tx_id), again=False)

    # ------------------------------------------------------------------ publishing
    async def _wait_credit(self) -> None:
        """Until the window has room, across a reconnection (whose end wakes the waiters)."""
        while True:
            conn = self._conn
            if conn is None or conn.state is not _OPEN:
                if not self._resuming:
                    raise self._error or LinkClosedError(ErrorCode.EOF, "not connected")
            elif conn.can_publish:
                return
            waiter: asyncio.Future[None] = self._event_loop().create_future()
            self._credit_waiters.append(waiter)
            await waiter

    async def _wait_writable(self) -> None:
        protocol = self._protocol
        if protocol is not None and not protocol.writable.is_set():
            await protocol.writable.wait()

    async def _send(self, message: WireMessage, tx_id: int = 0) -> asyncio.Future[None]:
        """Write a publish once the window allows (across a reconnection); the future resolves on the confirm."""
        while True:
            if self._resuming:
                await self._ready()
            await self._wait_credit()
            await self._wait_writable()
            if not self._resuming:
                return self._send_on(self._live(), message, tx_id)

    def _send_on(self, conn: LinkConnection, message: WireMessage, tx_id: int) -> asyncio.Future[None]:
        if len(message[M_BODY]) > conn.max_publish_body:  # refused here: its frame would break the link
            refused: asyncio.Future[None] = self._event_loop().create_future()
            refused.set_exception(_too_large(message, conn))
            return refused
        if message[M_DURABLE] and message[M_DEDUP] is None and self.reconnect.attempts:
            # Only a link that reconnects sends a message twice; without, the id would cost for nothing.
            self._dedup_seq += 1
            message[M_DEDUP] = f"{LINK_DEDUP_PREFIX}{self.producer_id}:{self._dedup_seq}"
        seq = conn.publish(message, tx_id)
        future: asyncio.Future[None] = self._event_loop().create_future()
        self._unconfirmed[seq] = (message, tx_id, future)
        self._queued(conn, message)
        return future

    def _send_unconfirmed_on(self, conn: LinkConnection, message: WireMessage) -> int:
        """Write a publish whose confirm nothing here waits for; its sequence number."""
        seq = conn.publish(message)
        self._queued(conn, message)
        return seq

    def _open_for_sending(self) -> LinkConnection | None:
        """The connection if a publish may go now: open, with credit, its socket keeping up, not being
        resumed."""
        conn, protocol, resuming = self._conn, self._protocol, self._reconnecting
        if (
            conn is None
            or conn.state is not _OPEN
            or conn.publish_credit <= 0
            or conn.publish_bytes <= 0
            or (protocol is not None and not protocol.writable.is_set())
            or (resuming is not None and not resuming.done())
        ):
            return None
        return conn

    async def _wait_window(self) -> None:
        """Until a publish may go: the link open (after a reconnection's re-sends), credit, a socket keeping up."""
        await self._ready()
        await self._wait_credit()
        await self._wait_writable()

    async def _until_open_for_sending(self) -> LinkConnection:
        while (conn := self._open_for_sending()) is None:
            await self._wait_window()
        return conn

    async def publish(self, message: WireMessage, tx_id: int = 0) -> None:
        """The acknowledged publish: wait until the server confirms it (stored, and fsynced and replicated when
        durable); raises ``LinkRequestError`` when it is refused. While the link is being resumed it waits, and
        a publish the old link never had confirmed is sent again (a durable one under its dedup id)."""
        await (await self._send(message, tx_id))

    async def publish_batch(self, messages: Iterable[WireMessage], tx_id: int = 0) -> list[asyncio.Future[None]]:
        """Many acknowledged publishes in one call: each is written, in order, as soon as the server's window
        allows (a burst goes out as one frame), and the call returns once all are written, with one future per
        message that resolves on its confirm or holds its refusal (``asyncio.gather`` waits for them all). When the
        link closes for good before all are written, that error is raised, and what was written may or may not
        have been stored."""
        confirms: list[asyncio.Future[None]] = []
        try:
            for message in messages:
                confirms.append(await self._send(message, tx_id))  # noqa: PERF401 - kept as they go: see except
        except BaseException:
            for confirm in confirms:  # their outcomes are nobody's now: taken, so asyncio does not report them
                confirm.add_done_callback(_take_outcome)
            raise
        return confirms

    async def publish_unconfirmed(self, message: WireMessage) -> None:
        """The fire-and-forget publish (at most once): it waits for the window only. The server still confirms
        it, but nothing here waits for that (a refusal reaches ``on_rejected``, when set), and a publish lost with
        the link is not sent again. A body larger than the link takes raises ``LinkRequestError``
        (``resource-limit``) before anything is sent."""
        conn = await self._until_open_for_sending()
        if len(message[M_BODY]) > conn.max_publish_body:
            raise _too_large(message, conn)
        self._send_unconfirmed_on(conn, message)


def _made_as_asked(made: dict[str, Any], condition: str | None) -> bool:
    """Whether a CREATE_QUEUE's answer meets a SUBSCRIBE's ``if`` (the core decides on a version 4 link)."""
    if condition is None:
        return True
    return bool(made.get("created")) and (condition == "made" or not made.get("elsewhere"))


def _subscribe_options(
    selector: str | None, options: dict[str, Any], *, auto_ack: bool, browse: bool = False
) -> dict[str, Any]:
    opts: dict[str, Any] = {"auto_ack": auto_ack, "browse": browse, **options}
    if selector:
        opts["selector"] = selector
    return opts


def queue_spec(
    name: str,
    address: str | None = None,
    *,
    routing_type: RoutingType = RoutingType.ANYCAST,
    durable: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """A CREATE_QUEUE spec (docs/link-protocol.md): ``address`` defaults to the name; ``options`` are the spec's
    other keys (``temporary``, ``expires_ms``, ``max_consumers``, ``filter``, ...)."""
    return {"name": name, "address": address or name, "routing_type": int(routing_type), "durable": durable, **options}


def _too_large(message: WireMessage, conn: LinkConnection) -> LinkRequestError:
    return LinkRequestError(
        ErrorCode.RESOURCE_LIMIT,
        f"message body of {len(message[M_BODY])} bytes exceeds the {conn.max_publish_body} the core's link takes",
    )


def _time_out(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError("no answer to the link's HELLO in time"))


def _take_outcome(future: asyncio.Future[Any]) -> None:
    """Taken so asyncio does not report an outcome nobody read ("exception was never retrieved")."""
    if not future.cancelled():
        future.exception()


def _ignore_answer(future: asyncio.Future[Any]) -> None:
    """The outcome of a request made again after a reconnect, taken so asyncio does not report it unread."""
    if not future.cancelled() and future.exception() is not None:
        log.debug("request after a reconnect refused: %s", future.exception())
