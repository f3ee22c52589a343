"""One MQTT client connection: the codec, the client's own link to the core, its session and subscriptions.

Packets are handled strictly in order by the shared session driver's worker, which runs only while there are
packets (an idle connection holds no task); reading the socket pauses while too many wait, so a flood of
PUBLISH packets is held back by the core's publish credit all the way to the client's TCP connection. PUBACKs
and PUBRECs go out in the order of their PUBLISH packets, each once the core confirmed the message (for QoS 1
and 2: once it is on disk).

Each subscription is a core queue with a consumer on the client's link, which calls the session back when
messages arrive (``pump``) and holds them while the client does not read. A QoS 0 subscription of a session
that ends with its connection is instead a member of the gateway's feed of its filter (see ``feeds``), which
writes it the messages that it encodes once for all.

A message the client has to acknowledge (QoS 1 and 2) stays unacknowledged in the core until it does, so
whatever is lost with a connection or a gateway comes back to the next connection of the session. Its
packet id is derived from the core's message id, so that after a reconnect it is sent again under the id
the client may have recorded, with DUP set. Once the client has received a QoS 2 message (PUBREC), the
session record says so before the PUBREL goes out: it is never sent again.

A persistent session (session expiry above 0) keeps its record and its subscription queues in the core
(see ``state``), so the client may come back through any gateway. A session that ends with its connection
uses temporary queues, which the core drops along with the link.

Retained messages a SUBSCRIBE sends at QoS 1 or 2 in a persistent session are session state too ([MQTT-4.4.0-1]):
they are copied into the session's outbox queue and delivered from there like a subscription's messages (as
Artemis copies them into the subscription's queue; here the gateway's own link holds them, as a client's user
may not read the retained store). Elsewhere they are written to the client at once, and kept nowhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass
from typing import Any

from tridentmq_mqtt import connecting, convert, messages, outbound, subscribing
from tridentmq_mqtt.convert import ConversionError
from tridentmq_mqtt.feeds import Encodings, Feed, Feeds, Numbering, numbering
from tridentmq_mqtt.protocol import events as ev
from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.protocol.connection import MqttServerConnection
from tridentmq_mqtt.protocol.errors import LocalProtocolError, RemoteProtocolError
from tridentmq_mqtt.protocol.packets import V5, Subscription, Will, encode_topic
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_mqtt.publish_answers import Pending, PublishAnswers, Refusal
from tridentmq_mqtt.settings import MqttSettings
from tridentmq_mqtt.state import (
    Registry,
    SessionBusyError,
    SessionOwnedError,
    SessionState,
    SessionUnreachableError,
    StoredSubscription,
)
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.gateway import Wire
from tridentmq_shared.link.client import Consumer, LinkClient, queue_spec
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import (
    HOME_PROPERTY,
    M_ADDRESS,
    M_BODY,
    M_DEDUP,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_TIMESTAMP,
    RoutingType,
    WireMessage,
)
from tridentmq_shared.runtime import random_hex
from tridentmq_shared.session_driver import HANDLING_BUGS, SessionDriver, close_now, core_unavailable_log

log = logging.getLogger("tridentmq.mqtt")

#: What is left of a subscription's look-up in the retained store: a list of messages at a time.
RetainedBatches = AsyncGenerator[list[WireMessage], None]
#: How long a session's end waits for its retained PUBLISHes still on their way to the store.
RETAINED_ON_CLOSE_S = 5.0
_CACHE_LIMIT = 4096  # topics remembered per connection in each direction
#: The filter text of a session's outbox (see ``_open_outbox``): no SUBSCRIBE's, as a filter is never empty
#: ([MQTT-4.7.3-1]), so the QoS 2 copies the session record notes for it are told from any subscription's.
OUTBOX = ""
#: Its messages say their QoS themselves (the one their SUBSCRIBE gave them) and go with the RETAIN flag.
_OUTBOX_OPTIONS = StoredSubscription(2, retain_as_published=True)


class Counters:
    """Gateway-wide counters for /metrics."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.packets_received = 0
        self.messages_published = 0
        self.messages_delivered = 0
        self.refused = 0  # CONNACKs refusing a connection
        self.protocol_errors = 0
        self.takeovers = 0
        self.qos0_dropped = 0  # fan-out messages skipped for connections that fell behind


@dataclass(eq=False)
class Sub:
    """A subscription of this connection: a queue of its own with a consumer, or a member of a feed."""

    text: str  # the SUBSCRIBE's filter text (with ``$share/<group>/``)
    topic_filter: str
    queue: str
    shared: bool
    options: StoredSubscription
    consumer: Consumer | None  # None for a member of a feed
    dollar_safe: bool  # the filter starts with a wildcard: it must not deliver ``$`` topics
    draining: bool = False  # its messages wait for the client to read what was written (``pump``)
    closed: bool = False
    session: MqttSession | None = None  # the connection its messages go to
    solo: bool = False  # a QoS 0 subscription that could have been a feed's member (``Feeds.solo_opened``)
    auto_ack: bool = False  # its consumer's messages are done once sent (QoS 0 of a session that ends here)
    # A solo subscription, and one that moved to a feed: the highest message id its own queue gave it, and so
    # the feed's messages it has had already (the feed's queue holds them too, from the moment it was made),
    # in the numbering ``had_on``.
    had_upto: int = 0
    had_on: Numbering = ("", 0)

    def woken(self) -> None:
        """Its own queue's consumer calls this when deliveries come (a bound method: a closure per subscription
        would cost 288 bytes, this 64)."""
        assert self.session is not None
        self.session.pump(self)

    # feeds.Subscriber
    def fan_out(self, batch: Encodings) -> int:
        assert self.session is not None
        return self.session.fan_out(self, batch)

    def feed_lost(self) -> None:
        assert self.session is not None
        self.session.feed_lost(self)


@dataclass(eq=False, slots=True)
class _Outgoing:
    """A QoS 1/2 PUBLISH waiting for the client: a message of a subscription (or of the session's outbox), or a
    retained message written straight from the store (``retained``: no core message of the session to acknowledge,
    as in a session that ends with its connection)."""

    sub: Sub | None
    message: WireMessage
    qos: int
    dup: bool = False
    retained: bool = False


class MqttSession:
    # Slots: tens of thousands of these live at once, one or more per client connection.
    __slots__ = (
        "__weakref__",  # the gateway looks whether ended sessions are freed (``EndedSessions``)
        "_acks",
        "_addresses",
        "_answers",
        "_background",
        "_connected",
        "_disconnecting",
        "_driver",
        "_dropping",
        "_gone",
        "_holder",
        "_lock",
        "_loop",
        "_outbound",
        "_outbox",
        "_queues",
        "_retaining",
        "_sending_retained",
        "_topics",
        "_unparked",
        "_violating",
        "_will_delay_s",
        "_will_key",
        "client_id",
        "conn",
        "core_links",
        "counters",
        "expiry_s",
        "feeds",
        "id",
        "link",
        "registry",
        "settings",
        "state",
        "subs",
        "user",
        "version",
        "wire",
    )

    def __init__(
        self,
        settings: MqttSettings,
        core_links: CoreLinks,
        registry: Registry,
        wire: Wire,
        counters: Counters,
        feeds: Feeds,
    ) -> None:
        limits = settings.mqtt
        self.settings = settings
        self.core_links = core_links
        self.registry = registry
        self.feeds = feeds
        self.wire = wire
        self.counters = counters
        self.id = random_hex(16)
        self.conn = MqttServerConnection(
            max_packet_size=limits.max_packet_bytes,
            receive_maximum=limits.receive_maximum,
            topic_alias_maximum=limits.topic_alias_maximum,
            max_connect_bytes=limits.max_connect_bytes,
            now=time.monotonic(),
        )
        self.link: PipelinedLink | None = None
        self.client_id = ""
        self.version = 0
        self.expiry_s = 0  # session expiry interval in force
        self.state = SessionState()
        self.user = ""  # the user this connection logged in as ("" anonymous)
        self.subs: dict[str, Sub] = {}
        self._lock: Consumer | None = None
        self._holder: Consumer | None = None
        self._will_key = ""
        self._will_delay_s: int | None = None  # the will's Will Delay Interval as the client set it; None: no will
        # Lists, not deques: an empty deque is 600 bytes, and each is taken whole (a batch) or cut once.
        self._answers: PublishAnswers[asyncio.Future[None]] = PublishAnswers()  # of the client's PUBLISH packets
        self._outbound: outbound.Outbound[_Outgoing] = outbound.Outbound()  # QoS 1/2 PUBLISH packets to the client
        self._acks: dict[Sub, list[int]] = {}  # acknowledged by the client, for the core at the next flush
        self._addresses: dict[str, str] = {}  # topic → address
        self._topics: dict[str, tuple[str, bytes]] = {}  # address → topic, and as a PUBLISH encodes it
        self._connected = False
        self._dropping = False  # fan-out messages are being skipped: the client does not keep up
        # Queues dropped after moving to a feed, a wait for the client to read (made when needed, as above).
        self._background: dict[asyncio.Task[None], bool] | None = None  # task → finished at the end (else cancelled)
        self._retaining: asyncio.Future[None] | None = None  # the last retained PUBLISH's update of the store
        # The subscriptions whose retained messages are still to be sent, in order, while they are sent.
        self._sending_retained: list[Sub] | None = None
        self._unparked: asyncio.Future[None] | None = None  # their task waits for parked messages to be sent
        self._violating = False  # a DISCONNECT waits for the answers before it: no packet is handled meanwhile
        self._gone = False  # the client's socket closed: nothing more is written to it
        self._queues = 0  # this connection's own subscription queues made so far (an int: a count() is 56 bytes)
        self._outbox: Sub | None = None  # the session's outbox, once consumed (``_open_outbox``)
        self._disconnecting = False
        loop = asyncio.get_running_loop()
        self._loop = loop
        # Packets are handled while the client does not read, up to pending_bytes of answers waiting for it (its
        # deliveries wait for the socket: ``pump``): a client that publishes a burst before it reads, while its own
        # subscriptions fill its socket, is not deadlocked with the gateway.
        self._driver = SessionDriver(
            self,
            wire,
            "mqtt",
            max_events=limits.pending_packets,
            max_bytes=limits.pending_bytes,
            max_unread=limits.pending_bytes,
        )
        connect_timeout = settings.mqtt.connect_timeout_ms / 1000
        if connect_timeout > 0:
            self._driver.arm_timer(connect_timeout, self._connect_deadline)
        counters.connections_total += 1

    @property
    def _closed(self) -> bool:
        return self._driver.closed

    @property
    def persistent(self) -> bool:
        return self.expiry_s > 0

    # ------------------------------------------------------------------ input from the client
    def feed(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            events = self.conn.receive_data(data, time.monotonic())
        except LocalProtocolError:
            log.exception("mqtt codec failed", extra={"peer": self.wire.peer})
            self._end()
            return
        if not events:  # a PINGREQ (a PUBREC of an unknown packet id) is answered by the codec alone
            out = self.conn.data_to_send() if self._connected else b""
            if out and self.wire.buffered() >= self.settings.mqtt.pending_bytes:
                # The client does not read: its answers wait in the worker's line, which waits for the client,
                # and reading pauses as for any packet (written at once, they grew its buffer without bound).
                self._driver.receive([_Answered(out)], len(data))
                return
            self._driver.receive(events, len(data), final=not data)
            if out:
                self.wire.write(out)
            return
        self.counters.packets_received += len(events)
        if type(events[-1]) is ev.Disconnect:
            self._disconnecting = True  # the codec is closed from now on, but the DISCONNECT is still to handle
        # Nothing more is read from a client not logged in yet.
        # After its DISCONNECT (or the end of its stream) a client that does not read is handled all the same:
        # its DISCONNECT drops its will, and its session ends.
        self._driver.receive(events, len(data), hold=not self._connected, final=self._disconnecting or not data)

    def connection_lost(self) -> None:
        # At once, not in the events' order: what waited for the client to read (woken by the socket's end)
        # is not written into the closed socket, where it would count as delivered; the clean-up gives it back.
        self._gone = True
        self._driver.connection_lost(ev.ConnectionClosed())

    async def wait_closed(self) -> None:
        await self._driver.wait_closed()

    def shutdown(self, *, unavailable: bool = False) -> None:
        """The gateway is stopping (5.0 clients are told so: 0x8B), or lost the core (0x88)."""
        self._end(rc.SERVER_UNAVAILABLE if unavailable else rc.SERVER_SHUTTING_DOWN)

    # ------------------------------------------------------------------ the packet worker (SessionHooks)
    handled_errors: tuple[type[Exception], ...] = (
        ConversionError,
        LinkRequestError,
        LocalProtocolError,
        *HANDLING_BUGS,
    )

    def handle_error(self, event: ev.Event, error: Exception) -> None:
        if isinstance(error, ConversionError):
            self._violation(error.reason_code, str(error))
        elif isinstance(error, LinkRequestError):
            log.info("core refused a request", extra={"peer": self.wire.peer, "reason": error.text})
            self._end(rc.UNSPECIFIED_ERROR)
        else:
            log.error("mqtt session failed", exc_info=error, extra={"peer": self.wire.peer})
            self._end(rc.IMPLEMENTATION_SPECIFIC_ERROR)

    def before_handle(self) -> None:
        self._answer_confirmed()
        self._flush()

    after_batch = before_handle

    def reading_paused(self) -> None:
        pass

    def reading_resumed(self) -> None:
        pass

    def handle_now(self, event: ev.Event | _Answered) -> bool:
        """QoS 0/1 PUBLISH and PUBACK without a coroutine each: at tens of thousands a second that is most of
        the cost."""
        if self._violating:
            return True
        kind = type(event)
        if kind is _Answered:
            assert isinstance(event, _Answered)
            self.wire.write(event.data)
            return True
        if kind is ev.Publish:
            assert isinstance(event, ev.Publish)
            if event.qos == 2 or event.retain or not self._connected:
                return False
            link = self.link
            if link is None:
                return False
            if event.duplicate:
                return True  # still being handled: its PUBACK will follow
            message = self._message(event)
            if message is None:
                return True
            if event.qos == 0:
                # No answer to wait for: sent without a confirm future (at most once, as QoS 0 is); a refusal
                # comes to ``_qos0_refused``. One too large for the link is refused by ``_publish``.
                if not link.body_fits(message) or link.send_if_open(message) < 0:
                    return False  # ``_publish`` waits for the link (and makes the message again)
            else:
                confirmed = link.try_send(message)
                if confirmed is None:
                    return False
                self._answers.waits(Pending(confirmed, event.packet_id or 0, event.qos, event.topic))
            self.counters.messages_published += 1
            return True
        if kind is ev.PubackReceived:
            assert isinstance(event, ev.PubackReceived)
            self._acknowledged(event.packet_id)
            return True
        return False

    async def handle(self, event: ev.Event) -> None:
        if self._violating and type(event) is not ev.ConnectionClosed:
            return
        match event:
            case ev.Connect():
                await self._connect(event)
            case ev.Publish():
                await self._publish(event)
            case ev.PubrecReceived():
                await self._received(event)
            case ev.PubcompReceived():
                self._completed(event.packet_id)
            case ev.PubrelReceived():
                await self._released(event)
            case ev.Subscribe():
                await self._subscribe(event)
            case ev.Unsubscribe():
                await self._unsubscribe(event)
            case ev.Disconnect():
                await self._disconnect(event)
            case ev.ConnectionClosed():
                self._driver.end()
            case ev.ProtocolViolation():
                log.info(
                    "mqtt protocol error",
                    extra={"peer": self.wire.peer, "error": event.message[:200], "reason_code": event.reason_code},
                )
                self.counters.protocol_errors += 1
                await self._settle_confirms()
                self.conn.reject(event)
                self._flush()

    # ------------------------------------------------------------------ CONNECT
    async def _connect(self, event: ev.Connect) -> None:
        limits = self.settings.mqtt
        self.version = event.version
        terms = connecting.negotiate(event, limits, _new_client_id)
        if isinstance(terms, connecting.Refused):
            self._refuse(terms.reason_code, terms.text)
            return
        self.client_id = client_id = terms.client_id
        self.expiry_s = terms.expiry_s
        password = terms.password
        will_message = None
        if event.will is not None:
            try:
                will_message = self._will_message(event.will)
            except ConversionError as exc:
                self._refuse(exc.reason_code, str(exc))
                return
        core = self.settings.core
        user, acting_for = event.username, None
        if limits.use_identity_as_username:
            # The certificate names the user; the gateway vouches for it on its own core credentials.
            if self.wire.certificate_name is None:
                log.info("mqtt login refused: no client certificate", extra={"peer": self.wire.peer})
                self._refuse(rc.NOT_AUTHORIZED, "a client certificate is required")
                return
            user, password, acting_for = core.user or None, core.password or None, self.wire.certificate_name
        link = self.core_links.client(
            user=user,
            password=password,
            client_name=f"mqtt {client_id[:64]} {self.wire.peer}",
            client_host=self.wire.host,
            acting_for=acting_for,
        )
        try:
            await link.connect()
        except LinkRequestError as exc:
            if exc.code == ErrorCode.UNAUTHENTICATED:
                log.info("mqtt login refused", extra={"peer": self.wire.peer, "user": acting_for or user})
                self._refuse(rc.BAD_USER_NAME_OR_PASSWORD, "bad user name or password")
            else:
                if core_unavailable_log.first():
                    log.warning("core unavailable", extra={"peer": self.wire.peer, "reason": exc.text})
                self._refuse(rc.SERVER_UNAVAILABLE, "the broker cannot be reached; try again")
            return
        self.link = link
        link.on_closed = self._link_closed
        link.on_settled = self._settled
        link.on_rejected = self._qos0_refused
        self.user = acting_for or event.username or ""
        try:
            # Another user's CONNECT must neither end the owner's connection nor discard the session: the lock
            # is refused while another user's connection holds it, and the record (here, or fetched from
            # another node) is checked before anything of it is discarded or resumed.
            self._lock, lock_was_free = await self.registry.acquire(
                client_id, limits.takeover_timeout_ms / 1000, self.user if limits.bind_sessions_to_users else None
            )
            previous, kept_nowhere = await self._open_session(event.clean_start)
            self._will_key = convert.lock_queue(client_id)  # unique per client id, and short
            # No will to set, and none under the key to cancel or publish: a will waits past its link only for
            # a persistent session (its delay is capped by the session's expiry), whose record no node kept, and
            # only a link whose connection held the lock holds one, which no connection did. One request fewer
            # for most device connects.
            if will_message is not None or not (lock_was_free and kept_nowhere):
                delay_ms = connecting.will_delay_ms(event.will, self.expiry_s) if event.will is not None else 0
                # A will with the retain flag becomes its topic's retained message when published ([MQTT-3.1.2-17]):
                # the core copies it to the retained store as this gateway does a retained PUBLISH.
                retain = None
                if event.will is not None and event.will.retain:
                    retain = (convert.RETAINED_ADDRESS, {messages.TOPIC: event.will.topic})
                # A pending will is left only by a kept session, whose last connection may have gone through
                # another core node: that node's is cancelled (or published, on a clean start) too.
                await self._set_will(
                    link, will_message, delay_ms, event.clean_start, retain, everywhere=not kept_nowhere
                )
            if event.will is not None:
                self._will_delay_s = event.will.properties.will_delay_interval or 0
        except SessionBusyError as exc:
            await self._refuse_connect(rc.SERVER_BUSY, str(exc))
            return
        except SessionUnreachableError:  # logged where it was found: once per attempt
            await self._refuse_connect(
                rc.SERVER_UNAVAILABLE, "this client's session is kept by a node that cannot be reached now; try again"
            )
            return
        except SessionOwnedError as exc:
            log.warning(
                "mqtt session refused: its client id belongs to another user",
                extra={
                    "peer": self.wire.peer,
                    "client_id": client_id[:60],
                    "user": self.user[:60],
                    "owner": exc.owner[:60],
                },
            )
            await self._refuse_connect(rc.NOT_AUTHORIZED, "this client id's session belongs to another user")
            return
        except OSError as exc:
            if core_unavailable_log.first():
                log.warning("core unavailable", extra={"peer": self.wire.peer, "reason": str(exc)})
            await self._refuse_connect(rc.SERVER_UNAVAILABLE, "the broker cannot be reached; try again")
            return
        except LinkRequestError as exc:
            code = rc.NOT_AUTHORIZED if exc.code == ErrorCode.FORBIDDEN else rc.SERVER_UNAVAILABLE
            log.info("mqtt session refused", extra={"peer": self.wire.peer, "reason": exc.text})
            await self._refuse_connect(code, exc.text)
            return
        if self.conn.closed:  # the client closed its side while the core was asked: no one reads a CONNACK
            log.info("mqtt client left before its CONNACK", extra={"peer": self.wire.peer, "client_id": client_id[:64]})
            self._end()
            return
        sent = self.conn.accept(
            time.monotonic(),
            session_present=previous is not None and not event.clean_start,
            assigned_client_id=terms.assigned_client_id,
            server_keep_alive=terms.server_keep_alive,
            properties=terms.properties,
        )
        if not sent:  # the CONNACK is larger than the client's maximum packet size: it cannot be sent
            log.info(
                "mqtt CONNACK over the client's maximum packet size: connection closed",
                extra={"peer": self.wire.peer, "client_id": client_id[:64], "limit": self.conn.client_max_packet_size},
            )
            self._end()
            return
        self._connected = True
        self.wire.logged_in()
        self._keep_alive_deadline()
        self._watch_lock(self._lock)
        await self._resume()

    async def _open_session(self, clean_start: bool) -> tuple[SessionState | None, bool]:
        """Find the earlier session (the record of a persistent one), end it if ``clean_start``, and set up
        this one. Returns the earlier session's record (None when there was none) and whether it is known that
        no node kept one, not even an empty record."""
        registry, client_id = self.registry, self.client_id
        # A clean start also waits for a record kept by another node of the cluster: the session it discards
        # has its queues there (MQTT 3.1.2.4), and with sessions bound to users its owner must be known first.
        bound = self.settings.mqtt.bind_sessions_to_users
        if clean_start and not self.persistent:
            # A session that ends with this connection, and no node keeps an earlier one: nothing to make or end
            # (a durable session queue made and deleted again cost every such connect two requests and two
            # journal records).
            found = await registry.look_up_session(client_id)
            if not (found.here or found.elsewhere):
                return None, True
        previous = await registry.open_session(client_id)
        if previous is not None and bound:
            try:
                self._check_owner(previous.user)
            except SessionOwnedError:
                await registry.let_go(client_id)  # a record fetched from another node is not ours to hold
                raise
        if previous is not None and clean_start:
            await self._discard(previous)
        elif previous is not None:
            self.state = previous  # resumed, even by a connection whose session ends with it
        if not self.persistent:
            await registry.drop_session(client_id, everywhere=self._holds_lock())  # any earlier session goes
            return previous, False
        self.state.user = self.user
        self._holder = await registry.hold_session(client_id)
        await registry.set_expiry(  # held: it counts from when this connection ends (see open_session)
            convert.session_queue(client_id),
            convert.session_queue(client_id),
            RoutingType.ANYCAST,
            self.expiry_s * 1000,
        )
        await registry.save(client_id, self.state)
        return previous, False

    async def _refuse_connect(self, reason_code: int, text: str) -> None:
        """Refuse a CONNECT once the session's lock, if taken, is released: a client that reconnects the moment
        it has the answer (the owner, after another user was refused) must not find this connection holding it."""
        lock, self._lock = self._lock, None
        if lock is not None:
            with contextlib.suppress(OSError):
                await self.registry.release(self.client_id, lock)
        self._refuse(reason_code, text)

    def _check_owner(self, owner: str | None) -> None:
        """Refuse the session of another user (a record that names nobody predates the binding)."""
        if owner is not None and owner != self.user:
            raise SessionOwnedError(owner)

    async def _discard(self, previous: SessionState) -> None:
        """End an earlier session: its subscription queues go, on every node that has one (shared ones belong
        to their group)."""
        assert self.link is not None
        for text in previous.subscriptions:
            with contextlib.suppress(LinkRequestError, ConversionError):
                group, topic_filter = convert.parse_subscription(text)
                if group is None:
                    queue = convert.subscription_queue(self.client_id, topic_filter)
                    await self.link.delete_queue(queue, everywhere=self._holds_lock())
        if previous.outbox:
            await self.registry.drop_outbox(self.client_id, everywhere=self._holds_lock())

    async def _resume(self) -> None:
        """Resume a session: PUBREL for what the client received but we did not see completed, then its outbox
        and subscriptions (their queues return unacknowledged messages first, with DUP set). Packets that follow
        the CONNECT wait meanwhile, so a SUBSCRIBE cannot race its own resumption."""
        for packet_id in sorted(self.state.released_out):
            self.conn.pubrel(packet_id)
        self._flush()
        try:
            if self.state.outbox:
                await self._open_outbox(resumed=True)
            for text, options in list(self.state.subscriptions.items()):
                if self._closed:
                    return
                await self._open_sub(text, options, resumed=True)
        except (LinkRequestError, ConversionError) as exc:
            log.warning("session resume failed", extra={"peer": self.wire.peer, "reason": str(exc)[:200]})
            self._end(rc.UNSPECIFIED_ERROR)

    async def _set_will(
        self,
        link: LinkClient,
        message: WireMessage | None,
        delay_ms: int,
        publish_pending: bool,
        retain: tuple[str, dict[str, Any]] | None,
        *,
        everywhere: bool,
    ) -> None:
        """Set the connection's will. Its retained copy is written with the rights of the gateway's user, whose
        shared link carries the session; a session on a link of its own (the shared links refused) has only
        its user's, who has none on the retained store: its will is then set without it, published unretained,
        as before the core could retain one."""
        try:
            await link.set_will(
                self._will_key,
                message,
                delay_ms=delay_ms,
                publish_pending=publish_pending,
                retain=retain,
                everywhere=everywhere,
            )
        except LinkRequestError as exc:
            if retain is None or exc.code != ErrorCode.FORBIDDEN:
                raise
            log.warning("mqtt will set without its retained copy", extra={"peer": self.wire.peer, "reason": exc.text})
            await link.set_will(
                self._will_key, message, delay_ms=delay_ms, publish_pending=publish_pending, everywhere=everywhere
            )

    def _will_message(self, will: Will) -> WireMessage:
        address = self._address(will.topic)
        now_ms = int(time.time() * 1000)
        message = messages.to_message(
            address, will.payload, will.qos, will.properties, self.client_id, now_ms, retain=will.retain
        )
        if message[M_EXPIRATION]:
            # The will's message expiry interval is its lifetime once published (5.0, 3.1.3.2.4): the core moves
            # the expiration of a will with a timestamp to as far from its publication as it is from the timestamp.
            message[M_TIMESTAMP] = now_ms
        return message

    def _holds_lock(self) -> bool:
        """Whether this connection may delete the session's queues on other nodes too (see ``Registry.holds``)."""
        return self._lock is not None and self.registry.holds(self._lock)

    def _watch_lock(self, lock: Consumer) -> None:
        """End this connection when another one takes the session: on this node the newcomer deletes the lock
        queue (the core closes our consumer); from another node of the cluster it sends a takeover notice. The
        lock consumer calls back when either happens: no task waits on it."""
        lock.on_wake = self._lock_woken  # a bound method: a closure would cost 288 bytes per connection, this 64
        self._lock_woken()

    def _lock_woken(self) -> None:
        lock = self._lock
        if lock is None:
            return
        try:
            self._lock_notices(lock)
        except Exception:  # as a task's failure would: this connection ends, the gateway goes on
            log.exception("mqtt session lock failed", extra={"peer": self.wire.peer})
            self._end(rc.IMPLEMENTATION_SPECIFIC_ERROR)

    def _lock_notices(self, lock: Consumer) -> None:
        notified = False
        if not self._closed:
            notices = lock.take_batch()
            notified = bool(notices) and self.registry.taken_over(lock, notices)
            if not notified and lock.closed is None:
                return  # nothing, or our own notice come back
        lock.on_wake = None
        if self._closed:
            return
        if notified or (lock.closed is not None and lock.closed.code == ErrorCode.NOT_FOUND):
            log.info("mqtt session taken over", extra={"peer": self.wire.peer, "client_id": self.client_id[:60]})
            self.counters.takeovers += 1
            if not notified:
                self._lock = None  # the queue is the new owner's now (a notified one is ours to let go)
            self._end(rc.SESSION_TAKEN_OVER)
        else:
            self._end(rc.SERVER_UNAVAILABLE)

    def _refuse(self, reason_code: int, text: str) -> None:
        self.counters.refused += 1
        if not self.conn.closed:  # else the client left while its CONNECT was checked: no one reads the answer
            props = Properties(reason_string=text[:200]) if self.version == V5 else NO_PROPERTIES
            self.conn.refuse(reason_code, props)
            self._flush()
        self._driver.end()

    # ------------------------------------------------------------------ messages from the client
    def _address(self, topic: str) -> str:
        address = self._addresses.get(topic)
        if address is None:
            address = convert.topic_to_address(topic)
            if len(self._addresses) >= _CACHE_LIMIT:
                self._addresses.clear()
            self._addresses[topic] = address
        return address

    def _message(self, event: ev.Publish) -> WireMessage | None:
        """The core message of a PUBLISH; None (and the connection ends) when the payload is not what its
        format indicator says."""
        if event.properties.payload_format_indicator == 1:
            try:
                event.payload.decode("utf-8")
            except UnicodeDecodeError:
                self._violation(rc.PAYLOAD_FORMAT_INVALID, "the payload is not UTF-8 as its format says")
                return None
        return messages.to_message(
            self._address(event.topic),
            event.payload,
            event.qos,
            event.properties,
            self.client_id,
            int(time.time() * 1000),
            retain=event.retain,
        )

    async def _publish(self, event: ev.Publish) -> None:
        """The PUBLISH packets ``_handle_now`` leaves: QoS 2, retained, or waiting for the core's credit."""
        link = self.link
        assert link is not None
        if event.duplicate:
            return
        message = self._message(event)
        if message is None:
            return
        packet_id = event.packet_id or 0
        if event.qos == 2 and (self.persistent or self.state.released_in):
            # Exactly once across reconnects: the record keeps the message's dedup id until the PUBREL, and
            # a PUBLISH sent again (after a lost PUBREC) is published again under it: the core drops it.
            dedup = self.state.released_in.get(packet_id)
            if dedup is None:
                # The id names the node the first copy goes to: a node drops the duplicates it has seen, so the
                # PUBLISH sent again through a link on another node (the session moved) is sent on there.
                dedup = f"mqtt:{self.client_id}:{uuid.uuid4().hex}@{link.node_id}"
                self.state.released_in[packet_id] = dedup
                if self.persistent:  # a session that ends with this connection keeps no record (saving made one)
                    await self.registry.save(self.client_id, self.state)
            else:
                _, at, home = dedup.rpartition("@")
                if at and home and home != link.node_id:
                    message[M_PROPS] = {**message[M_PROPS], HOME_PROPERTY: home}
            message[M_DEDUP] = dedup
        self.counters.messages_published += 1
        confirm = Pending(await link.send(message), packet_id, event.qos, event.topic)
        if event.retain:
            retained = self._loop.create_task(
                self._retain_once_accepted(confirm.outcome, self._retaining, event.topic, message)
            )
            retained.add_done_callback(self._retained_settled)
            self._retaining = confirm.retained = retained
        self._answers.waits(confirm)

    async def _retain_once_accepted(
        self,
        accepted: asyncio.Future[None],
        previous: asyncio.Future[None] | None,
        topic: str,
        message: WireMessage,
    ) -> None:
        """Make ``message`` its topic's retained message once the core has accepted it as this user's publish,
        after the retained PUBLISH before it. The store is written on the gateway's own link, which may do what
        the user may not: a publish the core refused (no send right, a full address) must retain nothing."""
        if previous is not None:
            with contextlib.suppress(LinkRequestError):  # refused or not, it is done: the order is kept
                await previous
        try:
            await accepted
        except LinkRequestError:  # refused (its answer says so) or lost with the link: nothing to retain
            return
        await self.registry.retain(topic, message)

    def _retained_settled(self, future: asyncio.Future[None]) -> None:
        _retrieve(future)  # its outcome is read by _answer_confirmed, unless the session ended first
        self._settled()

    def _settled(self) -> None:
        self._answer_confirmed()
        self._flush()

    def _answer_confirmed(self) -> None:
        """PUBACK or PUBREC, in order, for the messages the core has answered."""
        conn = self.conn
        for answer in self._answers.answerable(v5=self.version == V5):
            if conn.closed:
                continue
            if type(answer) is Refusal:
                self._refused(answer)
            elif answer.qos == 1:
                conn.puback(answer.packet_id)
            elif answer.qos == 2:
                conn.pubrec(answer.packet_id)

    def _qos0_refused(self, _seq: int, code: str, text: str) -> None:
        """The core refused a QoS 0 message sent without a confirm future: there is no answer to give."""
        log.info("mqtt publish refused", extra={"peer": self.wire.peer, "qos": 0, "code": code, "reason": text[:200]})

    def _refused(self, refusal: Refusal) -> None:
        log.info(
            "mqtt publish refused",
            extra={"peer": self.wire.peer, "topic": refusal.topic[:100], "reason": refusal.text[:200]},
        )
        if refusal.close:
            self._end(rc.UNSPECIFIED_ERROR)
            return
        props = Properties(reason_string=refusal.text[:200])
        if refusal.qos == 1:
            self.conn.puback(refusal.packet_id, refusal.reason_code, props)
        elif refusal.qos == 2:
            self.state.released_in.pop(refusal.packet_id, None)
            self.conn.pubrec(refusal.packet_id, refusal.reason_code, props)

    async def _settle_confirms(self) -> None:
        pending = self._answers.outstanding()
        if pending:
            await asyncio.wait(pending)
        self._answer_confirmed()

    async def _released(self, event: ev.PubrelReceived) -> None:
        """The client's PUBREL: the packet id is free once the record says so."""
        known = event.known
        if self.state.released_in.pop(event.packet_id, None) is not None:
            known = True
            if self.persistent:  # as in _publish: saving would bring back a session that ends with this connection
                await self.registry.save(self.client_id, self.state)
        self.conn.pubcomp(event.packet_id, 0 if known else rc.PACKET_IDENTIFIER_NOT_FOUND)

    # ------------------------------------------------------------------ SUBSCRIBE / UNSUBSCRIBE
    async def _subscribe(self, packet: ev.Subscribe) -> None:
        ids = packet.properties.subscription_identifiers
        subscription_id = ids[0] if ids else None
        codes: list[int] = []
        retained: list[tuple[Sub, bool]] = []
        most = self.settings.mqtt.max_subscriptions
        for request in packet.subscriptions:
            if request.topic_filter not in self.subs and len(self.subs) >= most:
                log.info(
                    "mqtt subscribe refused",
                    extra={
                        "peer": self.wire.peer,
                        "filter": request.topic_filter[:100],
                        "reason": f"the connection has its maximum of {most} subscriptions (mqtt.max_subscriptions)",
                    },
                )
                codes.append(rc.QUOTA_EXCEEDED)
                continue
            try:
                sub, new = await self._add_sub(request, subscription_id)
            except ConversionError as exc:
                if exc.reason_code == rc.PROTOCOL_ERROR:
                    raise
                codes.append(exc.reason_code)
                continue
            except LinkRequestError as exc:
                log.info(
                    "mqtt subscribe refused",
                    extra={"peer": self.wire.peer, "filter": request.topic_filter[:100], "reason": exc.text},
                )
                codes.append(rc.NOT_AUTHORIZED if exc.code == ErrorCode.FORBIDDEN else rc.UNSPECIFIED_ERROR)
                continue
            codes.append(request.qos)
            if subscribing.sends_retained(request.retain_handling, shared=sub.shared, new=new):
                retained.append((sub, new))
        if self.persistent:
            await self.registry.save(self.client_id, self.state)
        self.conn.suback(packet.packet_id, tuple(codes))
        self._flush()
        if retained:  # what the client can take now comes before its next packet is handled
            await self._send_retained_of([sub for sub, _ in retained])

    async def _add_sub(self, request: Subscription, subscription_id: int | None) -> tuple[Sub, bool]:
        subscribing.check_options(request.topic_filter, no_local=request.no_local, v5=self.version == V5)
        options = StoredSubscription(request.qos, request.no_local, request.retain_as_published, subscription_id)
        existing = self.subs.get(request.topic_filter)
        acknowledged = existing is not None and existing.consumer is not None and not existing.auto_ack
        if existing is not None and subscribing.keeps_its_queue(acknowledged=acknowledged, qos=options.qos):
            existing.options = options
            if options.qos:
                self._not_solo(existing)
            self.state.subscriptions[request.topic_filter] = options
            return existing, False
        if existing is not None:  # QoS 0 asking for QoS 1 or 2 now: a queue of its own, acknowledged
            sub = await self._open_sub(request.topic_filter, options)  # first: refused, the member stays
            await self._close_sub(existing)
            if existing.queue != sub.queue:  # a solo QoS 0 queue would fill with no consumer until the end
                await self._drop_sub_queue(existing)
            self.state.subscriptions[request.topic_filter] = options
            return sub, False
        sub = await self._open_sub(request.topic_filter, options)
        self.state.subscriptions[request.topic_filter] = options
        return sub, True

    async def _open_sub(self, text: str, options: StoredSubscription, *, resumed: bool = False) -> Sub:
        """Create (or find) the subscription's queue and consume from it (a ``resumed`` subscription's queue
        is the durable one of the earlier session, even when this session ends with its connection)."""
        link = self.link
        assert link is not None
        planned = subscribing.plan(
            text,
            options.qos,
            v5=self.version == V5,
            client_id=self.client_id,
            persistent=self.persistent,
            resumed=resumed,
        )
        topic_filter, pattern, queue, fannable = planned.topic_filter, planned.pattern, planned.queue, planned.fannable
        expiry_ms = self.expiry_s * 1000
        if fannable and self.feeds.fans_out(link.user, topic_filter):
            return await self._join_feed(self.feeds, text, topic_filter, options)
        if planned.kind is subscribing.QueueKind.SHARED:
            expiry_ms = await self._shared_expiry_ms(link, queue, pattern, expiry_ms)
            spec = queue_spec(queue, pattern, routing_type=RoutingType.MULTICAST, durable=True, expires_ms=expiry_ms)
        elif planned.kind is subscribing.QueueKind.DURABLE:
            # A resumed queue gets this session's expiry once it is consumed from: set now, the expiry would
            # count the time the queue waited for the client, and a shorter one (0: the session ends with this
            # connection) could delete it, with its messages, before the consumer reaches it.
            spec = queue_spec(
                queue,
                pattern,
                routing_type=RoutingType.MULTICAST,
                durable=True,
                expires_ms=None if resumed else expiry_ms,
            )
        else:  # this connection's own: an earlier connection of the client may still be dropping its own
            # Numbered too: a queue of this filter dropped in the background must not take a new one with it.
            self._queues += 1
            queue = f"{queue}.{self.id}.{self._queues}"
            spec = queue_spec(queue, pattern, routing_type=RoutingType.MULTICAST, durable=False, temporary=True)
        window = subscribing.window(options.qos, self.settings.mqtt, self.conn.client_receive_maximum)
        # A queue that expires at once (expiry 0) may be gone before this consumer reaches it (a node older than
        # link protocol version 4 makes it and subscribes in two requests): then the core makes it again from
        # ``address``, ``routing_type`` and ``durable``, as the subscription's queue, not as an anycast queue of
        # its name. QoS 0 messages of a queue that goes with this connection are done once sent (``fannable``):
        # acknowledging them would keep nothing safe, and the pump still takes no more than the client reads.
        terms: dict[str, Any] = {
            "credit": window,
            "credit_on_settle": not fannable,
            "auto_ack": fannable,
            "credit_bytes": self.settings.core.consumer_window_bytes,
            "address": pattern,
            "routing_type": int(RoutingType.MULTICAST),
            "durable": planned.durable,
        }
        if planned.kind is subscribing.QueueKind.DURABLE and not resumed:
            _, fresh = await link.subscribe_if_made(spec, **terms)
            if fresh is None:
                # No session record lists it (a gateway died between making it and saving the record), so a
                # clean start did not end it: a new subscription starts empty, not with what it gathered since.
                log.info(
                    "mqtt subscription queue left by an earlier session dropped",
                    extra={"peer": self.wire.peer, "client_id": self.client_id[:60], "queue": queue[:100]},
                )
                await link.delete_queue(queue, everywhere=self._holds_lock())
                _, fresh = await link.make_and_subscribe(spec, **terms)
            consumer = fresh
        else:
            _, consumer = await link.make_and_subscribe(spec, **terms)
        if resumed:
            await link.create_queue(queue, pattern, routing_type=RoutingType.MULTICAST, expires_ms=expiry_ms)
        sub = Sub(
            text,
            topic_filter,
            queue,
            planned.group is not None,
            options,
            consumer,
            dollar_safe=topic_filter[:1] in ("+", "#"),
            session=self,
            solo=fannable,
            auto_ack=fannable,
        )
        if fannable:
            self.feeds.solo_opened(link.user, topic_filter)
        self.subs[text] = sub
        consumer.on_wake = sub.woken
        self.pump(sub)  # what arrived with the subscribe's answer
        return sub

    async def _shared_expiry_ms(self, link: LinkClient, queue: str, pattern: str, expiry_ms: int) -> int:
        """The expiry this member gives its shared subscription's queue (see ``subscribing.longer_expiry``)."""
        try:
            found = await link.create_queue(queue, pattern, routing_type=RoutingType.MULTICAST, passive=True)
        except LinkRequestError:
            return expiry_ms
        return subscribing.longer_expiry(found.get("expires_ms"), expiry_ms)

    def _move_to_feed(self, sub: Sub, feed: Feed) -> None:
        """A solo subscription of the filter that now has a feed becomes its member; its own queue goes. It moves
        only once its own queue gave it everything the feed handed out before (``Feeds.feed_for``): what its
        queue still held comes through the feed, and no message is missed (before, a solo subscription that
        moved while the feed was ahead of it lost the messages between the two, a whole batch or more)."""
        consumer, queue = sub.consumer, sub.queue
        assert consumer is not None
        consumer.on_wake = None
        self._not_solo(sub)
        sub.consumer, sub.queue, sub.session = None, feed.queue, self
        self.feeds.adopt(sub, feed)
        self._in_background(self._drop_queue(consumer, queue), finished_at_end=True)

    def _in_background(self, work: Coroutine[Any, Any, None], *, finished_at_end: bool = False) -> None:
        """A task of this session's, kept until done. The clean-up waits for those ``finished_at_end`` (queues
        given up for a feed) and cancels the others: they wait for the client (to read what was written, which
        a client that went silent never does) or for answers nobody needs once the session ends."""
        if self._background is None:
            self._background = {}
        task = self._loop.create_task(work)
        self._background[task] = finished_at_end
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        if self._background is not None:
            self._background.pop(task, None)

    async def _drop_queue(self, consumer: Consumer, queue: str) -> None:
        with contextlib.suppress(LinkRequestError):
            await consumer.close()
        with contextlib.suppress(LinkRequestError):
            if self.link is not None:
                await self.link.delete_queue(queue)

    def _not_solo(self, sub: Sub) -> None:
        """``sub`` no longer counts towards making a feed of its filter."""
        if sub.solo and self.link is not None:
            sub.solo = False
            self.feeds.solo_closed(self.link.user, sub.topic_filter)

    async def _join_feed(self, feeds: Feeds, text: str, topic_filter: str, options: StoredSubscription) -> Sub:
        """A QoS 0 subscription served by the gateway's feed of its filter for this client's user."""
        link = self.link
        assert link is not None
        sub = Sub(
            text,
            topic_filter,
            "",
            shared=False,
            options=options,
            consumer=None,
            dollar_safe=topic_filter[:1] in ("+", "#"),
            session=self,
        )
        # Listed first: should this connection end while it joins (the join goes on), the shutdown leaves.
        self.subs[text] = sub
        try:
            sub.queue = (await feeds.join(sub, link.user, link.password, topic_filter)).queue
        except Exception:  # refused: it never joined
            if self.subs.get(text) is sub:
                del self.subs[text]
            raise
        return sub

    def fan_out(self, sub: Sub, batch: Encodings) -> int:
        """Write a feed's batch to the client as ``sub`` wants it (see ``feeds.Subscriber``)."""
        conn = self.conn
        if sub.closed or self._closed or conn.closed:
            return 0
        limits = self.settings.mqtt
        if self.wire.buffered() > limits.qos0_max_buffered_bytes:
            if not self._dropping:
                self._dropping = True
                log.info(
                    "mqtt client falling behind: QoS 0 messages skipped",
                    extra={"peer": self.wire.peer, "client_id": self.client_id[:60]},
                )
            self.counters.qos0_dropped += len(batch.messages)
            return 0
        self._dropping = False
        options = sub.options
        encoded = batch.packets(self.version, options.retain_as_published, options.subscription_id)
        data, count = encoded.joined, encoded.count
        limit = conn.client_max_packet_size
        had_upto = sub.had_upto
        if had_upto and (batch.numbering != sub.had_on or min(m[M_ID] for m in batch.messages) > had_upto):
            had_upto = sub.had_upto = 0  # past what its own queue gave it (or numbered otherwise)
        if options.no_local or encoded.largest > limit or had_upto:
            client_id = self.client_id
            kept = []
            for part, message in zip(encoded.parts, batch.messages, strict=True):
                if (
                    not part
                    or message[M_ID] <= had_upto
                    or (options.no_local and message[M_PROPS].get(messages.CLIENT) == client_id)
                ):
                    continue
                if len(part) > limit:
                    conn.discarded += 1  # as if sent ([MQTT-3.1.2-25])
                    continue
                kept.append(part)
            data, count = b"".join(kept), len(kept)
        if data:
            try:
                conn.publish_encoded(data)
            except LocalProtocolError:  # closed meanwhile
                return 0
            self._flush()
        return count

    def feed_lost(self, sub: Sub) -> None:
        if not self._closed and not sub.closed:
            log.info("fan-out subscription ended", extra={"peer": self.wire.peer, "filter": sub.topic_filter[:100]})
            self._end(rc.SERVER_UNAVAILABLE)

    async def _unsubscribe(self, packet: ev.Unsubscribe) -> None:
        v5 = self.version == V5
        invalid = set()
        for text in packet.topic_filters:
            try:
                convert.parse_subscription(text, shared=v5)
            except ConversionError as exc:
                if not v5:
                    # 3.1.1 has no UNSUBACK code for it: a filter that breaks the wildcard rules ([MQTT-4.7.1-2],
                    # [MQTT-4.7.1-3]) or is empty ([MQTT-4.7.3-1]) is a protocol violation, and the connection
                    # closes ([MQTT-4.8.0-1]), before any of the packet's filters is unsubscribed.
                    raise ConversionError(f"UNSUBSCRIBE: {exc}", rc.PROTOCOL_ERROR) from exc
                invalid.add(text)
        codes = []
        for text in packet.topic_filters:
            if text in invalid:  # 5.0: 0x8F Topic Filter invalid, rather than 0x11 No subscription existed
                codes.append(rc.TOPIC_FILTER_INVALID)
                continue
            sub = self.subs.pop(text, None)
            self.state.subscriptions.pop(text, None)
            if sub is None:
                codes.append(rc.NO_SUBSCRIPTION_EXISTED)
                continue
            await self._close_sub(sub)
            await self._drop_sub_queue(sub)
            codes.append(0)
        if self.persistent:
            await self.registry.save(self.client_id, self.state)
        self.conn.unsuback(packet.packet_id, tuple(codes))

    async def _drop_sub_queue(self, sub: Sub) -> None:
        """Delete the queue of a subscription that ended. A shared queue belongs to its group (it expires when the
        last member is gone), a feed's queue to the feed."""
        if not sub.shared and sub.consumer is not None:
            with contextlib.suppress(LinkRequestError):
                assert self.link is not None
                await self.link.delete_queue(sub.queue, everywhere=self._holds_lock())

    async def _close_sub(self, sub: Sub) -> None:
        sub.closed = True
        if sub.consumer is not None:
            sub.consumer.on_wake = None
        parked = self._outbound.forget_parked(lambda out: out.sub is sub)
        self._wake_retained()
        self._not_solo(sub)
        if sub.consumer is None:
            await self.feeds.leave(sub)
            return
        with contextlib.suppress(LinkRequestError):
            sub.consumer.release_unsent(out.message[M_ID] for out in parked if not out.retained)
            await sub.consumer.close()

    async def _send_retained_of(self, subs: list[Sub]) -> None:
        """Send the retained messages of new subscriptions after their SUBACK: here, in the worker, until they
        are all sent or the client must read first (``#`` may match the whole store); the rest then goes in a
        task of the session's, while the worker handles the client's PUBACKs, which it may need to go on. Those
        of a later SUBSCRIBE follow in that task. (A task for every SUBSCRIBE was a fifth of the tasks a device's
        connect, subscribe and disconnect made.)"""
        if self._sending_retained is not None:  # a task is sending earlier ones: these come after them
            self._sending_retained += subs
            return
        self._sending_retained = subs
        await self._send_all_retained(None)

    async def _send_all_retained(self, resumed: tuple[Sub, RetainedBatches] | None) -> None:
        """Send the retained messages of the subscriptions in ``_sending_retained``, after the rest of
        ``resumed``'s (a subscription and what is left of its store's batches) when a task goes on where the
        worker left off. The worker (``resumed`` None) hands over to such a task where it would wait."""
        pending = self._sending_retained
        in_worker = resumed is None
        handed_over = False
        try:
            while pending is not None and not self._closed:
                # The worker wrote a batch and left the wait for the client to this task.
                must_wait = resumed is not None
                if resumed is not None:
                    sub, batches = resumed
                    resumed = None
                elif pending:
                    sub = pending.pop(0)
                    if sub.closed:
                        continue
                    batches = self.registry.retained(sub.topic_filter)
                else:
                    break
                try:
                    if must_wait and not await self._room_for_more():
                        return
                    if await self._send_retained(sub, batches, in_worker=in_worker):
                        self._in_background(self._send_all_retained((sub, batches)))
                        handed_over = True
                        return
                except LinkRequestError as exc:
                    log.info(
                        "mqtt retained messages not sent",
                        extra={"peer": self.wire.peer, "filter": sub.topic_filter[:100], "reason": exc.text},
                    )
                finally:
                    if not handed_over:
                        await batches.aclose()
        except Exception:  # as a task's failure would: this connection ends, the gateway goes on
            log.exception("mqtt retained messages failed", extra={"peer": self.wire.peer})
            self._end(rc.IMPLEMENTATION_SPECIFIC_ERROR)
        finally:
            if not handed_over:
                self._sending_retained = None

    async def _send_retained(self, sub: Sub, batches: RetainedBatches, *, in_worker: bool) -> bool:
        """The retained messages of a new subscription, a batch of the store at a time: the next is read once the
        client has read what was written and has room for more. True when ``in_worker`` and it must wait for
        that: a task is to go on with ``batches``."""
        async for found in batches:
            kept: list[tuple[WireMessage, int]] = []
            for message in found:
                if self._closed or sub.closed:
                    return False
                qos = min(sub.options.qos, messages.published_qos(message))
                if subscribing.keeps_retained(qos, persistent=self.persistent):
                    kept.append((message, qos))
                else:
                    self._deliver(_Outgoing(sub, message, qos, retained=True))
            self._flush()
            if kept:
                await self._to_outbox(sub, kept)
            if in_worker and self._must_wait_for_client():
                return True
            if not await self._room_for_more():
                return False
        return False

    def _must_wait_for_client(self) -> bool:
        return not self.wire.writable() or bool(self._outbound.parked)

    async def _room_for_more(self) -> bool:
        """Wait until the client has read what was written and no message waits for its receive maximum;
        False once the session has ended."""
        while not self._closed:
            if not self.wire.writable():
                await self.wire.drained()
            elif self._outbound.parked:
                self._unparked = unparked = self._loop.create_future()
                try:
                    await unparked
                finally:
                    self._unparked = None
            else:
                return True
        return False

    async def _to_outbox(self, sub: Sub, found: list[tuple[WireMessage, int]]) -> None:
        """Send retained messages at QoS 1 or 2 through the session's outbox: the core keeps each until the client
        acknowledges it, and delivers it again to the session's next connection (through any gateway, after a
        kill -9 too). The record says there is an outbox before anything is put in it."""
        if not self.state.outbox:
            self.state.outbox = True
            await self.registry.save(self.client_id, self.state)
        outbox = await self._open_outbox(resumed=False)
        subscription_id = sub.options.subscription_id
        copies = [messages.retained_delivery(message, outbox.queue, qos, subscription_id) for message, qos in found]
        await self.registry.to_outbox(copies, self._outbox_refused)

    def _outbox_refused(self, future: asyncio.Future[None]) -> None:
        if future.cancelled() or future.exception() is None:
            return
        log.warning(
            "retained message not put in the session's outbox",
            extra={"client_id": self.client_id[:60], "reason": str(future.exception())[:200]},
        )

    async def _open_outbox(self, *, resumed: bool) -> Sub:
        """Consume the session's outbox (made now unless ``resumed``: it is then the earlier connection's, which
        takes this session's expiry once consumed, as a resumed subscription's queue does)."""
        if self._outbox is not None:
            return self._outbox
        name = convert.outbox_queue(self.client_id)
        expiry_ms = self.expiry_s * 1000
        window = subscribing.window(2, self.settings.mqtt, self.conn.client_receive_maximum)
        consumer = await self.registry.open_outbox(
            self.client_id, None if resumed else expiry_ms, window, self.settings.core.consumer_window_bytes
        )
        sub = Sub(
            OUTBOX, "", name, shared=False, options=_OUTBOX_OPTIONS, consumer=consumer, dollar_safe=False, session=self
        )
        self._outbox = sub
        if resumed:
            await self.registry.set_expiry(name, name, RoutingType.ANYCAST, expiry_ms)
        consumer.on_wake = sub.woken
        self.pump(sub)  # what arrived with the subscribe's answer
        return sub

    # ------------------------------------------------------------------ deliveries
    def pump(self, sub: Sub) -> None:
        """Write what ``sub``'s consumer holds to the client. The consumer calls it when deliveries arrive (no
        task per subscription); while the client does not read what was written, the deliveries wait in the
        consumer, whose credit then stops the core, and a task waits for the client to drain."""
        consumer = sub.consumer
        if self._closed or self._gone or sub.closed or sub.draining or consumer is None:
            return
        if not self.wire.writable():
            sub.draining = True
            self._in_background(self._pump_when_drained(sub))
            return
        try:
            self._write_batch(sub, consumer)
        except LinkRequestError as exc:
            self._subscription_ended(exc)
        except LocalProtocolError:
            if not self.conn.closed:  # the connection closing mid-batch is no error
                log.exception("mqtt subscription failed", extra={"peer": self.wire.peer})
                self._end(rc.IMPLEMENTATION_SPECIFIC_ERROR)
        except Exception:  # as a task's failure would: this connection ends, the gateway goes on
            log.exception("mqtt subscription failed", extra={"peer": self.wire.peer})
            self._end(rc.IMPLEMENTATION_SPECIFIC_ERROR)

    def _subscription_ended(self, error: LinkRequestError) -> None:
        log.info("subscription ended by the core", extra={"peer": self.wire.peer, "reason": error.text})
        self._end(rc.UNSPECIFIED_ERROR)

    async def _pump_when_drained(self, sub: Sub) -> None:
        await self.wire.drained()
        sub.draining = False
        self.pump(sub)

    def _write_batch(self, sub: Sub, consumer: Consumer) -> None:
        batch = consumer.take_batch()
        if not batch:
            if consumer.closed is not None:
                self._subscription_ended(consumer.closed)
            return
        if self.conn.closed:
            return
        now_ms = int(time.time() * 1000)
        done = []
        # Per batch, not per message: whether any message could be unwanted, and the QoS cap.
        filtering = sub.dollar_safe or sub.options.no_local
        sub_qos = sub.options.qos
        for count, message in batch:
            if (filtering or message[M_EXPIRATION]) and not self._wanted(sub, message, now_ms):
                done.append(message[M_ID])
                continue
            qos = min(messages.published_qos(message), sub_qos) if sub_qos else 0
            if qos == 0:
                if self._write_or_refuse(sub, message, 0, now_ms) is not None:
                    done.append(message[M_ID])
            else:
                self._deliver(_Outgoing(sub, message, qos, dup=count > 1))
        if done and not sub.auto_ack:
            consumer.ack_ids(done)  # QoS 0: written (or skipped) is done
        self.counters.messages_delivered += len(batch)
        self._flush()
        link = self.link
        if sub.solo and link is not None:
            numbered, top = numbering(link), max(message[M_ID] for _, message in batch)
            if numbered != sub.had_on:  # the first batch, or the link failed over: numbered anew
                sub.had_upto, sub.had_on = top, numbered
            else:
                sub.had_upto = max(sub.had_upto, top)
            feed = self.feeds.feed_for(link.user, sub.topic_filter, numbered, sub.had_upto)
            if feed is not None:
                self._move_to_feed(sub, feed)

    def _wanted(self, sub: Sub, message: WireMessage, now_ms: int) -> bool:
        """Whether a message of ``sub``'s queue goes to the client: not an expired one, not a ``$`` topic for a
        filter starting with a wildcard, not our own for no-local."""
        expiration = message[M_EXPIRATION]
        if expiration and expiration <= now_ms:
            return False
        if sub.dollar_safe and message[M_ADDRESS][:1] == "$":
            return False
        return not (sub.options.no_local and message[M_PROPS].get(messages.CLIENT) == self.client_id)

    def _deliver(self, out: _Outgoing) -> None:
        """Send a QoS 1/2 message, or park it while the client's window is full or its packet id is taken."""
        if self._outbound.must_wait() or not self._try_send(out):
            self._outbound.parked.append(out)

    def _try_send(self, out: _Outgoing) -> bool:
        message = out.message
        if out.retained:
            packet_id = None
        else:
            message_id = message[M_ID]
            sub = out.sub
            assert sub is not None
            if self._outbound.client_has(message_id, sub.text, self.state.released_out):
                assert sub.consumer is not None
                sub.consumer.ack_ids([message_id])
                return True
            packet_id = outbound.packet_id(message_id)
            if self.conn.in_flight(packet_id):
                return False
        if self.conn.send_window <= 0:
            return False
        now_ms = int(time.time() * 1000) if self.version == V5 else 0  # for a 5.0 message expiry interval
        sent = self._write_or_refuse(out.sub, message, out.qos, now_ms, packet_id, dup=out.dup, retained=out.retained)
        if sent is None:
            return False
        if sent < 0:
            return True  # dead-lettered
        if sent == 0:  # too large for the client: dropped as if sent ([MQTT-3.1.2-25])
            self._done(out)
        else:
            self._outbound.sent(sent, out)
        return True

    def _write_or_refuse(
        self,
        sub: Sub | None,
        message: WireMessage,
        qos: int,
        now_ms: int,
        packet_id: int | None = None,
        *,
        dup: bool = False,
        retained: bool = False,
    ) -> int | None:
        """``_write_publish``, or -1 for a message MQTT cannot carry (an address that is no topic name, a
        property no MQTT string can hold): it goes to the dead-letter address instead of stopping the
        subscription (None when the connection closed meanwhile: nothing is written)."""
        try:
            return self._write_publish(sub, message, qos, now_ms, packet_id, dup=dup, retained=retained)
        except (ConversionError, LocalProtocolError) as exc:
            if self.conn.closed:
                return None
            log.warning(
                "message not deliverable over MQTT",
                extra={"peer": self.wire.peer, "address": message[M_ADDRESS][:100], "reason": str(exc)[:200]},
            )
            if sub is not None and sub.consumer is not None and not sub.auto_ack and not retained:
                sub.consumer.nack_ids([message[M_ID]], NackMode.REJECT)
            return -1

    def _write_publish(
        self,
        sub: Sub | None,
        message: WireMessage,
        qos: int,
        now_ms: int,
        packet_id: int | None = None,
        *,
        dup: bool = False,
        retained: bool = False,
    ) -> int | None:
        topic, encoded = self._topic(message)
        retain = retained or (sub is not None and sub.options.retain_as_published and messages.was_retained(message))
        props = NO_PROPERTIES
        if self.version == V5:
            if sub is None:
                subscription_id = None
            elif sub is self._outbox:  # each of its messages is for a subscription of its own
                subscription_id = messages.outbox_subscription_id(message)
            else:
                subscription_id = sub.options.subscription_id
            props = messages.publish_properties(message, now_ms, subscription_id)
        return self.conn.publish(
            topic,
            message[M_BODY],
            qos,
            retain=retain,
            properties=props,
            packet_id=packet_id,
            dup=dup,
            encoded_topic=encoded,
        )

    def _topic(self, message: WireMessage) -> tuple[str, bytes]:
        """The topic of a message, and its encoding in a PUBLISH (remembered per address)."""
        address = message[M_ADDRESS]
        known = self._topics.get(address)
        if known is not None:
            return known
        if address == convert.RETAINED_ADDRESS or address.startswith(convert.OUTBOX_PREFIX):
            # A retained copy keeps its topic in a property. Another protocol's client with rights on these
            # addresses (any, with no users configured) may send one without it: not deliverable, not a failure.
            topic = message[M_PROPS].get(messages.TOPIC)
            if type(topic) is not str or not convert.is_topic_name(topic):
                raise ConversionError(f"a message on {address[:100]!r} holds no topic name in {messages.TOPIC}")
            return topic, encode_topic(topic)
        topic = convert.address_to_topic(address)
        if len(self._topics) >= _CACHE_LIMIT:
            self._topics.clear()
        known = self._topics[address] = (topic, encode_topic(topic))
        return known

    def _acknowledged(self, packet_id: int) -> None:
        """PUBACK: the message is the client's."""
        out = self._outbound.acknowledged(packet_id)
        if out is not None:
            self._done(out)
            self._unpark()

    async def _received(self, event: ev.PubrecReceived) -> None:
        """PUBREC: record that the client has the message before the PUBREL (which forbids sending it again)."""
        packet_id = event.packet_id
        out = self._outbound.in_flight.get(packet_id)
        if event.reason_code >= rc.UNSPECIFIED_ERROR:  # the client refused it: done all the same
            self._outbound.acknowledged(packet_id)
            if out is not None:
                self._done(out)
            self._unpark()
            return
        if out is not None and out.sub is not None and not out.retained and self.persistent:
            self.state.released_out[packet_id] = (out.message[M_ID], out.sub.text)
            await self.registry.save(self.client_id, self.state)
        if out is not None:
            self._done(out)
            self._send_acks()
            consumer = out.sub.consumer if out.sub is not None else None
            link = consumer.client if consumer is not None else self.link  # an outbox's is the service link
            if link is not None:
                # The ack leaves for the core before the PUBREL leaves for the client: should this gateway die
                # in between, the core does not deliver the message again after the client has released it.
                link.flush()
        self.conn.pubrel(packet_id)

    def _completed(self, packet_id: int) -> None:
        """PUBCOMP: the QoS 2 flow is over."""
        copy = self._outbound.completed(packet_id, self.state.released_out)
        if copy is not None and self.persistent:
            # Not awaited: should it be lost, the stale entry only costs a PUBREL answered by PUBCOMP.
            self.registry.save(self.client_id, self.state).add_done_callback(_retrieve)
        self._unpark()

    def _done(self, out: _Outgoing) -> None:
        """The client has the message: acknowledge it to the core (at the next flush, with the others)."""
        sub = out.sub
        if sub is not None and not out.retained and not sub.closed:
            acks = self._acks.get(sub)
            if acks is None:
                self._acks[sub] = [out.message[M_ID]]
            else:
                acks.append(out.message[M_ID])

    def _unpark(self) -> None:
        self._outbound.unpark(self._send_parked)
        self._wake_retained()

    def _wake_retained(self) -> None:
        """The task sending retained messages goes on once none waits for the client's receive maximum."""
        unparked = self._unparked
        if unparked is not None and not self._outbound.parked and not unparked.done():
            unparked.set_result(None)

    def _send_parked(self, out: _Outgoing) -> bool:
        return not self.conn.closed and self._try_send(out)

    # ------------------------------------------------------------------ the end
    async def _disconnect(self, event: ev.Disconnect) -> None:
        await self._settle_confirms()
        self._flush()
        asked = event.properties.session_expiry_interval if self.version == V5 else None
        expiry_s = connecting.leaving(asked, self.settings.mqtt)
        if expiry_s is not None:
            was = self.expiry_s
            await self._change_expiry(expiry_s)
            declared = self._will_delay_s
            if (
                event.with_will
                and declared is not None
                and self.link is not None
                and min(declared, was) != min(declared, expiry_s)
            ):
                # The will waits no longer than the session lasts, and the DISCONNECT changed that (MQTT 5.0,
                # 3.1.3.2.2): a session that ends now sends it now.
                try:
                    await self.link.delay_will(min(declared, expiry_s) * 1000)
                except LinkRequestError as exc:  # it keeps its delay
                    log.warning(
                        "mqtt will kept its delay", extra={"client_id": self.client_id[:60], "reason": exc.text}
                    )
        if not event.with_will and self.link is not None:
            # This connection's will only: one taken over meanwhile must not drop its successor's.
            with contextlib.suppress(LinkRequestError):
                await self.link.clear_will()
        self._driver.end()

    async def _change_expiry(self, expiry_s: int) -> None:
        if expiry_s == self.expiry_s:
            return
        self.expiry_s = expiry_s
        registry = self.registry
        if expiry_s == 0:
            assert self.link is not None
            for sub in self.subs.values():
                await self._close_sub(sub)  # first: its consumer seeing its queue deleted would end the connection
                if not sub.shared and sub.consumer is not None:
                    # This node's copies only, here and below: a connection that took the session over through
                    # another node meanwhile has its own copies there.
                    with contextlib.suppress(LinkRequestError):
                        await self.link.delete_queue(sub.queue)
            if self._outbox is not None:
                await self._close_sub(self._outbox)
                self._outbox = None
            if self.state.outbox:
                await registry.drop_outbox(self.client_id, everywhere=False)
            await registry.drop_session(self.client_id, everywhere=False)
            return
        await registry.set_expiry(
            convert.session_queue(self.client_id),
            convert.session_queue(self.client_id),
            RoutingType.ANYCAST,
            expiry_s * 1000,
        )
        for sub in self.subs.values():
            pattern, sub_expiry_ms = convert.filter_to_pattern(sub.topic_filter), expiry_s * 1000
            if sub.shared and self.link is not None:
                sub_expiry_ms = await self._shared_expiry_ms(self.link, sub.queue, pattern, sub_expiry_ms)
            await registry.set_expiry(sub.queue, pattern, RoutingType.MULTICAST, sub_expiry_ms)
        if self.state.outbox:
            outbox = convert.outbox_queue(self.client_id)
            await registry.set_expiry(outbox, outbox, RoutingType.ANYCAST, expiry_s * 1000)

    def _violation(self, reason_code: int, text: str) -> None:
        """End the connection over a packet it cannot take, once the PUBLISH packets before it are answered: the
        core may have stored them, and a client that gets no PUBACK sends them again. No packet after it is
        handled meanwhile."""
        if self._violating:
            return
        log.info("mqtt protocol error", extra={"peer": self.wire.peer, "error": text[:200], "reason_code": reason_code})
        self.counters.protocol_errors += 1
        if self.conn.closed:
            return
        if self._answers.outstanding():
            self._violating = True
            self._in_background(self._disconnect_once_answered(reason_code, text))
            return
        self._disconnect_for(reason_code, text)

    async def _disconnect_once_answered(self, reason_code: int, text: str) -> None:
        await self._settle_confirms()
        self._disconnect_for(reason_code, text)

    def _disconnect_for(self, reason_code: int, text: str) -> None:
        if self.conn.closed:
            self._end()
            return
        if self._connected:
            props = Properties(reason_string=text[:200]) if self.version == V5 else NO_PROPERTIES
            self.conn.disconnect(reason_code, props)
        self._flush()
        self._end()

    def _link_closed(self, error: LinkRequestError) -> None:
        if not self._closed:
            log.info("link to the core closed", extra={"peer": self.wire.peer, "reason": error.text})
            self._end(rc.SERVER_UNAVAILABLE)

    def _send_acks(self) -> None:
        if self._acks:
            acks, self._acks = self._acks, {}
            for sub, ids in acks.items():
                if not sub.closed and sub.consumer is not None:
                    sub.consumer.ack_ids(ids)

    def _flush(self) -> None:
        self._send_acks()
        data = self.conn.data_to_send()
        if data:
            self.wire.write(data)
        if self.conn.closed and not self._disconnecting:
            self._end()

    def _end(self, reason_code: int = 0) -> None:
        """End the session wherever that is noticed: the worker may be waiting, so it is cancelled, and its
        clean-up releases the session and closes the link and the socket."""
        if self._closed:
            return
        if reason_code and not self.conn.closed and self._connected:
            self.conn.disconnect(reason_code)
            data = self.conn.data_to_send()
            if data:
                self.wire.write(data)
        self._driver.end()

    def _connect_deadline(self) -> None:
        if not self._connected and not self._closed and not self.version:  # a CONNECT being handled may take its time
            log.info("mqtt connect timeout", extra={"peer": self.wire.peer})
            self._end()

    def _keep_alive_deadline(self) -> None:
        """Ends a connection silent for longer than its keep-alive allows, else waits for the next deadline."""
        if self._closed:
            return
        conn = self.conn
        try:
            conn.handle_timeout(time.monotonic())
        except RemoteProtocolError as exc:
            log.info("mqtt keep-alive timeout", extra={"peer": self.wire.peer, "error": exc.message})
            self._flush()
            self._end()
            return
        deadline = conn.next_deadline()
        self._driver.arm_timer(None if deadline is None else deadline - time.monotonic(), self._keep_alive_deadline)

    async def abort(self) -> None:
        """The clean-up is overdue (``SessionDriver``): the link and the socket close now, and the outbox's
        consumer, which is on the service link: left open, it would hold the outbox's messages for good."""
        outbox = self._outbox
        try:
            await close_now(self.link, self.wire)
        finally:
            if outbox is not None and outbox.consumer is not None:
                with contextlib.suppress(LinkRequestError):
                    await outbox.consumer.close()

    async def clean_up(self) -> None:
        if self._lock is not None:
            self._lock.on_wake = None
        for sub in self._consuming():
            if sub.consumer is not None:
                sub.consumer.on_wake = None
        for sub in list(self.subs.values()):
            self._not_solo(sub)
            if sub.consumer is None:
                sub.closed = True
                await self.feeds.leave(sub)
        if self._background:
            # Not waiting for the client: one that left without closing its socket never reads again, and the
            # session's link, with its consumers, would stay open (they come back with every failover, taking
            # the session's messages). Queues given up for a feed are gone before the link (or with it).
            for task, finished in list(self._background.items()):
                if not finished:
                    task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
        link = self.link
        if link is not None:
            link.on_closed = link.on_settled = link.on_rejected = None
            retaining = self._retaining
            if retaining is not None and not retaining.done():
                # A client may close its socket right behind a retained PUBLISH: the store is written once the
                # core has accepted the message, and the core answers nothing that comes before a link's CLOSE.
                await asyncio.wait([retaining], timeout=RETAINED_ON_CLOSE_S)
            self._release_unsent()
            outbox = self._outbox
            if outbox is not None and outbox.consumer is not None:
                # On the service link, which stays open: closed here, it returns what the client did not
                # acknowledge to the queue, for the session's next connection.
                with contextlib.suppress(LinkRequestError):
                    await outbox.consumer.close()
                if not self.persistent and self._lock is not None and self._lock.closed is None:
                    await self.registry.drop_outbox(self.client_id, everywhere=False)  # as the subscriptions below
            if not self.persistent and self._lock is not None and self._lock.closed is None:
                # The session ends here (unless taken over): so do the durable queues of one it resumed (this
                # node's copies: a takeover through another node, its notice not read yet, has its own there).
                for sub in self.subs.values():
                    if not sub.shared and sub.consumer is not None:
                        with contextlib.suppress(LinkRequestError):
                            await link.delete_queue(sub.queue)
            await link.close()  # the core returns unacked messages, drops temporary queues, sends the will
        if self._holder is not None:
            with contextlib.suppress(LinkRequestError):
                await self._holder.close()  # the session's expiry starts now
        if self._lock is not None:
            await self.registry.release(self.client_id, self._lock)
        self._answers.drop()
        self.wire.close()
        # References back to the session (through a subscription, or a message in flight of one that ended): it
        # is freed as its last reference goes.
        self._outbound.clear()
        for sub in self._consuming():
            sub.session = None

    def _release_unsent(self) -> None:
        """Before the link's close returns what its consumers hold as failed deliveries: give back, uncounted,
        what never reached the client (waiting for its receive maximum, or in a consumer). Each close counted a
        failed delivery for all of them, and in a randomised run a backlog reached max_delivery_attempts and
        was dead-lettered without a message of it ever being written (through sessions that outlived their
        end: see ``SessionDriver``)."""
        parked: dict[Sub, list[int]] = {}
        for out in self._outbound.forget_parked(lambda out: out.sub is not None and not out.retained):
            assert out.sub is not None
            parked.setdefault(out.sub, []).append(out.message[M_ID])
        for sub in self._consuming():
            if sub.consumer is not None:
                with contextlib.suppress(LinkRequestError):
                    sub.consumer.release_unsent(parked.get(sub, ()))

    def _consuming(self) -> list[Sub]:
        """The subscriptions, and the outbox if it is consumed."""
        subs = list(self.subs.values())
        if self._outbox is not None:
            subs.append(self._outbox)
        return subs


class _Answered:
    """What the codec answered by itself (PINGRESP, the PUBREL of an unknown PUBREC) while the client did not
    read: written by the worker in its turn."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a failure nobody waits for as seen (asyncio would warn); the link's loss is handled elsewhere."""
    if not future.cancelled():
        future.exception()


def _new_client_id() -> str:
    """The id the server assigns to a client that sent an empty one."""
    return f"auto-{uuid.uuid4().hex}"
