"""STOMP headers of core messages (pure)."""

from __future__ import annotations

from tridentmq_shared.message import new_message
from tridentmq_stomp import convert


def test_another_protocols_original_encoding_is_not_a_header() -> None:
    message = new_message("a", b"", properties={"colour": "red", "$enc.amqp.properties": b"\x00\x53\x73\x45"})
    headers = dict(convert.message_headers(message, "s", "1-1", 1))
    assert headers["colour"] == "red"
    assert not any(name.startswith("$enc.") for name in headers)
