"""The STOMP gateway's rules that need no connection: what an ACK or NACK settles in each ack mode, the order
of receipts, and what a SUBSCRIBE asks of the core."""

from __future__ import annotations

import pytest
from tests.unit.outcomes import FakeOutcome

from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.message import ROUTING_DEFAULT, RoutingType
from tridentmq_stomp.acks import AUTO, CLIENT, CLIENT_INDIVIDUAL, Unacked, locate
from tridentmq_stomp.receipts import Receipts, refusal
from tridentmq_stomp.subscribing import Plan, QueueToMake, Refused, durable_name, plan, window

# ---------------------------------------------------------------------- acks


def test_auto_mode_keeps_nothing_and_settles_at_once() -> None:
    acks = Unacked("s", 1, AUTO)
    assert acks.delivered([1, 2]) is True
    assert acks.frames == {}


def test_client_mode_settles_its_message_and_every_one_before_it() -> None:
    acks = Unacked("s", 1, CLIENT)
    assert acks.delivered([10, 11, 12, 13]) is False
    assert acks.settle(12) == [10, 11, 12]
    assert list(acks.frames) == [13]
    assert acks.settle(13) == [13]
    assert acks.frames == {}


def test_client_individual_mode_settles_one_message() -> None:
    acks = Unacked("s", 1, CLIENT_INDIVIDUAL)
    acks.delivered([10, 11, 12])
    assert acks.settle(11) == [11]
    assert list(acks.frames) == [10, 12]


def test_a_message_delivered_again_before_its_ack_takes_an_ack_per_frame() -> None:
    """A failover redelivers a message the client had not acknowledged on the lost link: both frames carry the
    same ack header, and the client may acknowledge each."""
    acks = Unacked("s", 1, CLIENT_INDIVIDUAL)
    acks.delivered([5])
    acks.delivered([5])
    assert acks.settle(5) == [5]
    assert acks.frames == {5: 1}
    assert locate([acks], "1-5", None) == (acks, 5)
    assert acks.settle(5) == [5]
    assert locate([acks], "1-5", None) is None


def test_an_ack_header_names_the_subscription_key_and_the_message() -> None:
    first, second = Unacked("a", 1, CLIENT), Unacked("b", 2, CLIENT)
    first.delivered([7])
    second.delivered([7, 8])
    assert first.ack_header(7) == "1-7"
    assert locate([first, second], "2-7", None) == (second, 7)
    assert locate([first, second], "1-8", None) is None  # not delivered on that subscription
    assert locate([first, second], "3-7", None) is None  # no such subscription


@pytest.mark.parametrize(
    "ack", ["", "x", "1-", "-1", "1-x", "a-1", "1-2-3", "\u0661-\u0662", "1" * 21, "1-" + "2" * 21]
)
def test_an_ack_header_that_is_not_ours_names_nothing(ack: str) -> None:
    acks = Unacked("s", 1, CLIENT)
    acks.delivered([1, 2, 3])
    assert locate([acks], ack, None) is None


def test_a_message_id_is_found_on_the_subscription_named_or_on_any() -> None:
    """STOMP 1.0 and 1.1 acknowledge by message-id, with the subscription header when they have one."""
    first, second = Unacked("a", 1, CLIENT), Unacked("b", 2, CLIENT)
    first.delivered([7])
    second.delivered([7])
    assert locate([first, second], "7", None) == (first, 7)
    assert locate([first, second], "7", "b") == (second, 7)
    assert locate([first, second], "7", "c") is None
    assert locate([first, second], "8", None) is None


# ---------------------------------------------------------------------- receipts


def test_receipts_go_out_in_the_order_of_their_frames() -> None:
    receipts: Receipts[FakeOutcome] = Receipts()
    first, second = FakeOutcome(), FakeOutcome()
    receipts.after(first, "send-1")
    receipts.done("subscribe")  # handled at once, but after the SEND before it
    receipts.after(second, None)  # no receipt asked: an ERROR only if refused
    receipts.done(None)  # a frame without a receipt header answers nothing
    receipts.after(FakeOutcome(), "send-3")
    assert receipts.answerable() == []
    assert receipts.outstanding() == [first, second, receipts.outstanding()[2]]
    second.confirm()
    assert receipts.answerable() == []  # the first SEND still waits
    first.confirm()
    assert receipts.answerable() == [("send-1", None), ("subscribe", None), (None, None)]
    assert len(receipts.outstanding()) == 1


def test_a_refused_send_is_answered_with_its_refusal_in_its_place() -> None:
    receipts: Receipts[FakeOutcome] = Receipts()
    refused = FakeOutcome()
    receipts.after(refused, "r1")
    receipts.done("r2")
    error = LinkRequestError(ErrorCode.FORBIDDEN, "no right to send to orders")
    refused.refuse(error)
    assert receipts.answerable() == [("r1", error), ("r2", None)]
    assert receipts.answerable() == []


def test_answers_nobody_will_read_are_retrieved_when_the_connection_ends() -> None:
    receipts: Receipts[FakeOutcome] = Receipts()
    finished, waiting = FakeOutcome(), FakeOutcome()
    finished.refuse(LinkRequestError(ErrorCode.INVALID, "bad"))
    receipts.after(waiting, "r1")
    receipts.after(finished, "r2")
    receipts.drop()
    assert finished.read is True
    assert waiting.read is False
    assert receipts.outstanding() == []
    assert receipts.answerable() == []


def test_a_refusal_says_whether_it_was_a_permission() -> None:
    assert refusal(LinkRequestError(ErrorCode.FORBIDDEN, "no")) == ("permission denied", "no")
    assert refusal(LinkRequestError(ErrorCode.RESOURCE_LIMIT, "full")) == ("send refused", "full")
    assert refusal(ConnectionError("lost")) == ("send refused", "lost")


# ---------------------------------------------------------------------- subscribing
LIMITS = {"prefetch": 100, "max_prefetch": 1000}
ANYCAST, MULTICAST = int(RoutingType.ANYCAST), int(RoutingType.MULTICAST)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, 100),
        ({"consumer-window-size": "10"}, 10),
        ({"activemq.prefetchSize": "20"}, 20),
        ({"consumer-window-size": "5000"}, 1000),
        ({"consumer-window-size": "0"}, 1000),  # unlimited, as far as the gateway allows
        ({"consumer-window-size": "-1"}, 1000),
        ({"consumer-window-size": "ten"}, None),  # refused
        ({"consumer-window-size": "1.5"}, None),
        ({"consumer-window-size": " 10"}, None),
        ({"consumer-window-size": "1" * 12}, 1000),  # beyond any window
        ({"consumer-window-size": "-" + "1" * 12}, 1000),  # unlimited
        ({"consumer-window-size": "", "activemq.prefetchSize": "30"}, 30),
    ],
)
def test_the_window_is_the_client_s_within_the_gateway_s_bounds(headers: dict[str, str], expected: int | None) -> None:
    assert window(headers, **LIMITS) == expected


def test_a_window_that_is_not_an_integer_is_refused() -> None:
    refused = plan("orders", ANYCAST, {"consumer-window-size": "lots"}, client_id=None, temporary_queue="t", **LIMITS)
    assert isinstance(refused, Refused)
    assert refused.message == "invalid header"
    assert "consumer-window-size" in refused.detail


def test_an_anycast_destination_is_consumed_as_it_is_and_its_consumer_filters() -> None:
    assert plan("orders", ANYCAST, {"selector": "region = 'eu'"}, client_id=None, temporary_queue="t", **LIMITS) == (
        Plan("orders", None, temporary=False, window=100, consumer_selector="region = 'eu'")
    )
    # a durable subscription's name means nothing on a queue: the selector still applies
    durable = {"durable-subscription-name": "d", "selector": "x = 1"}
    assert plan("orders", ANYCAST, durable, client_id="c", temporary_queue="t", **LIMITS) == (
        Plan("orders", None, temporary=False, window=100, consumer_selector="x = 1")
    )


def test_a_fully_qualified_queue_is_consumed_as_it_is_and_made_with_its_destination_s_routing() -> None:
    """``/topic/news::archive`` is the queue ``archive`` of ``news``: no subscription queue of its own, the
    consumer filters, and the core makes a missing queue on ``news`` as multicast."""
    headers = {"selector": "x = 1", "durable-subscription-name": "d"}
    assert plan("news::archive", MULTICAST, headers, client_id="c", temporary_queue="t", **LIMITS) == (
        Plan("news::archive", None, temporary=False, window=100, consumer_selector="x = 1", routing=MULTICAST)
    )
    assert plan("orders::eu", ANYCAST, {}, client_id=None, temporary_queue="t", **LIMITS).routing == ANYCAST
    assert plan("orders::eu", ROUTING_DEFAULT, {}, client_id=None, temporary_queue="t", **LIMITS).routing is None


def test_a_topic_gets_a_temporary_queue_of_the_connection_that_the_selector_filters() -> None:
    assert plan("news", MULTICAST, {"selector": "x = 1"}, client_id=None, temporary_queue="stomp.c.1", **LIMITS) == (
        Plan(
            "stomp.c.1",
            QueueToMake("stomp.c.1", "news", durable=False, selector="x = 1"),
            temporary=True,
            window=100,
            consumer_selector=None,
        )
    )
    assert plan("news", MULTICAST, {"selector": ""}, client_id=None, temporary_queue="q", **LIMITS) == (
        Plan(
            "q",
            QueueToMake("q", "news", durable=False, selector=None),
            temporary=True,
            window=100,
            consumer_selector=None,
        )
    )


@pytest.mark.parametrize("header", ["durable-subscription-name", "activemq.subscriptionName"])
def test_a_durable_subscription_is_named_after_the_client_id(header: str) -> None:
    headers = {header: "audit", "selector": "x = 1"}
    assert durable_name(headers) == "audit"
    assert plan("news", MULTICAST, headers, client_id="app", temporary_queue="t", **LIMITS) == (
        Plan(
            "app.audit",
            QueueToMake("app.audit", "news", durable=True, selector="x = 1"),
            temporary=False,
            window=100,
            consumer_selector=None,
        )
    )


@pytest.mark.parametrize("client_id", [None, ""])
def test_a_durable_subscription_without_a_client_id_is_refused(client_id: str | None) -> None:
    refused = plan(
        "news", MULTICAST, {"durable-subscription-name": "a"}, client_id=client_id, temporary_queue="t", **LIMITS
    )
    assert refused == Refused("missing header", "a durable subscription needs client-id on CONNECT")
