"""A multicast message forwarded for another node's subscription is that subscription's copy only: when the
other node refuses it, or no longer has that subscription, it is not routed by its address instead (the
address's other subscriptions had their own copies when it was published). In process with a real broker
(``broker_harness``); no connection is opened."""

from __future__ import annotations

from tests.unit.broker_harness import ANYCAST, MULTICAST, Harness, ok

from tridentmq_core.forwarding import FORWARD_PROPERTY, encode_header, numbered_header
from tridentmq_core.settings import AddressSettingsEntry, CoreSettings
from tridentmq_shared.message import M_ID, M_PROPS, WireMessage, new_message

OTHER = "node-2"


def _for_subscription(h: Harness, queue: str, routing: int = MULTICAST) -> WireMessage:
    """A message of ``news`` as this node forwards it to ``queue`` on OTHER."""
    message = new_message("news", b"one copy", routing=routing, durable=True)
    message[M_ID] = h.broker.new_message_id()
    message[M_PROPS] = {FORWARD_PROPERTY: numbered_header(OTHER, (queue,), 1, h.broker.transfer_prefix)}
    return message


def _depth(h: Harness, queue: str) -> int:
    return len(h.broker.queues[queue])


def test_a_refused_copy_for_another_nodes_subscription_is_not_a_second_copy_for_this_nodes() -> None:
    h = Harness(CoreSettings(address_settings=[AddressSettingsEntry(match="news", dead_letter_address="news.dlq")]))
    client = h.connect()
    ok(client.create_queue("sub-here", "news", MULTICAST))
    ok(client.create_queue("news.dlq", "news.dlq", ANYCAST))
    forward_queue = h.broker.forwarder.forward_queue(OTHER, h.now_ms)
    h.broker.forwarder.place_refused(_for_subscription(h, "sub-there"), h.now_ms, text="full", origin=forward_queue)
    assert _depth(h, "sub-here") == 0  # it had its copy when the message was published
    assert _depth(h, "news.dlq") == 1  # confirmed long ago: never dropped


def test_a_refused_anycast_message_is_still_routed_here_by_its_address() -> None:
    h = Harness()
    ok(h.connect().create_queue("news-here", "news", ANYCAST))
    forward_queue = h.broker.forwarder.forward_queue(OTHER, h.now_ms)
    message = _for_subscription(h, "news-there", ANYCAST)
    h.broker.forwarder.place_refused(message, h.now_ms, text="full", origin=forward_queue)
    assert _depth(h, "news-here") == 1  # one logical queue: this instance takes it


def test_a_copy_arriving_for_a_subscription_deleted_meanwhile_goes_to_no_other_subscription() -> None:
    h = Harness()
    ok(h.connect().create_queue("sub-kept", "news", MULTICAST))
    message = new_message("news", b"for sub-gone", routing=MULTICAST, durable=True)
    message[M_ID] = 7
    message[M_PROPS] = {FORWARD_PROPERTY: encode_header("node-1", ("sub-gone",), 1, "node-2:7")}
    h.broker.forwarder.accept_from_cluster(message, h.now_ms)
    assert _depth(h, "sub-kept") == 0
