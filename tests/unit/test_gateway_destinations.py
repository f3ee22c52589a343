"""How the STOMP and AMQP gateways name core addresses: destinations and node addresses in, addresses,
routing types and queues out, and a STOMP MESSAGE's headers back (pure functions)."""

from __future__ import annotations

import pytest

from tridentmq_amqp import convert as amqp
from tridentmq_shared.message import (
    M_ADDRESS,
    M_ID,
    M_TIMESTAMP,
    ROUTING_DEFAULT,
    TEMPORARY_ADDRESS_PREFIX,
    RoutingType,
    new_message,
)
from tridentmq_stomp import convert as stomp

ANYCAST, MULTICAST = int(RoutingType.ANYCAST), int(RoutingType.MULTICAST)


# ---------------------------------------------------------------------- STOMP
@pytest.mark.parametrize(
    ("destination", "kind", "expected"),
    [
        ("/queue/orders", None, ("orders", ANYCAST)),
        ("/topic/news", None, ("news", MULTICAST)),
        ("/topic/news", "ANYCAST", ("news", MULTICAST)),  # the prefix says it already
        ("orders", None, ("orders", ROUTING_DEFAULT)),
        ("orders", "anycast", ("orders", ANYCAST)),
        ("news", "MULTICAST", ("news", MULTICAST)),
        ("/exchange/amq.direct/route", None, ("/exchange/amq.direct/route", ROUTING_DEFAULT)),
    ],
)
def test_a_stomp_destination_names_an_address_and_its_routing(
    destination: str, kind: str | None, expected: tuple[str, int]
) -> None:
    assert stomp.destination_to_address(destination, kind) == expected


def test_a_destination_type_other_than_anycast_or_multicast_is_refused() -> None:
    with pytest.raises(stomp.ConversionError, match="not ANYCAST or MULTICAST"):
        stomp.destination_to_address("orders", "BROADCAST")


def test_a_temporary_queue_is_the_connection_s_own() -> None:
    assert stomp.temporary_address("c1", "/temp-queue/replies") == f"{TEMPORARY_ADDRESS_PREFIX}c1.replies"
    for bad in ("/temp-queue/", "/temp-queue/a*", "/temp-queue/#"):
        with pytest.raises(stomp.ConversionError, match="not a temporary queue name"):
            stomp.temporary_address("c1", bad)


def test_a_send_becomes_a_message_with_stomp_s_headers_as_fields() -> None:
    headers = {
        "destination": "/queue/orders",
        "persistent": "TRUE",
        "priority": "7",
        "expires": "4102444800000",
        "content-type": "text/plain",
        "receipt": "r1",
        "region": "eu",
    }
    message = stomp.to_message("orders", ANYCAST, headers, b"hello")
    headers_back = dict(stomp.message_headers(message, "s1", "1-5", 1))
    assert headers_back["destination"] == "/queue/orders"
    assert headers_back["persistent"] == "true"
    assert headers_back["priority"] == "7"
    assert headers_back["expires"] == "4102444800000"
    assert headers_back["content-type"] == "text/plain"
    assert headers_back["region"] == "eu"  # any other header comes back as it was
    assert headers_back["subscription"] == "s1"
    assert headers_back["ack"] == "1-5"
    assert "receipt" not in headers_back
    assert "redelivered" not in headers_back
    assert stomp.body_of(message) == b"hello"


def test_a_message_names_the_destination_its_send_named() -> None:
    """Not ``/queue/probe-bare`` for ``probe-bare``, nor ``/queue//exchange/...`` for a RabbitMQ-style name."""
    for destination in ("probe-bare", "/exchange/amq.direct/route"):
        message = stomp.to_message(destination, ROUTING_DEFAULT, {"destination": destination}, b"")
        assert dict(stomp.message_headers(message, "s", "1-1", 1))["destination"] == destination
    topic = stomp.to_message("news", MULTICAST, {"destination": "/topic/news"}, b"")
    assert dict(stomp.message_headers(topic, "s", "1-1", 1))["destination"] == "/topic/news"
    moved = stomp.to_message("orders", ANYCAST, {"destination": "orders"}, b"")
    moved[M_ADDRESS] = "DLQ"  # dead-lettered: at another address now
    assert dict(stomp.message_headers(moved, "s", "1-1", 1))["destination"] == "/queue/DLQ"
    shown = dict(stomp.message_headers(moved, "s", "1-1", 1, "/temp-queue/replies"))
    assert shown["destination"] == "/temp-queue/replies"


def test_a_message_sent_without_a_routing_type_shows_the_one_of_the_queue_it_reached() -> None:
    """A bare AMQP address on a multicast address reached a /topic/ subscriber as /queue/."""
    message = new_message("ticks", b"", routing=ROUTING_DEFAULT)
    on_topic = dict(stomp.message_headers(message, "s", "1-1", 1, queue_routing=MULTICAST))
    assert on_topic["destination"] == "/topic/ticks"
    assert dict(stomp.message_headers(message, "s", "1-1", 1))["destination"] == "/queue/ticks"
    anycast = new_message("ticks", b"", routing=ANYCAST)  # its own routing type wins
    assert dict(stomp.message_headers(anycast, "s", "1-1", 1, queue_routing=MULTICAST))["destination"] == "/queue/ticks"


def test_a_redelivery_says_so_and_the_message_id_and_timestamp_are_the_core_s() -> None:
    message = stomp.to_message("orders", ANYCAST, {}, b"")
    message[M_ID], message[M_TIMESTAMP] = 42, 1700000000000
    headers = dict(stomp.message_headers(message, "s", "1-42", 2))
    assert headers["redelivered"] == "true"
    assert headers["message-id"] == "42"
    assert headers["timestamp"] == "1700000000000"
    assert headers["persistent"] == "false"


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ({"priority": "10"}, "not within 0..9"),
        ({"priority": "-1"}, "not within 0..9"),
        ({"priority": "high"}, "priority 'high' is not a number"),
        ({"expires": "soon"}, "expires 'soon' is not a number"),
    ],
)
def test_a_header_the_gateway_cannot_map_is_refused(headers: dict[str, str], problem: str) -> None:
    with pytest.raises(stomp.ConversionError, match=problem):
        stomp.to_message("orders", ANYCAST, headers, b"")


def test_a_send_to_a_queue_of_an_address_is_refused() -> None:
    with pytest.raises(stomp.ConversionError, match="names a queue"):
        stomp.to_message("orders::q1", ANYCAST, {}, b"")


def test_empty_numbers_take_the_defaults() -> None:
    message = stomp.to_message("orders", ANYCAST, {"priority": "", "expires": "", "content-type": "x"}, b"")
    headers = dict(stomp.message_headers(message, "s", "1-1", 1))
    assert headers["priority"] == "4"
    assert headers["expires"] == "0"


# ---------------------------------------------------------------------- AMQP
@pytest.mark.parametrize(
    ("address", "capabilities", "expected"),
    [
        ("orders", (), amqp.Node("orders", ROUTING_DEFAULT)),
        ("queue://orders", ("topic",), amqp.Node("orders", ANYCAST)),  # the prefix wins
        ("topic://news", (), amqp.Node("news", MULTICAST)),
        ("anycast://orders", (), amqp.Node("orders", ANYCAST)),
        ("multicast://news", (), amqp.Node("news", MULTICAST)),
        ("/queue/orders", (), amqp.Node("orders", ANYCAST)),
        ("/topic/news", (), amqp.Node("news", MULTICAST)),
        ("news", ("shared", "topic"), amqp.Node("news", MULTICAST)),  # as Qpid JMS says it
        ("orders", ("queue",), amqp.Node("orders", ANYCAST)),
        ("news::audit", ("topic",), amqp.Node("news", MULTICAST, "audit")),
    ],
)
def test_an_amqp_address_names_a_core_node(address: str, capabilities: tuple[str, ...], expected: amqp.Node) -> None:
    assert amqp.resolve(address, capabilities) == expected


@pytest.mark.parametrize(("address", "problem"), [("", "empty"), ("topic://", "empty"), ("news::", "queue after")])
def test_an_amqp_address_that_names_nothing_is_refused(address: str, problem: str) -> None:
    with pytest.raises(amqp.ConversionError, match=problem):
        amqp.resolve(address)


def test_a_node_s_capability_tells_its_kind() -> None:
    assert amqp.capability_of(MULTICAST) == "topic"
    assert amqp.capability_of(ANYCAST) == "queue"
    assert amqp.capability_of(ROUTING_DEFAULT) is None


def test_subscription_queues_are_named_as_jms_clients_expect() -> None:
    assert amqp.durable_subscription_queue("app", "audit") == "app.audit"
    assert amqp.shared_subscription_queue("app", "audit|2", shared_globally=False) == "app.audit"
    assert amqp.shared_subscription_queue("app", "audit|volatile1", shared_globally=True) == "audit"
    assert amqp.temporary_address("c1", 3) == f"{TEMPORARY_ADDRESS_PREFIX}amqp.c1.3"
