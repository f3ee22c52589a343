"""What the core keeps of MQTT sessions, reached over the gateway's own link (its "service link").

Per client id (queue names in ``convert``):

* **the lock queue**, with one consumer: the connection that owns the session. A new connection deletes it
  (the owner's consumer is closed: that is its notice of the takeover, on whichever gateway it runs),
  creates it again and takes the consumer. It expires as soon as it has no consumer, so it goes with a
  dead gateway's link. With sessions bound to users, its filter names the owner (``... OR owner = 'bob'``,
  letting every takeover notice in all the same): a connection of another user on the same node finds it so
  and is refused before it takes anything.
* **the session queue** of a persistent session: a durable last-value queue holding one record (the
  subscriptions and the QoS 2 packet ids in flight) and expiring ``session expiry`` after its owner's
  consumer left. The subscription queues expire with it.
* **the outbox** of a persistent session that was sent retained messages at QoS 1 or 2: a durable queue holding
  a copy of each until the client acknowledges it (the record says the session has one). Its consumer is on the
  service link, as only the gateway may use ``$mqtt.`` queues; it expires with the session.

The retained messages of all topics are published to one multicast address, where each core node keeps a
durable last-value queue of them keyed by topic; a gateway reads the one of the node its link is on.

In a cluster these queues may live on another node than the one a reconnecting client reaches. The core
says so when it creates a queue here (``elsewhere``): a newcomer then sends a takeover notice that the core
forwards to the owner's lock queue on its node, and waits for the session record, which redistribution
brings over once the new holder's consumer is known there. Subscription queues follow the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from tridentmq_mqtt import convert
from tridentmq_mqtt.messages import TOPIC
from tridentmq_mqtt.outbound import Copy
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.link.client import Consumer, LinkClient, queue_spec
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.link.pipelined import PipelinedLink
from tridentmq_shared.message import (
    M_ADDRESS,
    M_BODY,
    M_DEDUP,
    M_EXPIRATION,
    M_ID,
    M_PROPS,
    M_ROUTING,
    RoutingType,
    WireMessage,
    new_message,
)
from tridentmq_shared.runtime import random_hex

log = logging.getLogger("tridentmq.mqtt")

STATE_KEY = "state"
TAKEOVER = "takeover"  # property of a takeover notice: the token of the connection that sent it
OWNER = "owner"  # named in a lock queue's filter: the user whose connection holds the session
#: How long a connection waits for its session's record to come over from another node of the cluster.
FETCH_TIMEOUT = 5.0
#: Retained messages a SUBSCRIBE's look-up of the store takes from the core ahead of the client.
RETAINED_WINDOW: Final = 1000


@dataclass(slots=True)
class StoredSubscription:
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    subscription_id: int | None = None


@dataclass(slots=True)
class SessionState:
    """The record of a persistent session."""

    subscriptions: dict[str, StoredSubscription] = field(default_factory=dict)  # by the SUBSCRIBE's filter text
    released_in: dict[int, str] = field(default_factory=dict)  # client's QoS 2 packet id → dedup id, until PUBREL
    released_out: dict[int, Copy] = field(default_factory=dict)  # our QoS 2 packet id → its copy, until PUBCOMP
    user: str | None = None  # who created the session ("" for an anonymous client); None in older records
    outbox: bool = False  # it has an outbox queue (retained messages on their way to the client)

    def encode(self) -> bytes:
        subs = {
            text: [s.qos, s.no_local, s.retain_as_published, s.subscription_id]
            for text, s in self.subscriptions.items()
        }
        out = {packet: list(copy) for packet, copy in self.released_out.items()}
        record: dict[str, Any] = {"v": 1, "subs": subs, "in": self.released_in, "out": out}
        if self.user is not None:
            record["user"] = self.user
        if self.outbox:  # absent otherwise: a gateway of an earlier version reads the record as before
            record["outbox"] = True
        return bytes(msgpack.packb(record, strict_types=True))

    @classmethod
    def decode(cls, data: bytes) -> SessionState:
        record = msgpack.unpackb(data, strict_map_key=False)
        subs = {
            str(text): StoredSubscription(int(q), bool(nl), bool(rap), sid if type(sid) is int else None)
            for text, (q, nl, rap, sid) in record.get("subs", {}).items()
        }
        user = record.get("user")
        return cls(
            subs,
            {int(k): str(v) for k, v in record.get("in", {}).items()},
            {int(k): _copy(v) for k, v in record.get("out", {}).items()},
            user if type(user) is str else None,
            record.get("outbox") is True,
        )


def _copy(recorded: Any) -> Copy:
    """A released copy as recorded: ``[message id, filter text]``, or a bare message id in older records."""
    if type(recorded) is list:
        message_id, subscription = recorded
        return int(message_id), str(subscription)
    return int(recorded), None


class SessionBusyError(Exception):
    """Another connection kept the session past the takeover timeout."""


class SessionUnreachableError(Exception):
    """The session's record is kept by another node of the cluster that does not hand it over now (it is down,
    cut off, or failing over): starting afresh would drop the messages its subscriptions hold."""


@dataclass(frozen=True, slots=True)
class FoundSession:
    here: bool  # its session queue is on this node
    elsewhere: bool  # other nodes of the cluster hold a queue of that name
    state: SessionState | None  # the record in the queue here


class SessionOwnedError(Exception):
    """The session belongs to another user (``mqtt.bind_sessions_to_users``)."""

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.owner = owner


#: How often a CONNECT looks again at another user's lock queue that has no consumer (it expires at the core's
#: next tick, 50 ms, when its connection has ended).
FOREIGN_LOCK_RETRY_S: Final = 0.05


class Registry:
    """The gateway's service link and the operations on session, lock and retained-message queues."""

    def __init__(self, core_links: CoreLinks, user: str, password: str, name: str) -> None:
        self._core_links = core_links
        self._args = (user or None, password or None, name)
        self._link: PipelinedLink | None = None
        self._opening: asyncio.Task[PipelinedLink] | None = None
        self._tail: asyncio.Future[None] | None = None  # the last write still waiting for credit
        self.on_lost: list[Any] = []  # callbacks run when the service link is lost (sessions end)
        self._retained_queues: set[str] = set()  # the nodes' retained-message queues made so far
        self._holders: dict[str, Consumer] = {}  # session holders taken while fetching a record from elsewhere
        self._tokens: dict[int, str] = {}  # id of a lock consumer → the token of its takeover notices
        self._closing: set[asyncio.Future[None]] = set()  # outbox consumers of ended sessions being closed

    async def link(self) -> PipelinedLink:
        """The service link, opened (again) on demand."""
        if self._link is not None:
            return self._link
        if self._opening is None or self._opening.done():
            self._opening = asyncio.get_running_loop().create_task(self._open())
        return await asyncio.shield(self._opening)

    async def _open(self) -> PipelinedLink:
        user, password, name = self._args
        link = self._core_links.client(user=user, password=password, client_name=f"mqtt gateway {name}")
        await link.connect()
        try:
            await self._retained_queue(link)
        except LinkRequestError:
            await link.close()
            raise
        link.on_closed = self._lost
        self._link = link
        core = self._core_links.settings
        log.info("service link open", extra={"core": f"{core.host}:{core.port}"})
        return link

    async def _retained_queue(self, link: LinkClient) -> str:
        """The retained-message queue of the node the link is on now (made on first use there)."""
        name = convert.retained_queue(link.node_id)
        if name not in self._retained_queues:
            await link.create_queue(
                name, convert.RETAINED_ADDRESS, routing_type=RoutingType.MULTICAST, durable=True, last_value_key=TOPIC
            )
            self._retained_queues.add(name)
        return name

    def _lost(self, error: LinkRequestError) -> None:
        log.warning("service link lost", extra={"reason": error.text})
        self._link = None
        for callback in list(self.on_lost):
            callback()

    async def close(self) -> None:
        if self._link is not None:
            link, self._link = self._link, None
            link.on_closed = None
            await link.close()

    # ------------------------------------------------------------------ session ownership
    async def acquire(self, client_id: str, timeout: float, user: str | None = None) -> tuple[Consumer, bool]:
        """Become the owner of ``client_id``'s session, taking it from any earlier connection. The returned
        consumer is closed by the core when a later connection takes the session in turn; the flag says that no
        node had a lock for it (no connection held the session). With ``user`` (sessions bound to users), a
        connection of another user holding the session is left alone and ``SessionOwnedError`` raised."""
        link = await self.link()
        name = convert.lock_queue(client_id)
        owner_filter = None if user is None else _owner_filter(user)
        deadline = time.monotonic() + timeout
        contended = False  # another connection's lock was found (and taken, or waited for)
        spec = queue_spec(
            name, routing_type=RoutingType.ANYCAST, durable=False, max_consumers=1, expires_ms=0, filter=owner_filter
        )
        while True:
            # A message here may be a takeover notice. Never made again by a SUBSCRIBE if it expired (it may, at
            # the core's next tick, once it has no consumer): a plain queue would hold no owner and no consumer
            # limit, and another user's CONNECT would take this live session (seen under load).
            try:
                created, lock = await link.subscribe_if_made(spec, nowhere_else=True, credit=1, create=False)
            except LinkRequestError as exc:
                # An older node makes it and subscribes in two requests: the queue may expire or another
                # connection get there in between. Taken from that one below, as any existing lock.
                if exc.code not in (ErrorCode.RESOURCE_LIMIT, ErrorCode.NOT_FOUND):
                    raise
                created, lock = {}, None
            if lock is not None:  # made here and held by no other node: ours, in one request
                token = random_hex(32)  # only ours to recognise: no system call for it
                self._tokens[id(lock)] = token
                return lock, not contended
            contended = True
            held_by = created.get("filter")
            if owner_filter is not None and not created.get("created") and held_by and held_by != owner_filter:
                if created.get("consumers"):
                    raise SessionOwnedError(_owner_named(held_by))
                # Another user's, with no consumer: an ended connection's, which expires at the core's next tick
                # (then ours is made, naming us). Not deleted here: the owner's consumer may only be attaching
                # again (its link failing over), and deleting its lock would end a live connection.
                if time.monotonic() > deadline:
                    raise SessionBusyError(f"the session of {client_id[:60]!r} is still in use")
                await asyncio.sleep(FOREIGN_LOCK_RETRY_S)
                continue
            if created.get("created"):
                token = random_hex(32)  # only ours to recognise: no system call for it
                if created.get("elsewhere"):
                    # The owner's lock queue is on another node: the core forwards this notice to its consumer.
                    # It may also come back here (no owner left there): the token tells it is our own.
                    notice = new_message(name, b"", routing=RoutingType.ANYCAST, properties={TAKEOVER: token})
                    await link.publish(notice)
                try:
                    lock = await link.subscribe(name, credit=1, create=False)
                except LinkRequestError as exc:  # another connection got there first: take it from that one
                    if exc.code not in (ErrorCode.RESOURCE_LIMIT, ErrorCode.NOT_FOUND):
                        raise
                else:
                    self._tokens[id(lock)] = token
                    return lock, False
            if time.monotonic() > deadline:
                raise SessionBusyError(f"the session of {client_id[:60]!r} is still in use")
            with contextlib.suppress(LinkRequestError):  # closes the owner's consumer: its notice
                await link.delete_queue(name)

    def holds(self, lock: Consumer) -> bool:
        """Whether ``lock`` still stands for this connection's ownership: not closed, and no takeover notice of
        another connection waiting in it (looked at, not taken: the session reads them once its CONNECT is
        answered). A session deletes queues on other nodes only while it holds its lock: a connection that took
        the session over through another node has its own there."""
        if lock.closed is not None:
            return False
        token = self._tokens.get(id(lock))
        return all(message[M_PROPS].get(TAKEOVER) == token for message in lock.peek())

    def taken_over(self, lock: Consumer, notices: list[tuple[int, WireMessage]]) -> bool:
        """Whether takeover notices that reached our lock queue come from another connection (our own
        notice may come back to us); they are acknowledged either way."""
        token = self._tokens.get(id(lock))
        lock.ack_ids([message[M_ID] for _, message in notices])
        return any(message[M_PROPS].get(TAKEOVER) != token for _, message in notices)

    async def release(self, client_id: str, lock: Consumer) -> None:
        """Let go of the session. The queue itself is not deleted by name (a new owner may have made it again
        meanwhile): it expires as soon as it has no consumer."""
        self._tokens.pop(id(lock), None)
        if lock.closed is not None or self._link is None:
            return
        with contextlib.suppress(LinkRequestError):
            await lock.close()

    # ------------------------------------------------------------------ session records
    async def look_up_session(self, client_id: str) -> FoundSession:
        """``client_id``'s session on this node and on others, looked up without creating or changing anything."""
        link = await self.link()
        found = await link.create_queue(
            convert.session_queue(client_id), routing_type=RoutingType.ANYCAST, durable=True, passive=True
        )
        elsewhere = bool(found.get("elsewhere"))
        if found.get("exists") is False:
            return FoundSession(here=False, elsewhere=elsewhere, state=None)
        state = await self._read_session(link, client_id, or_empty=False)
        return FoundSession(here=True, elsewhere=elsewhere, state=state)

    async def open_session(self, client_id: str) -> SessionState | None:
        """Create or find the session queue of a persistent session; the record of an earlier session, if any.
        A record kept by another node of the cluster is waited for (up to ``FETCH_TIMEOUT``): to resume that
        session, or to discard it and its queues there (a clean start).
        The queue's expiry is left as it is: the new session's counts once it holds the queue (a shorter one set
        now would count the time the queue waited for the client, and could delete it before it is read)."""
        link = await self.link()
        name = convert.session_queue(client_id)
        found = await link.create_queue(name, routing_type=RoutingType.ANYCAST, durable=True, last_value_key="")
        if found.get("created") and not found.get("elsewhere"):
            return None
        if found.get("created") or client_id in self._holders:  # (an earlier fetch still waits)
            return await self._fetch_session(client_id)
        state = await self._read_session(link, client_id, or_empty=False)
        if state is None:
            # The queue is here, its record is not: redistribution or a scale-down moved it to another node.
            # Fetch it back. A new session (session present 0, so the client subscribes again) only when no node
            # holds the queue any more; never an empty one passed off as the client's (it would wait for its
            # subscriptions' messages in vain, as the randomised run over up --nodes 3 found), nor a new one
            # while that node is down (its SUBSCRIBE would drop the subscription's queue and its messages as an
            # earlier session's, as the run over up --pairs 3 found): refused until the record can come.
            return await self._fetch_session(client_id)
        return state

    async def _fetch_session(self, client_id: str) -> SessionState | None:
        """The session lives on another node: hold it here, so redistribution moves its record over, and
        wait for it. None if no other node holds its queue any more without the record having come (that
        session ended there). If it does not come (that node is down, say), SessionUnreachableError: the
        client is refused and tries again, while the holder stays, so the record comes here once that node is
        back."""
        link = await self.link()
        name = convert.session_queue(client_id)
        holder = self._holders.get(client_id)
        if holder is None or holder.closed is not None:
            self._holders[client_id] = await link.subscribe(name, credit=0)
        deadline = time.monotonic() + FETCH_TIMEOUT
        while time.monotonic() < deadline:
            state = await self._read_session(link, client_id, or_empty=False)
            if state is not None:
                return state
            here = await link.create_queue(name, routing_type=RoutingType.ANYCAST, passive=True)
            if not here.get("elsewhere"):  # gone from the node that had it (after this read: no record lost)
                return await self._read_session(link, client_id, or_empty=False)
            await asyncio.sleep(0.1)
        log.warning(
            "session record on another node did not arrive: the client is refused until it does",
            extra={"client_id": client_id[:60]},
        )
        raise SessionUnreachableError(client_id)

    async def _read_session(self, link: LinkClient, client_id: str, *, or_empty: bool = True) -> SessionState | None:
        """The record in the session queue here; with none, an empty session (``or_empty``) or None."""
        name = convert.session_queue(client_id)
        browser = await link.subscribe(name, credit=10, browse=True)
        try:
            record: bytes | None = None
            while batch := await browser.get_batch():
                for _, message in batch:
                    record = message[M_BODY]
        finally:
            with contextlib.suppress(LinkRequestError):
                await browser.close()
        if record is None:
            return SessionState() if or_empty else None  # the queue outlived its record
        try:
            return SessionState.decode(record)
        except (ValueError, TypeError, KeyError, msgpack.UnpackException):
            log.warning("session record unreadable: starting afresh", extra={"client_id": client_id[:60]})
            return SessionState()

    async def let_go(self, client_id: str) -> None:
        """Stop holding a session fetched from another node (it was refused): its expiry may run again."""
        holder = self._holders.pop(client_id, None)
        if holder is not None and holder.closed is None:
            with contextlib.suppress(LinkRequestError):
                await holder.close()

    async def hold_session(self, client_id: str) -> Consumer:
        """A consumer on the session queue: while it is there the session does not expire."""
        holder = self._holders.pop(client_id, None)
        if holder is not None and holder.closed is None:
            return holder
        return await (await self.link()).subscribe(convert.session_queue(client_id), credit=0)

    def save(self, client_id: str, state: SessionState) -> asyncio.Future[None]:
        """Replace the session record; the future resolves once it is on disk."""
        message = new_message(
            convert.session_queue(client_id),
            state.encode(),
            routing=RoutingType.ANYCAST,
            durable=True,
            last_value_key=STATE_KEY,
        )
        return self._send_in_order(message)

    def _send_in_order(self, message: WireMessage) -> asyncio.Future[None]:
        """Publish on the service link in call order, whether the link has credit now or not: these go to
        last-value queues, where a write overtaken by an older one would leave the older value."""
        link, tail = self._link, self._tail
        if link is not None and (tail is None or tail.done()) and (sent := link.try_send(message)) is not None:
            return sent
        self._tail = asyncio.ensure_future(self._publish_after(tail, message))
        return self._tail

    async def _publish_after(self, previous: asyncio.Future[None] | None, message: WireMessage) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # its outcome is its caller's; only the order matters here
        await (await self.link()).publish(message)

    async def set_expiry(self, queue: str, address: str, routing: RoutingType, expiry_ms: int) -> None:
        with contextlib.suppress(LinkRequestError):
            await (await self.link()).create_queue(queue, address, routing_type=routing, expires_ms=expiry_ms)

    async def drop_session(self, client_id: str, *, everywhere: bool) -> None:
        """Delete the session queue here; ``everywhere``: its copies on the other nodes too (only for the holder
        of the session's lock, which no connection through another node can have taken meanwhile)."""
        self._holders.pop(client_id, None)  # goes with its queue
        with contextlib.suppress(LinkRequestError):
            await (await self.link()).delete_queue(convert.session_queue(client_id), everywhere=everywhere)

    # ------------------------------------------------------------------ outboxes
    async def open_outbox(self, client_id: str, expires_ms: int | None, credit: int, credit_bytes: int) -> Consumer:
        """Make (or find) ``client_id``'s outbox queue and consume from it on the service link: its messages wait
        for the client's acknowledgements (``credit_on_settle``). ``expires_ms`` None leaves the expiry of one
        that exists as it is (as for a resumed subscription's queue: see ``Registry.open_session``)."""
        opening = asyncio.ensure_future(self._open_outbox(client_id, expires_ms, credit, credit_bytes))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The session ended meanwhile, and nobody would close the consumer: on the service link, which stays
            # open, it would hold the outbox's messages from the session's next connection.
            opening.add_done_callback(self._orphaned)
            raise

    async def _open_outbox(self, client_id: str, expires_ms: int | None, credit: int, credit_bytes: int) -> Consumer:
        link = await self.link()
        name = convert.outbox_queue(client_id)
        spec = queue_spec(name, routing_type=RoutingType.ANYCAST, durable=True, expires_ms=expires_ms)
        _, consumer = await link.make_and_subscribe(
            spec,
            credit=credit,
            credit_on_settle=True,
            credit_bytes=credit_bytes,
            address=name,
            routing_type=int(RoutingType.ANYCAST),
            durable=True,
        )
        return consumer

    def _orphaned(self, opening: asyncio.Future[Consumer]) -> None:
        if opening.cancelled() or opening.exception() is not None:
            return
        consumer = opening.result()
        with contextlib.suppress(LinkRequestError):  # the link gone meanwhile took the consumer with it
            consumer.release_unsent()  # nothing of it reached a client: back uncounted
        closing = asyncio.ensure_future(consumer.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closed_orphan)

    def _closed_orphan(self, closing: asyncio.Future[None]) -> None:
        self._closing.discard(closing)
        if not closing.cancelled():
            closing.exception()  # seen (a link lost meanwhile took the consumer with it)

    async def to_outbox(self, copies: list[WireMessage], confirmed: Callable[[asyncio.Future[None]], None]) -> None:
        """Put copies made by ``messages.retained_delivery`` in their outbox, in order, waiting for the link's
        publish credit (a SUBSCRIBE matching many retained messages is held back, not buffered here). Each
        confirm, which comes once the copy is on disk (the core delivers a durable message only then anyway),
        goes to ``confirmed``."""
        link = await self.link()
        for copy in copies:
            (await link.send(copy)).add_done_callback(confirmed)

    async def drop_outbox(self, client_id: str, *, everywhere: bool) -> None:
        """Delete ``client_id``'s outbox queue here (``everywhere``: as in ``drop_session``), if there is one."""
        with contextlib.suppress(LinkRequestError):
            await (await self.link()).delete_queue(convert.outbox_queue(client_id), everywhere=everywhere)

    # ------------------------------------------------------------------ retained messages
    def retain(self, topic: str, message: WireMessage) -> asyncio.Future[None]:
        """Make ``message`` the retained message of ``topic`` (an empty payload clears it)."""
        copy = list(message)
        copy[M_ADDRESS] = convert.RETAINED_ADDRESS
        copy[M_ROUTING] = int(RoutingType.MULTICAST)  # to every node's copy
        copy[M_DEDUP] = None  # the original's dedup id must not make the copy a duplicate
        copy[M_PROPS] = {**message[M_PROPS], TOPIC: topic}
        if not message[M_BODY]:
            # An empty payload clears: the empty copy replaces the value and stays as a marker readers skip. It
            # does not expire, or it could expire on its way to another node and leave the old value there.
            copy[M_EXPIRATION] = 0
        return self._send_in_order(copy)

    async def retained(self, topic_filter: str) -> AsyncGenerator[list[WireMessage], None]:
        """The retained messages whose topics ``topic_filter`` matches (each has its topic in ``TOPIC``), a batch
        at a time: the browse's window of the store, which waits while the caller does (``#`` may match the
        whole store). Use it in ``contextlib.aclosing``: the browse ends with it."""
        link = await self.link()
        prefix = _literal_prefix(topic_filter)
        selector = None
        if prefix == topic_filter:  # no wildcard: one topic, which the core finds by key (no scan of them all)
            quoted = topic_filter.replace("'", "''")
            selector = f"{TOPIC} = '{quoted}'"
        elif prefix:
            escaped = prefix.replace("'", "''").replace("!", "!!").replace("%", "!%").replace("_", "!_")
            selector = f"{TOPIC} LIKE '{escaped}%' ESCAPE '!'"
        queue = await self._retained_queue(link)
        browser = await link.subscribe(queue, credit=RETAINED_WINDOW, browse=True, selector=selector)
        try:
            while batch := await browser.get_batch():
                found = []
                for _, message in batch:
                    topic = message[M_PROPS].get(TOPIC)
                    if type(topic) is str and message[M_BODY] and convert.matches(topic_filter, topic):
                        found.append(message)
                if found:
                    yield found
        finally:
            with contextlib.suppress(LinkRequestError):
                await browser.close()


def _owner_filter(user: str) -> str:
    """A lock queue's filter naming its owner. Every takeover notice has a token, so all pass it whoever sent
    them (another user's connection on another node is refused once the session's record has come over)."""
    quoted = user.replace("'", "''")
    return f"{TAKEOVER} IS NOT NULL OR {OWNER} = '{quoted}'"


def _owner_named(owner_filter: str) -> str:
    """The user a lock queue's filter names, for the log."""
    _, _, quoted = owner_filter.partition(f"{OWNER} = '")
    return quoted[:-1].replace("''", "'")


def _literal_prefix(topic_filter: str) -> str:
    """The part of a filter before its first wildcard: every topic it matches starts with it (``a/#`` also
    matches ``a``, so its prefix is ``a``)."""
    cut = min((i for i in (topic_filter.find("+"), topic_filter.find("#")) if i >= 0), default=len(topic_filter))
    if topic_filter[cut : cut + 1] == "#" and cut:
        cut -= 1
    return topic_filter[:cut]
