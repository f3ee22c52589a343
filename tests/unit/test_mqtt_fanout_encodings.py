"""A fan-out batch encoded once per kind of subscriber: the same bytes as the codec writes for each message."""

from __future__ import annotations

from typing import Any, cast

from tridentmq_mqtt import messages
from tridentmq_mqtt.feeds import Encodings, Feed
from tridentmq_mqtt.protocol.packets import V5, V311, PacketParser, Publish, encode
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_shared.message import M_ID, WireMessage, new_message

NOW = 1_700_000_000_000


def _batch() -> list[WireMessage]:
    plain = messages.to_message("a.b", b"one", 1, NO_PROPERTIES, "c1", NOW)
    retained = messages.to_message("a.c", b"two", 0, NO_PROPERTIES, "c2", NOW, retain=True)
    props = Properties(content_type="text/plain", message_expiry_interval=30, user_properties=(("k", "v"),))
    rich = messages.to_message("a.%", b"three", 1, props, "c1", NOW)
    return [plain, retained, rich]


def test_each_message_is_what_the_codec_writes() -> None:
    batch = _batch()
    encodings = Encodings(batch, NOW + 10_000, {})
    v311 = encodings.packets(V311, retain_as_published=True, subscription_id=None)
    assert v311.parts == [
        encode(Publish("a/b", b"one", 0), V311),
        encode(Publish("a/c", b"two", 0, retain=True), V311),
        encode(Publish("a/", b"three", 0), V311),
    ]
    assert (v311.joined, v311.count, v311.largest) == (b"".join(v311.parts), 3, max(map(len, v311.parts)))
    v5 = encodings.packets(V5, retain_as_published=False, subscription_id=9)
    parsed = PacketParser(version=V5).feed(v5.joined)
    assert [(p.topic, p.payload, p.qos, p.retain) for p in parsed] == [  # type: ignore[union-attr]
        ("a/b", b"one", 0, False),
        ("a/c", b"two", 0, False),
        ("a/", b"three", 0, False),
    ]
    assert {p.properties.subscription_identifiers for p in parsed} == {(9,)}  # type: ignore[union-attr]
    rich = parsed[2].properties  # type: ignore[union-attr]
    assert (rich.content_type, rich.message_expiry_interval, rich.user_properties) == ("text/plain", 20, (("k", "v"),))


def test_a_kind_is_encoded_once_and_shared() -> None:
    encodings = Encodings(_batch(), NOW, {})
    first = encodings.packets(V5, retain_as_published=False, subscription_id=None)
    assert encodings.packets(V5, retain_as_published=False, subscription_id=None) is first
    assert encodings.packets(V311, retain_as_published=False, subscription_id=7) is encodings.packets(
        V311, retain_as_published=False, subscription_id=None
    )  # no ids before 5.0
    assert encodings.packets(V5, retain_as_published=True, subscription_id=None) is not first


def test_an_address_that_is_no_topic_is_left_out() -> None:
    topics: dict[str, tuple[str, bytes] | None] = {}
    batch = [new_message("x+y", b"no"), new_message("ok", b"yes")]  # '+' spells no MQTT topic name
    encoded = Encodings(batch, NOW, topics).packets(V311, retain_as_published=False, subscription_id=None)
    assert encoded.parts == [b"", encode(Publish("ok", b"yes", 0), V311)]
    assert encoded.count == 1
    assert topics["x+y"] is None  # remembered: the next batch does not try again


def _numbered(*ids: int) -> list[tuple[int, WireMessage]]:
    batch = []
    for n in ids:
        message = new_message("t", b"x")
        message[M_ID] = n
        batch.append((n, message))
    return batch


def test_a_solo_subscription_is_adopted_only_when_level_with_the_feed() -> None:
    """``Feed.can_adopt``: the feed has handed out nothing past what the solo queue gave, and its queue holds
    everything after that (its first message is no later than the solo's last)."""
    feed = Feed(("u", "t"), "q", cast(Any, None), cast(Any, None), dollar_safe=False)
    node = ("node-1", 1)
    assert not feed.can_adopt(node, 100)  # it has fanned out nothing: it cannot vouch for anything yet
    feed.passed(_numbered(10, 11, 12), node)
    assert (feed.first_id, feed.fanned_upto) == (10, 12)
    assert feed.can_adopt(node, 12)
    assert feed.can_adopt(node, 15)  # the solo is ahead: the feed leaves out what it had
    assert not feed.can_adopt(node, 11)  # the feed handed 12 to its members already
    assert not feed.can_adopt(node, 9)  # before the feed's first message: its queue may not hold what follows
    assert not feed.can_adopt(("node-2", 1), 12)  # numbered otherwise: ids do not compare
    feed.passed(_numbered(8), node)  # a message of higher priority, say, with a lower id
    assert feed.fanned_upto == 12
    feed.passed(_numbered(3, 4), ("node-1", 2))  # its link failed over: numbered anew
    assert (feed.seen_on, feed.first_id, feed.fanned_upto) == (("node-1", 2), 3, 4)
    assert not feed.can_adopt(node, 12)
    assert feed.can_adopt(("node-1", 2), 4)
