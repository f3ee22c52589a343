"""One AMQP 1.0 client connection: SASL, proton's engine, the client's own link to the core, and the AMQP
links mapped onto core publishes and consumers.

The shared session driver's worker handles the client's bytes in order: SASL first (authenticated by the core
with the client's credentials), then proton's events. A client's sending link gets credit while the core keeps
up, and its unsettled transfers are settled (accepted, or rejected with the core's reason) once the core
confirmed them: for a durable message, once it is on disk. Each of the client's receiving links is a core
consumer that calls the session back when deliveries arrive, and they go out as transfers while the client
grants credit; the client's dispositions become core acks and nacks. Nothing is kept here that the core does
not also know: when the connection ends its link closes, and the core returns unsettled messages to their
queues and drops temporary ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, Final

from cproton_ffi import ffi, lib
from proton import Condition, Delivery, Endpoint, Link, Terminus, symbol, ulong
from proton import Described as PnDescribed

from tridentmq_amqp import convert, messages, receiving
from tridentmq_amqp.links import (
    DECLARE,
    DECLARED,
    TRANSACTIONAL_STATE,
    Coordinator,
    Inbound,
    Outbound,
    answer_filters,
    coordinator_body,
    put_capabilities,
    terminus_selector,
    terminus_symbols,
    transactional_state,
    txn_id_of,
)
from tridentmq_amqp.protocol.engine import (
    NULL,
    Engine,
    close_frame,
    field_info,
    link_name,
    wrap_delivery,
    wrap_link,
    wrap_session,
)
from tridentmq_amqp.protocol.errors import (
    CONNECTION_FORCED,
    DECODE_ERROR,
    DETACH_FORCED,
    FRAMING_ERROR,
    INTERNAL_ERROR,
    INVALID_FIELD,
    MESSAGE_SIZE,
    NOT_FOUND,
    RESOURCE_LIMIT,
    RESOURCE_LOCKED,
    TRANSFER_LIMIT,
    TX_ROLLBACK,
    TX_UNKNOWN,
    UNAUTHORIZED,
    RemoteProtocolError,
)
from tridentmq_amqp.protocol.sasl import AuthRequest, SaslLayer
from tridentmq_amqp.settings import AmqpSettings
from tridentmq_shared import id_locks
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.gateway import Wire
from tridentmq_shared.link.client import Consumer, queue_spec
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode, NackMode
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import (
    M_ADDRESS,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_ROUTING,
    MAX_PROPERTIES,
    ROUTING_DEFAULT,
    RoutingType,
    WireMessage,
)
from tridentmq_shared.runtime import random_hex
from tridentmq_shared.session_driver import HANDLING_BUGS, SessionDriver, close_now
from tridentmq_shared.supervision import end_on_failure

log = logging.getLogger("tridentmq.amqp")

OFFERED_CAPABILITIES: Final = ("ANONYMOUS-RELAY", "SHARED-SUBS")


class _Marker:
    """An event of the session's own among the client's bytes."""


_TIMER_EVENTS: Final = _Marker()  # proton's timer raised events (an idle timeout): process them
_ENGINE_DONE: Final = _Marker()  # proton has said all it will: end once the input before is handled
#: A non-durable shared subscription outlives its last consumer by this much (so that a consumer reattaching
#: at once finds it, and the core never deletes it between its creation and the first consumer).
SHARED_VOLATILE_EXPIRY_MS: Final = 1000
#: The largest message a coordinator link takes: a declare or a discharge is a few dozen bytes. (Not announced:
#: proton writes no max-message-size into the attach of a coordinator.)
COORDINATOR_MAX_MESSAGE_BYTES: Final = 64 * 1024
#: How long a client may take to answer the gateway's CLOSE before its socket is closed anyway.
CLOSE_GRACE_S: Final = 2.0
#: AMQP conditions for the core's refusals.
_CONDITIONS: Final = {
    ErrorCode.FORBIDDEN: UNAUTHORIZED,
    ErrorCode.NOT_FOUND: NOT_FOUND,
    ErrorCode.INVALID: INVALID_FIELD,
    ErrorCode.RESOURCE_LIMIT: RESOURCE_LIMIT,
    ErrorCode.UNAUTHENTICATED: UNAUTHORIZED,
    ErrorCode.EXISTS: RESOURCE_LOCKED,
}

_PN_DELIVERY: Final = lib.PN_DELIVERY
_PN_LINK_FLOW: Final = lib.PN_LINK_FLOW
_ACCEPTED: Final = lib.PN_ACCEPTED
_REJECTED: Final = lib.PN_REJECTED
_RELEASED: Final = lib.PN_RELEASED
_MODIFIED: Final = lib.PN_MODIFIED
#: The events of a connection's sessions and links (those of one whose OPEN was refused are dropped).
_AFTER_OPEN: Final = frozenset(
    (
        lib.PN_SESSION_REMOTE_OPEN,
        lib.PN_SESSION_REMOTE_CLOSE,
        lib.PN_LINK_REMOTE_OPEN,
        lib.PN_LINK_REMOTE_CLOSE,
        lib.PN_LINK_REMOTE_DETACH,
    )
)
_SASL_OUTCOME_SYS_TEMP: Final = 4
_MAX_CAPACITY: Final = 2**31 - 1  # proton computes the window in 32 bits: more wraps it to nothing
#: Where the bytes of transfers the gateway drops are read to (one buffer for the process: engines run on the
#: event loop's thread, and nothing is kept of what is read).
_DROPPED: Final = ffi.new("char[]", 64 * 1024)


class Counters:
    """Gateway-wide counters for /metrics."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.refused = 0
        self.messages_published = 0
        self.messages_delivered = 0
        self.protocol_errors = 0


class AmqpSession:
    def __init__(self, settings: AmqpSettings, core_links: CoreLinks, wire: Wire, counters: Counters) -> None:
        limits = settings.amqp
        self.core_links = core_links
        self.settings = settings
        self.wire = wire
        self.counters = counters
        self.id = random_hex(16)  # unique across gateway replicas: it names temporary queues
        mechanisms = ("PLAIN", "ANONYMOUS") if limits.allow_anonymous else ("PLAIN",)
        self.sasl = SaslLayer(mechanisms=mechanisms, allow_no_sasl=limits.allow_anonymous)
        self.engine: Engine | None = None
        self.link: PipelinedLink | None = None
        self.container_id = ""
        self.container_id_lock: str | None = None  # the queue that holds container_id for this connection, if any
        self.inbound: dict[Any, Inbound] = {}
        self.outbound: dict[Any, Outbound] = {}
        self.coordinators: dict[Any, Coordinator] = {}
        self.transactions: dict[bytes, int] = {}  # AMQP txn-id → core transaction
        # AMQP txn-id → the outcomes other than accepted given in it, applied at a successful discharge
        self._tx_outcomes: dict[bytes, list[tuple[Consumer, int, NackMode]]] = {}
        self._tx_ids = itertools.count(1)
        # pn_delivery_t* → bytes so far of the client's messages still arriving in several frames (proton holds
        # them), bounded per connection: a thousand links each holding a message just under the size limit
        # would otherwise hold gigabytes.
        self._incomplete: dict[Any, int] = {}
        self._incomplete_bytes = 0
        self._temporary = itertools.count(1)
        # pn_link_t* → (address, expiry policy) of the dynamic node the link made, deleted with the link
        self._dynamic: dict[Any, tuple[str, int]] = {}
        # (confirm future, pn_delivery_t* or None when pre-settled, inbound link, txn-id) in publish order
        self._unsettled_in: deque[tuple[asyncio.Future[None], Any, Inbound, bytes | None]] = deque()
        self._background: set[asyncio.Task[None]] = set()  # the session's own tasks (a link's consumer closing)
        # pn_link_t* → its receiving link, waiting for proton to let out the transfers it holds (``_pump``)
        self._held: dict[Any, Outbound] = {}
        self._lost = False  # the socket closed
        self._opened = False  # the client's OPEN was answered
        self._closing = False  # the gateway closed the connection (with an error): nothing more is taken
        self._loop = asyncio.get_running_loop()
        self._output_scheduled = False
        connect_timeout = limits.connect_timeout_ms / 1000
        self._connect_deadline = time.monotonic() + connect_timeout if connect_timeout > 0 else None
        # The client's bytes are the events: reading pauses on their size alone. They are handled while the client
        # does not read, up to pending_bytes of answers waiting for it (its deliveries wait for the socket:
        # ``_pump``): a client that sends a burst before it reads, while its own receiving links fill its socket,
        # is not deadlocked with the gateway. The answers are bounded by the credit the gateway grants (a
        # disposition per transfer) and by the frames handled (an attach, a flow asking for an echo).
        self._driver = SessionDriver(
            self,
            wire,
            "amqp",
            max_events=None,
            max_bytes=limits.pending_bytes,
            max_unread=limits.pending_bytes,
        )
        self._arm_timer()
        counters.connections_total += 1

    # ------------------------------------------------------------------ input from the client
    def feed(self, data: bytes) -> None:
        if self._closed:
            return
        # Until the client is logged in, at most max_connect_bytes are read ahead.
        waiting = self._driver.read_ahead + len(data)
        self._driver.receive(
            [data],
            len(data),
            hold=self.link is None and waiting >= self.settings.amqp.max_connect_bytes,
            final=not data,  # the end of its stream: handled even while the client does not read
        )

    def connection_lost(self) -> None:
        """The socket is gone: whatever proton still wants to say cannot be sent, so the session ends once the
        input before it is handled."""
        if not self._closed:
            self._lost = True
            self._driver.connection_lost(b"")

    async def wait_closed(self) -> None:
        await self._driver.wait_closed()

    @property
    def _closed(self) -> bool:
        return self._driver.closed

    def shutdown(self) -> None:
        """The gateway is stopping: close the connection with ``amqp:connection:forced``."""
        if self.engine is not None and not self._closed:
            self._close_connection(CONNECTION_FORCED, "the gateway is shutting down")
            self._flush()
        self._end()

    # ------------------------------------------------------------------ the worker (SessionHooks)
    handled_errors: tuple[type[Exception], ...] = (
        RemoteProtocolError,
        UnicodeDecodeError,  # a ValueError: handle_error tells it apart first
        LinkRequestError,
        AttributeError,
        *HANDLING_BUGS,
    )

    def handle_now(self, event: bytes | _Marker) -> bool:
        return False  # every chunk goes through SASL or proton, which may wait for the core

    async def handle(self, event: bytes | _Marker) -> None:
        if event is _TIMER_EVENTS:  # raised by proton's timer (an idle timeout, say)
            await self._process()
        elif event is _ENGINE_DONE or (self._lost and event == b""):
            if isinstance(event, bytes) and self.engine is not None:
                await self._to_engine(event)  # the end of the client's input
            # Everything the client sent before is handled, and nothing more can be said.
            self._end()
        elif isinstance(event, bytes):
            if self.sasl.done:
                await self._to_engine(event)
            else:
                await self._through_sasl(event)

    def handle_error(self, event: bytes | _Marker, error: Exception) -> None:
        if isinstance(error, RemoteProtocolError):
            log.info("amqp protocol error", extra={"peer": self.wire.peer, "error": error.message})
            self.counters.protocol_errors += 1
            self._flush()
        elif isinstance(error, UnicodeDecodeError):  # proton hands out the client's strings (ids, names) decoded
            log.warning("amqp client sent a string that is not UTF-8", extra={"peer": self.wire.peer})
            self.counters.protocol_errors += 1
            if self.engine is not None:
                self._close_connection(DECODE_ERROR, "a string is not valid UTF-8")
                self._flush()
        elif isinstance(error, LinkRequestError):  # the core refused a request no handler expected, or went away
            log.info("amqp core request failed", extra={"peer": self.wire.peer, "reason": error.text})
            if self.engine is not None:
                self._close_connection(CONNECTION_FORCED, f"the broker refused: {error.text}")
                self._flush()
        else:  # a bug of ours: this connection ends, the gateway goes on
            log.error("amqp session failed", exc_info=error, extra={"peer": self.wire.peer})
            if self.engine is not None:
                self._close_connection(INTERNAL_ERROR, "the gateway failed to handle this connection")
                self._flush()
        self._end()

    def before_handle(self) -> None:
        self._output_soon()  # what the chunk before produced

    def after_batch(self) -> None:
        self._output_soon()

    def reading_paused(self) -> None:
        pass

    def reading_resumed(self) -> None:
        pass

    async def _through_sasl(self, data: bytes) -> None:
        try:
            for item in self.sasl.receive_data(data):
                if isinstance(item, AuthRequest):
                    await self._authenticate(item)
                else:
                    await self._to_engine(item.data)
        finally:  # a refusal raises after queuing its answer (our header, or an outcome)
            self._write_sasl()
        if self.sasl.closed:
            self._end()

    def _write_sasl(self) -> None:
        out = self.sasl.data_to_send()
        if out:
            self.wire.write(out)

    async def _authenticate(self, request: AuthRequest) -> None:
        """Log in to the core as the client (the layer refuses mechanisms other than PLAIN and ANONYMOUS)."""
        user = request.username if request.mechanism == "PLAIN" else None
        password = request.password if request.mechanism == "PLAIN" else None
        error = await self._connect(user, password)
        if error is not None:
            self.counters.refused += 1
            code = 1 if error.code == ErrorCode.UNAUTHENTICATED else _SASL_OUTCOME_SYS_TEMP
            log.info("amqp login refused", extra={"peer": self.wire.peer, "user": user, "reason": error.text})
            self.sasl.outcome(ok=False, code=code)
            return
        passthrough = self.sasl.outcome(ok=True)
        self._write_sasl()  # the outcome goes out before the engine's first bytes
        for item in passthrough:
            await self._to_engine(item.data)

    async def _connect(self, user: str | None, password: str | None) -> LinkRequestError | None:
        link = self.core_links.client(
            user=user, password=password, client_name=f"amqp {self.wire.peer}", client_host=self.wire.host
        )
        try:
            await link.connect()
        except LinkRequestError as exc:
            return exc
        except OSError as exc:
            return LinkRequestError(ErrorCode.EOF, str(exc))
        self.link = link
        self.wire.logged_in()
        link.on_closed = self._link_closed
        link.on_settled = self._settle_inbound
        return None

    async def _to_engine(self, data: bytes) -> None:
        engine = self.engine
        if engine is None:
            limits = self.settings.amqp
            engine = self.engine = Engine(
                container_id=self.settings.node.name,
                max_frame_bytes=limits.max_frame_bytes,
                channel_max=limits.channel_max,
                idle_timeout_ms=limits.idle_timeout_ms,
                offered_capabilities=OFFERED_CAPABILITIES,
            )
            self._arm_timer()
            if self.link is None:  # no SASL layer: an anonymous connection, tried once
                error = await self._connect(None, None)
                if error is not None:
                    self.counters.refused += 1
                    log.info("amqp anonymous connection refused", extra={"peer": self.wire.peer, "reason": error.text})
                    engine.receive_data(data)
                    self._refuse_open(
                        UNAUTHORIZED if error.code == ErrorCode.UNAUTHENTICATED else INTERNAL_ERROR, error.text
                    )
                    return
        elif self.link is None:  # refused: the client's bytes go to proton only to see its CLOSE
            engine.receive_data(data)
            while lib.pn_collector_peek(engine.pn_collector) != NULL:
                lib.pn_collector_pop(engine.pn_collector)
            return
        engine.receive_data(data)
        await self._process()
        while engine.buffered_input and not self._closed:
            engine.pump_input()
            await self._process()
        self._top_up()

    def _refuse_open(self, condition: str, description: str) -> None:
        """Answer the client's OPEN with OPEN and an immediate CLOSE carrying the reason."""
        assert self.engine is not None
        connection = self.engine.connection
        connection.open()
        self._close_connection(condition, description)

    # ------------------------------------------------------------------ proton events
    async def _process(self) -> None:
        """Handle every event proton has queued, in order; only the worker calls this, so that an event waiting
        for the core (an attach, a publish into a full window) holds back the ones after it. Deliveries and
        flow take the raw C path; the rest is rare."""
        engine = self.engine
        assert engine is not None
        collector = engine.pn_collector
        acks: dict[Outbound, list[int]] = {}
        while (event := lib.pn_collector_peek(collector)) != NULL:
            kind = lib.pn_event_type(event)
            if kind == _PN_DELIVERY:
                delivery = lib.pn_event_delivery(event)
                pn_link = lib.pn_delivery_link(delivery)
                inbound = self.inbound.get(pn_link)
                if self._closing and lib.pn_link_is_receiver(pn_link):
                    # Nothing sent after the gateway's CLOSE can be answered, and the client may go on until
                    # it reads the CLOSE (or for the grace period): its messages are dropped as they come,
                    # not held (those still arriving were the limit the connection was closed for).
                    self._forget_incomplete(pn_link)
                    self._discard(pn_link)
                elif inbound is not None:
                    # (a link waiting to be detached publishes none of its transfers any more)
                    blocked = None if inbound.closing is not None else self._transfer(inbound, pn_link, delivery)
                    if blocked is not None:  # the core's window is full: wait for it (rare)
                        message, tx, txn_id = blocked
                        assert self.link is not None
                        self._published(await self.link.send(message, tx), delivery, inbound, txn_id)
                    elif inbound.closing is not None:
                        await self._detach_dropped(inbound)
                else:
                    outbound = self.outbound.get(pn_link)
                    if outbound is not None:
                        self._disposition(outbound, delivery, acks)
                    elif pn_link in self.coordinators:
                        await self._coordinate(pn_link, delivery)
                    elif lib.pn_link_is_receiver(pn_link):  # a link the gateway detached (or refused)
                        self._discard(pn_link)
            elif kind == _PN_LINK_FLOW:
                pn_link = lib.pn_event_link(event)
                outbound = self.outbound.get(pn_link)
                if outbound is not None:
                    self._pump(outbound)  # what waited for credit goes, and what came meanwhile
            else:
                _ack_all(acks)  # before a detach closes their consumer
                if self.link is not None or kind not in _AFTER_OPEN:  # a refused OPEN: its sessions get nothing
                    await self._endpoint_event(kind, event)
            lib.pn_collector_pop(collector)
        _ack_all(acks)

    async def _endpoint_event(self, kind: int, event: Any) -> None:
        if kind == lib.PN_CONNECTION_REMOTE_OPEN:
            await self._open()
        elif kind == lib.PN_CONNECTION_REMOTE_CLOSE:
            assert self.engine is not None
            connection = self.engine.connection
            if connection.state & Endpoint.LOCAL_ACTIVE:
                await self._release_container_id()  # before the answer: the client may connect again at once
                connection.close()
        elif kind == lib.PN_SESSION_REMOTE_OPEN:
            session = wrap_session(lib.pn_event_session(event))
            if session.state & Endpoint.LOCAL_UNINIT:
                limits = self.settings.amqp
                # proton derives the incoming window (in frames) from the capacity (in bytes) and the frame size.
                session.incoming_capacity = min(limits.session_window * limits.max_frame_bytes, _MAX_CAPACITY)
                session.open()
        elif kind == lib.PN_SESSION_REMOTE_CLOSE:
            session = wrap_session(lib.pn_event_session(event))
            await self._end_links(session=lib.pn_event_session(event))
            if session.state & Endpoint.LOCAL_ACTIVE:
                session.close()
        elif kind == lib.PN_LINK_REMOTE_OPEN:
            await self._attach(lib.pn_event_link(event))
        elif kind in (lib.PN_LINK_REMOTE_CLOSE, lib.PN_LINK_REMOTE_DETACH):
            await self._detach(lib.pn_event_link(event), closed=kind == lib.PN_LINK_REMOTE_CLOSE)
        elif kind == lib.PN_TRANSPORT_ERROR:
            assert self.engine is not None
            error = self.engine.error()
            if error is not None and error[1] == "connection aborted":  # the client left without CLOSE
                log.debug("amqp connection aborted", extra={"peer": self.wire.peer})
            elif error is not None:
                self.counters.protocol_errors += 1
                log.info(
                    "amqp connection error",
                    extra={"peer": self.wire.peer, "condition": error[0], "error": error[1][:200]},
                )
        elif kind == lib.PN_TRANSPORT_TAIL_CLOSED:
            assert self.engine is not None
            remote_closed = self.engine.connection.state & Endpoint.REMOTE_CLOSED
            if not self.engine.tail_closed and not remote_closed:  # proton stopped reading: a frame it could not
                # decode (after a CLOSE it stops too, rightly); when it said nothing (no transport error, which
                # was counted and answered with its own condition), we do
                if self.engine.error() is None:
                    self.counters.protocol_errors += 1
                    log.info("amqp protocol error", extra={"peer": self.wire.peer, "error": "undecodable frame"})
                    self._close_connection(DECODE_ERROR, "a frame could not be decoded")
            elif not remote_closed and self.engine.error() is None:
                # The client ended its stream in the middle of a frame: proton reports an abort only between
                # frames, and would wait for the rest for ever (until the connect or idle timeout).
                log.debug("amqp connection aborted", extra={"peer": self.wire.peer})
                self._close_now(FRAMING_ERROR, "connection aborted in the middle of a frame")
                self._end()  # the client can send nothing more, its CLOSE neither
        elif kind == lib.PN_TRANSPORT_CLOSED:
            self._flush()

    async def _open(self) -> None:
        engine = self.engine
        assert engine is not None
        connection = engine.connection
        self.container_id = connection.remote_container or self.id
        if self.link is None:  # refused already (_refuse_open)
            return
        if connection.state & Endpoint.LOCAL_UNINIT:
            if connection.remote_container and convert.SOLE_CONNECTION in terminus_symbols(
                engine.desired_capabilities()
            ):
                engine.offer(convert.SOLE_CONNECTION)  # in the refusing OPEN too: the refusal is its answer
                if not await self._hold_container_id():
                    return
            connection.open()
        self._opened = True
        self._arm_timer()  # the idle timeouts are known now: heartbeats and the silence check start

    async def _hold_container_id(self) -> bool:
        """Make the container id this connection's for its life (see ``id_locks``), as ActiveMQ does for a client
        that desires ``sole-connection-for-container``: otherwise two connections would share its durable
        subscriptions and split their messages. False: the OPEN was refused."""
        assert self.link is not None
        name = convert.container_id_lock(self.container_id)
        try:
            held = await id_locks.hold(self.link, name)
        except LinkRequestError as exc:
            if exc.code != ErrorCode.FORBIDDEN:
                raise  # the core is gone or failed: CLOSE amqp:connection:forced (handle_error)
            log.info("amqp container id not held", extra={"peer": self.wire.peer, "reason": exc.text})
            rights = f"createAddress and createNonDurableQueue on {convert.CONTAINER_ID_LOCK_PREFIX}#"
            await self._refuse_container_id(UNAUTHORIZED, f"{convert.SOLE_CONNECTION} needs {rights}: {exc.text}")
            return False
        if held:
            self.container_id_lock = name
            return True
        log.info("amqp container id in use", extra={"peer": self.wire.peer, "container_id": self.container_id[:200]})
        # As Artemis and ActiveMQ answer, and Qpid JMS reads it: InvalidClientIDException.
        description = f"container-id {self.container_id[:200]} is in use by another connection"
        await self._refuse_container_id(INVALID_FIELD, description, field_info("container-id"))
        return False

    async def _refuse_container_id(self, condition: str, description: str, info: dict[Any, Any] | None = None) -> None:
        """OPEN (marked as failed) and CLOSE at once; the connection's core session ends now, and what the client
        sends until its CLOSE goes to proton only."""
        assert self.engine is not None
        assert self.link is not None
        self.counters.refused += 1
        link, self.link = self.link, None
        link.on_closed = link.on_settled = None
        self.engine.open_failed()
        self._close_connection(condition, description, info)
        await link.close()

    async def _release_container_id(self) -> None:
        name, self.container_id_lock = self.container_id_lock, None
        if name is not None and self.link is not None:
            await id_locks.release(self.link, name)

    # ------------------------------------------------------------------ attach and detach
    async def _attach(self, pn_link: Any) -> None:
        link = wrap_link(pn_link)
        if not link.state & Endpoint.LOCAL_UNINIT:
            return
        if link_name(link) is None:  # mandatory (AMQP 1.0 2.7.3): an ATTACH without it is malformed, as proton lets by
            self.counters.protocol_errors += 1
            log.info("amqp protocol error", extra={"peer": self.wire.peer, "error": "an ATTACH without a link name"})
            self._close_connection(DECODE_ERROR, "an ATTACH without its link name")
            return
        if len(self.inbound) + len(self.outbound) + len(self.coordinators) >= self.settings.amqp.max_links:
            self._refuse_link(link, RESOURCE_LIMIT, "too many links on this connection")
            return
        if self.engine is not None and self.engine.nul_names.problems:
            # A NUL proton cut the name or address short at: refused, never attached to what is left.
            problem = self.engine.nul_names.problems.pop((link.name, not link.is_receiver), None)
            if problem is not None:
                self._refuse_link(link, INVALID_FIELD, problem)
                return
        try:
            if link.is_receiver:  # the client sends
                await self._attach_inbound(link)
            else:
                await self._attach_outbound(link)
        except convert.ConversionError as exc:
            self._refuse_link(link, INVALID_FIELD, str(exc))
        except LinkRequestError as exc:
            self._refuse_link(link, _CONDITIONS.get(exc.code, INTERNAL_ERROR), exc.text)

    def _refuse_link(self, link: Link, condition: str, description: str) -> None:
        """Attach with a null terminus and detach at once with the reason (AMQP 1.0 2.6.3)."""
        log.info(
            "amqp link refused", extra={"peer": self.wire.peer, "condition": condition, "error": description[:200]}
        )
        link.condition = Condition(condition, description)
        link.source.type = link.target.type = Terminus.UNSPECIFIED  # encoded as null
        link.open()
        link.close()
        self._flush()  # before any transfer the client sent on it is released (``_discard``)

    async def _attach_inbound(self, link: Link) -> None:
        remote = link.remote_target
        if remote.type == Terminus.COORDINATOR:
            link.target.type = Terminus.COORDINATOR
            put_capabilities(link.target.capabilities, "amqp:local-transactions")
            link.source.copy(link.remote_source)
            link.open()
            self.coordinators[link._impl] = Coordinator(link._impl)
            link.flow(self.settings.amqp.link_credit)
            return
        node: convert.Node | None = None
        if remote.address:
            node = convert.resolve(remote.address, terminus_symbols(remote.capabilities))
            if node.queue is not None:
                raise convert.ConversionError("send to an address: a fully qualified queue name is for consumers")
        elif remote.dynamic:
            if "temporary-topic" in terminus_symbols(remote.capabilities):
                # A JMS TemporaryTopic: an address of this connection's that its subscribers' queues (made, and
                # deleted, with them) make, and that goes once unused; its messages go to every subscriber.
                node = convert.Node(convert.temporary_address(self.id, next(self._temporary)), convert.MULTICAST)
            else:
                node = await self._temporary_node()
        link.target.copy(remote)
        if node is not None and remote.dynamic:
            link.target.address = node.address
        link.source.copy(link.remote_source)
        link.max_message_size = self.settings.amqp.max_message_bytes
        link.open()
        if node is not None and remote.dynamic and node.routing == convert.ANYCAST:
            self._made_dynamic(link._impl, node.address, remote)
        window = self.settings.amqp.link_credit
        self.inbound[link._impl] = Inbound(link._impl, node, window, credit=window)
        link.flow(window)

    def _made_dynamic(self, pn_link: Any, address: str, terminus: Terminus) -> None:
        """Remember the dynamic node ``pn_link`` made, to delete with the link (AMQP 1.0 3.5.9: delete-on-close,
        the default lifetime policy); a node asked to live longer goes with the connection."""
        if _deleted_on_close(terminus.properties):
            self._dynamic[pn_link] = (address, terminus.expiry_policy)

    async def _end_dynamic(self, pn_link: Any, *, closed: bool, by_client: bool) -> None:
        """Delete the dynamic node of a link that ends: closed, or detached (its session ended) when its
        terminus expires with the link (or the session)."""
        found = self._dynamic.pop(pn_link, None)
        if found is None or self.link is None:
            return
        address, expiry = found
        expiring = (
            (Terminus.EXPIRE_WITH_LINK,) if by_client else (Terminus.EXPIRE_WITH_LINK, Terminus.EXPIRE_WITH_SESSION)
        )
        if closed or expiry in expiring:
            try:
                await self.link.delete_queue(address)
            except LinkRequestError as exc:
                log.info("amqp dynamic node kept", extra={"peer": self.wire.peer, "queue": address, "reason": exc.text})

    async def _temporary_node(self) -> convert.Node:
        assert self.link is not None
        address = convert.temporary_address(self.id, next(self._temporary))
        await self.link.create_queue(address, address, routing_type=RoutingType.ANYCAST, temporary=True)
        return convert.Node(address, convert.ANYCAST)

    async def _attach_outbound(self, link: Link) -> None:
        assert self.link is not None
        remote = link.remote_source
        limits = self.settings.amqp
        if remote.type == Terminus.UNSPECIFIED:  # no source (proton shows one without an address so too)
            await self._attach_subscription(link)
            return
        if remote.dynamic:
            node = await self._temporary_node()
        elif remote.address:
            node = convert.resolve(remote.address, terminus_symbols(remote.capabilities))
        else:
            raise convert.ConversionError("a receiving link needs a source address (or a dynamic source)")
        capabilities = terminus_symbols(remote.capabilities)
        source = receiving.Source(
            node,
            capabilities,
            durable=remote.durability != Terminus.NONDURABLE or remote.expiry_policy == Terminus.EXPIRE_NEVER,
            copy=remote.distribution_mode == Terminus.DIST_MODE_COPY,
            settled=link.remote_snd_settle_mode == Link.SND_SETTLED,
            selector=terminus_selector(remote.filter),
        )
        planned = receiving.plan(source, container_id=self.container_id, link_name=link.name)
        queue, kind = planned.queue, planned.kind
        if kind in (receiving.QueueKind.SHARED, receiving.QueueKind.DURABLE_SUBSCRIPTION):
            container_problem = self.engine.nul_names.container_problem if self.engine is not None else None
            if container_problem is not None:  # proton cut it short: the queue would be another's
                raise convert.ConversionError(container_problem)
            convert.checked_name(queue, "subscription queue (container id and link name)")
        window: dict[str, Any] = {
            "credit": limits.prefetch,
            "selector": planned.consumer_selector,
            "credit_on_settle": not planned.presettled,
            "credit_bytes": self.settings.core.consumer_window_bytes,
        }
        if kind is receiving.QueueKind.VOLATILE_SUBSCRIPTION:  # the link's own queue: made and consumed in one go
            queue = f"amqp.{self.id}.{next(self._temporary)}"
            spec = queue_spec(
                queue,
                node.address,
                routing_type=RoutingType.MULTICAST,
                durable=False,
                temporary=True,
                filter=planned.queue_selector,
            )
            _, consumer = await self.link.make_and_subscribe(spec, **window)
        else:
            if kind is receiving.QueueKind.SHARED:  # JMS 2.0 shared subscriptions
                await self._shared_queue(queue, node.address, durable=planned.durable, selector=planned.queue_selector)
            elif kind is receiving.QueueKind.DURABLE_SUBSCRIPTION:
                await self._subscription_queue(queue, node.address, selector=planned.queue_selector)
            if node.queue is not None:
                # ``address::queue``: the core makes a missing queue on that address (not on one of its own name),
                # with the routing type asked; on a topic, as durable as the terminus.
                queue = f"{node.address}{convert.FQQN_SEPARATOR}{node.queue}"
                window["routing_type"] = planned.routing
                window["durable"] = planned.routing == convert.ANYCAST or source.durable
            consumer = await self.link.subscribe(queue, browse=planned.browse, **window)
        link.source.copy(remote)
        answer_filters(link.source.filter, remote.filter)
        if remote.dynamic:
            link.source.address = node.address
        if planned.announce is not None:
            put_capabilities(link.source.capabilities, planned.announce)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = Link.SND_SETTLED if planned.presettled else Link.SND_UNSETTLED
        link.open()
        if remote.dynamic:
            self._made_dynamic(link._impl, node.address, remote)
        outbound = Outbound(
            pn_link := link._impl,
            consumer,
            planned.presettled,
            planned.browse,
            queue,
            durable=planned.durable,
            temporary=kind is receiving.QueueKind.VOLATILE_SUBSCRIPTION,
            shared=kind is receiving.QueueKind.SHARED,
            address=node.address,
            max_message_size=int(lib.pn_link_remote_max_message_size(pn_link)),
        )
        self.outbound[pn_link] = outbound
        consumer.on_wake = lambda: self._pump(outbound)
        self._pump(outbound)  # what arrived with the subscribe's answer

    async def _attach_subscription(self, link: Link) -> None:
        """A receiving link with a null source attaches to the durable subscription its name names, as it is
        (AMQP 1.0 2.6.3: the source is the node's, given back in the answer), or is refused with
        ``amqp:not-found``. Qpid JMS unsubscribes so: it attaches ``<subscription>`` (``<subscription>|global``
        without a client id) with no source, and closes the link when the answer carries one, which ends the
        subscription as closing a durable subscriber's link does."""
        assert self.link is not None
        shared_globally = link.name.partition("|")[2] == "global"
        queue = convert.shared_subscription_queue(self.container_id, link.name, shared_globally=shared_globally)
        container_problem = self.engine.nul_names.container_problem if self.engine is not None else None
        if container_problem is not None and not shared_globally:
            raise convert.ConversionError(container_problem)
        convert.checked_name(queue, "subscription queue (container id and link name)")
        try:
            consumer = await self.link.subscribe(
                queue,
                create=False,  # a lookup: nothing is made
                credit=self.settings.amqp.prefetch,
                credit_on_settle=True,
                credit_bytes=self.settings.core.consumer_window_bytes,
            )
        except LinkRequestError as exc:
            if exc.code != ErrorCode.NOT_FOUND:
                raise
            raise LinkRequestError(
                ErrorCode.NOT_FOUND, f"no source address, and no durable subscription {queue!r}"
            ) from exc
        spec = consumer.spec
        address, routing = (spec["address"], spec["routing_type"]) if spec else (consumer.bound_to or (None, None))
        if not isinstance(address, str) or routing != RoutingType.MULTICAST:  # a queue of that name, not a topic's
            with contextlib.suppress(LinkRequestError):
                await consumer.close()
            raise LinkRequestError(ErrorCode.NOT_FOUND, f"no source address, and no durable subscription {queue!r}")
        link.source.address = address
        link.source.durability = Terminus.DELIVERIES
        link.source.expiry_policy = Terminus.EXPIRE_NEVER
        put_capabilities(link.source.capabilities, *(("topic", "shared", "global") if shared_globally else ("topic",)))
        link.target.copy(link.remote_target)
        link.snd_settle_mode = Link.SND_UNSETTLED
        link.open()
        outbound = Outbound(
            pn_link := link._impl,
            consumer,
            presettled=False,
            browse=False,
            queue=queue,
            durable=True,
            temporary=False,
            shared=shared_globally,
            address=address,
            max_message_size=int(lib.pn_link_remote_max_message_size(pn_link)),
            lookup=True,
        )
        self.outbound[pn_link] = outbound
        consumer.on_wake = lambda: self._pump(outbound)
        self._pump(outbound)

    async def _subscription_queue(self, queue: str, address: str, *, selector: str | None) -> None:
        """A durable subscription's queue on a multicast address. One that exists is kept unless its address or
        selector changed: then, as in JMS, it is a new subscription and the old one's messages go."""
        assert self.link is not None
        options: dict[str, Any] = {"filter": selector} if selector else {}
        try:
            found = await self.link.create_queue(queue, address, routing_type=RoutingType.MULTICAST, **options)
        except LinkRequestError as exc:
            if exc.code != ErrorCode.EXISTS:
                raise
            found = {"created": False, "filter": "-"}  # on another topic, or a queue of its own
        if not found.get("created") and (found.get("filter") or None) != (selector or None):
            refusal = await self.link.not_a_subscription(queue)
            if refusal is not None:  # never deleted for a subscription, with its messages
                raise LinkRequestError(ErrorCode.EXISTS, refusal)
            await self.link.delete_queue(queue, everywhere=True)
            await self.link.create_queue(queue, address, routing_type=RoutingType.MULTICAST, durable=True, **options)

    async def _shared_queue(self, queue: str, address: str, *, durable: bool, selector: str | None) -> None:
        """The queue of a shared subscription. A non-durable one goes when its last consumer leaves (on any
        gateway). One that exists is joined; with another selector it is replaced, but only while nobody
        consumes from it (JMS forbids changing an active shared subscription)."""
        assert self.link is not None
        options: dict[str, Any] = {} if durable else {"expires_ms": SHARED_VOLATILE_EXPIRY_MS}
        if selector:
            options["filter"] = selector
        found = await self.link.create_queue(
            queue, address, routing_type=RoutingType.MULTICAST, durable=durable, **options
        )
        if found.get("created") or (found.get("filter") or None) == (selector or None):
            return
        if found.get("consumers"):
            raise LinkRequestError(ErrorCode.EXISTS, f"shared subscription {queue!r} is in use with another selector")
        await self.link.delete_queue(queue)
        await self.link.create_queue(queue, address, routing_type=RoutingType.MULTICAST, durable=durable, **options)

    async def _detach(self, pn_link: Any, *, closed: bool, by_client: bool = True) -> None:
        """The client detached (or closed) the link; or its session ended (``by_client`` false: the client
        sent its END, and takes nothing more on it)."""
        link = wrap_link(pn_link)
        waiting = self.inbound.get(pn_link)
        if waiting is not None and waiting.unconfirmed and by_client and not self._closing:
            # The outcomes of what the link published go out before its DETACH: after it, none could be given,
            # and a client never told the core has its messages waits for them, or sends them again.
            await self._drain_inbound()
            if self._closed:
                return
        inbound, coordinator = self.inbound.pop(pn_link, None), self.coordinators.pop(pn_link, None)
        if inbound is not None or coordinator is not None:
            self._forget_incomplete(pn_link)
        outbound = self.outbound.pop(pn_link, None)
        refused: Condition | None = None
        if outbound is not None:
            await self._stop(outbound)
            if closed and outbound.durable and not outbound.temporary and self.link is not None:
                in_use = await self._end_durable(outbound)
                if in_use and outbound.lookup:  # a JMS unsubscribe: its client is told (IllegalStateException)
                    refused = Condition(
                        "amqp:resource-locked",
                        f"durable subscription {outbound.queue!r} has {in_use} active consumers: not ended",
                    )
            elif outbound.temporary and self.link is not None:
                try:
                    await self.link.delete_queue(outbound.queue)
                except LinkRequestError as exc:
                    log.info(
                        "amqp subscription kept",
                        extra={"peer": self.wire.peer, "queue": outbound.queue, "reason": exc.text},
                    )
        await self._end_dynamic(pn_link, closed=closed, by_client=by_client)
        if link.state & Endpoint.LOCAL_ACTIVE:
            if refused is not None:
                link.condition = refused
            if closed:
                link.close()
            else:
                link.detach()

    async def _end_durable(self, outbound: Outbound) -> int:
        """A durable subscription ends when its last consumer closes its link (a JMS unsubscribe closes the link
        of its look-up); while other links consume from it, closing one only takes that consumer away. An
        exclusive one ends with its copies on the nodes its client came through; a shared one's other copies
        may have consumers of their own. Returns the consumers that kept it (0: ended, or kept for a reason
        logged)."""
        assert self.link is not None
        try:
            found = await self.link.create_queue(
                outbound.queue, outbound.address, routing_type=RoutingType.MULTICAST, passive=True
            )
            in_use = found.get("consumers")
            if in_use:
                return int(in_use)
            if found.get("exists") is False and not found.get("elsewhere"):
                return 0  # gone already (an operator deleted it): nothing to end
            await self.link.delete_queue(outbound.queue, everywhere=not outbound.shared)
        except LinkRequestError as exc:
            log.info(
                "amqp subscription kept", extra={"peer": self.wire.peer, "queue": outbound.queue, "reason": exc.text}
            )
        return 0

    async def _stop(self, outbound: Outbound) -> None:
        self._stop_pumping(outbound)
        self._release_unsent(outbound)
        with contextlib.suppress(LinkRequestError):
            await outbound.consumer.close()

    def _release_unsent(self, outbound: Outbound) -> None:
        """Give back, uncounted, what the link's consumer fetched and never sent to the client (receivers that
        each took one message had the rest dead-lettered without its ever being delivered)."""
        unsent = [message[M_ID] for _, message in outbound.pending]
        outbound.pending.clear()
        with contextlib.suppress(LinkRequestError):  # the core link is gone: it took them back already
            outbound.consumer.release_unsent(unsent)

    async def _end_links(self, *, session: Any) -> None:
        for pn_link in [
            p for p in (*self.inbound, *self.outbound, *self.coordinators) if lib.pn_link_session(p) == session
        ]:
            await self._detach(pn_link, closed=False, by_client=False)

    # ------------------------------------------------------------------ messages from the client
    def _transfer(self, inbound: Inbound, pn_link: Any, delivery: Any) -> tuple[WireMessage, int, bytes | None] | None:
        """A message from the client, published at once; returned (with its transaction) when the core's window
        is full, for the caller to wait. A plain method, not a coroutine: this runs for every message."""
        if not lib.pn_delivery_readable(delivery):
            return None
        size = lib.pn_delivery_pending(delivery)
        partial = lib.pn_delivery_partial(delivery)
        if size > self.settings.amqp.max_message_bytes:
            self._drop_link(inbound, MESSAGE_SIZE, "the message is larger than the link's max-message-size")
            return None
        if partial:
            self._arriving(delivery, size)
            return None
        if self._incomplete:
            self._incomplete_bytes -= self._incomplete.pop(delivery, 0)
        if inbound.credit <= 0:
            self._drop_link(inbound, TRANSFER_LIMIT, "more transfers than the link credit allows")
            return None
        inbound.credit -= 1
        inbound.granted += 1
        data = bytearray(size)
        lib.pn_link_recv(pn_link, ffi.from_buffer(data), size)
        lib.pn_link_advance(pn_link)
        if lib.pn_delivery_aborted(delivery):
            lib.pn_delivery_settle(delivery)
            return None
        txn_id: bytes | None = None
        tx = 0
        if lib.pn_delivery_remote_state(delivery) == TRANSACTIONAL_STATE:
            txn_id = txn_id_of(delivery)
            tx = self.transactions.get(txn_id or b"", 0)
            if not tx:
                self._reject(delivery, TX_UNKNOWN, "no such transaction")
                return None
        try:
            message = _core_message(bytes(data), inbound.node)
        except (messages.MessageFormatError, convert.ConversionError) as exc:
            self._reject(delivery, getattr(exc, "condition", INVALID_FIELD), str(exc))
            return None
        link = self.link
        assert link is not None
        confirmed = link.try_send(message, tx)
        if confirmed is None:
            return message, tx, txn_id
        self._published(confirmed, delivery, inbound, txn_id)
        return None

    def _arriving(self, delivery: Any, size: int) -> None:
        """A message whose rest is still to come: proton holds what came so far, counted per connection."""
        self._incomplete_bytes += size - self._incomplete.get(delivery, 0)
        self._incomplete[delivery] = size
        if self._incomplete_bytes > self.settings.amqp.max_incomplete_bytes:
            self._close_connection(RESOURCE_LIMIT, "too many bytes of incomplete messages at once")

    def _published(self, future: asyncio.Future[None], delivery: Any, inbound: Inbound, txn_id: bytes | None) -> None:
        """A transfer handed to the core: settled at once when the client pre-settled it, else once the core
        confirms (``_settle_inbound``)."""
        self.counters.messages_published += 1
        presettled = bool(lib.pn_delivery_settled(delivery))
        if presettled:
            lib.pn_delivery_settle(delivery)
        else:
            inbound.unconfirmed += 1
        self._unsettled_in.append((future, None if presettled else delivery, inbound, txn_id))
        if future.done():  # refused by the link client itself (a body its link cannot carry): no confirm comes
            self._loop.call_soon(self._settle_inbound)

    def _drop_link(self, inbound: Inbound, condition: str, description: str) -> None:
        """End a client's sending link for abuse: it takes no more transfers (the one at hand, over a limit, is
        not published: released after the detach, as ``_detach_dropped`` does with the later ones). It is
        detached once the transfers it published have their outcomes, in order: after the detach none could
        be settled, and a client never told that the core has them sends them again."""
        if inbound.closing is None:
            inbound.closing = (condition, description)
        self._forget_incomplete(inbound.link)
        if not inbound.unconfirmed:
            self._end_inbound(inbound)

    def _end_inbound(self, inbound: Inbound) -> None:
        """Detach a link that waited for its transfers' outcomes (``_drop_link``)."""
        if self.inbound.get(inbound.link) is inbound and inbound.closing is not None:
            del self.inbound[inbound.link]
            self._close_link(inbound.link, *inbound.closing)
            self._flush()  # the DETACH goes out now, before what ``_discard`` releases

    async def _detach_dropped(self, inbound: Inbound) -> None:
        """A transfer on a link waiting for its detach (``_drop_link``; the one that ended it, too). proton
        would hold it, and all the client sends after it, for as long as the link lives: the detach is made
        to come now, once the core has answered for the transfers the link published (reading the client's
        input waits meanwhile), and what came is dropped."""
        if inbound.unconfirmed:
            await self._drain_inbound()  # settles them, in order, and detaches the link
            if self._closed:
                return
        self._end_inbound(inbound)
        self._discard(inbound.link)

    def _discard(self, pn_link: Any) -> None:
        """Read and drop the transfers of a link whose DETACH went out, as they come, each released (not
        processed: the client may send it again) once whole, which frees it in proton. A message still
        arriving stays current, to read the rest of: settled in the middle, proton would count its further
        frames against the session's window for ever."""
        while (delivery := lib.pn_link_current(pn_link)) != NULL:
            while lib.pn_link_recv(pn_link, _DROPPED, len(_DROPPED)) > 0:
                pass
            if lib.pn_delivery_partial(delivery) and not lib.pn_delivery_aborted(delivery):
                return
            if not lib.pn_delivery_settled(delivery):  # (pre-settled by the client: nothing to say)
                lib.pn_delivery_update(delivery, _RELEASED)
            lib.pn_delivery_settle(delivery)

    def _forget_incomplete(self, pn_link: Any) -> None:
        """The incomplete messages of a link that ends are not coming any more."""
        for delivery in [d for d in self._incomplete if lib.pn_delivery_link(d) == pn_link]:
            self._incomplete_bytes -= self._incomplete.pop(delivery)

    def _top_up(self) -> None:
        """More credit for the client's links that used half of theirs, while the core keeps up. Called between
        reads of the client's bytes, never amid one: a client cannot use credit it has not been sent."""
        link = self.link
        if link is None or not link.can_send:
            return
        for inbound in self.inbound.values():
            if inbound.granted * 2 >= inbound.window and inbound.closing is None:
                lib.pn_link_flow(inbound.link, inbound.granted)
                inbound.credit += inbound.granted
                inbound.granted = 0

    def _settle_inbound(self) -> None:
        """The core confirmed or refused publishes: settle their transfers, in order."""
        pending = self._unsettled_in
        while pending and pending[0][0].done():
            future, delivery, inbound, txn_id = pending.popleft()
            error = future.exception()
            if delivery is None:
                continue  # pre-settled
            inbound.unconfirmed -= 1
            if self.inbound.get(inbound.link) is not inbound:
                continue  # its link is gone
            if error is None:
                if txn_id is not None:
                    self._transactional_outcome(delivery, txn_id)
                else:
                    lib.pn_delivery_update(delivery, _ACCEPTED)
                    lib.pn_delivery_settle(delivery)
            elif isinstance(error, LinkRequestError):
                condition = _CONDITIONS.get(error.code, INTERNAL_ERROR)
                self._reject(delivery, condition, error.text)
                if error.code == ErrorCode.FORBIDDEN:  # the link's address is not this user's to send to
                    self._drop_link(inbound, UNAUTHORIZED, error.text)
            else:
                self._reject(delivery, INTERNAL_ERROR, str(error))
            if inbound.closing is not None and not inbound.unconfirmed:
                self._end_inbound(inbound)  # every transfer it published has its outcome
        self._top_up()
        self._output_soon()

    def _reject(self, delivery: Any, condition: str, description: str) -> None:
        wrapped = wrap_delivery(delivery)
        wrapped.local.condition = Condition(condition, description)
        wrapped.update(Delivery.REJECTED)
        wrapped.settle()

    # ------------------------------------------------------------------ transactions
    async def _coordinate(self, pn_link: Any, delivery: Any) -> None:
        """Declare and discharge of local transactions (AMQP 1.0 part 4) on the coordinator link."""
        if not lib.pn_delivery_readable(delivery):
            return
        size = lib.pn_delivery_pending(delivery)
        if size > COORDINATOR_MAX_MESSAGE_BYTES:  # no control message: the coordinator goes, the connection stays
            del self.coordinators[pn_link]
            self._forget_incomplete(pn_link)
            limit = f"a message to the coordinator is larger than {COORDINATOR_MAX_MESSAGE_BYTES} bytes"
            self._close_link(pn_link, MESSAGE_SIZE, limit)
            self._flush()  # the DETACH goes out before the message is released
            self._discard(pn_link)
            return
        if lib.pn_delivery_partial(delivery):
            self._arriving(delivery, size)
            return
        if self._incomplete:
            self._incomplete_bytes -= self._incomplete.pop(delivery, 0)
        data = bytearray(size)
        lib.pn_link_recv(pn_link, ffi.from_buffer(data), size)
        lib.pn_link_advance(pn_link)
        link = self.link
        assert link is not None
        wrapped = wrap_delivery(delivery)
        try:
            body = coordinator_body(bytes(data))
        except RemoteProtocolError as exc:
            self._reject(delivery, exc.condition, exc.message)
            lib.pn_link_flow(pn_link, 1)
            return
        lib.pn_link_flow(pn_link, 1)  # credit for the next control message, whatever becomes of this one
        if body.descriptor in DECLARE:
            try:
                tx = await link.begin()
            except LinkRequestError as exc:
                self._reject(delivery, _CONDITIONS.get(exc.code, INTERNAL_ERROR), exc.text)
                return
            txn_id = next(self._tx_ids).to_bytes(4, "big")
            self.transactions[txn_id] = tx
            local: Any = wrapped.local  # proton types ``data`` as a list of int
            local.data = [txn_id]
            wrapped.update(DECLARED)
            wrapped.settle()
        else:
            fields = body.value if isinstance(body.value, list) else []
            txn_id = bytes(fields[0]) if fields and isinstance(fields[0], bytes | bytearray) else b""
            fail = bool(fields[1]) if len(fields) > 1 else False
            tx = self.transactions.pop(txn_id, 0)
            if not tx:
                self._reject(delivery, TX_UNKNOWN, "no such transaction")
                return
            outcomes = self._tx_outcomes.pop(txn_id, [])
            await self._drain_inbound()  # the transaction's publishes are confirmed before it ends
            try:
                if fail:
                    await link.rollback(tx)
                else:
                    await link.commit(tx)
            except LinkRequestError as exc:
                if not fail:
                    # The core keeps a transaction whose commit it refused open: rolled back, what it acknowledged
                    # comes back, and it no longer counts against the connection's open transactions.
                    with contextlib.suppress(LinkRequestError):
                        await link.rollback(tx)
                fail = True
                self._reject(delivery, TX_ROLLBACK, exc.text)
            else:
                wrapped.update(Delivery.ACCEPTED)
                wrapped.settle()
            for consumer, message_id, mode in outcomes:
                # Applied once committed (AMQP 1.0 part 4, 4.4.2). Rolled back, they are not: the messages come
                # again, as those the transaction accepted do.
                with contextlib.suppress(LinkRequestError):  # a consumer gone since gave its messages back
                    consumer.nack_ids([message_id], NackMode.REDELIVER if fail else mode)

    async def _drain_inbound(self) -> None:
        pending = [future for future, *_ in self._unsettled_in]
        if pending:
            await asyncio.wait(pending)
        self._settle_inbound()

    def _transactional_outcome(self, delivery: Any, txn_id: bytes) -> None:
        wrapped = wrap_delivery(delivery)
        local: Any = wrapped.local  # proton types ``data`` as a list of int
        local.data = [txn_id, PnDescribed(ulong(0x24), [])]  # transactional-state: accepted, at commit
        wrapped.update(TRANSACTIONAL_STATE)
        wrapped.settle()

    # ------------------------------------------------------------------ messages to the client
    def _pump(self, outbound: Outbound) -> None:
        """Send what the link's consumer holds while the client grants credit. The consumer calls it when
        deliveries arrive, and the client's FLOW (what waited for credit goes first): no task per link. At most
        the prefetch is out of the queue: an unsettled link's core credit comes back with the client's
        dispositions, and a pre-settled link's with its transfers written. While the client does not read what
        was written, the deliveries wait in the consumer, whose credit then stops the core, and a task waits
        for the client to drain."""
        if self._closed or outbound.draining is not None or self.outbound.get(outbound.link) is not outbound:
            return  # (detached: the core takes back what its consumer holds)
        if not self.wire.writable():
            # The client's frames are handled meanwhile (its FLOWs too): what it is sent waits for it to read.
            outbound.draining = end_on_failure(
                self._loop.create_task(self._pump_when_drained(outbound), name="amqp drain"), self._end, self.wire.peer
            )
            return
        consumer = outbound.consumer
        try:
            if outbound.pending:
                self._send_pending(outbound)  # what waited for the client's credit, as far as it goes now
                self._output_soon()
                if outbound.pending:
                    return  # the rest waits for more credit
            if self._held_in_proton() >= self.settings.amqp.pending_bytes:
                # The client's session windows let out less than its link credit asks for: proton holds the
                # transfers, and a pre-settled link's were acknowledged as sent. What comes next waits in the
                # consumer (whose credit then stops the core) until proton lets them out (``_flush``).
                self._held[outbound.link] = outbound
                return
            batch = consumer.take_batch()
            if batch:
                outbound.pending.extend(batch)
            elif consumer.closed is not None:
                self._consumer_ended(outbound, consumer.closed)
                return
            elif not lib.pn_link_get_drain(outbound.link):
                return  # (or a browse that showed what was there: it ends)
            self._send_pending(outbound)  # (a drain with nothing to send is answered so)
            self._output_soon()
        except Exception:  # as a task's failure would: this connection ends, the gateway goes on
            log.exception("amqp delivery failed", extra={"peer": self.wire.peer})
            self._end()

    async def _pump_when_drained(self, outbound: Outbound) -> None:
        await self.wire.drained()
        outbound.draining = None
        self._pump(outbound)

    def _held_in_proton(self) -> int:
        """Bytes of transfers proton holds for the client's sessions, not yet let out by their windows."""
        engine = self.engine
        if engine is None:
            return 0
        held = 0
        pn_session = lib.pn_session_head(engine.pn_connection, 0)
        while pn_session != NULL:
            held += lib.pn_session_outgoing_bytes(pn_session)
            pn_session = lib.pn_session_next(pn_session, 0)
        return held

    def _stop_pumping(self, outbound: Outbound) -> None:
        self._held.pop(outbound.link, None)
        outbound.consumer.on_wake = None
        if outbound.draining is not None:
            outbound.draining.cancel()
            outbound.draining = None

    def _consumer_ended(self, outbound: Outbound, error: LinkRequestError) -> None:
        """The core ended the link's consumer (its queue was deleted, or not restored after a failover)."""
        self.outbound.pop(outbound.link, None)
        self._stop_pumping(outbound)
        self._close_link(outbound.link, _CONDITIONS.get(error.code, DETACH_FORCED), error.text)
        self._flush()

    def _send_pending(self, outbound: Outbound) -> None:
        pn_link = outbound.link
        pending = outbound.pending
        credit = available = lib.pn_link_credit(pn_link)
        drain = lib.pn_link_get_drain(pn_link)
        if drain and len(pending) < credit:
            # A drain is answered with everything the gateway holds (the consumer's buffer too) before the
            # rest of the credit is used up: what it left there would wait for the client's next credit.
            pending.extend(outbound.consumer.take_batch())
        if pending and credit > 0:
            now_ms = int(time.time() * 1000)
            presettled = outbound.presettled
            sent: list[int] = []
            expired: list[int] = []
            to_amqp = messages.to_amqp
            while pending and credit > 0:
                count, message = pending.popleft()
                message_id = message[M_ID]
                if 0 < message[M_EXPIRATION] <= now_ms:
                    # Expired while it waited here for the client's credit: not handed on, as the link client
                    # does with what it buffers; it goes back uncounted and the node expires it (a browser skips it).
                    expired.append(message_id)
                    continue
                try:
                    data = to_amqp(message, count, now_ms)
                except (messages.MessageFormatError, TypeError, ValueError) as exc:
                    # Kept AMQP sections that do not hold together (a link client can write any property):
                    # no AMQP client can be given this message, so it goes to the dead letters.
                    log.warning(
                        "amqp message undeliverable",
                        extra={"peer": self.wire.peer, "id": message_id, "error": str(exc)[:200]},
                    )
                    outbound.consumer.nack_ids([message_id], NackMode.REJECT)
                    continue
                if outbound.max_message_size and len(data) > outbound.max_message_size:
                    # More than the client's link takes (AMQP 1.0 2.7.3: it would detach with
                    # message-size-exceeded, and get the message again on its next link): to the dead letters
                    # (a browser only skips it).
                    log.warning(
                        "amqp message over the receiver's max-message-size",
                        extra={"peer": self.wire.peer, "id": message_id, "size": len(data)},
                    )
                    if not outbound.browse:
                        outbound.consumer.nack_ids([message_id], NackMode.REJECT)
                    continue
                tag = message_id.to_bytes(8, "big")
                delivery = lib.pn_delivery(pn_link, (8, ffi.from_buffer(tag)))
                lib.pn_link_send(pn_link, ffi.from_buffer(data), len(data))
                lib.pn_link_advance(pn_link)
                if presettled:
                    lib.pn_delivery_settle(delivery)
                    sent.append(message_id)
                credit -= 1
            if sent and not outbound.browse:
                outbound.consumer.ack_ids(sent)
            if expired and not outbound.browse:
                outbound.consumer.nack_ids(expired, NackMode.RELEASE)
            self.counters.messages_delivered += available - credit
        if drain and not pending:
            lib.pn_link_drained(pn_link)  # nothing more right now: the rest of the credit is used up

    def _end_outbound(self, outbound: Outbound, condition: str, description: str) -> None:
        """Close a receiving link of the client's on our side: its consumer goes (the core takes back what it
        held), and the client's answering detach is not taken for an unsubscribe."""
        self.outbound.pop(outbound.link, None)
        self._stop_pumping(outbound)
        self._release_unsent(outbound)  # now: should the connection end before the task runs, they would count
        self._in_background(self._stop(outbound), "amqp link end")
        self._close_link(outbound.link, condition, description)

    def _in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """A task of this session's: kept until done (the loop holds only weak references to tasks), and one
        that fails ends the connection, logged, as the worker's would."""
        task = end_on_failure(self._loop.create_task(work, name=name), self._end, self.wire.peer)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _disposition(self, outbound: Outbound, delivery: Any, acks: dict[Outbound, list[int]]) -> None:
        """The client settled or decided on a message: ack or nack it in the core."""
        if not lib.pn_delivery_updated(delivery) and not lib.pn_delivery_settled(delivery):
            return
        state = lib.pn_delivery_remote_state(delivery)
        tag = lib.pn_delivery_tag(delivery)
        message_id = int.from_bytes(ffi.unpack(tag.start, tag.size), "big")
        consumer = outbound.consumer
        if state == _ACCEPTED or (state == 0 and lib.pn_delivery_settled(delivery)):
            acks.setdefault(outbound, []).append(message_id)
        elif state == _RELEASED:
            consumer.nack_ids([message_id], NackMode.RELEASE)
        elif state == _REJECTED:
            consumer.nack_ids([message_id], NackMode.REJECT)
        elif state == _MODIFIED:
            remote = lib.pn_delivery_remote(delivery)
            failed = lib.pn_disposition_is_failed(remote)
            consumer.nack_ids([message_id], NackMode.REDELIVER if failed else NackMode.RELEASE)
        elif state == TRANSACTIONAL_STATE:
            txn_id, outcome = transactional_state(delivery)
            tx = self.transactions.get(txn_id or b"", 0)
            if not tx:
                consumer.nack_ids([message_id], NackMode.RELEASE)
                self._end_outbound(outbound, TX_UNKNOWN, "no such transaction")
            elif outcome in (None, _ACCEPTED):
                consumer.ack_ids([message_id], tx)  # acknowledged when the transaction commits
            else:  # applied at the discharge, if it commits
                mode = NackMode.REJECT if outcome == _REJECTED else NackMode.RELEASE
                self._tx_outcomes.setdefault(txn_id or b"", []).append((consumer, message_id, mode))
        else:
            return  # received (a non-terminal state): wait for the outcome
        lib.pn_delivery_settle(delivery)

    # ------------------------------------------------------------------ output and the end
    def _output_soon(self) -> None:
        """Write what proton has to say once this turn of the event loop is over: one write for everything
        the turn produced (transfers, dispositions, flow) instead of a system call each."""
        if not self._output_scheduled:
            self._output_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._output_scheduled = False
        engine = self.engine
        if engine is None:
            return
        data = engine.data_to_send()
        if data:
            self.wire.write(data)
        if self._held and self._held_in_proton() < self.settings.amqp.pending_bytes:
            held = list(self._held.values())  # proton let transfers out (the client opened its session window)
            self._held.clear()
            for outbound in held:
                self._pump(outbound)
        if engine.closed:  # proton has said all it will (a CLOSE, or an error): the session ends after the input
            self._driver.receive([_ENGINE_DONE], 0)

    def _close_link(self, pn_link: Any, condition: str, description: str) -> None:
        link = wrap_link(pn_link)
        log.info("amqp link closed", extra={"peer": self.wire.peer, "condition": condition, "error": description[:200]})
        if link.state & Endpoint.LOCAL_ACTIVE:
            link.condition = Condition(condition, description)
            link.close()

    def _close_connection(self, condition: str, description: str, info: dict[Any, Any] | None = None) -> None:
        """CLOSE with an error; the client should answer with its own CLOSE, and one that does not within
        ``CLOSE_GRACE_S`` has its socket closed all the same."""
        assert self.engine is not None
        connection = self.engine.connection
        if not connection.state & Endpoint.LOCAL_CLOSED:
            connection.condition = Condition(condition, description, info)
            if connection.state & Endpoint.LOCAL_UNINIT:
                connection.open()
            connection.close()
            self._closing = True
            self._flush()  # the CLOSE goes out before anything the client sends next is dropped (released)
            self._loop.call_later(CLOSE_GRACE_S, self._end)

    def _close_now(self, condition: str, description: str) -> None:
        """CLOSE with an error and write it at once (the caller ends the session)."""
        assert self.engine is not None
        self._close_connection(condition, description)
        data = self.engine.data_to_send()
        if not self.engine.connection.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED):
            # proton writes no CLOSE before the client's OPEN: our OPEN, then a CLOSE of our own.
            data += close_frame(condition, description)
        self.wire.write(data)

    def _link_closed(self, error: LinkRequestError) -> None:
        if not self._closed and self.engine is not None:
            self._close_connection(CONNECTION_FORCED, f"the link to the broker closed: {error.text}")
            self._flush()
            self._end()

    def _end(self) -> None:
        self._driver.end()

    def _arm_timer(self) -> None:
        """Wait for the next deadline: the OPEN's (connect timeout), then proton's idle-timeout ticks."""
        now = time.monotonic()
        deadline = None if self._opened else self._connect_deadline
        if self.engine is not None:
            # What is due goes out first (the OPEN, after the client's): proton counts output made after a
            # tick as traffic, and would have put the first heartbeat off by another half idle timeout (a
            # whole one after the OPEN, when the client gives up).
            self._flush()
            tick = self.engine.tick(now)
            if lib.pn_collector_peek(self.engine.pn_collector) != NULL:  # e.g. the idle timeout expired
                # An expired idle timeout ends the connection even while the client does not read (whose input,
                # its CLOSE say, waits unhandled meanwhile, so proton saw it silent): handled all the same.
                self._driver.receive([_TIMER_EVENTS], 0, final=self.engine.error() is not None)
            self._flush()  # heartbeats
            if tick is not None:
                deadline = tick if deadline is None else min(deadline, tick)
        self._driver.arm_timer(None if deadline is None else deadline - now, self._deadline)

    def _deadline(self) -> None:
        if self._closed:
            return
        if not self._opened and self._connect_deadline is not None and time.monotonic() >= self._connect_deadline:
            log.info("amqp connect timeout", extra={"peer": self.wire.peer})
            if self.engine is not None:
                self._close_now(CONNECTION_FORCED, "no OPEN in time")
            self._end()
            return
        self._arm_timer()

    async def abort(self) -> None:
        """The clean-up is overdue (``SessionDriver``): the link and the socket close now."""
        await close_now(self.link, self.wire)

    async def clean_up(self) -> None:
        for outbound in self.outbound.values():
            self._stop_pumping(outbound)
            self._release_unsent(outbound)  # before the link's close takes back the rest
        for task in list(self._background):  # consumers closing: the link's close takes back what they hold
            task.cancel()
        if self.link is not None:
            self.link.on_closed = self.link.on_settled = None
            await self.link.close()  # the core returns unsettled messages and drops temporary queues
        for future, *_ in self._unsettled_in:  # answers nobody will read: retrieved, so asyncio does not warn
            if future.done() and not future.cancelled():
                future.exception()
        self._unsettled_in.clear()
        self.inbound.clear()
        self.outbound.clear()
        self.coordinators.clear()
        self._dynamic.clear()
        self._incomplete.clear()
        self._held.clear()
        # proton's memory goes now, not whenever what still refers to this session (a timer handle, a task
        # ending) lets it go: thousands of short connections kept their engines that way.
        self.engine = None
        self.wire.close()


# ---------------------------------------------------------------------------------------------- helpers
_DELETE_ON_CLOSE: Final = (0x2B, "amqp:delete-on-close:list")


def _deleted_on_close(properties: Any) -> bool:
    """Whether a dynamic terminus' node properties ask for lifetime-policy delete-on-close (or for none: the
    default)."""
    properties.rewind()
    if not properties.next():
        return True
    value = properties.get_object()
    policy = value.get(symbol("lifetime-policy")) if isinstance(value, dict) else None
    return policy is None or getattr(policy, "descriptor", None) in _DELETE_ON_CLOSE


def _ack_all(acks: dict[Outbound, list[int]]) -> None:
    """Acknowledge the messages the client accepted, one core ack per consumer."""
    for outbound, ids in acks.items():
        if ids:
            outbound.consumer.ack_ids(ids)
    acks.clear()


def _core_message(data: bytes, node: convert.Node | None) -> WireMessage:
    """The core message of a transfer to ``node`` (None: the anonymous relay, to the message's ``to``)."""
    if node is not None:
        message = messages.to_core(data, node.address, node.routing, int(time.time() * 1000))
    else:
        message = messages.to_core(data, None, ROUTING_DEFAULT, int(time.time() * 1000))
        to = convert.resolve(message[M_ADDRESS])
        if to.queue is not None:
            raise convert.ConversionError("send to an address: a fully qualified queue name is for consumers")
        message[M_ADDRESS], message[M_ROUTING] = to.address, to.routing
    if len(message[M_PROPS]) > MAX_PROPERTIES:  # the core would end the whole link for a malformed message
        raise convert.ConversionError(f"more than {MAX_PROPERTIES} properties")
    return message
