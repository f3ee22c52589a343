"""Gateway-local fan-out of QoS 0 subscriptions: one core subscription per user and topic filter, written to
every connection of this gateway that subscribed to that filter.

A QoS 0 subscription of a session that ends with its connection has nothing to keep: no queued messages
for a later connection, no acknowledgements. Given a queue each, a message to a topic with a thousand such
subscribers is copied, delivered, decoded, encoded and acknowledged a thousand times. Here the subscribers
of one filter on one gateway share a *feed*: a temporary queue consumed with auto-acknowledge on a link of
their user, whose messages the gateway decodes once and encodes once per way a PUBLISH can look (protocol
version, retain-as-published, subscription identifier), then writes to each subscriber.

The core still decides who may subscribe: a feed's queue is created on a link of the subscribers' own user,
so a refused user is refused as before, and a feed carries only what its user may read. That link is one
more per user and gateway, which pays only where a user has several subscribers of one filter: a feed is
made once ``mqtt.qos0_fan_out_from`` subscriptions of a user to a filter are open. The ones before have
queues of their own (counted here as *solo*); each moves over to the feed (``adopt``) after a batch of its own
that leaves it level with the feed (``Feed.can_adopt``), so that it misses nothing.

A subscriber that does not keep up loses QoS 0 messages instead of holding up the others: while more than
``mqtt.qos0_max_buffered_bytes`` wait to be written to its connection, the feed's messages skip it. QoS 1 and
2 subscriptions, shared subscriptions and persistent sessions keep their own queues in the core.

Joining and leaving take no lock: a member is added or removed at once (a leave waits only for that
member's own join); making a feed (and its user's link) is one task per feed that every joiner of it
awaits, and closing one happens in the background, so a slow core holds up only the subscribers of the
feed being made.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from tridentmq_mqtt import convert
from tridentmq_mqtt.convert import ConversionError
from tridentmq_mqtt.messages import RETAIN, publish_properties
from tridentmq_mqtt.protocol.errors import LocalProtocolError
from tridentmq_mqtt.protocol.packets import V5, Publish, encode, encode_plain_publish, encode_topic
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES
from tridentmq_mqtt.settings import CoreLinkSection
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.link.client import Consumer, LinkClient
from tridentmq_shared.link.errors import LinkClosedError, LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import M_ADDRESS, M_BODY, M_EXPIRATION, M_ID, M_PROPS, RoutingType, WireMessage

log = logging.getLogger("tridentmq.mqtt")

_TOPIC_CACHE_LIMIT = 4096  # addresses remembered per feed with their topic's encoding
#: Who gave messages their ids: a core node (its id) in one activation (its epoch; a backup taking over
#: keeps the node id and numbers anew). Ids of one numbering grow in routing order.
Numbering = tuple[str, int]


def numbering(client: LinkClient) -> Numbering:
    return client.node_id, client.node_epoch


class Encoded:
    """A batch as one kind of subscriber gets it: each message's PUBLISH (b"" for one MQTT cannot carry),
    all of them joined, how many there are, and the size of the largest."""

    __slots__ = ("count", "joined", "largest", "parts")

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.joined = b"".join(parts)
        self.count = len(parts) - parts.count(b"")
        self.largest = max(map(len, parts), default=0)


class Encodings:
    """One batch of a feed's messages as QoS 0 PUBLISH packets, encoded once per way a subscriber wants them
    (protocol version, retain-as-published, subscription identifier) and shared by every subscriber that
    wants them that way."""

    __slots__ = ("_by_kind", "_topics", "messages", "now_ms", "numbering")

    def __init__(
        self,
        messages: list[WireMessage],
        now_ms: int,
        topics: dict[str, tuple[str, bytes] | None],
        numbering: Numbering = ("", 0),
    ) -> None:
        self.messages = messages
        self.now_ms = now_ms
        self.numbering = numbering  # who numbered the messages
        self._topics = topics
        self._by_kind: dict[tuple[int, bool, int | None], Encoded] = {}

    def packets(self, version: int, retain_as_published: bool, subscription_id: int | None) -> Encoded:
        kind = (version, retain_as_published, subscription_id if version == V5 else None)
        known = self._by_kind.get(kind)
        if known is None:
            known = self._by_kind[kind] = Encoded([self._encode(m, *kind) for m in self.messages])
        return known

    def _encode(
        self, message: WireMessage, version: int, retain_as_published: bool, subscription_id: int | None
    ) -> bytes:
        topic = self._topic(message[M_ADDRESS])
        if topic is None:
            return b""
        retain = retain_as_published and message[M_PROPS].get(RETAIN) is True
        props = publish_properties(message, self.now_ms, subscription_id) if version == V5 else NO_PROPERTIES
        try:
            if props is NO_PROPERTIES:
                return encode_plain_publish(topic[1], message[M_BODY], version, retain=retain)
            return encode(Publish(topic[0], message[M_BODY], 0, retain, properties=props), version)
        except LocalProtocolError as exc:  # a property no MQTT string can hold
            log.warning(
                "message not deliverable over MQTT",
                extra={"address": message[M_ADDRESS][:100], "reason": str(exc)[:200]},
            )
            return b""

    def _topic(self, address: str) -> tuple[str, bytes] | None:
        """The topic of an address and its encoding, remembered per feed (None: no MQTT topic)."""
        topics = self._topics
        if address in topics:
            return topics[address]
        try:
            topic = convert.address_to_topic(address)
            known: tuple[str, bytes] | None = (topic, encode_topic(topic))
        except (ConversionError, LocalProtocolError) as exc:
            log.warning("message not deliverable over MQTT", extra={"address": address[:100], "reason": str(exc)[:200]})
            known = None
        if len(topics) >= _TOPIC_CACHE_LIMIT:
            topics.clear()
        topics[address] = known
        return known


class Subscriber(Protocol):
    """A connection's subscription to a feed."""

    def fan_out(self, batch: Encodings) -> int:
        """Write what it wants of ``batch``; returns how many messages it wrote. Never raises."""
        ...

    def feed_lost(self) -> None:
        """The feed ended (its link to the core is gone, or the core ended its consumer)."""
        ...


Key = tuple[str | None, str]  # user, topic filter


@dataclass(eq=False)
class Feed:
    key: Key
    queue: str
    consumer: Consumer
    link: _UserLink
    dollar_safe: bool  # the filter starts with a wildcard: it must not deliver ``$`` topics
    members: dict[Subscriber, None] = field(default_factory=dict)  # an ordered set: written in joining order
    topics: dict[str, tuple[str, bytes] | None] = field(default_factory=dict)
    pump: asyncio.Task[None] | None = None
    ended: bool = False
    # What it has fanned out, in the numbering ``seen_on``: the id of its first message (its queue holds every
    # message routed after it was made: ids from there on) and of its last.
    seen_on: Numbering | None = None  # None: it has fanned out nothing yet
    first_id: int = 0
    fanned_upto: int = 0

    def passed(self, batch: list[tuple[int, WireMessage]], numbered: Numbering) -> None:
        """It fanned out ``batch`` (or filtered it away), numbered as ``numbered``."""
        top = max(m[M_ID] for _, m in batch)
        if numbered != self.seen_on:  # the first batch, or its link failed over: numbered anew
            self.seen_on, self.first_id, self.fanned_upto = numbered, min(m[M_ID] for _, m in batch), top
        elif top > self.fanned_upto:  # (a message of a higher priority may have come before lower ids)
            self.fanned_upto = top

    def can_adopt(self, numbered: Numbering, had_upto: int) -> bool:
        """Whether a solo subscription whose own queue gave it every message up to id ``had_upto`` (numbered
        as ``numbered``) can move over without a gap: the feed's queue holds every message after that one, and
        has handed none of them to its members yet."""
        return numbered == self.seen_on and self.first_id <= had_upto and self.fanned_upto <= had_upto


@dataclass(eq=False)
class _UserLink:
    user: str | None
    client: LinkClient
    feeds: set[Feed] = field(default_factory=set)
    opening: int = 0  # feeds being made on it: it is not closed meanwhile


class Feeds:
    """The feeds of one gateway: made by the subscription that reaches ``threshold`` (0: never), dropped
    with their last member."""

    def __init__(
        self,
        core_links: CoreLinks,
        core: CoreLinkSection,
        gateway_name: str,
        window: int,
        threshold: int,
        on_delivered: Callable[[int], None],
    ) -> None:
        self.core_links = core_links
        self.core = core
        self.gateway_name = gateway_name
        self.window = window
        self.threshold = threshold
        self.on_delivered = on_delivered
        self._feeds: dict[Key, Feed] = {}
        self._opening: dict[Key, asyncio.Task[Feed]] = {}
        self._links: dict[str | None, _UserLink] = {}
        self._linking: dict[str | None, asyncio.Task[_UserLink]] = {}
        self._joined: dict[Subscriber, Feed] = {}
        self._joining: dict[Subscriber, asyncio.Task[Feed]] = {}
        self._solo: Counter[Key] = Counter()
        self._background: set[asyncio.Task[None]] = set()
        self._stopped = False
        # Feed queues are named per gateway process (replicas may share a configured name) and per feed.
        self._process = uuid.uuid4().hex[:12]
        self._made = itertools.count(1)

    def __len__(self) -> int:
        return len(self._feeds)

    # ------------------------------------------------------------------ subscribers
    def fans_out(self, user: str | None, topic_filter: str) -> bool:
        """Whether a new QoS 0 subscription of ``user`` to ``topic_filter`` is to join a feed (else it takes a
        queue of its own, and ``solo_opened`` counts it)."""
        key = (user, topic_filter)
        if not self.threshold or self._stopped:
            return False
        return key in self._feeds or key in self._opening or self._solo[key] + 1 >= self.threshold

    def solo_opened(self, user: str | None, topic_filter: str) -> None:
        self._solo[(user, topic_filter)] += 1

    def feed_for(self, user: str | None, topic_filter: str, numbered: Numbering, had_upto: int) -> Feed | None:
        """The live feed of ``topic_filter`` for ``user`` that a solo subscription numbered as ``numbered``, which
        had every message up to ``had_upto`` from its own queue, can move to now (see ``Feed.can_adopt``). None
        while the feed is ahead of it (it takes one more batch of its own first) or cannot vouch for the
        messages after ``had_upto`` (routed before the feed's queue was made): its own queue still holds them."""
        feed = self._feeds.get((user, topic_filter))
        if feed is None or numbering(feed.link.client) != numbered or not feed.can_adopt(numbered, had_upto):
            return None
        return feed

    def adopt(self, member: Subscriber, feed: Feed) -> None:
        """Add ``member`` to ``feed`` at once (a solo subscription moving over: ``feed_for`` gave it)."""
        feed.members[member] = None
        self._joined[member] = feed

    def solo_closed(self, user: str | None, topic_filter: str) -> None:
        key = (user, topic_filter)
        self._solo[key] -= 1
        if self._solo[key] <= 0:
            del self._solo[key]

    async def join(self, member: Subscriber, user: str | None, password: str | None, topic_filter: str) -> Feed:
        """Add ``member`` to the feed of ``topic_filter`` for ``user``, made first if there is none (the core
        may refuse its queue: ``LinkRequestError``). A caller cancelled meanwhile does not stop the join: it
        calls ``leave``, which waits for the join to end and undoes it."""
        if self._stopped:
            raise LinkClosedError(ErrorCode.EOF, "the gateway is stopping")
        task = asyncio.get_running_loop().create_task(self._join(member, (user, topic_filter), password))
        self._joining[member] = task
        task.add_done_callback(lambda done: self._joined_or_not(member, done))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._stopped:  # cancelled by ``stop``, not the caller
                raise LinkClosedError(ErrorCode.EOF, "the gateway is stopping") from None
            raise

    def _joined_or_not(self, member: Subscriber, task: asyncio.Task[Feed]) -> None:
        if self._joining.get(member) is task:
            del self._joining[member]
        if not task.cancelled():
            task.exception()  # the joiner's to read; retrieved here should it be gone

    async def _join(self, member: Subscriber, key: Key, password: str | None) -> Feed:
        feed = self._feeds.get(key)
        if feed is None:
            opening = self._opening.get(key)
            if opening is None:
                opening = self._opening[key] = asyncio.get_running_loop().create_task(self._open(key, password))
                opening.add_done_callback(lambda done: self._opened(key, done))
            feed = await asyncio.shield(opening)
        if feed.ended:  # lost between its making and now
            raise LinkClosedError(ErrorCode.EOF, "the fan-out's link to the core was lost")
        feed.members[member] = None
        self._joined[member] = feed
        return feed

    def _opened(self, key: Key, task: asyncio.Task[Feed]) -> None:
        if self._opening.get(key) is task:
            del self._opening[key]
        if not task.cancelled():
            task.exception()  # every joiner reads it; retrieved here for when none is left

    async def leave(self, member: Subscriber) -> None:
        """Take ``member`` out of its feed, if it is in one (once its join, if any, has ended)."""
        joining = self._joining.get(member)
        if joining is not None:
            await asyncio.wait([joining])
        feed = self._joined.pop(member, None)
        if feed is not None:
            feed.members.pop(member, None)
            if not feed.members:
                self._retire(feed)

    async def stop(self) -> None:
        self._stopped = True
        pending = [*self._linking.values(), *self._opening.values(), *self._joining.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # what they leave behind is below
        for feed in list(self._feeds.values()):
            self._retire(feed, close=False)
            if feed.pump is not None:
                pending.append(feed.pump)
        for link in list(self._links.values()):
            self._drop_link(link)
        await asyncio.gather(*pending, return_exceptions=True)
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ------------------------------------------------------------------ feeds and their links
    async def _open(self, key: Key, password: str | None) -> Feed:
        user, topic_filter = key
        pattern = convert.filter_to_pattern(topic_filter)
        link = await self._link(user, password)
        link.opening += 1
        queue = convert.fanout_queue(f"{self.gateway_name}.{self._process}.{next(self._made)}", topic_filter)
        created = False
        try:
            await link.client.create_queue(
                queue, pattern, routing_type=RoutingType.MULTICAST, durable=False, temporary=True
            )
            created = True
            consumer = await link.client.subscribe(
                queue,
                credit=self.window,
                auto_ack=True,
                address=pattern,
                routing_type=int(RoutingType.MULTICAST),
                credit_bytes=self.core.consumer_window_bytes,
            )
        except BaseException:  # refused (or the gateway stopping)
            link.opening -= 1
            if not link.feeds and not link.opening:
                self._drop_link(link)  # its temporary queues go with it
            elif created:  # the core let the user create the queue but not consume from it
                self._run(self._delete_queue(link, queue))
            raise
        link.opening -= 1
        feed = Feed(key, queue, consumer, link, dollar_safe=topic_filter[:1] in ("+", "#"))
        if self._links.get(user) is not link:  # lost for good meanwhile
            feed.ended = True
            return feed
        link.feeds.add(feed)
        self._feeds[key] = feed
        feed.pump = asyncio.get_running_loop().create_task(self._pump(feed))
        return feed

    async def _link(self, user: str | None, password: str | None) -> _UserLink:
        """The user's link to the core, connected first if there is none."""
        link = self._links.get(user)
        if link is not None:
            return link
        linking = self._linking.get(user)
        if linking is None:
            linking = self._linking[user] = asyncio.get_running_loop().create_task(self._connect(user, password))
            linking.add_done_callback(lambda done: self._linked(user, done))
        return await asyncio.shield(linking)

    def _linked(self, user: str | None, task: asyncio.Task[_UserLink]) -> None:
        if self._linking.get(user) is task:
            del self._linking[user]
        if not task.cancelled():
            task.exception()

    async def _connect(self, user: str | None, password: str | None) -> _UserLink:
        client = self.core_links.client(
            user=user,
            password=password,
            client_name=f"mqtt fan-out {self.gateway_name}",
        )
        try:
            await client.connect()
        except BaseException:
            await client.close()
            raise
        link = self._links[user] = _UserLink(user, client)
        client.on_closed = lambda error: self._link_lost(link, error)
        return link

    def _retire(self, feed: Feed, *, close: bool = True) -> None:
        """Forget a feed now (a new subscriber makes a new one); its consumer and queue, or its user's link
        when no feed is left on it, go in the background."""
        if self._feeds.get(feed.key) is feed:
            del self._feeds[feed.key]
        feed.ended = True
        if feed.pump is not None and feed.pump is not asyncio.current_task():
            feed.pump.cancel()
        for member in feed.members:
            self._joined.pop(member, None)
        link = feed.link
        link.feeds.discard(feed)
        if not close:
            return
        if not link.feeds and not link.opening:
            self._drop_link(link)  # its temporary queues go with it
        else:
            self._run(self._delete_queue(link, feed.queue, feed.consumer))

    def _drop_link(self, link: _UserLink) -> None:
        if self._links.get(link.user) is link:
            del self._links[link.user]
        link.client.on_closed = None
        self._run(link.client.close())

    async def _delete_queue(self, link: _UserLink, queue: str, consumer: Consumer | None = None) -> None:
        if consumer is not None:
            with contextlib.suppress(LinkRequestError):
                await consumer.close()
        with contextlib.suppress(LinkRequestError):
            await link.client.delete_queue(queue)  # which the link then no longer makes again after a failover

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        """Background work, awaited by ``stop``."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._ran)

    def _ran(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("fan-out clean-up failed", exc_info=task.exception())

    def _link_lost(self, link: _UserLink, error: LinkRequestError) -> None:
        """Lost for good (failing over did not bring it back): its feeds end."""
        log.info("fan-out link to the core closed", extra={"reason": error.text})
        if self._links.get(link.user) is link:
            del self._links[link.user]
        for feed in list(link.feeds):
            self._ended(feed)

    def _ended(self, feed: Feed) -> None:
        """The feed cannot go on: it is retired, and its members are told (their connections end)."""
        members = list(feed.members)
        self._retire(feed)
        feed.members.clear()
        for member in members:
            member.feed_lost()

    # ------------------------------------------------------------------ fan-out
    async def _pump(self, feed: Feed) -> None:
        try:
            await self._fan_out(feed)
        except Exception:  # a bug: the feed cannot go on, its subscribers reconnect
            log.exception("fan-out failed", extra={"queue": feed.queue})
            self._ended(feed)

    async def _fan_out(self, feed: Feed) -> None:
        consumer = feed.consumer
        while True:
            try:
                batch = await consumer.get_batch()
            except LinkRequestError as exc:  # the core ended the consumer (its queue was deleted, say)
                log.info("fan-out subscription ended by the core", extra={"queue": feed.queue, "reason": exc.text})
                self._ended(feed)
                return
            if batch:
                feed.passed(batch, numbering(feed.link.client))
            now_ms = int(time.time() * 1000)
            dollar_safe = feed.dollar_safe
            # What no subscriber of this filter may get, decided once: expired messages, and ``$`` topics for a
            # filter that starts with a wildcard.
            messages = [
                m
                for _, m in batch
                if not ((m[M_EXPIRATION] and m[M_EXPIRATION] <= now_ms) or (dollar_safe and m[M_ADDRESS][:1] == "$"))
            ]
            if not messages:
                continue
            encodings = Encodings(messages, now_ms, feed.topics, numbering(feed.link.client))
            delivered = 0
            for member in list(feed.members):
                try:
                    delivered += member.fan_out(encodings)
                except Exception:  # one connection's failure is not the others'
                    log.exception("fan-out to a subscriber failed")
                    member.feed_lost()
            self.on_delivered(delivered)
