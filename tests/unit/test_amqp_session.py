"""The AMQP 1.0 session's rules, frame by frame: a real core node in this process (``gateway_harness``), and on
the client's side python-qpid-proton's engine without I/O (its bytes fed to the session, the session's bytes
pushed into it), so that the session is checked against an independent implementation of the protocol.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import proton
import pytest
from cproton_ffi import ffi, lib
from proton import Collector, Condition, Connection, Data, Delivery, Endpoint, Link, Message, Terminus, Transport
from proton.reactor import Copy, DurableSubscription, Selector
from tests.unit.gateway_harness import (
    Core,
    MemoryWire,
    core_settings,
    end_sessions,
    eventually,
    running_core,
    settle,
    unused_port,
)

from tridentmq_amqp.protocol.types import Described, Symbol, UByte, UInt, ULong, decode, encode
from tridentmq_amqp.session import AmqpSession, Counters
from tridentmq_amqp.settings import AmqpLimitsSection, AmqpSettings, CoreLinkSection
from tridentmq_core.settings import AddressSettingsEntry, CoreSettings, PermissionEntry, UserEntry
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.message import RoutingType, new_message

SASL_HEADER = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
OPEN, BEGIN, ATTACH, FLOW, TRANSFER, DISPOSITION, DETACH, END, CLOSE = range(0x10, 0x19)
SASL_MECHANISMS, SASL_OUTCOME = 0x40, 0x44
DECLARED, TRANSACTIONAL_STATE = 0x33, 0x34
RELEASED = 0x26
_HEAD = struct.Struct(">IBBH")

#: Every client of the running test: waiting for one pumps the bytes of all, as their sockets would flow.
_clients: list[Client] = []


@pytest.fixture(autouse=True)
def _forget_clients() -> Iterator[None]:
    yield
    _clients.clear()


# ------------------------------------------------------------------------------------------------ raw frames
def frame(code: int, fields: list[Any], *, channel: int = 0, payload: bytes = b"", kind: int = 0) -> bytes:
    body = encode(Described(ULong(code), fields)) + payload
    return _HEAD.pack(_HEAD.size + len(body), 2, kind, channel) + body


def frames_of(data: bytes) -> list[tuple[int | None, list[Any]]]:
    """(performative code, fields) of each frame in ``data`` (after any protocol headers); None: an empty frame."""
    found: list[tuple[int | None, list[Any]]] = []
    while data:
        if data.startswith(b"AMQP"):
            data = data[8:]
            continue
        size, doff = _HEAD.unpack_from(data)[:2]
        body, data = data[doff * 4 : size], data[size:]
        if not body:
            found.append((None, []))
            continue
        value, _ = decode(body)
        assert isinstance(value, Described)
        found.append((int(value.descriptor), list(value.value)))
    return found


def error_of(fields: list[Any], index: int = 0) -> tuple[str, str]:
    error = fields[index]
    assert isinstance(error, Described), fields
    condition, description = [*error.value, None][:2]
    return str(condition), str(description)


# ------------------------------------------------------------------------------------------------ the client
class Client:
    """An AMQP client's side of one session: proton's engine, its bytes fed to the session and the session's
    bytes pushed back, with ``until`` pumping both ways while the loop runs the session and the core."""

    def __init__(
        self,
        core: Core,
        settings: AmqpSettings | None = None,
        *,
        mechanism: str | None = "ANONYMOUS",
        user: str | None = None,
        password: str | None = None,
        container: str = "client-1",
        idle_timeout_s: float = 0,
        raw: bool = False,
    ) -> None:
        self.wire = MemoryWire()
        self.counters = Counters()
        self.session = AmqpSession(settings or amqp_settings(core), core.links, self.wire, self.counters)
        core.opened(self.session)
        self.connection = Connection()
        self.connection.container = container
        self.transport = Transport()
        if idle_timeout_s:
            self.transport.idle_timeout = idle_timeout_s
        if mechanism is not None:
            sasl = self.transport.sasl()
            sasl.allowed_mechs(mechanism)
            sasl.allow_insecure_mechs = True
            if user is not None:
                self.connection.user = user
                self.connection.password = password or ""
        self.collector = Collector()
        self.transport.bind(self.connection)
        self.connection.collect(self.collector)
        self.received = b""  # every byte the session wrote
        self._inbox = bytearray()  # what proton's transport could not take yet
        self.events: list[Any] = []
        self.raw = raw  # the test writes the client's bytes itself: proton's are not sent
        _clients.append(self)

    # ------------------------------------------------------------------ bytes
    def pump(self) -> None:
        if self.raw:
            self.received += self.wire.take()
            return
        pending = self.transport.pending()
        if pending > 0 and not self.session._closed:
            self.session.feed(self.output())
        if not self.wire.writable():
            return  # the client does not read (``MemoryWire.stall``): what the session wrote waits in the wire
        out = self.wire.take()
        self.received += out
        self._inbox += out
        while self._inbox and (capacity := self.transport.capacity()) > 0:
            self.transport.push(bytes(self._inbox[:capacity]))
            del self._inbox[:capacity]
        if self.wire.closed and not self._inbox and self.transport.capacity() >= 0:
            self.transport.close_tail()
        while (event := self.collector.peek()) is not None:
            self.events.append(event.type)
            self.collector.pop()

    def output(self) -> bytes:
        """What proton has to send, taken from it."""
        pending = self.transport.pending()
        data = self.transport.peek(pending) if pending > 0 else b""
        assert data is not None
        self.transport.pop(len(data))
        return bytes(data)

    def inject(self, data: bytes) -> None:
        """Raw bytes after everything proton has to send."""
        self.pump()
        self.session.feed(data)

    async def until(self, condition: Callable[[], Any], what: str) -> Any:
        def pumped() -> Any:
            for client in _clients:
                client.pump()
            return condition()

        return await eventually(pumped, what)

    async def nothing(self, rounds: int = 25) -> None:
        """Let everything flow that would, both ways and again: the clients' frames to their sessions, a loop
        turn for the sessions (they write a turn later) and the core to answer, what they wrote back to the
        clients, whose answers go out in the next round. Nothing is asserted here: what a test then finds
        missing had these rounds to come."""
        for _ in range(rounds):
            for client in _clients:
                client.pump()
            await settle(1)
        for client in _clients:
            client.pump()

    # ------------------------------------------------------------------ endpoints
    async def open(self) -> None:
        self.connection.open()
        await self.until(lambda: self.connection.state & Endpoint.REMOTE_ACTIVE, "the gateway's OPEN")

    async def begin(self) -> proton.Session:
        session = self.connection.session()
        session.open()
        await self.until(lambda: session.state & Endpoint.REMOTE_ACTIVE, "the gateway's BEGIN")
        return session

    async def attached(self, link: Link) -> Link:
        link.open()
        await self.until(lambda: link.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED), "the ATTACH")
        return link

    async def sender(self, address: str | None, *, session: proton.Session | None = None, name: str = "s") -> Any:
        sender = (session or self.connection.session()).sender(name)
        sender.session.open()
        if address is not None:
            sender.target.address = address
        await self.attached(sender)
        assert sender.state & Endpoint.REMOTE_ACTIVE, sender.remote_condition
        return sender

    def receiver_link(self, address: str | None, *, name: str = "r", options: tuple[Any, ...] = ()) -> Any:
        receiver = self.connection.session().receiver(name)
        receiver.session.open()
        if address is not None:
            receiver.source.address = address
        for option in options:
            option.apply(receiver)
        return receiver

    async def receiver(
        self, address: str | None, *, name: str = "r", credit: int = 10, options: tuple[Any, ...] = ()
    ) -> Any:
        receiver = await self.attached(self.receiver_link(address, name=name, options=options))
        assert receiver.state & Endpoint.REMOTE_ACTIVE, receiver.remote_condition
        assert receiver.remote_source.address is not None  # not refused (a null source)
        if credit:
            receiver.flow(credit)
        return receiver

    async def refused(self, link: Link) -> Condition:
        """The link is attached with a null terminus and detached at once: the condition why."""
        await self.attached(link)
        await self.until(lambda: link.state & Endpoint.REMOTE_CLOSED, "the refusing DETACH")
        terminus = link.remote_target if link.is_sender else link.remote_source
        assert terminus.type == Terminus.UNSPECIFIED or terminus.address is None
        condition = link.remote_condition
        assert condition is not None
        return condition

    async def close(self, link: Link) -> None:
        """Close the link and wait for the gateway's answer."""
        link.close()
        await self.until(lambda: link.state & Endpoint.REMOTE_CLOSED, "the answering DETACH")

    async def closed_link(self, link: Link) -> Condition:
        await self.until(lambda: link.state & Endpoint.REMOTE_CLOSED, "a DETACH")
        condition = link.remote_condition
        assert condition is not None
        return condition

    async def connection_closed(self) -> Condition | None:
        await self.until(lambda: self.connection.state & Endpoint.REMOTE_CLOSED, "the gateway's CLOSE")
        return self.connection.remote_condition

    # ------------------------------------------------------------------ messages
    async def send(self, sender: Any, message: Message, *, presettled: bool = False) -> Delivery:
        """Send and wait for the gateway to settle it (a pre-settled one: for the bytes to go)."""
        delivery: Delivery = sender.send(message)
        if presettled:
            delivery.settle()
            await self.until(lambda: self.transport.pending() <= 0, "the transfer sent")
            return delivery
        await self.until(lambda: delivery.remote_state, "the disposition")
        assert delivery.settled  # settled by the gateway, with its outcome
        return delivery

    async def receive(self, receiver: Any) -> tuple[Delivery, Message]:
        def ready() -> Delivery | None:
            current = receiver.current
            return current if current is not None and current.readable and not current.partial else None

        delivery: Delivery = await self.until(ready, "a transfer")
        message = Message()
        message.decode(receiver.recv(delivery.pending))
        receiver.advance()
        return delivery, message

    async def bodies(self, receiver: Any, count: int, outcome: int = Delivery.ACCEPTED) -> list[Any]:
        got = []
        for _ in range(count):
            delivery, message = await self.receive(receiver)
            delivery.update(outcome)
            delivery.settle()
            got.append(bytes(message.body) if isinstance(message.body, memoryview) else message.body)
        return got

    async def none_for(self, receiver: Any) -> None:
        """No transfer is waiting on ``receiver`` once everything flowed (what the client did last included)."""
        await self.nothing()
        assert receiver.current is None or not receiver.current.readable, "an unexpected transfer"

    def transfers(self) -> int:
        """How many TRANSFER frames the session wrote so far."""
        return [code for code, _ in frames_of(self.received)].count(TRANSFER)


class Capabilities:
    """A source with these capabilities (as Qpid JMS attaches its subscriptions)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def apply(self, link: Link) -> None:
        capabilities = link.source.capabilities
        capabilities.put_array(described=False, element_type=Data.SYMBOL)
        capabilities.enter()
        for name in self.names:
            capabilities.put_symbol(proton.symbol(name))
        capabilities.exit()


def symbols(data: Data) -> list[str]:
    data.rewind()
    if not data.next():
        return []
    value = data.get_object()
    if isinstance(value, str):
        return [value]
    elements = getattr(value, "elements", None)
    assert elements is not None, value
    return [str(v) for v in elements]


def amqp_settings(core: Core, **limits: Any) -> AmqpSettings:
    return AmqpSettings(core=CoreLinkSection(port=core.port), amqp=AmqpLimitsSection(**limits))


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        yield core


async def connected(core: Core, **kwargs: Any) -> Client:
    client = Client(core, **kwargs)
    await client.open()
    return client


def queued(core: Core, name: str) -> int:
    queue = core.node.broker.queues.get(name)
    return -1 if queue is None else len(queue)


# ------------------------------------------------------------------------------------------------ connecting
async def test_sasl_anonymous_opens_and_the_gateway_announces_itself(core: Core) -> None:
    c = await connected(core)
    assert c.connection.remote_container == "gateway-amqp"
    assert set(c.connection.remote_offered_capabilities) == {"ANONYMOUS-RELAY", "SHARED-SUBS"}
    assert c.wire.logged_in_called
    assert c.counters.connections_total == 1
    assert c.received.startswith(SASL_HEADER)
    mechanisms = frames_of(c.received[:8] + c.received[8:].split(AMQP_HEADER)[0])[0]
    assert mechanisms[0] == SASL_MECHANISMS
    assert mechanisms[1][0].items == ["PLAIN", "ANONYMOUS"]


def secured(tmp_path: Path, *grants: tuple[str, str]) -> CoreSettings:
    """A core with one user, alice (password secret), granted ``(match, permission)``."""
    return core_settings(
        tmp_path,
        users=[UserEntry("alice", "secret", ["app"])],
        permissions=[PermissionEntry(match, permission, ["app"]) for match, permission in grants],
    )


ALL_ON_OPEN = tuple(
    ("open.#", permission)
    for permission in ("send", "consume", "browse", "createAddress", "createDurableQueue", "deleteDurableQueue")
)


def sasl_frames(client: Client) -> list[tuple[int | None, list[Any]]]:
    return [f for f in frames_of(client.received.split(AMQP_HEADER)[0]) if f[0] is not None and f[0] >= 0x40]


async def test_plain_with_the_right_password_logs_in_as_that_user(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path, *ALL_ON_OPEN), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret")
        assert c.transport.sasl().outcome == proton.SASL.OK
        sender = await c.sender("open.orders")
        delivery = await c.send(sender, Message(body="x"))
        assert delivery.remote_state == Delivery.ACCEPTED
        assert queued(core, "open.orders") == 1
        # The core knows the client as alice: what alice may not do is refused.
        condition = await c.refused(c.receiver_link("secret.things"))
        assert condition.name == "amqp:unauthorized-access"


async def test_plain_with_a_wrong_password_gets_outcome_auth_and_the_socket_closes(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        c = Client(core, mechanism="PLAIN", user="alice", password="wrong")
        c.connection.open()
        await c.until(lambda: c.wire.closed, "the socket closed")
        assert sasl_frames(c)[-1] == (SASL_OUTCOME, [1])  # auth
        assert c.transport.sasl().outcome == proton.SASL.AUTH
        assert c.counters.refused == 1
        assert not c.wire.logged_in_called
        assert AMQP_HEADER not in c.received  # proton's engine was never reached


async def test_a_mechanism_not_offered_gets_outcome_auth(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        c = Client(core, amqp_settings(core, allow_anonymous=False), mechanism=None, raw=True)
        c.session.feed(SASL_HEADER + frame(0x41, [Symbol("ANONYMOUS"), b""], kind=1))
        await c.until(lambda: c.wire.closed, "the socket closed")
        frames = sasl_frames(c)
        assert frames[0][0] == SASL_MECHANISMS
        assert frames[0][1][0].items == ["PLAIN"]  # ANONYMOUS is not offered
        assert frames[-1] == (SASL_OUTCOME, [1])


async def test_without_sasl_while_anonymous_access_is_off_the_client_gets_the_sasl_header(core: Core) -> None:
    c = Client(core, amqp_settings(core, allow_anonymous=False), mechanism=None)
    c.connection.open()
    await c.until(lambda: c.wire.closed, "the socket closed")
    assert c.received == SASL_HEADER
    assert not c.wire.logged_in_called


async def test_a_client_without_sasl_is_anonymous(core: Core) -> None:
    c = await connected(core, mechanism=None)
    assert c.received.startswith(AMQP_HEADER)
    sender = await c.sender("plain")
    assert (await c.send(sender, Message(body=1))).remote_state == Delivery.ACCEPTED


async def test_without_sasl_a_core_with_users_refuses_at_the_open(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path), lambda port: CoreLinkSection(port=port)) as core:
        c = Client(core, mechanism=None)
        c.connection.open()
        condition = await c.connection_closed()
        assert condition is not None
        assert condition.name == "amqp:unauthorized-access"
        assert c.counters.refused == 1
        # The client's own CLOSE ends it.
        c.connection.close()
        await c.until(lambda: c.wire.closed, "the socket closed")


async def test_a_gateway_without_a_core_answers_sys_temp() -> None:
    port = unused_port()  # the core is down
    links = CoreLinks(CoreLinkSection(port=port, shared_links=0), name="gateway-test")
    wire = MemoryWire()
    counters = Counters()
    session = AmqpSession(AmqpSettings(core=CoreLinkSection(port=port)), links, wire, counters)
    try:
        session.feed(SASL_HEADER + frame(0x41, [Symbol("ANONYMOUS"), b""], kind=1))
        await eventually(lambda: wire.closed, "the socket closed")
        assert frames_of(wire.take())[-1] == (SASL_OUTCOME, [4])  # sys-temp: try again later
        assert counters.refused == 1
        assert not wire.logged_in_called
    finally:
        try:
            await end_sessions([session])
        finally:
            await links.stop()


async def test_sasl_not_finished_in_time_closes_the_socket(core: Core) -> None:
    c = Client(core, amqp_settings(core, connect_timeout_ms=50), mechanism=None, raw=True)
    c.session.feed(SASL_HEADER)
    await c.until(lambda: c.wire.closed, "the socket closed")
    assert [code for code, _ in frames_of(c.received)] == [SASL_MECHANISMS]


async def test_the_amqp_header_without_an_open_in_time_gets_open_and_close(core: Core) -> None:
    c = Client(core, amqp_settings(core, connect_timeout_ms=50), mechanism=None, raw=True)
    c.session.feed(AMQP_HEADER)
    await c.until(lambda: c.wire.closed, "the socket closed")
    frames = frames_of(c.received)
    assert [code for code, _ in frames] == [OPEN, CLOSE]
    assert error_of(frames[1][1]) == ("amqp:connection:forced", "no OPEN in time")


async def test_close_is_answered_and_the_session_ends(core: Core) -> None:
    c = await connected(core)
    c.connection.close()
    assert await c.connection_closed() is None
    await c.until(lambda: c.wire.closed, "the socket closed")
    await c.session.wait_closed()


async def test_a_gateway_shutting_down_closes_with_connection_forced(core: Core) -> None:
    c = await connected(core)
    c.session.shutdown()
    condition = await c.connection_closed()
    assert condition is not None
    assert (condition.name, condition.description) == ("amqp:connection:forced", "the gateway is shutting down")
    await c.session.wait_closed()


async def test_a_silent_client_is_closed_after_twice_the_idle_timeout(core: Core) -> None:
    c = Client(core, amqp_settings(core, idle_timeout_ms=50))
    await c.open()
    assert c.transport.remote_idle_timeout == pytest.approx(0.05)  # announced as set
    condition = await c.connection_closed()
    assert condition is not None
    assert condition.name == "amqp:resource-limit-exceeded"


async def test_a_client_announcing_an_idle_timeout_gets_heartbeats(core: Core) -> None:
    c = Client(core, idle_timeout_s=0.1)
    await c.open()
    opened = len(c.received)
    await c.until(lambda: frames_of(c.received[opened:]).count((None, [])) >= 2, "two empty frames")
    assert not c.connection.state & Endpoint.REMOTE_CLOSED


# ------------------------------------------------------------------------------------------------ protocol errors
async def test_bytes_that_are_no_frame_close_the_connection_with_a_framing_error(core: Core) -> None:
    c = await connected(core)
    c.inject(b"\x00\x00\x00\x04garbage")  # a frame shorter than its own header
    condition = await c.connection_closed()
    assert condition is not None
    assert condition.name == "amqp:connection:framing-error"
    assert c.counters.protocol_errors == 1
    await c.until(lambda: c.wire.closed, "the socket closed")


async def test_a_frame_that_cannot_be_decoded_closes_the_connection_with_a_decode_error(core: Core) -> None:
    c = await connected(core)
    c.inject(_HEAD.pack(12, 2, 0, 0) + b"\xff\xff\xff\xff")
    condition = await c.connection_closed()
    assert condition is not None
    assert condition.name == "amqp:decode-error"
    assert c.counters.protocol_errors == 1


async def test_a_string_that_is_not_utf8_closes_with_a_decode_error(core: Core) -> None:
    c = Client(core, mechanism=None, raw=True)
    good = frame(OPEN, ["abcd"])
    c.session.feed(AMQP_HEADER + good.replace(b"abcd", b"ab\xff\xfe"))
    await c.until(lambda: c.wire.closed, "the socket closed")
    frames = frames_of(c.received)
    assert frames[-1][0] == CLOSE
    assert error_of(frames[-1][1])[0] == "amqp:decode-error"


async def test_another_protocol_gets_the_sasl_header_and_a_close(core: Core) -> None:
    c = Client(core, mechanism=None, raw=True)
    c.session.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await c.until(lambda: c.wire.closed, "the socket closed")
    assert c.received == SASL_HEADER


async def test_a_stream_ending_in_a_frame_is_closed_with_a_framing_error(core: Core) -> None:
    c = await connected(core)
    c.inject(b"\x00\x00\x00\x40\x02\x00\x00\x00\x00S")  # the start of a 64-byte frame
    await c.nothing()
    c.session.connection_lost()
    await c.session.wait_closed()
    frames = frames_of(c.received + c.wire.take())
    assert frames[-1][0] == CLOSE
    assert error_of(frames[-1][1]) == ("amqp:connection:framing-error", "connection aborted in the middle of a frame")


# ------------------------------------------------------------------------------------------------ sending
async def test_an_unsettled_transfer_is_accepted_once_the_core_has_it(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core, container="consumer")
    sender = await producer.sender("orders")
    assert sender.credit == 1000  # amqp.link_credit
    assert sender.remote_max_message_size == 8 * 1024 * 1024
    delivery = await producer.send(sender, Message(body="order 1", durable=True))
    assert delivery.remote_state == Delivery.ACCEPTED
    assert queued(core, "orders") == 1
    assert producer.counters.messages_published == 1
    receiver = await consumer.receiver("orders")
    assert receiver.remote_source.address == "orders"
    assert await consumer.bodies(receiver, 1) == ["order 1"]
    assert consumer.counters.messages_delivered == 1
    await consumer.until(
        lambda: queued(core, "orders") == 0 and core.node.broker.queues["orders"].in_flight == 0, "ack"
    )


async def test_credit_is_topped_up_when_half_is_used(core: Core) -> None:
    c = Client(core, amqp_settings(core, link_credit=4))
    await c.open()
    sender = await c.sender("topped")
    assert sender.credit == 4
    for n in range(2):
        await c.send(sender, Message(body=n))
    await c.until(lambda: sender.credit == 4, "the credit topped up")  # half used: that much more
    await c.send(sender, Message(body=2))
    await c.nothing()
    assert sender.credit == 3  # less than half used: no top-up yet
    assert queued(core, "topped") == 3


def settled_before_detach(data: bytes) -> list[int]:
    """The delivery-ids the gateway settled as a receiver before its first DETACH."""
    frames = frames_of(data)
    end = next((n for n, (code, _) in enumerate(frames) if code == DETACH), len(frames))
    return settled_in(frames[:end])


async def test_transfers_beyond_the_credit_detach_the_link_and_are_not_published(core: Core) -> None:
    c = Client(core, amqp_settings(core, link_credit=2))
    await c.open()
    sender = await c.sender("limited")
    first, second = sender.send(Message(body=0)), sender.send(Message(body=1))
    data = c.output()
    beyond = frame(TRANSFER, [UInt(0), UInt(2), b"t3", UInt(0), False, False], payload=Message(body=2).encode())
    c.session.feed(data + beyond)  # one read: no top-up in between
    condition = await c.closed_link(sender)
    assert condition.name == "amqp:link:transfer-limit-exceeded"
    # The two within the credit were published: the client is told before the detach (or it sends them again).
    assert (first.remote_state, second.remote_state) == (Delivery.ACCEPTED, Delivery.ACCEPTED)
    assert settled_before_detach(c.received) == [0, 1]
    await c.nothing()
    assert queued(core, "limited") == 2


def held_by_proton(c: Client) -> tuple[int, int]:
    """(bytes of the client's transfers, deliveries not settled) that the gateway's proton holds."""
    engine = c.session.engine
    assert engine is not None
    pn_connection = engine.connection._impl
    held = unsettled = 0
    session = lib.pn_session_head(pn_connection, 0)
    while session != ffi.NULL:
        held += lib.pn_session_incoming_bytes(session)
        session = lib.pn_session_next(session, 0)
    link = lib.pn_link_head(pn_connection, 0)
    while link != ffi.NULL:
        unsettled += lib.pn_link_unsettled(link)
        link = lib.pn_link_next(link, 0)
    return held, unsettled


async def test_transfers_on_a_link_the_gateway_detached_are_dropped_as_they_come(core: Core) -> None:
    c = Client(core, amqp_settings(core, link_credit=2))
    await c.open()
    sender = await c.sender("ignored")
    first, second = sender.send(Message(body=0)), sender.send(Message(body=1))
    data = c.output()
    payload = Message(body=b"x" * 10_000).encode()

    def transfer(delivery_id: int) -> bytes:
        fields = [UInt(0), UInt(delivery_id), b"t%d" % delivery_id, UInt(0), False, False]
        return frame(TRANSFER, fields, payload=payload)

    # Beyond the credit, and more after it in the same read: the link waits for the outcomes of the two
    # within it before its detach.
    c.session.feed(data + b"".join(transfer(n) for n in range(2, 20)))
    condition = await c.closed_link(sender)
    assert condition.name == "amqp:link:transfer-limit-exceeded"
    assert (first.remote_state, second.remote_state) == (Delivery.ACCEPTED, Delivery.ACCEPTED)
    assert settled_before_detach(c.received) == [0, 1]
    # The client goes on sending on the handle it was told is detached.
    c.session.feed(b"".join(transfer(n) for n in range(20, 120)))
    await c.nothing()
    assert held_by_proton(c) == (0, 0)
    # Each dropped one is released after the detach: not processed, and the client knows it.
    frames = frames_of(c.received)
    detach = next(n for n, (code, _) in enumerate(frames) if code == DETACH)
    assert settled_in(frames[detach:]) == list(range(2, 120))
    assert {outcome_of(fields) for code, fields in frames[detach:] if code == DISPOSITION} == {RELEASED}
    assert c.connection.state & Endpoint.REMOTE_ACTIVE
    assert queued(core, "ignored") == 2
    other = await c.sender("ignored", name="other")
    assert (await c.send(other, Message(body="next"))).remote_state == Delivery.ACCEPTED


async def test_presettled_transfers_are_published(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core, container="consumer")
    sender = producer.connection.session().sender("fire")
    sender.session.open()
    sender.target.address = "fire"
    sender.snd_settle_mode = Link.SND_SETTLED
    await producer.attached(sender)
    for n in range(3):
        await producer.send(sender, Message(body=n), presettled=True)
    receiver = await consumer.receiver("fire")
    assert await consumer.bodies(receiver, 3) == [0, 1, 2]
    assert producer.counters.messages_published == 3


async def test_queue_and_topic_prefixes_route_as_they_say(core: Core) -> None:
    producer, a, b = await connected(core), await connected(core, container="a"), await connected(core, container="b")
    queue_a = await a.receiver("queue://jobs", name="qa")
    topic_a = await a.receiver("topic://news", name="ta")
    topic_b = await b.receiver("topic://news", name="tb")
    assert symbols(topic_a.remote_source.capabilities) == ["topic"]  # what it attached to
    assert symbols(queue_a.remote_source.capabilities) == ["queue"]
    to_queue, to_topic = await producer.sender("queue://jobs", name="sq"), await producer.sender("topic://news")
    for n in range(2):
        await producer.send(to_queue, Message(body=f"job {n}"))
        await producer.send(to_topic, Message(body=f"news {n}"))
    assert await a.bodies(queue_a, 2) == ["job 0", "job 1"]
    assert await a.bodies(topic_a, 2) == ["news 0", "news 1"]
    assert await b.bodies(topic_b, 2) == ["news 0", "news 1"]
    await b.none_for(topic_b)


async def test_a_topic_capability_makes_a_bare_address_multicast(core: Core) -> None:
    producer, consumer = await connected(core), await connected(core, container="consumer")

    receiver = await consumer.receiver("alerts", options=(Capabilities("topic"),))
    assert core.node.broker.queues.get("alerts") is None  # a subscription queue of its own, not "alerts"
    sender = await producer.sender("topic://alerts")
    await producer.send(sender, Message(body="fire"))
    assert await consumer.bodies(receiver, 1) == ["fire"]


async def test_the_anonymous_relay_sends_each_message_to_its_to(core: Core) -> None:
    c = await connected(core)
    relay = await c.sender(None)
    assert relay.remote_target.address is None
    assert (await c.send(relay, Message(address="queue://relayed", body=1))).remote_state == Delivery.ACCEPTED
    assert (await c.send(relay, Message(address="bare", body=2))).remote_state == Delivery.ACCEPTED
    assert queued(core, "relayed") == 1
    assert queued(core, "bare") == 1
    for message, description in [
        (Message(body=3), "a message sent to the anonymous relay needs a to address"),
        (Message(address="a::b", body=4), "send to an address: a fully qualified queue name is for consumers"),
    ]:
        delivery = await c.send(relay, message)
        assert delivery.remote_state == Delivery.REJECTED
        condition = delivery.remote.condition
        assert condition is not None
        assert condition.name == "amqp:invalid-field"
        assert str(condition.description).startswith(description)  # (the decoder's errors add their condition)
    assert relay.state & Endpoint.REMOTE_ACTIVE  # the link stays


async def test_a_dynamic_target_is_a_temporary_queue(core: Core) -> None:
    c = await connected(core)
    sender = c.connection.session().sender("dyn")
    sender.session.open()
    sender.target.dynamic = True
    await c.attached(sender)
    address = sender.remote_target.address
    assert address is not None
    assert address.startswith(f"tmp.amqp.{c.session.id}.")
    await c.send(sender, Message(body="kept"))
    assert queued(core, address) == 1
    assert core.node.broker.queues[address].temporary


def temporary_queue_sender(c: Client, name: str) -> Any:
    """A sending link with a dynamic target as Qpid JMS makes a TemporaryQueue (deleted by closing the link)."""
    sender = c.connection.session().sender(name)
    sender.session.open()
    sender.target.dynamic = True
    sender.target.expiry_policy = Terminus.EXPIRE_WITH_LINK
    properties = sender.target.properties
    properties.put_map()
    properties.enter()
    properties.put_symbol(proton.symbol("lifetime-policy"))
    properties.put_object(proton.Described(proton.ulong(0x2B), []))  # delete-on-close
    properties.exit()
    return sender


@pytest.mark.parametrize("closed", [True, False])
async def test_a_dynamic_node_is_deleted_with_the_link_that_made_it(core: Core, closed: bool) -> None:
    c = await connected(core)
    sender = await c.attached(temporary_queue_sender(c, "jms-temp-queue"))
    address = sender.remote_target.address
    assert address in core.node.broker.queues
    if closed:
        sender.close()
    else:
        sender.detach()  # its terminus expires with the link: gone all the same
    await c.until(lambda: address not in core.node.broker.queues, "the temporary queue deleted")
    assert c.connection.state & Endpoint.REMOTE_ACTIVE
    link = c.receiver_link(None, name="replies")
    link.source.dynamic = True  # proton's: expires with the session, so detaching keeps it, closing does not
    replies = await c.attached(link)
    reply_to = replies.remote_source.address
    replies.detach()
    await c.until(lambda: proton.Event.LINK_REMOTE_DETACH in c.events, "the answering DETACH")
    assert reply_to in core.node.broker.queues
    again = c.receiver_link(None, name="replies-2")
    again.source.dynamic = True
    again = await c.attached(again)
    reply_to = again.remote_source.address
    again.close()
    await c.until(lambda: reply_to not in core.node.broker.queues, "the temporary queue deleted")


class Capability:
    """A source or target capability, as Qpid JMS gives the type of a destination (``temporary-topic`` ...)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def apply(self, link: Any) -> None:
        terminus = link.source if link.is_receiver else link.target
        terminus.capabilities.put_array(described=False, element_type=Data.SYMBOL)
        terminus.capabilities.enter()
        terminus.capabilities.put_symbol(proton.symbol(self.name))
        terminus.capabilities.exit()


async def test_a_jms_temporary_topic_gives_each_subscriber_every_message(core: Core) -> None:
    c, other = await connected(core), await connected(core, container="other")
    creator = c.connection.session().sender("qpid-jms:temp-topic-creator:1")
    creator.session.open()
    creator.target.dynamic = True
    Capability("temporary-topic").apply(creator)
    await c.attached(creator)
    address = creator.remote_target.address
    assert address is not None
    option = (Capability("temporary-topic"),)
    first = await c.receiver(address, name="one", options=option)
    second = await other.receiver(address, name="two", options=option)
    publisher = other.connection.session().sender("publisher")
    publisher.session.open()
    publisher.target.address = address
    Capability("temporary-topic").apply(publisher)
    await other.attached(publisher)
    await other.send(publisher, Message(body="to all"))
    assert await c.bodies(first, 1) == ["to all"]
    assert await other.bodies(second, 1) == ["to all"]  # a copy each, as on a topic


async def test_a_sender_to_a_fully_qualified_queue_name_is_refused(core: Core) -> None:
    c = await connected(core)
    link = c.connection.session().sender("fq")
    link.session.open()
    link.target.address = "orders::audit"
    condition = await c.refused(link)
    assert (condition.name, condition.description) == (
        "amqp:invalid-field",
        "send to an address: a fully qualified queue name is for consumers",
    )


async def test_a_message_that_is_not_amqp_is_rejected_and_the_link_stays(core: Core) -> None:
    c = await connected(core)
    sender = await c.sender("bad")
    delivery = sender.delivery(b"raw")
    sender.stream(b"\x00\x53\x77\xff")  # an amqp-value of an unknown type
    sender.advance()
    await c.until(lambda: delivery.remote_state, "the disposition")
    assert delivery.remote_state == Delivery.REJECTED
    assert delivery.remote.condition is not None
    assert delivery.remote.condition.name == "amqp:decode-error"
    assert (await c.send(sender, Message(body="good"))).remote_state == Delivery.ACCEPTED
    assert queued(core, "bad") == 1


async def test_a_message_over_max_message_size_detaches_the_link_and_the_connection_goes_on(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_message_bytes=1000))
    await c.open()
    sender = await c.sender("big")
    assert sender.remote_max_message_size == 1000
    sender.send(Message(body=b"x" * 2000))
    condition = await c.closed_link(sender)
    assert condition.name == "amqp:link:message-size-exceeded"
    assert queued(core, "big") <= 0
    other = await c.sender("big", name="other")
    assert (await c.send(other, Message(body=b"small"))).remote_state == Delivery.ACCEPTED


async def test_transfers_before_one_over_max_message_size_are_settled_before_the_detach(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_message_bytes=1000))
    await c.open()
    sender = await c.sender("sized")
    small = [sender.send(Message(body=n)) for n in range(3)]
    big = sender.send(Message(body=b"x" * 2000))  # in the same read as the three: none is confirmed yet
    condition = await c.closed_link(sender)
    assert condition.name == "amqp:link:message-size-exceeded"
    assert [d.remote_state for d in small] == [Delivery.ACCEPTED] * 3
    assert settled_before_detach(c.received) == [0, 1, 2]
    await c.until(lambda: big.settled, "the big one settled")  # after the detach: not processed
    assert big.remote_state == Delivery.RELEASED
    assert queued(core, "sized") == 3


async def test_a_message_in_many_frames_arrives_whole(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_frame_bytes=512))
    await c.open()
    assert c.transport.remote_max_frame_size == 512
    sender = await c.sender("frames")
    body = bytes(range(256)) * 40
    assert (await c.send(sender, Message(body=body))).remote_state == Delivery.ACCEPTED
    receiver = await c.receiver("frames")
    assert await c.bodies(receiver, 1) == [body]


async def test_too_many_incomplete_bytes_close_the_connection(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_frame_bytes=512, max_incomplete_bytes=2000))
    await c.open()
    sender = await c.sender("incomplete")
    delivery = sender.delivery(b"t")
    sender.stream(b"\x00\x53\x75\xb0\x00\x00\x10\x00" + b"x" * 3000)  # a data section of 4096 bytes: 3000 of it
    condition = await c.connection_closed()
    assert condition is not None
    assert condition.name == "amqp:resource-limit-exceeded"
    assert not delivery.settled


async def test_after_its_close_the_gateway_holds_nothing_more_the_client_sends(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_incomplete_bytes=2000))
    await c.open()
    await c.sender("incomplete")  # channel 0
    await c.sender("incomplete", name="other")  # channel 1

    def transfer(channel: int, delivery_id: int, payload: bytes, *, more: bool) -> bytes:
        fields = [UInt(0), UInt(delivery_id), b"t%d" % delivery_id, UInt(0), False, more]  # each in its session
        return frame(TRANSFER, fields, channel=channel, payload=payload)

    start = b"\x00\x53\x75\xb0\x00\x10\x00\x00"  # a data section of 1 MiB
    c.session.feed(c.output() + transfer(0, 0, start + b"x" * 3000, more=True))
    condition = await c.connection_closed()
    assert condition is not None
    assert condition.name == "amqp:resource-limit-exceeded"
    # The client has not read the CLOSE yet: it goes on with that message, and sends others.
    c.raw = True
    closed_at = len(c.received)
    for n in range(1, 31):
        whole = transfer(1, n - 1, Message(body=n).encode(), more=False)
        c.session.feed(transfer(0, 0, b"x" * 30_000, more=True) + whole)
        await settle(1)
    assert held_by_proton(c)[0] == 0
    assert frames_of(c.received[closed_at:]) == []  # nothing said after the CLOSE
    assert c.counters.messages_published == 0
    assert queued(core, "incomplete") <= 0


# ------------------------------------------------------------------------------------------------ receiving
async def fill(core: Core, address: str, *bodies: Any, **fields: Any) -> None:
    """Messages sent by a client of their own."""
    producer = await connected(core, container=f"producer-{address}")
    sender = await producer.sender(address)
    for body in bodies:
        assert (await producer.send(sender, Message(body=body, **fields))).remote_state == Delivery.ACCEPTED


async def test_deliveries_follow_the_client_s_credit(core: Core) -> None:
    await fill(core, "credit", *range(5))
    c = await connected(core)
    receiver = await c.receiver("credit", credit=2)
    assert await c.bodies(receiver, 2) == [0, 1]
    queue = core.node.broker.queues["credit"]
    await c.until(lambda: queue.acked == 2, "the two settled in the core")  # their dispositions were handled
    await c.none_for(receiver)  # no credit left: settling gives none back
    assert c.transfers() == 2
    assert receiver.credit == 0
    assert c.counters.messages_delivered == 2  # not even handed to proton (which would hold it back)
    receiver.flow(3)
    assert await c.bodies(receiver, 3) == [2, 3, 4]
    await c.until(lambda: queue.acked == 5, "all five settled in the core")
    assert c.transfers() == 5
    assert c.counters.messages_delivered == 5


async def test_accepted_messages_are_gone(core: Core) -> None:
    await fill(core, "acc", "a")
    c = await connected(core)
    receiver = await c.receiver("acc")
    delivery, message = await c.receive(receiver)
    assert (message.body, message.delivery_count) == ("a", 0)
    assert not delivery.settled  # at least once: it waits for the client
    assert core.node.broker.queues["acc"].in_flight == 1
    delivery.update(Delivery.ACCEPTED)
    delivery.settle()
    await c.until(lambda: core.node.broker.queues["acc"].in_flight == 0, "the ack")
    assert queued(core, "acc") == 0


async def test_released_and_unfailed_modified_messages_come_back_uncounted(core: Core) -> None:
    await fill(core, "rel", "a")
    c = await connected(core)
    receiver = await c.receiver("rel")
    delivery, _ = await c.receive(receiver)
    delivery.update(Delivery.RELEASED)
    delivery.settle()
    delivery, message = await c.receive(receiver)
    assert (message.body, message.delivery_count) == ("a", 0)
    delivery.local.failed = False
    delivery.update(Delivery.MODIFIED)
    delivery.settle()
    delivery, message = await c.receive(receiver)
    assert (message.body, message.delivery_count) == ("a", 0)


async def test_a_failed_modified_message_comes_back_counted(core: Core) -> None:
    await fill(core, "mod", "a")
    c = await connected(core)
    receiver = await c.receiver("mod")
    delivery, _ = await c.receive(receiver)
    delivery.local.failed = True
    delivery.update(Delivery.MODIFIED)
    delivery.settle()
    delivery, message = await c.receive(receiver)
    assert (message.body, message.delivery_count) == ("a", 1)
    assert message.first_acquirer is False


async def test_a_rejected_message_goes_to_the_dead_letters(core: Core) -> None:
    await fill(core, "rej", "bad")
    c = await connected(core)
    receiver = await c.receiver("rej")
    delivery, _ = await c.receive(receiver)
    delivery.update(Delivery.REJECTED)
    delivery.settle()
    dead = await c.receiver("DLQ", name="dlq")
    _, message = await c.receive(dead)
    assert message.body == "bad"
    assert message.annotations is not None
    assert message.annotations["x-opt-ORIG-ADDRESS"] == "rej"
    assert message.annotations["x-opt-ORIG-REASON"] == "rejected"
    assert queued(core, "rej") == 0


async def test_a_received_state_waits_for_the_outcome(core: Core) -> None:
    await fill(core, "recv", "a")
    queue = core.node.broker.queues["recv"]
    c = await connected(core)
    receiver = await c.receiver("recv")
    delivery, _ = await c.receive(receiver)
    delivery.update(Delivery.RECEIVED)  # how far it got, no outcome: the message stays the link's
    await c.nothing()
    assert not delivery.settled
    assert (len(queue), queue.in_flight, queue.acked) == (0, 1, 0)
    # The link ends without an outcome: the message was never acknowledged, so it comes back.
    await c.close(receiver)
    await c.until(lambda: (len(queue), queue.in_flight) == (1, 0), "the message back in the queue")
    assert queue.acked == 0
    again = await c.receiver("recv", name="again")
    delivery, message = await c.receive(again)
    assert message.body == "a"
    delivery.update(Delivery.RECEIVED)
    await c.nothing()
    assert not delivery.settled
    assert queue.acked == 0
    delivery.update(Delivery.ACCEPTED)  # the outcome settles it
    delivery.settle()
    await c.until(lambda: queue.acked == 1, "the ack")
    assert (len(queue), queue.in_flight) == (0, 0)


async def test_settled_without_an_outcome_is_accepted(core: Core) -> None:
    await fill(core, "bare-settle", "a")
    c = await connected(core)
    receiver = await c.receiver("bare-settle")
    delivery, _ = await c.receive(receiver)
    delivery.settle()
    queue = core.node.broker.queues["bare-settle"]
    await c.until(lambda: queue.acked == 1, "the ack")  # accepted, not given back
    assert (len(queue), queue.in_flight) == (0, 0)


async def test_an_at_most_once_receiver_gets_presettled_transfers(core: Core) -> None:
    await fill(core, "amo", "a", "b")
    c = await connected(core)
    link = c.receiver_link("amo")
    link.snd_settle_mode = Link.SND_SETTLED
    receiver = await c.attached(link)
    assert receiver.remote_snd_settle_mode == Link.SND_SETTLED
    receiver.flow(10)
    first, _ = await c.receive(receiver)
    second, _ = await c.receive(receiver)
    assert first.settled
    assert second.settled
    await c.until(lambda: core.node.broker.queues["amo"].in_flight == 0, "consumed when sent")
    assert queued(core, "amo") == 0


def drain_answers(client: Client) -> list[str]:
    """The transfers and the flows that answer a drain (drain set, no credit left) the gateway wrote, in order."""
    return [
        "transfer" if code == TRANSFER else "drained"
        for code, fields in frames_of(client.received)
        if code == TRANSFER or (code == FLOW and len(fields) > 8 and fields[8] is True and fields[6] == 0)
    ]


async def test_drain_sends_what_is_there_then_uses_up_the_credit(core: Core) -> None:
    await fill(core, "drain", 0, 1, 2)
    c = await connected(core)
    receiver = await c.receiver("drain", credit=1)
    assert await c.bodies(receiver, 1) == [0]
    receiver.drain(10)
    await c.until(lambda: drain_answers(c) == ["transfer"] * 3 + ["drained"], "the drain answered")
    assert await c.bodies(receiver, 2) == [1, 2]
    receiver.drain(5)  # nothing there: answered at once
    await c.until(lambda: drain_answers(c) == ["transfer"] * 3 + ["drained"] * 2, "the empty drain answered")
    assert receiver.credit == 0


async def test_a_drain_sends_what_waits_in_the_consumer_too(core: Core) -> None:
    await fill(core, "drain-all", "a", "b")
    queue = core.node.broker.queues["drain-all"]
    c = await connected(core)
    receiver = await c.receiver("drain-all", credit=1)
    assert await c.bodies(receiver, 1) == ["a"]
    await fill(core, "drain-all", "c")  # comes while "b" waits for credit: it waits in the consumer
    await c.until(lambda: len(queue) == 0, "every message fetched by the gateway")
    receiver.drain(10)
    await c.until(lambda: "drained" in drain_answers(c), "the drain answered")
    assert drain_answers(c) == ["transfer"] * 3 + ["drained"]
    assert await c.bodies(receiver, 2) == ["b", "c"]


async def test_a_selector_on_a_queue_leaves_the_rest_for_others(core: Core) -> None:
    c = await connected(core)
    sender = await c.sender("paint")
    for colour in ("red", "blue", "red"):
        await c.send(sender, Message(body=colour, properties={"colour": colour}))
    receiver = await c.receiver("paint", options=(Selector("colour = 'red'"),))
    filters = receiver.remote_source.filter
    filters.rewind()
    filters.next()
    echoed = filters.get_object()
    assert echoed[proton.symbol("selector")].value == "colour = 'red'"
    assert await c.bodies(receiver, 2) == ["red", "red"]
    await c.none_for(receiver)
    await c.until(lambda: queued(core, "paint") == 1, "the blue one left")


class NoLocal(Selector):
    """Qpid JMS's no-local filter (a JMS noLocal consumer) beside its selector."""

    def apply(self, receiver: Any) -> None:
        super().apply(receiver)
        filters = receiver.source.filter
        filters.rewind()
        filters.next()
        asked = filters.get_object()
        asked[proton.symbol("no-local")] = proton.Described(proton.ulong(0x0000468C00000003), [])
        filters.clear()
        filters.put_object(asked)


async def test_the_attach_answers_only_the_filters_the_gateway_applies(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("local", options=(NoLocal("n > 1"),))
    filters = receiver.remote_source.filter  # AMQP 1.0 3.5.3: the filters actually in place
    filters.rewind()
    filters.next()
    echoed = filters.get_object()
    assert list(echoed) == [proton.symbol("selector")]
    assert echoed[proton.symbol("selector")].value == "n > 1"


async def test_a_selector_on_a_topic_filters_the_subscription(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("topic://prices", options=(Selector("size > 4"),))
    sender = await c.sender("topic://prices")
    for size in (1, 5, 9):
        await c.send(sender, Message(body=size, properties={"size": size}))
    assert await c.bodies(receiver, 2) == [5, 9]
    await c.none_for(receiver)


async def test_browsing_shows_messages_without_taking_them(core: Core) -> None:
    await fill(core, "shown", "a", "b")
    c = await connected(core)
    receiver = await c.receiver("shown", options=(Copy(),))
    assert receiver.remote_snd_settle_mode == Link.SND_SETTLED
    first, one = await c.receive(receiver)
    _, two = await c.receive(receiver)
    assert (one.body, two.body) == ("a", "b")
    assert first.settled
    await c.none_for(receiver)
    assert queued(core, "shown") == 2


async def test_a_fully_qualified_queue_name_takes_from_that_queue(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("orders::audit")
    assert core.node.broker.queues["audit"].address == "orders"
    sender = await c.sender("orders")
    await c.send(sender, Message(body="seen"))
    assert await c.bodies(receiver, 1) == ["seen"]


async def test_a_dynamic_receiver_gets_a_temporary_queue_gone_with_the_connection(core: Core) -> None:
    requester, responder = await connected(core), await connected(core, container="responder")
    link = requester.receiver_link(None, name="replies")
    link.source.dynamic = True
    replies = await requester.attached(link)
    reply_to = replies.remote_source.address
    assert reply_to is not None
    assert reply_to.startswith(f"tmp.amqp.{requester.session.id}.")
    replies.flow(1)
    answer = await responder.sender(reply_to)
    await responder.send(answer, Message(body="pong", correlation_id="c-1"))
    _, message = await requester.receive(replies)
    assert (message.body, message.correlation_id) == ("pong", "c-1")
    requester.session.connection_lost()
    await requester.session.wait_closed()
    await responder.until(lambda: reply_to not in core.node.broker.queues, "the temporary queue deleted")


async def test_a_topic_subscription_ends_with_its_link(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("topic://short")
    mine = f"amqp.{c.session.id}."
    assert [q for q in core.node.broker.queues if q.startswith(mine)]
    receiver.detach()
    await c.until(lambda: proton.Event.LINK_REMOTE_DETACH in c.events, "the answering DETACH")
    await c.until(lambda: not [q for q in core.node.broker.queues if q.startswith(mine)], "the queue deleted")


async def test_ending_a_session_ends_its_links(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("topic://session-bound")
    sender = await c.sender("topic://session-bound", session=receiver.session)
    assert sender.state & Endpoint.REMOTE_ACTIVE
    mine = f"amqp.{c.session.id}."
    receiver.session.close()
    await c.until(lambda: receiver.session.state & Endpoint.REMOTE_CLOSED, "the END")
    await c.until(lambda: not [q for q in core.node.broker.queues if q.startswith(mine)], "the queue deleted")
    assert not c.session.inbound
    assert not c.session.outbound


async def test_unsettled_messages_return_to_the_queue_when_the_connection_ends(core: Core) -> None:
    await fill(core, "kept", "a")
    first = await connected(core)
    receiver = await first.receiver("kept")
    delivery, _ = await first.receive(receiver)
    assert not delivery.settled
    first.session.connection_lost()
    await first.session.wait_closed()
    assert first.wire.closed
    second = await connected(core, container="second")
    again = await second.receiver("kept")
    _, message = await second.receive(again)
    assert (message.body, message.delivery_count) == ("a", 1)


async def test_a_client_that_stops_reading_gets_its_messages_once_it_reads_again(core: Core) -> None:
    consumer = await connected(core)
    receiver = await consumer.receiver("slow")
    consumer.wire.stall()
    await fill(core, "slow", 0, 1, 2)
    await consumer.none_for(receiver)
    consumer.wire.drain()
    assert await consumer.bodies(receiver, 3) == [0, 1, 2]


async def test_a_deleted_queue_detaches_its_receivers_with_not_found(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("doomed")
    async with core.admin() as admin:
        await admin.delete_queue("doomed")
    condition = await c.closed_link(receiver)
    assert condition.name == "amqp:not-found"


# ------------------------------------------------------------------------------------------------ subscriptions
async def test_a_durable_subscription_keeps_messages_while_detached_and_ends_when_closed(core: Core) -> None:
    producer = await connected(core, container="producer")
    sender = await producer.sender("topic://prices")
    sub = await connected(core, container="billing")
    receiver = await sub.receiver("topic://prices", name="audit", options=(DurableSubscription(),))
    assert core.node.broker.queues["billing.audit"].durable
    receiver.detach()  # a detach keeps the subscription
    await sub.until(lambda: proton.Event.LINK_REMOTE_DETACH in sub.events, "the answering DETACH")
    await producer.send(sender, Message(body="while away"))
    assert queued(core, "billing.audit") == 1
    back = await sub.receiver("topic://prices", name="audit", options=(DurableSubscription(),))
    assert await sub.bodies(back, 1) == ["while away"]
    back.close()  # a close ends it
    await sub.until(lambda: back.state & Endpoint.REMOTE_CLOSED, "the answering DETACH")
    await sub.until(lambda: "billing.audit" not in core.node.broker.queues, "the subscription deleted")


async def test_an_attach_without_a_link_name_closes_the_connection_as_undecodable(core: Core) -> None:
    """The name is mandatory (AMQP 1.0 2.7.3), and proton let an ATTACH without it by: the gateway failed on
    it with a traceback and closed with amqp:internal-error, which is kept for its own bugs."""
    c = await connected(core)
    c.receiver_link("orders", name=None).open()  # type: ignore[arg-type]
    condition = await c.connection_closed()
    assert condition is not None
    assert (condition.name, condition.description) == ("amqp:decode-error", "an ATTACH without its link name")


async def test_a_durable_subscription_never_replaces_a_plain_queue_of_its_name(core: Core) -> None:
    """Its queue is ``<container id>.<link name>``, which a plain queue may be named too: attaching the subscription
    took that name for one on another topic, and deleted the queue and its messages."""
    producer = await connected(core, container="producer")
    sender = await producer.sender("orders.eu")
    for n in range(3):
        await producer.send(sender, Message(body=n, durable=True))
    sub = await connected(core, container="orders")
    condition = await sub.refused(sub.receiver_link("topic://news", name="eu", options=(DurableSubscription(),)))
    assert (condition.name, "not a durable subscription's" in (condition.description or "")) == (
        "amqp:resource-locked",
        True,
    )
    queue = core.node.broker.queues["orders.eu"]
    assert (queue.routing_type, len(queue)) == (RoutingType.ANYCAST, 3)


async def test_a_durable_subscription_with_another_selector_is_a_new_one(core: Core) -> None:
    producer = await connected(core, container="producer")
    sender = await producer.sender("topic://ticks")
    sub = await connected(core, container="app")
    first = await sub.receiver("topic://ticks", name="d", options=(DurableSubscription(),))
    first.detach()
    await sub.until(lambda: proton.Event.LINK_REMOTE_DETACH in sub.events, "the answering DETACH")
    await producer.send(sender, Message(body="old", properties={"kind": "b"}))  # one the new selector would take
    assert queued(core, "app.d") == 1
    second = await sub.receiver(
        "topic://ticks", name="d", options=(DurableSubscription(), Selector("kind = 'b'"))
    )  # the old subscription and its message go
    queue = core.node.broker.queues["app.d"]
    assert queue.filter is not None
    assert (queue.filter.text, len(queue), queue.in_flight) == ("kind = 'b'", 0, 0)
    await producer.send(sender, Message(body="skipped", properties={"kind": "a"}))
    await producer.send(sender, Message(body="new", properties={"kind": "b"}))
    assert await sub.bodies(second, 1) == ["new"]
    await sub.none_for(second)
    # Attached again with the same selector: the same subscription.
    second.detach()
    await producer.send(sender, Message(body="kept", properties={"kind": "b"}))
    third = await sub.receiver("topic://ticks", name="d", options=(DurableSubscription(), Selector("kind = 'b'")))
    assert await sub.bodies(third, 1) == ["kept"]


async def test_a_shared_durable_subscription_spreads_messages_and_ends_with_its_last_consumer(core: Core) -> None:
    shared = (DurableSubscription(), Capabilities("topic", "shared"))
    one, two = await connected(core, container="app"), await connected(core, container="app")
    a = await one.receiver("topic://orders", name="orders", options=shared)
    b = await two.receiver("topic://orders", name="orders", options=shared)
    assert "app.orders" in core.node.broker.queues
    sender = await one.sender("topic://orders")
    for n in range(4):
        await one.send(sender, Message(body=n))
    got_a = await one.bodies(a, 2)
    got_b = await two.bodies(b, 2)
    assert sorted(got_a + got_b) == [0, 1, 2, 3]
    # Another selector while it is in use: refused.
    other = one.receiver_link("topic://orders", name="orders|2", options=(*shared, Selector("x = 1")))
    condition = await one.refused(other)
    assert condition.name == "amqp:resource-locked"
    a.close()
    await one.until(lambda: a.state & Endpoint.REMOTE_CLOSED, "the answering DETACH")
    assert "app.orders" in core.node.broker.queues  # b still consumes
    b.close()
    await two.until(lambda: "app.orders" not in core.node.broker.queues, "the subscription ended")


@pytest.mark.parametrize("shared", [(), (Capabilities("topic", "shared"),)], ids=["exclusive", "shared"])
async def test_an_unsubscribe_keeps_a_durable_subscription_another_link_consumes_from(
    core: Core, shared: tuple[Any, ...]
) -> None:
    """Qpid JMS's unsubscribe (attach the subscription's name with a null source, then close the link) while
    another link of the client still consumes: the subscription and its messages stay, and the close says why
    (JMS forbids unsubscribing an active subscription). It was deleted, with its messages, under the consumer
    (a shared subscription with a client id was looked up as an exclusive one). Ended when its last consumer
    leaves, as a shared one already was."""
    c = await connected(core, container="app")
    consuming = await c.receiver("topic://bills", name="bills", options=(DurableSubscription(), *shared))
    sender = await c.sender("topic://bills")
    await c.send(sender, Message(body="first"))
    lookup = await c.receiver(None, name="bills")  # the unsubscribe's look-up
    await c.close(lookup)
    assert "app.bills" in core.node.broker.queues
    condition = lookup.remote_condition  # Qpid JMS throws it from unsubscribe (an active subscription)
    assert (condition.name, condition.description) == (
        "amqp:resource-locked",
        "durable subscription 'app.bills' has 1 active consumers: not ended",
    )
    await c.send(sender, Message(body="second"))
    assert await c.bodies(consuming, 2) == ["first", "second"]
    await c.close(consuming)
    await c.until(lambda: "app.bills" not in core.node.broker.queues, "the subscription ended with its last link")


async def test_a_shared_subscription_nobody_uses_is_replaced_for_another_selector(core: Core) -> None:
    shared = (DurableSubscription(), Capabilities("topic", "shared", "global"))
    c = await connected(core)
    first = await c.receiver("topic://feed", name="feed", options=shared)
    assert "feed" in core.node.broker.queues  # global: not scoped by the container id
    first.detach()
    await c.until(lambda: proton.Event.LINK_REMOTE_DETACH in c.events, "the answering DETACH")
    await c.until(lambda: not core.node.broker.queues["feed"].consumers, "the consumer gone")
    sender = await c.sender("topic://feed")
    await c.send(sender, Message(body="old", properties={"n": 9}))  # one the new selector would take
    assert queued(core, "feed") == 1
    second = await c.receiver("topic://feed", name="feed", options=(*shared, Selector("n > 1")))
    queue = core.node.broker.queues["feed"]  # replaced: the old one's message went with it
    assert queue.filter is not None
    assert (queue.filter.text, len(queue), queue.in_flight) == ("n > 1", 0, 0)
    for n in range(3):
        await c.send(sender, Message(body=n, properties={"n": n}))
    assert await c.bodies(second, 1) == [2]
    await c.none_for(second)


async def test_a_volatile_shared_subscription_filters_on_its_consumers(core: Core) -> None:
    c = await connected(core, container="app")
    receiver = await c.receiver(
        "topic://vol", name="v|volatile1", options=(Capabilities("topic", "shared"), Selector("n = 1"))
    )
    assert not core.node.broker.queues["app.v"].durable
    sender = await c.sender("topic://vol")
    for n in range(3):
        await c.send(sender, Message(body=n, properties={"n": n}))
    assert await c.bodies(receiver, 1) == [1]
    await c.none_for(receiver)


# ------------------------------------------------------------------------------------------------ transactions
class Transactions:
    """proton's transaction controller messages (``proton.reactor.Transaction``) on a coordinator link."""

    def __init__(self, client: Client, controller: Any) -> None:
        self.client = client
        self.controller = controller

    @classmethod
    async def attach(cls, client: Client) -> Transactions:
        link = client.connection.session().sender("txn-ctrl")
        link.session.open()
        link.target.type = Terminus.COORDINATOR
        link.target.capabilities.put_object(proton.symbol("amqp:local-transactions"))
        await client.attached(link)
        assert link.remote_target.type == Terminus.COORDINATOR
        assert symbols(link.remote_target.capabilities) == ["amqp:local-transactions"]
        await client.until(lambda: link.credit > 0, "credit for the coordinator")
        return cls(client, link)

    async def control(self, body: Any) -> Delivery:
        delivery: Delivery = self.controller.send(Message(body=body))
        await self.client.until(lambda: delivery.remote_state, "the coordinator's outcome")
        return delivery

    async def declare(self) -> bytes:
        delivery = await self.control(proton.Described(proton.symbol("amqp:declare:list"), [None]))
        assert delivery.remote_state == DECLARED
        data: Any = delivery.remote.data  # the state's fields (proton types them as a list of int)
        txn_id = bytes(data[0])
        assert txn_id
        return txn_id

    async def discharge(self, txn_id: bytes, *, fail: bool) -> Delivery:
        delivery = self.send_discharge(txn_id, fail=fail)
        await self.client.until(lambda: delivery.remote_state, "the coordinator's outcome")
        return delivery

    def send_discharge(self, txn_id: bytes, *, fail: bool) -> Delivery:
        """The discharge, not waited for (it goes out with what the test wrote before it)."""
        body = proton.Described(proton.symbol("amqp:discharge:list"), [txn_id, fail])
        delivery: Delivery = self.controller.send(Message(body=body))
        return delivery


def in_transaction(delivery: Delivery, txn_id: bytes, outcome: int | None = None) -> None:
    local: Any = delivery.local
    local.data = [txn_id] if outcome is None else [txn_id, proton.Described(proton.ulong(outcome), [])]
    delivery.update(TRANSACTIONAL_STATE)


def send_in_transaction(sender: Any, txn_id: bytes, count: int) -> list[Delivery]:
    """``count`` messages (bodies 0, 1, ...) sent in transaction ``txn_id``."""
    sent = []
    for n in range(count):
        delivery = sender.send(Message(body=n))
        in_transaction(delivery, txn_id)
        sent.append(delivery)
    return sent


async def outcome_in_transaction(
    core: Core, queue: str, body: str, outcome: int
) -> tuple[Client, Transactions, Any, bytes]:
    """``body`` put in ``queue``, received by a new client and settled with ``outcome`` in a transaction that
    is still open: (the client, its controller, its receiver, the txn-id)."""
    await fill(core, queue, body)
    c = await connected(core)
    tx = await Transactions.attach(c)
    receiver = await c.receiver(queue)
    txn_id = await tx.declare()
    delivery, _ = await c.receive(receiver)
    in_transaction(delivery, txn_id, outcome)
    delivery.settle()
    return c, tx, receiver, txn_id


async def test_transactional_sends_are_routed_at_commit_only(core: Core) -> None:
    c = await connected(core)
    tx = await Transactions.attach(c)
    sender = await c.sender("txq")
    txn_id = await tx.declare()
    sent = send_in_transaction(sender, txn_id, 2)
    await c.until(lambda: all(d.remote_state for d in sent), "the transactional dispositions")
    assert [d.remote_state for d in sent] == [TRANSACTIONAL_STATE] * 2
    assert bytes(sent[0].remote.data[0]) == txn_id
    assert queued(core, "txq") <= 0  # nothing routed before the commit
    commit = await tx.discharge(txn_id, fail=False)
    assert commit.remote_state == Delivery.ACCEPTED
    assert queued(core, "txq") == 2


async def test_a_rolled_back_transaction_drops_its_sends_and_returns_its_acks(core: Core) -> None:
    await fill(core, "txr", "taken")
    c = await connected(core)
    tx = await Transactions.attach(c)
    sender = await c.sender("txr")
    receiver = await c.receiver("txr")
    txn_id = await tx.declare()
    delivery = sender.send(Message(body="never"))
    in_transaction(delivery, txn_id)
    got, message = await c.receive(receiver)
    assert message.body == "taken"
    in_transaction(got, txn_id, Delivery.ACCEPTED)
    got.settle()
    await c.until(lambda: delivery.remote_state, "the send's disposition")
    abort = await tx.discharge(txn_id, fail=True)
    assert abort.remote_state == Delivery.ACCEPTED
    # The acknowledgement was undone and the message is redelivered: the gateway's choice (the core's rollback
    # gives back what the transaction acknowledged), as many brokers do; the spec does not require it.
    _, again = await c.receive(receiver)
    assert again.body == "taken"
    await c.none_for(receiver)  # "never" was never routed


async def test_a_committed_acknowledgement_takes_the_message(core: Core) -> None:
    await fill(core, "txa", "one", "two", "three")
    c = await connected(core)
    tx = await Transactions.attach(c)
    receiver = await c.receiver("txa", credit=3)
    txn_id = await tx.declare()
    outcomes = {"one": Delivery.ACCEPTED, "two": Delivery.RELEASED, "three": Delivery.REJECTED}
    for _ in range(3):
        delivery, message = await c.receive(receiver)
        in_transaction(delivery, txn_id, outcomes[str(message.body)])
        delivery.settle()
    queue = core.node.broker.queues["txa"]
    assert (await tx.discharge(txn_id, fail=False)).remote_state == Delivery.ACCEPTED
    await c.until(lambda: queue.acked == 1, "the commit's ack")
    receiver.flow(1)
    _, released = await c.receive(receiver)  # (when it came back: see the test after this one)
    assert released.body == "two"
    dead = await c.receiver("DLQ", name="dlq")
    assert await c.bodies(dead, 1) == ["three"]
    await c.none_for(receiver)  # "one" is not given again
    assert (queue.acked, len(queue), queue.in_flight) == (1, 0, 1)  # "two" is out again, unsettled


async def test_a_released_outcome_in_a_transaction_waits_for_the_discharge(core: Core) -> None:
    """AMQP 1.0 part 4, 4.4.2: a transactional outcome is applied upon a successful discharge."""
    c, tx, receiver, txn_id = await outcome_in_transaction(core, "txrel", "two", Delivery.RELEASED)
    queue = core.node.broker.queues["txrel"]
    await tx.declare()  # answered after the disposition before it was handled
    await c.nothing()
    assert queue.delivered == 1  # not given back (and so to the receiver again) before the discharge
    await c.none_for(receiver)
    assert (await tx.discharge(txn_id, fail=False)).remote_state == Delivery.ACCEPTED
    _, again = await c.receive(receiver)  # released by the commit
    assert again.body == "two"


async def test_unknown_transactions_are_refused(core: Core) -> None:
    await fill(core, "txu", "m")
    c = await connected(core)
    tx = await Transactions.attach(c)
    discharge = await tx.discharge(b"nope", fail=False)
    assert discharge.remote_state == Delivery.REJECTED
    assert discharge.remote.condition is not None
    assert discharge.remote.condition.name == "amqp:transaction:unknown-id"
    sender = await c.sender("txu")
    delivery = sender.send(Message(body="x"))
    in_transaction(delivery, b"nope")
    await c.until(lambda: delivery.remote_state, "the disposition")
    assert delivery.remote_state == Delivery.REJECTED
    assert delivery.remote.condition is not None
    assert delivery.remote.condition.name == "amqp:transaction:unknown-id"
    assert sender.state & Endpoint.REMOTE_ACTIVE  # the link stays
    receiver = await c.receiver("txu")
    got, _ = await c.receive(receiver)
    in_transaction(got, b"nope", Delivery.ACCEPTED)
    got.settle()
    condition = await c.closed_link(receiver)
    assert condition.name == "amqp:transaction:unknown-id"
    other = await c.receiver("txu", name="other")
    _, message = await c.receive(other)  # released: back in the queue
    assert (message.body, message.delivery_count) == ("m", 0)


async def test_a_receiving_link_the_gateway_ends_closes_its_consumer_in_a_task_it_keeps_until_done(
    core: Core,
) -> None:
    await fill(core, "txend", "m")
    c = await connected(core)
    receiver = await c.receiver("txend")
    got, _ = await c.receive(receiver)
    in_transaction(got, b"nope", Delivery.ACCEPTED)  # an unknown txn-id: the gateway ends the link
    got.settle()
    assert (await c.closed_link(receiver)).name == "amqp:transaction:unknown-id"
    queue = core.node.broker.queues["txend"]
    await c.until(lambda: not queue.consumers and not c.session._background, "the consumer closed, its task done")
    assert c.connection.state & Endpoint.REMOTE_ACTIVE  # the connection goes on
    assert (len(queue), queue.in_flight) == (1, 0)


async def test_a_coordinator_message_without_a_declare_or_discharge_is_rejected(core: Core) -> None:
    c = await connected(core)
    tx = await Transactions.attach(c)
    delivery = await tx.control("hello")
    assert delivery.remote_state == Delivery.REJECTED
    assert delivery.remote.condition is not None
    assert delivery.remote.condition.name == "amqp:decode-error"
    assert await tx.declare()  # the coordinator goes on


async def test_a_coordinator_message_over_its_max_message_size_detaches_the_coordinator(core: Core) -> None:
    c = await connected(core)
    tx = await Transactions.attach(c)
    controller = tx.controller
    big = controller.delivery(b"big")
    controller.stream(b"\x00\x53\x77\xb0\x00\x10\x00\x00" + b"x" * 100_000)  # the start of a 1 MiB body
    condition = await c.closed_link(controller)
    assert condition.name == "amqp:link:message-size-exceeded"
    controller.stream(b"x" * 200_000)  # the client goes on with it all the same
    await c.nothing()
    assert held_by_proton(c) == (0, 1)  # read and dropped as it comes; released once whole
    controller.stream(b"x" * (0x100000 - 300_000))
    controller.advance()
    await c.until(lambda: big.settled, "the message released")
    assert big.remote_state == Delivery.RELEASED
    assert held_by_proton(c) == (0, 0)
    assert c.connection.state & Endpoint.REMOTE_ACTIVE
    assert await (await Transactions.attach(c)).declare()  # another coordinator works


async def test_coordinator_messages_arriving_count_toward_the_incomplete_bytes(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_frame_bytes=512, max_incomplete_bytes=2000))
    await c.open()
    for _ in range(2):  # 1500 bytes each, under the coordinator's max-message-size: 3000 together
        controller = (await Transactions.attach(c)).controller
        controller.delivery(b"t")
        controller.stream(b"\x00\x53\x77\xb0\x00\x00\x10\x00" + b"x" * 1500)
        await c.nothing()
    condition = await c.connection_closed()
    assert condition is not None
    assert condition.name == "amqp:resource-limit-exceeded"


# ------------------------------------------------------------------------------------------------ refusals
async def test_links_the_user_may_not_have_are_refused_and_the_connection_stays(tmp_path: Path) -> None:
    grants = (("open.#", "send"), ("open.#", "createAddress"), ("open.#", "createDurableQueue"))
    async with running_core(secured(tmp_path, *grants), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret")
        for address in ("open.orders", "topic://open.news"):
            condition = await c.refused(c.receiver_link(address, name=address))
            assert condition.name == "amqp:unauthorized-access"
        link = c.receiver_link(None, name="dyn")
        link.source.dynamic = True
        assert (await c.refused(link)).name == "amqp:unauthorized-access"  # no temporary queues either
        sender = await c.sender("open.orders")
        assert (await c.send(sender, Message(body="ok"))).remote_state == Delivery.ACCEPTED


async def test_a_message_the_user_may_not_send_is_rejected_and_its_link_detached(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path, *ALL_ON_OPEN), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret")
        sender = await c.sender("secret.plans")
        delivery = await c.send(sender, Message(body="leak"))
        assert delivery.remote_state == Delivery.REJECTED
        assert delivery.remote.condition is not None
        assert delivery.remote.condition.name == "amqp:unauthorized-access"
        condition = await c.closed_link(sender)
        assert condition.name == "amqp:unauthorized-access"
        relay = await c.sender(None, name="relay")
        refused = await c.send(relay, Message(address="secret.plans", body="leak"))
        assert refused.remote_state == Delivery.REJECTED
        allowed = await c.send(await c.sender("open.x", name="ok"), Message(body="fine"))
        assert allowed.remote_state == Delivery.ACCEPTED
        assert "secret.plans" not in core.node.broker.queues


async def test_a_link_detached_for_a_refused_message_first_settles_what_it_published(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path, *ALL_ON_OPEN), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret")
        relay = await c.sender(None, name="relay")
        # In one read: the two after the refused one are published before the core refuses it.
        sent = [relay.send(Message(address=to, body=to)) for to in ("open.r", "secret.r", "open.r", "open.r")]
        condition = await c.closed_link(relay)
        assert condition.name == "amqp:unauthorized-access"
        outcomes = [d.remote_state for d in sent]
        assert outcomes == [Delivery.ACCEPTED, Delivery.REJECTED, Delivery.ACCEPTED, Delivery.ACCEPTED]
        assert sorted(settled_before_detach(c.received)) == [0, 1, 2, 3]
        assert queued(core, "open.r") == 3


async def test_addresses_that_may_not_be_created_are_not_found(tmp_path: Path) -> None:
    settings = core_settings(
        tmp_path,
        address_settings=[AddressSettingsEntry(match="#", auto_create_addresses=False, auto_create_queues=False)],
    )
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core)
        condition = await c.refused(c.receiver_link("missing"))
        assert condition.name == "amqp:not-found"
        sender = await c.sender("missing")
        delivery = await c.send(sender, Message(body="lost"))
        assert delivery.remote_state == Delivery.REJECTED
        assert delivery.remote.condition is not None
        assert delivery.remote.condition.name == "amqp:not-found"
        assert sender.state & Endpoint.REMOTE_ACTIVE  # only that message is refused


@pytest.mark.parametrize(
    ("address", "dynamic", "description"),
    [
        ("queue://", False, "the address is empty"),
        ("orders::", False, "a fully qualified queue name needs a queue after '::'"),
    ],
)
async def test_a_receiver_with_a_bad_source_is_refused_with_invalid_field(
    core: Core, address: str | None, dynamic: bool, description: str
) -> None:
    c = await connected(core)
    condition = await c.refused(c.receiver_link(address))
    assert (condition.name, condition.description) == ("amqp:invalid-field", description)
    assert c.connection.state & Endpoint.REMOTE_ACTIVE


async def test_a_receiver_without_a_source_address_or_a_subscription_of_its_name_is_refused_with_not_found(
    core: Core,
) -> None:
    c = await connected(core)  # (a null source looks the durable subscription of the link's name up)
    condition = await c.refused(c.receiver_link(None, name="nothing"))
    assert (condition.name, condition.description) == (
        "amqp:not-found",
        f"no source address, and no durable subscription '{c.connection.container}.nothing'",
    )
    assert c.connection.state & Endpoint.REMOTE_ACTIVE


async def test_links_beyond_max_links_are_refused(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_links=2))
    await c.open()
    await c.sender("one", name="1")
    await c.receiver("one", name="2")
    condition = await c.refused(c.receiver_link("one", name="3"))
    assert (condition.name, condition.description) == (
        "amqp:resource-limit-exceeded",
        "too many links on this connection",
    )


# ------------------------------------------------------------------------------------------------ messages
async def test_a_message_keeps_its_sections_through_the_core(core: Core) -> None:
    c = await connected(core)
    sender = await c.sender("sections")
    sent = Message(
        id="m-1",
        user_id=b"anonymous",
        subject="greeting",
        reply_to="queue://replies",
        correlation_id="c-9",
        content_type="text/plain",
        content_encoding="utf-8",
        group_id="g",
        group_sequence=3,
        creation_time=1700000000.5,
        durable=True,
        priority=7,
        ttl=60,
        properties={"colour": "red", "n": 7, "ok": True},
        annotations={"x-opt-kind": "test"},
        instructions={"x-opt-dropped": 1},
        body="hello",
    )
    sent.address = "sections"
    assert (await c.send(sender, sent)).remote_state == Delivery.ACCEPTED
    receiver = await c.receiver("sections")
    _, got = await c.receive(receiver)
    assert (got.id, got.subject, got.reply_to, got.correlation_id) == ("m-1", "greeting", "queue://replies", "c-9")
    assert got.user_id == b"anonymous"
    assert (got.content_type, got.content_encoding, got.group_id, got.group_sequence) == ("text/plain", "utf-8", "g", 3)
    assert (got.address, got.creation_time, got.body) == ("sections", 1700000000.5, "hello")
    assert dict(got.properties or {}) == {"colour": "red", "n": 7, "ok": True}
    assert dict(got.annotations or {}) == {"x-opt-kind": "test"}
    assert got.instructions is None  # delivery annotations are the sender's to the gateway only
    assert (got.durable, got.priority, got.delivery_count) == (True, 7, 0)
    assert 0 < got.ttl <= 60
    assert core.node.broker.queues["sections"].in_flight == 1  # unsettled: still the receiver's


async def test_a_message_from_another_protocol_arrives_as_amqp(core: Core) -> None:
    async with core.admin() as admin:
        await admin.publish(new_message("plain", b"from the core", properties={"k": "v"}))
    c = await connected(core)
    receiver = await c.receiver("plain")
    _, message = await c.receive(receiver)
    assert message.body == b"from the core"
    assert message.properties == {"k": "v"}


async def test_a_message_with_too_many_properties_is_rejected(core: Core) -> None:
    c = await connected(core)
    sender = await c.sender("many")
    delivery = await c.send(sender, Message(body=1, properties={f"p{n}": n for n in range(300)}))
    assert delivery.remote_state == Delivery.REJECTED
    assert delivery.remote.condition is not None
    assert (delivery.remote.condition.name, delivery.remote.condition.description) == (
        "amqp:invalid-field",
        "more than 256 properties",
    )


async def test_a_kept_section_no_amqp_client_can_be_given_goes_to_the_dead_letters(core: Core) -> None:
    async with core.admin() as admin:
        # A link client may write any property: this one claims an AMQP properties section, but is no bytes.
        broken = new_message("broken", b"x", properties={"$enc.amqp.properties": "not bytes"}, protocol="amqp")
        await admin.publish(broken)
        await admin.publish(new_message("broken", b"fine"))
    c = await connected(core)
    receiver = await c.receiver("broken")
    assert await c.bodies(receiver, 1) == [b"fine"]
    await c.none_for(receiver)
    await c.until(lambda: queued(core, "DLQ") == 1, "the broken one dead-lettered")


async def test_a_message_larger_than_a_read_crosses_in_several(core: Core) -> None:
    c = await connected(core)
    sender = await c.sender("large")
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB: more than proton's engine takes at once, and frames of 1 MiB
    assert (await c.send(sender, Message(body=body))).remote_state == Delivery.ACCEPTED
    receiver = await c.receiver("large")
    assert await c.bodies(receiver, 1) == [body]


async def test_sasl_with_the_amqp_stream_pipelined_behind_it(core: Core) -> None:
    c = Client(core, mechanism=None, raw=True)
    c.session.feed(SASL_HEADER + frame(0x41, [Symbol("ANONYMOUS"), b""], kind=1) + AMQP_HEADER + frame(OPEN, ["raw"]))
    await c.until(lambda: OPEN in [code for code, _ in frames_of(c.received)], "the OPEN")
    assert [code for code, _ in frames_of(c.received)] == [SASL_MECHANISMS, SASL_OUTCOME, OPEN]
    assert frames_of(c.received)[1] == (SASL_OUTCOME, [0])
    assert c.session.container_id == "raw"


async def test_an_aborted_transfer_is_dropped_and_the_link_goes_on(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_frame_bytes=512))
    await c.open()
    sender = await c.sender("aborted")
    delivery = sender.delivery(b"a")
    sender.stream(b"\x00\x53\x75\xb0\x00\x00\x10\x00" + b"x" * 3000)  # 3000 bytes of a 4096-byte data section
    await c.nothing()
    delivery.abort()
    await c.nothing()
    assert (await c.send(sender, Message(body="next"))).remote_state == Delivery.ACCEPTED
    receiver = await c.receiver("aborted")
    assert await c.bodies(receiver, 1) == ["next"]
    await c.none_for(receiver)


async def test_a_link_that_ends_in_a_message_frees_its_share_of_the_incomplete_bytes(core: Core) -> None:
    c = Client(core, amqp_settings(core, max_frame_bytes=512, max_incomplete_bytes=2000))
    await c.open()
    first = await c.sender("partial", name="first")
    first.delivery(b"a")
    first.stream(b"\x00\x53\x75\xb0\x00\x00\x10\x00" + b"x" * 1500)
    await c.nothing()
    first.close()
    await c.until(lambda: first.state & Endpoint.REMOTE_CLOSED, "the answering DETACH")
    second = await c.sender("partial", name="second")
    second.delivery(b"b")
    start = b"\x00\x53\x75\xb0\x00\x00\x07\xd0"  # a data section of 2000 bytes
    second.stream(start + b"y" * 1500)  # with the first link's 1500, more than the limit
    await c.nothing()
    assert c.connection.state & Endpoint.REMOTE_ACTIVE
    delivery = second.current
    second.stream(b"y" * 500)
    second.advance()
    await c.until(lambda: delivery.remote_state, "the disposition")
    assert delivery.remote_state == Delivery.ACCEPTED
    assert queued(core, "partial") == 1


async def test_a_discharge_waits_for_the_transfers_before_it(core: Core) -> None:
    c = await connected(core)
    tx = await Transactions.attach(c)
    sender = await c.sender("txw")
    txn_id = await tx.declare()
    sent = send_in_transaction(sender, txn_id, 20)
    commit = tx.send_discharge(txn_id, fail=False)  # in the same read as the transfers: not confirmed yet
    await c.until(lambda: commit.remote_state, "the commit")
    assert commit.remote_state == Delivery.ACCEPTED
    assert queued(core, "txw") == 20
    await c.until(lambda: all(d.remote_state == TRANSACTIONAL_STATE for d in sent), "every transfer settled")


async def test_a_commit_the_core_refuses_is_rejected_with_rollback(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path, *ALL_ON_OPEN), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret")
        tx = await Transactions.attach(c)
        sender = await c.sender("secret.tx")
        txn_id = await tx.declare()
        delivery = sender.send(Message(body="no"))
        in_transaction(delivery, txn_id)
        commit = await tx.discharge(txn_id, fail=False)
        assert commit.remote_state == Delivery.REJECTED
        assert commit.remote.condition is not None
        assert commit.remote.condition.name == "amqp:transaction:rollback"
        assert "secret.tx" not in core.node.broker.queues


async def test_a_commit_the_core_refuses_rolls_the_transaction_back(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path, *ALL_ON_OPEN), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret")
        tx = await Transactions.attach(c)
        assert (await c.send(await c.sender("open.txb"), Message(body="taken"))).remote_state == Delivery.ACCEPTED
        receiver = await c.receiver("open.txb")
        txn_id = await tx.declare()
        got, _ = await c.receive(receiver)
        in_transaction(got, txn_id, Delivery.ACCEPTED)
        got.settle()
        refused = (await c.sender("secret.txb", name="refused")).send(Message(body="no"))
        in_transaction(refused, txn_id)
        commit = await tx.discharge(txn_id, fail=False)
        assert commit.remote_state == Delivery.REJECTED
        # The acknowledgement is undone in the core, as by a rollback: the message comes again.
        _, again = await c.receive(receiver)
        assert (again.body, again.delivery_count) == ("taken", 1)


async def test_closing_a_durable_subscription_without_the_delete_permission_keeps_it(tmp_path: Path) -> None:
    grants = [grant for grant in ALL_ON_OPEN if grant[1] != "deleteDurableQueue"]
    async with running_core(secured(tmp_path, *grants), lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core, mechanism="PLAIN", user="alice", password="secret", container="app")
        for options in ((DurableSubscription(),), (DurableSubscription(), Capabilities("topic", "shared"))):
            receiver = await c.receiver("topic://open.t", name="sub", options=options)
            await c.close(receiver)
            await c.nothing()
            assert "app.sub" in core.node.broker.queues


async def test_closing_a_link_while_the_client_does_not_read_gives_its_messages_back(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("unread", credit=1)
    c.wire.stall()
    await fill(core, "unread", "a", "b")
    await c.none_for(receiver)
    receiver.close()  # read once the client reads again, after what waited for it
    c.wire.drain()
    await c.until(lambda: receiver.state & Endpoint.REMOTE_CLOSED, "the answering DETACH")
    await c.until(lambda: queued(core, "unread") == 2, "the messages back in the queue")
    assert core.node.broker.queues["unread"].in_flight == 0


async def test_a_connection_lost_while_the_client_does_not_read_gives_its_messages_back(core: Core) -> None:
    c = await connected(core)
    receiver = await c.receiver("unread")
    c.wire.stall()
    await fill(core, "unread", "a", "b")
    await c.none_for(receiver)
    c.wire.drain()  # as a socket's wire does when it is lost: nothing waits for it any more
    c.session.connection_lost()
    await c.session.wait_closed()
    await c.until(lambda: queued(core, "unread") == 2, "the messages back in the queue")
    assert core.node.broker.queues["unread"].in_flight == 0


@pytest.mark.parametrize("ending", ["link", "session", "connection"])
async def test_messages_fetched_but_never_sent_come_back_uncounted(core: Core, ending: str) -> None:
    await fill(core, "unsent", "a", "b")
    queue = core.node.broker.queues["unsent"]
    c = await connected(core)
    receiver = await c.receiver("unsent", credit=1)
    await c.receive(receiver)  # "a": sent, and left unsettled
    await fill(core, "unsent", "c")  # comes while "b" waits for credit: it waits in the consumer
    await c.until(lambda: len(queue) == 0, "every message fetched by the gateway")
    if ending == "link":
        await c.close(receiver)
    elif ending == "session":
        receiver.session.close()
        await c.until(lambda: receiver.session.state & Endpoint.REMOTE_CLOSED, "the END")
    else:
        c.session.connection_lost()
        await c.session.wait_closed()
    await c.until(lambda: (len(queue), queue.in_flight) == (3, 0), "the messages back in the queue")
    other = await connected(core, container="other")
    again = await other.receiver("unsent")
    got = []
    for _ in range(3):
        _, message = await other.receive(again)
        got.append((message.body, message.delivery_count))
    # In their order again, and only the one the client was given counts as an attempt.
    assert got == [("a", 1), ("b", 0), ("c", 0)]


def settled_ids(data: bytes) -> list[int]:
    """The delivery-ids the gateway settled as a receiver (of the client's transfers), in the order it did."""
    return settled_in(frames_of(data))


def outcome_of(disposition: list[Any]) -> int | None:
    """The descriptor of a disposition's state."""
    state = disposition[4] if len(disposition) > 4 else None
    return int(state.descriptor) if isinstance(state, Described) else None


def settled_in(frames: list[tuple[int | None, list[Any]]]) -> list[int]:
    ids: list[int] = []
    for code, fields in frames:
        if code == DISPOSITION and fields[0] is True and len(fields) > 3 and fields[3] is True:
            first = int(fields[1])
            last = first if fields[2] is None else int(fields[2])
            ids.extend(range(first, last + 1))
    return ids


async def test_many_unsettled_transfers_at_once_are_settled_in_order(tmp_path: Path) -> None:
    # A publish window of 2: the gateway's publishes wait for the core's credit again and again.
    settings = core_settings(tmp_path, publish_window=2)
    async with running_core(settings, lambda port: CoreLinkSection(port=port)) as core:
        c = await connected(core)
        sender = await c.sender("many")
        before = len(c.received)
        sent = [sender.send(Message(body=b"x" * 1000, properties={"n": n})) for n in range(300)]
        await c.until(lambda: all(d.remote_state for d in sent), "every disposition")
        assert {d.remote_state for d in sent} == {Delivery.ACCEPTED}
        ids = settled_ids(c.received[before:])
        assert ids == list(range(ids[0], ids[0] + 300))  # each once, in the order they were sent
        receiver = await c.receiver("many", credit=300)
        numbers = []
        for _ in range(300):
            delivery, message = await c.receive(receiver)
            delivery.settle()
            properties: Any = message.properties
            numbers.append(properties["n"])
        assert numbers == list(range(300))


async def test_outcomes_of_a_transaction_rolled_back_are_not_applied(core: Core) -> None:
    c, tx, receiver, txn_id = await outcome_in_transaction(core, "txrb", "kept", Delivery.REJECTED)
    assert (await tx.discharge(txn_id, fail=True)).remote_state == Delivery.ACCEPTED
    _, again = await c.receive(receiver)  # not rejected: it comes again, as a rolled-back acceptance would
    assert again.body == "kept"
    assert queued(core, "DLQ") in (-1, 0)  # nothing dead-lettered (-1: no dead-letter queue was even made)


async def test_an_outcome_whose_link_closed_before_the_commit_leaves_the_message_in_its_queue(core: Core) -> None:
    c, tx, receiver, txn_id = await outcome_in_transaction(core, "txgone", "m", Delivery.REJECTED)
    queue = core.node.broker.queues["txgone"]
    receiver.close()  # its consumer goes: the core takes the message back
    await c.until(lambda: receiver.state & Endpoint.REMOTE_CLOSED, "the detach")
    await eventually(lambda: len(queue) == 1, "the message back in its queue")
    assert (await tx.discharge(txn_id, fail=False)).remote_state == Delivery.ACCEPTED
    await c.nothing()
    assert len(queue) == 1  # the late outcome changed nothing


# ------------------------------------------------------------------------------------------------ container ids
SOLE = "sole-connection-for-container"


def sole(core: Core, container: str, **kwargs: Any) -> Client:
    client = Client(core, container=container, **kwargs)
    client.connection.desired_capabilities = [proton.symbol(SOLE)]
    client.connection.open()
    return client


def locks(core: Core) -> list[str]:
    return [q for q in core.node.broker.queues if q.startswith("$amqp.lock.")]


async def test_a_container_id_desired_as_sole_is_held_and_a_second_open_refused(core: Core) -> None:
    first = sole(core, "billing")
    await first.until(lambda: first.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
    assert SOLE in set(first.connection.remote_offered_capabilities)
    assert [q.startswith("$amqp.lock.billing.") for q in locks(core)] == [True]
    second = sole(core, "billing")
    condition = await second.connection_closed()
    assert condition is not None
    assert (condition.name, condition.info) == ("amqp:invalid-field", {"invalid-field": "container-id"})
    assert second.connection.remote_properties == {"amqp:connection-establishment-failed": True}
    assert SOLE in set(second.connection.remote_offered_capabilities)
    assert second.counters.refused == 1
    second.connection.close()
    await second.until(lambda: second.wire.closed, "the socket closed")
    assert len(locks(core)) == 1  # the holder's, untouched
    sender = await first.sender("still.open")
    assert (await first.send(sender, Message(body=1))).remote_state == Delivery.ACCEPTED
    other = sole(core, "payroll")
    await other.until(lambda: other.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
    assert other.connection.remote_condition is None


async def test_a_container_id_is_free_once_its_close_is_answered_or_its_socket_gone(core: Core) -> None:
    first = sole(core, "billing")
    await first.until(lambda: first.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
    first.connection.close()
    await first.connection_closed()
    assert locks(core) == []  # freed before the answer: the client may connect again at once
    second = sole(core, "billing")
    await second.until(lambda: second.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
    second.session.connection_lost()
    await second.session.wait_closed()
    third = sole(core, "billing")
    await third.until(lambda: third.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
    assert third.connection.remote_condition is None


async def test_without_the_capability_a_container_id_asks_the_core_nothing(core: Core) -> None:
    one, two = await connected(core, container="shared"), await connected(core, container="shared")
    assert SOLE not in set(one.connection.remote_offered_capabilities)
    assert locks(core) == []
    held = sole(core, "shared")  # the others hold nothing
    await held.until(lambda: held.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
    assert held.connection.remote_condition is None
    assert await two.sender("still.open")


async def test_a_sole_container_id_needs_the_right_to_make_its_lock(tmp_path: Path) -> None:
    async with running_core(secured(tmp_path, *ALL_ON_OPEN), lambda port: CoreLinkSection(port=port)) as core:
        refused = sole(core, "billing", mechanism="PLAIN", user="alice", password="secret")
        condition = await refused.connection_closed()
        assert condition is not None
        assert condition.name == "amqp:unauthorized-access"
        assert "createNonDurableQueue on $amqp.lock.#" in condition.description
        plain = await connected(core, mechanism="PLAIN", user="alice", password="secret", container="billing")
        assert plain.connection.remote_condition is None  # without the capability: nothing asked
    grants = (("$amqp.lock.#", "createAddress"), ("$amqp.lock.#", "createNonDurableQueue"))
    async with running_core(secured(tmp_path, *grants), lambda port: CoreLinkSection(port=port)) as core:
        held = sole(core, "billing", mechanism="PLAIN", user="alice", password="secret")
        await held.until(lambda: held.connection.state & Endpoint.REMOTE_ACTIVE, "the OPEN")
        assert held.connection.remote_condition is None


async def test_a_client_that_does_not_read_still_has_its_frames_handled(core: Core) -> None:
    """A one-thread client sends a burst before it reads, while its own receiver fills its socket: the gateway
    goes on handling its frames (it would otherwise wait for the client to read, and the client for the gateway
    to read its burst: a deadlock); its deliveries wait for the socket."""
    c, reader = await connected(core), await connected(core, container="reader")
    mine = await c.receiver("mine")
    sender = await c.sender("burst")
    incoming = await reader.receiver("burst")
    c.wire.stall()
    await fill(core, "mine", "a", "b", "c")
    deliveries = [sender.send(Message(body=n)) for n in range(5)]
    assert await reader.bodies(incoming, 5) == [0, 1, 2, 3, 4]
    assert TRANSFER not in [code for code, _ in frames_of(bytes(c.wire.out))]  # (what it was sent waits)
    c.wire.drain()
    await c.until(lambda: all(d.remote_state == Delivery.ACCEPTED for d in deliveries), "the dispositions")
    assert await c.bodies(mine, 3) == ["a", "b", "c"]


async def test_the_answers_waiting_for_a_client_that_does_not_read_are_bounded(core: Core) -> None:
    c = Client(core, amqp_settings(core, pending_bytes=1000))
    await c.open()
    reader = await connected(core, container="reader")
    sender = await c.sender("bounded")
    incoming = await reader.receiver("bounded", credit=100)
    c.wire.stall()
    links, deliveries = [], []
    for n in range(20):  # each answer (an ATTACH of a long name, its FLOW, a DISPOSITION) is over 300 bytes
        link = sender.session.sender(f"{'x' * 200}-{n}")
        link.target.address = "bounded"
        link.open()
        links.append(link)
        deliveries.append(sender.send(Message(body=n)))
        c.pump()
        await settle()
    await reader.nothing()
    handled = c.counters.messages_published
    assert 2 <= handled < 20  # after a few, the gateway waits for the client
    assert len(c.wire.out) < 2000
    c.wire.drain()
    await c.until(lambda: all(d.remote_state == Delivery.ACCEPTED for d in deliveries), "the dispositions")
    assert all(link.state & Endpoint.REMOTE_ACTIVE for link in links)
    assert await reader.bodies(incoming, 20) == list(range(20))


async def test_credit_granted_while_the_client_does_not_read_sends_nothing_until_it_reads(core: Core) -> None:
    """Its FLOW is handled, but what waited for that credit still waits for the socket (deliveries are what the
    gateway writes unasked: they would pile up in memory for a client that never reads)."""
    await fill(core, "later", "a", "b", "c")
    c = await connected(core)
    receiver = await c.receiver("later", credit=1)
    assert await c.bodies(receiver, 1) == ["a"]  # "b" and "c" wait for credit
    c.wire.stall()
    receiver.flow(10)
    await c.nothing()
    assert c.transport.pending() <= 0  # the FLOW went
    assert TRANSFER not in [code for code, _ in frames_of(bytes(c.wire.out))]
    c.wire.drain()
    assert await c.bodies(receiver, 2) == ["b", "c"]


def held_by_the_gateway_s_proton(c: Client) -> int:
    engine = c.session.engine
    assert engine is not None
    held, session = 0, lib.pn_session_head(engine.pn_connection, 0)
    while session != ffi.NULL:
        held += lib.pn_session_outgoing_bytes(session)
        session = lib.pn_session_next(session, 0)
    return held


async def test_what_a_client_s_session_window_does_not_let_out_waits_in_the_core(core: Core) -> None:
    """A pre-settled receiver with plenty of link credit on a session whose incoming window stays small: proton
    holds the transfers the window does not let out, and the gateway took them all from the core (acknowledged
    as sent), for as long as the client granted credit. Now what comes next waits in the core."""
    c = Client(core, amqp_settings(core, pending_bytes=100_000, prefetch=10), mechanism=None, raw=True)
    source, target = Described(ULong(0x28), ["held"]), Described(ULong(0x29), [None])
    c.session.feed(AMQP_HEADER + frame(OPEN, ["raw"]) + frame(BEGIN, [None, UInt(0), UInt(2), UInt(65536)]))
    c.session.feed(frame(ATTACH, ["r", UInt(0), True, UByte(1), UByte(0), source, target]))  # pre-settled
    await c.nothing()
    # incoming-window 2 (frames), link credit 100 000
    c.session.feed(frame(FLOW, [UInt(0), UInt(2), UInt(0), UInt(65536), UInt(0), UInt(0), UInt(100_000)]))
    await c.nothing()
    await fill(core, "held", *[b"x" * 10_000 for _ in range(300)])
    await c.nothing()
    assert c.transfers() == 2  # what the window let out
    assert held_by_the_gateway_s_proton(c) < 250_000  # pending_bytes, and a batch of the prefetch
    assert queued(core, "held") > 250  # the rest waits in the core (all was taken: 298 held, 3 MB)
    c.session.feed(frame(FLOW, [UInt(2), UInt(1000), UInt(0), UInt(65536)]))  # the session window opens
    await c.until(lambda: c.transfers() == 300, "every message")
    assert queued(core, "held") == 0
