"""Gateway-local fan-out of QoS 0 subscriptions: one core subscription per user and topic filter, written to
every connection of this gateway that subscribed to that filter.

A QoS 0 subscription of a session that ends with its connection has nothing to keep: no queued messages
for a later connection, no acknowledgements. Given a queue each, a message to a topic with a thousand such
subscribers is copied, delivered, decoded, encoded and acknowledged a thousand times. Here the subscribers
of one filter on one gateway share a *feed*: a temporary queue consumed with auto-acknowledge on a link of
their user, whose messages the gateway decodes once and encodes once per way a PUBLISH can look (protocol
version, retain-as-published, subscription identifier), then writes to each subscriber.

The core still decides who may subscribe: a feed's queue is created on a link of the subscribers' own user,
so a refused user is refused as before, and a feed carries only what its user may read.

A subscriber that does not keep up loses QoS 0 messages instead of holding up the others: while more than
``mqtt.qos0_max_buffered_bytes`` wait to be written to its connection, the feed's messages skip it. QoS 1 and
2 subscriptions, shared subscriptions and persistent sessions keep their own queues in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tridentmq_mqtt import convert
from tridentmq_mqtt.convert import ConversionError
from tridentmq_mqtt.messages import RETAIN, publish_properties
from tridentmq_mqtt.protocol.errors import LocalProtocolError
from tridentmq_mqtt.protocol.packets import V5, Publish, encode, encode_plain_publish, encode_topic
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES
from tridentmq_mqtt.settings import CoreLinkSection
from tridentmq_shared.core_links import CoreLinks
from tridentmq_shared.link.client import Consumer, LinkClient, LinkRequestError
from tridentmq_shared.message import M_ADDRESS, M_BODY, M_EXPIRATION, M_PROPS, RoutingType, WireMessage

log = logging.getLogger("tridentmq.mqtt")

_TOPIC_CACHE_LIMIT = 4096  # addresses remembered per feed with their topic's encoding


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

    __slots__ = ("_by_kind", "_topics", "messages", "now_ms")

    def __init__(self, messages: list[WireMessage], now_ms: int, topics: dict[str, tuple[str, bytes] | None]) -> None:
        self.messages = messages
        self.now_ms = now_ms
        self._topics = topics
        self._by_kind: dict[tuple[int, bool, int | None], Encoded] = {}

    def packets(self, version: int, retain_as_published: bool, subscription_id: int | None) -> Encoded:
        kind = (version, retain_as_published, subscription_id if version == V5 else None)
        known = self._by_kind.get(kind)
        if known is None:
            known = self._by_kind[kind] = Encoded([self._encode(m, *kind) for m in self.messages])
        return known

    def _encode(self, message: WireMessage, version: int, retain_as_published: bool,
                subscription_id: int | None) -> bytes:  # fmt: skip
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
            log.warning("message not deliverable over MQTT", extra={"address": message[M_ADDRESS][:100],
                                                                    "reason": str(exc)[:200]})  # fmt: skip
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


@dataclass(eq=False)
class Feed:
    key: tuple[str | None, str]  # user, topic filter
    queue: str
    consumer: Consumer
    link: _UserLink
    dollar_safe: bool  # the filter starts with a wildcard: it must not deliver ``$`` topics
    members: dict[Subscriber, None] = field(default_factory=dict)  # an ordered set: written in joining order
    topics: dict[str, tuple[str, bytes] | None] = field(default_factory=dict)
    pump: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _UserLink:
    user: str | None
    client: LinkClient
    feeds: set[Feed] = field(default_factory=set)


class Feeds:
    """The feeds of one gateway. A feed is made by its first subscriber and dropped with its last; ``join``
    and ``leave`` run one at a time."""

    def __init__(self, core: CoreLinkSection, gateway_name: str, window: int,
                 on_delivered: Callable[[int], None]) -> None:  # fmt: skip
        self.core = core
        self.gateway_name = gateway_name
        self.window = window
        self.on_delivered = on_delivered
        self._feeds: dict[tuple[str | None, str], Feed] = {}
        self._links: dict[str | None, _UserLink] = {}
        self._joined: dict[Subscriber, Feed] = {}
        self._changing = asyncio.Lock()
        # Feed queues are named per gateway process (replicas may share a configured name) and per feed.
        self._process = uuid.uuid4().hex[:12]
        self._made = itertools.count(1)

    def __len__(self) -> int:
        return len(self._feeds)

    async def join(self, member: Subscriber, user: str | None, password: str | None, topic_filter: str) -> Feed:
        """Add ``member`` to the feed of ``topic_filter`` for ``user``, made first if there is none (the core
        may refuse its queue: ``LinkRequestError``). A caller cancelled meanwhile does not stop the join (a feed
        half made would be left without members): it calls ``leave``, which waits for the join to end."""
        task = asyncio.get_running_loop().create_task(self._join(member, user, password, topic_filter))
        return await asyncio.shield(task)

    async def _join(self, member: Subscriber, user: str | None, password: str | None, topic_filter: str) -> Feed:
        async with self._changing:
            key = (user, topic_filter)
            feed = self._feeds.get(key)
            if feed is None:
                feed = await self._open(key, password)
            feed.members[member] = None
            self._joined[member] = feed
            return feed

    async def leave(self, member: Subscriber) -> None:
        """Take ``member`` out of its feed (if it is in one), which goes with its last member."""
        async with self._changing:
            feed = self._joined.pop(member, None)
            if feed is None:
                return
            feed.members.pop(member, None)
            if not feed.members and self._feeds.get(feed.key) is feed:
                await self._close(feed)

    async def stop(self) -> None:
        async with self._changing:
            for feed in list(self._feeds.values()):
                await self._close(feed)

    # ------------------------------------------------------------------ feeds and their links
    async def _open(self, key: tuple[str | None, str], password: str | None) -> Feed:
        user, topic_filter = key
        pattern = convert.filter_to_pattern(topic_filter)
        link = self._links.get(user)
        if link is None:
            client = CoreLinks.of(self.core).client(user=user, password=password, heartbeat_ms=self.core.heartbeat_ms,
                                                    client_name=f"mqtt fan-out {self.gateway_name}")  # fmt: skip
            await client.connect()
            link = self._links[user] = _UserLink(user, client)
            client.on_closed = lambda error: self._link_lost(link, error)
        queue = convert.fanout_queue(f"{self.gateway_name}.{self._process}.{next(self._made)}", topic_filter)
        created = False
        try:
            await link.client.create_queue(queue, pattern, routing_type=RoutingType.MULTICAST, durable=False,
                                           temporary=True)  # fmt: skip
            created = True
            consumer = await link.client.subscribe(queue, credit=self.window, auto_ack=True, address=pattern,
                                                   routing_type=int(RoutingType.MULTICAST))  # fmt: skip
        except LinkRequestError:
            if not link.feeds:
                await self._drop_link(link)  # its temporary queue goes with it
            elif created:  # the core let the user create the queue but not consume from it
                with contextlib.suppress(LinkRequestError):
                    await link.client.delete_queue(queue)
            raise
        feed = Feed(key, queue, consumer, link, dollar_safe=topic_filter[:1] in ("+", "#"))
        link.feeds.add(feed)
        self._feeds[key] = feed
        feed.pump = asyncio.get_running_loop().create_task(self._pump(feed))
        return feed

    async def _close(self, feed: Feed) -> None:
        del self._feeds[feed.key]
        for member in feed.members:
            self._joined.pop(member, None)
        if feed.pump is not None:
            feed.pump.cancel()
        link = feed.link
        link.feeds.discard(feed)
        if not link.feeds:  # the queue is temporary: it goes with the link
            await self._drop_link(link)
            return
        with contextlib.suppress(LinkRequestError):
            await feed.consumer.close()
            await link.client.delete_queue(feed.queue)

    async def _drop_link(self, link: _UserLink) -> None:
        if self._links.get(link.user) is link:
            del self._links[link.user]
        link.client.on_closed = None
        await link.client.close()

    def _link_lost(self, link: _UserLink, error: LinkRequestError) -> None:
        """Lost for good (failing over did not bring it back)."""
        log.info("fan-out link to the core closed", extra={"reason": error.text})
        if self._links.get(link.user) is link:
            del self._links[link.user]
        for feed in list(link.feeds):
            self._ended(feed)

    def _ended(self, feed: Feed) -> None:
        """The feed cannot go on: it is forgotten, and its members are told (their connections end)."""
        if self._feeds.get(feed.key) is feed:
            del self._feeds[feed.key]
        if feed.pump is not None and feed.pump is not asyncio.current_task():
            feed.pump.cancel()
        feed.link.feeds.discard(feed)
        members = list(feed.members)
        feed.members.clear()
        for member in members:
            self._joined.pop(member, None)
            member.feed_lost()

    # ------------------------------------------------------------------ fan-out
    async def _pump(self, feed: Feed) -> None:
        consumer = feed.consumer
        try:
            while True:
                batch = await consumer.get_batch()
                now_ms = int(time.time() * 1000)
                dollar_safe = feed.dollar_safe
                # What no subscriber of this filter may get, decided once: expired messages, and ``$`` topics
                # for a filter that starts with a wildcard.
                messages = [m for _, m in batch if not ((m[M_EXPIRATION] and m[M_EXPIRATION] <= now_ms)
                                                        or (dollar_safe and m[M_ADDRESS][:1] == "$"))]  # fmt: skip
                if not messages:
                    continue
                encodings = Encodings(messages, now_ms, feed.topics)
                delivered = 0
                for member in list(feed.members):
                    delivered += member.fan_out(encodings)
                self.on_delivered(delivered)
        except LinkRequestError as exc:  # the core ended the consumer (its queue was deleted, say)
            log.info("fan-out subscription ended by the core", extra={"queue": feed.queue, "reason": exc.text})
            self._ended(feed)
