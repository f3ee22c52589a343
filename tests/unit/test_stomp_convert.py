"""STOMP headers of core messages (pure)."""

from __future__ import annotations

from tridentmq_shared.message import M_ADDRESS, M_PROPS, ROUTING_DEFAULT, RoutingType, new_message
from tridentmq_stomp import convert


def test_another_protocols_original_encoding_is_not_a_header() -> None:
    message = new_message("a", b"", properties={"colour": "red", "$enc.amqp.properties": b"\x00\x53\x73\x45"})
    headers = dict(convert.message_headers(message, "s", "1-1", 1))
    assert headers["colour"] == "red"
    assert not any(name.startswith("$enc.") for name in headers)


def test_a_bare_destination_comes_back_as_sent_but_not_on_a_dead_letter_copy() -> None:
    sent = convert.to_message("orders", ROUTING_DEFAULT, {"destination": "orders"}, b"")
    assert dict(convert.message_headers(sent, "s", "1-1", 1))["destination"] == "orders"
    prefixed = convert.to_message("orders", int(RoutingType.ANYCAST), {"destination": "/queue/orders"}, b"")
    assert convert.SENT_DESTINATION not in prefixed[M_PROPS]
    assert dict(convert.message_headers(prefixed, "s", "1-1", 1))["destination"] == "/queue/orders"
    dead = list(sent)
    dead[M_ADDRESS] = "DLQ"  # the broker's copy for a dead-letter address keeps the properties
    assert dict(convert.message_headers(dead, "s", "1-1", 1))["destination"] == "/queue/DLQ"
