"""What an AMQP receiving link asks of the core (``receiving``), without proton or a connection."""

from __future__ import annotations

import pytest

from tridentmq_amqp import convert
from tridentmq_amqp.receiving import Plan, QueueKind, Source, plan


def planned(
    address: str,
    capabilities: tuple[str, ...] = (),
    *,
    durable: bool = False,
    copy: bool = False,
    settled: bool = False,
    selector: str | None = None,
    link_name: str = "sub1",
) -> Plan:
    source = Source(convert.resolve(address, capabilities), capabilities, durable, copy, settled, selector)
    return plan(source, container_id="app-1", link_name=link_name)


def test_a_bare_address_is_its_anycast_queue() -> None:
    p = planned("orders")
    assert (p.kind, p.queue, p.routing) == (QueueKind.QUEUE, "orders", convert.ANYCAST)
    assert not p.durable
    assert p.announce == "queue"  # the client learns what it attached to


def test_a_topic_is_a_volatile_subscription_of_this_link() -> None:
    p = planned("topic://news")
    assert (p.kind, p.queue, p.routing) == (QueueKind.VOLATILE_SUBSCRIPTION, "", convert.MULTICAST)
    assert not p.durable
    assert p.announce == "topic"


def test_a_durable_topic_source_is_a_durable_subscription_named_by_container_and_link() -> None:
    p = planned("topic://news", durable=True, link_name="weekly")
    assert p.kind is QueueKind.DURABLE_SUBSCRIPTION
    assert p.queue == convert.durable_subscription_queue("app-1", "weekly")
    assert p.durable


def test_jms_shared_subscriptions_share_one_queue_per_name() -> None:
    scoped = planned("topic://news", ("shared",), durable=True, link_name="s|2")
    assert scoped.kind is QueueKind.SHARED
    assert scoped.queue == convert.shared_subscription_queue("app-1", "s|2", shared_globally=False)
    assert scoped.durable
    assert scoped.announce is None  # the client named its capabilities itself
    unscoped = planned("topic://news", ("shared", "global"), link_name="s|volatile1")
    assert unscoped.queue == "s"
    assert not unscoped.durable


def test_shared_only_applies_to_a_topic() -> None:
    assert planned("orders", ("shared",)).kind is QueueKind.QUEUE


def test_a_fully_qualified_queue_name_consumes_from_that_queue_even_on_a_topic() -> None:
    p = planned("news::news-archive", ("topic",), durable=True, selector="a = 1")
    assert (p.kind, p.queue) == (QueueKind.QUEUE, "news-archive")
    assert not p.durable
    # Not a subscription: the consumer filters (a durable terminus once dropped the selector here).
    assert (p.queue_selector, p.consumer_selector) == (None, "a = 1")


@pytest.mark.parametrize(
    ("address", "capabilities", "durable", "queue_selector", "consumer_selector"),
    [
        ("orders", (), False, None, "s"),  # a queue: each consumer filters
        ("topic://news", (), False, "s", None),  # a subscription's queue holds what its selector picks
        ("topic://news", (), True, "s", None),
        ("topic://news", ("shared",), True, "s", None),
        # A volatile shared subscription's queue may be another link's (made with another selector) until its
        # last consumer leaves: the consumer filters too.
        ("topic://news", ("shared",), False, "s", "s"),
    ],
)
def test_where_a_selector_applies(
    address: str, capabilities: tuple[str, ...], durable: bool, queue_selector: str, consumer_selector: str
) -> None:
    p = planned(address, capabilities, durable=durable, selector="s")
    assert (p.queue_selector, p.consumer_selector) == (queue_selector, consumer_selector)


def test_a_copying_source_browses_a_queue_but_not_a_topic() -> None:
    browsing = planned("orders", copy=True)
    assert browsing.browse
    assert browsing.presettled  # shown, not taken: nothing to settle
    on_topic = planned("topic://news", copy=True)
    assert not on_topic.browse
    assert not on_topic.presettled


def test_deliveries_are_presettled_when_the_client_asks() -> None:
    assert planned("orders", settled=True).presettled
    assert not planned("orders").presettled
