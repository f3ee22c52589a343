"""The rules of every address and queue name (``tridentmq_shared.names``), at each door: the core's link
requests, and the gateways' mapping of their protocols' destinations."""

from __future__ import annotations

import random

import pytest
from tests.unit.broker_harness import Harness, failed, ok

from tridentmq_amqp import convert as amqp_convert
from tridentmq_amqp.protocol.nul_names import NulNames
from tridentmq_core.router import MAX_ADDRESS_LENGTH, InvalidAddress, validate_address
from tridentmq_mqtt import convert as mqtt_convert
from tridentmq_shared.link.ops import ErrorCode
from tridentmq_shared.names import MAX_ADDRESS_WORDS, MAX_NAME_LENGTH, name_problem
from tridentmq_stomp import convert as stomp_convert
from tridentmq_stomp import subscribing

BAD_NAMES = [
    ("a\x00b", "control character '\\x00' at position 1"),
    ("a\x1fb", "control character"),
    ("\x7f", "control character"),
    ("a\x9f", "control character"),
    ("x" * (MAX_NAME_LENGTH + 1), f"{MAX_NAME_LENGTH + 1} characters long, the limit is {MAX_NAME_LENGTH}"),
    ("", "must not be empty"),
]


@pytest.mark.parametrize(("name", "problem"), BAD_NAMES)
def test_a_bad_name_is_named_with_what_is_wrong(name: str, problem: str) -> None:
    found = name_problem(name, "queue name")
    assert found is not None
    assert found.startswith("queue name")
    assert problem in found


@pytest.mark.parametrize("name", ["orders", "a.b.c", "tmp.x", "x" * MAX_NAME_LENGTH, "café.日本", "$sys.x"])
def test_a_good_name_has_no_problem(name: str) -> None:
    assert name_problem(name) is None


def test_the_core_and_the_mqtt_gateway_share_the_limits() -> None:
    assert MAX_ADDRESS_LENGTH == mqtt_convert.MAX_ADDRESS_LENGTH == MAX_NAME_LENGTH
    assert mqtt_convert.MAX_ADDRESS_WORDS == MAX_ADDRESS_WORDS
    with pytest.raises(InvalidAddress, match="control character"):
        validate_address("a\x00", allow_wildcards=False)


@pytest.mark.parametrize(("name", "problem"), BAD_NAMES[:-1])  # an empty name is refused as before
def test_the_core_refuses_to_make_a_queue_of_a_bad_name(name: str, problem: str) -> None:
    h = Harness()
    c = h.connect("app")
    assert problem in failed(c.create_queue(name, "plain"), ErrorCode.INVALID)
    assert problem in failed(c.subscribe(f"plain::{name}")[1], ErrorCode.INVALID)  # auto-created by a SUBSCRIBE
    assert problem in failed(c.subscribe(name, address="plain")[1], ErrorCode.INVALID)
    assert name not in h.broker.queues
    ok(c.create_queue("fine", "plain"))  # the link goes on


@pytest.mark.parametrize(
    "destination", ["/queue/a\x00b", "/topic/a\x01", "a\x00", "/queue/ok::q\x00", "/queue/" + "x" * 256]
)
def test_the_stomp_gateway_refuses_a_destination_of_a_bad_name(destination: str) -> None:
    with pytest.raises(stomp_convert.ConversionError):
        stomp_convert.destination_to_address(destination)


def test_the_stomp_gateway_refuses_a_durable_subscription_of_a_bad_name() -> None:
    refused = subscribing.plan(
        "news",
        int(subscribing.RoutingType.MULTICAST),
        {"durable-subscription-name": "sub\x00"},
        client_id="app",
        temporary_queue="t",
        prefetch=10,
        max_prefetch=100,
    )
    assert isinstance(refused, subscribing.Refused)
    assert refused.message == "invalid header"
    assert "control character" in refused.detail


@pytest.mark.parametrize("address", ["a\x00b", "queue://a\x00", "ok::q\x00", "topic://" + "x" * 256])
def test_the_amqp_gateway_refuses_an_address_of_a_bad_name(address: str) -> None:
    with pytest.raises(amqp_convert.ConversionError):
        amqp_convert.resolve(address)


def test_the_mqtt_gateway_refuses_an_over_long_topic() -> None:
    with pytest.raises(mqtt_convert.ConversionError, match="limit is 255"):
        mqtt_convert.topic_to_address("x" * 256)


# ------------------------------------------------------------------------------------------------ AMQP NULs
def _amqp_stream() -> bytes:
    """A client's AMQP stream: a container id, a link name and addresses with NULs among good frames (the
    frames are built as the AMQP bad-input tests build them)."""
    from tests.integration.test_amqp_bad_input import (  # noqa: PLC0415 - its frame builders
        AMQP_HEADER,
        attach_receiver,
        attach_sender,
        begin_frame,
        message_bytes,
        open_frame,
        transfer_frame,
    )

    return b"".join(
        [
            AMQP_HEADER,
            open_frame("app\x00x"),
            begin_frame(),
            attach_sender("good", 0, "orders"),
            *(transfer_frame(0, n, message_bytes(b"\x00S\x12" * n)) for n in range(20)),  # attach-like bytes
            attach_sender("to", 1, "a\x00b"),
            b"\x00\x00\x00\x08\x02\x00\x00\x00",  # a heartbeat
            attach_receiver("from", 2, "ok::q\x00"),
            attach_receiver("na\x00me", 3, "fine"),
            attach_receiver("fine", 4, "fine"),
        ]
    )


def _fed(chunks: list[bytes]) -> NulNames:
    names = NulNames()
    for chunk in chunks:
        names.feed(chunk)
    return names


@pytest.mark.parametrize("split", ["whole", "bytes", "random"])
def test_nuls_proton_would_cut_are_found_whatever_the_reads(split: str) -> None:
    stream = _amqp_stream()
    if split == "whole":
        chunks = [stream]
    elif split == "bytes":
        chunks = [stream[i : i + 1] for i in range(len(stream))]
    else:
        rng, chunks, i = random.Random(7), [], 0
        while i < len(stream):
            step = rng.randint(1, 40)
            chunks.append(stream[i : i + step])
            i += step
    names = _fed(chunks)
    assert names.container_problem is not None
    assert "container id" in names.container_problem
    # keyed by the name proton shows and whether the client receives on the link
    assert set(names.problems) == {("to", False), ("from", True), ("na", True)}
    assert "target address 'a\\x00b'" in names.problems[("to", False)]
    assert "source address" in names.problems[("from", True)]
    assert "link name" in names.problems[("na", True)]


@pytest.mark.parametrize("seed", range(20))
def test_garbage_never_breaks_the_nul_finder(seed: int) -> None:
    rng = random.Random(seed)
    stream = _amqp_stream()
    noisy = bytearray(stream)
    for _ in range(30):
        noisy[rng.randrange(len(noisy))] = rng.randrange(256)
    _fed([bytes(noisy[i : i + 17]) for i in range(0, len(noisy), 17)])
    _fed([rng.randbytes(4096)])
