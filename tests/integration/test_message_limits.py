"""Limits that agree: what a core accepts it can deliver, and what it cannot is refused at publish.

The core's link frame limit is derived from ``broker.max_message_bytes``; link clients (gateways) accept
deliveries as large as the core's own limit, so raising the one setting is enough; a limit set by hand that
cannot carry the largest message is refused at start. Real core and STOMP gateway processes, raw STOMP sockets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from proton import Disposition, Message
from proton.utils import BlockingConnection, SendException
from tests.conftest import start_core, start_gateway, stop_cleanly
from tests.integration.test_stomp_bad_input import Peer

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


def send(peer: Peer, queue: str, body: bytes, receipt: str) -> None:
    peer.send(
        f"SEND\ndestination:/queue/{queue}\ncontent-length:{len(body)}\nreceipt:{receipt}\n\n".encode() + body + b"\x00"
    )


def test_a_message_above_16_mib_is_delivered_when_the_core_accepts_it(tmp_path: Path) -> None:
    """The issue's case: broker.max_message_bytes raised to 32 MiB. A 20 MiB message used to be accepted, then
    the core could not frame it to the subscriber's gateway (16 MiB) and dead-lettered it after ten tries."""
    core = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(32 * MIB))
    gateway = start_gateway(tmp_path, core, TRIDENTMQ_STOMP_STOMP_MAX_FRAME_BYTES=str(32 * MIB))
    try:
        body = bytes(range(256)) * (20 * MIB // 256)
        with Peer(gateway.port) as consumer, Peer(gateway.port) as producer:
            consumer.connect()
            consumer.send(b"SUBSCRIBE\nid:0\ndestination:/queue/big\nack:client\nreceipt:sub\n\n\x00")
            assert consumer.expect("RECEIPT").headers["receipt-id"] == "sub"
            producer.connect()
            send(producer, "big", body, "sent")
            assert producer.expect("RECEIPT").headers["receipt-id"] == "sent"
            message = consumer.expect("MESSAGE")
            assert message.body == body
            consumer.send(f"ACK\nid:{message.headers['ack']}\nreceipt:acked\n\n\x00".encode())
            assert consumer.expect("RECEIPT").headers["receipt-id"] == "acked"
        stop_cleanly(gateway)
    finally:
        assert core.stop() == 0
    log = core.log()
    assert "cannot frame output" not in log, log
    assert "Traceback" not in log, log


def test_a_body_of_exactly_the_cores_limit_passes_through_a_gateway(tmp_path: Path) -> None:
    """A gateway's session is a channel of its shared link, whose frames lose a margin to the channel: with
    broker.max_message_bytes at 20 MiB, a STOMP body 512 bytes under it was refused ("exceeds the 20970496
    the core's link takes"). The derived link frame leaves room for that margin too."""
    core = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(20 * MIB))
    gateway = start_gateway(
        tmp_path,
        core,
        TRIDENTMQ_STOMP_STOMP_MAX_FRAME_BYTES=str(24 * MIB),
        TRIDENTMQ_STOMP_STOMP_PENDING_BYTES=str(48 * MIB),
    )
    try:
        with Peer(gateway.port) as producer:
            producer.connect()
            send(producer, "limit", b"x" * (20 * MIB), "sent")
            assert producer.expect("RECEIPT").headers["receipt-id"] == "sent"
            send(producer, "limit", b"x" * (20 * MIB + 1), "over")
            error = producer.expect("ERROR")
            assert str(20 * MIB) in error.headers.get("message", "") + error.body.decode(), error
        stop_cleanly(gateway)
    finally:
        assert core.stop() == 0


def test_an_amqp_message_its_core_link_cannot_carry_is_rejected_at_once(tmp_path: Path) -> None:
    """The AMQP gateway takes larger messages than the core: one its core link refuses before sending (over the
    link's body limit) was never settled, since only a confirm from the core settled transfers, and its sender
    waited until some later publish was confirmed."""
    core = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(2 * MIB))
    gateway = start_gateway(tmp_path, core, "amqp", TRIDENTMQ_AMQP_AMQP_MAX_MESSAGE_BYTES=str(40 * MIB))
    try:
        conn = BlockingConnection(f"amqp://127.0.0.1:{gateway.port}", timeout=20)
        try:
            sender = conn.create_sender("too.big")
            with pytest.raises(SendException) as refused:
                sender.send(Message(body=b"x" * (18 * MIB)))  # over the link's frame (16 MiB): never sent
            assert refused.value.state == Disposition.REJECTED
            sender.send(Message(body=b"fits"))  # the link goes on
        finally:
            conn.close()
        stop_cleanly(gateway)
    finally:
        assert core.stop() == 0


def test_a_message_the_core_cannot_take_is_refused_to_its_producer(tmp_path: Path) -> None:
    """A gateway configured to take larger frames than the core: the producer gets an ERROR naming the limit,
    whether the core refuses the body (broker.max_message_bytes) or the gateway's link would (the core's frame)."""
    core = start_core(tmp_path, TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(2 * MIB))
    gateway = start_gateway(
        tmp_path,
        core,
        TRIDENTMQ_STOMP_STOMP_MAX_FRAME_BYTES=str(40 * MIB),
        TRIDENTMQ_STOMP_STOMP_PENDING_BYTES=str(64 * MIB),
    )
    try:
        for size, limit in ((3 * MIB, str(2 * MIB)), (17 * MIB, "the core's link takes")):
            with Peer(gateway.port) as producer:
                producer.connect()
                send(producer, "too.big", b"x" * size, "sent")
                error = producer.expect("ERROR")
                assert limit in error.headers.get("message", "") + error.body.decode(), error
        with Peer(gateway.port) as producer:  # the gateway and its link carry on
            producer.connect()
            send(producer, "fits", b"x" * MIB, "sent")
            assert producer.expect("RECEIPT").headers["receipt-id"] == "sent"
        stop_cleanly(gateway)
    finally:
        assert core.stop() == 0
    assert "Traceback" not in core.log()


def test_a_link_frame_limit_that_cannot_carry_the_largest_message_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as refused:
        start_core(
            tmp_path,
            TRIDENTMQ_CORE_BROKER_MAX_MESSAGE_BYTES=str(32 * MIB),
            TRIDENTMQ_CORE_LINK_MAX_FRAME_BYTES=str(16 * MIB),
        )
    assert "link.max_frame_bytes = 16777216 cannot carry a message of broker.max_message_bytes = 33554432" in str(
        refused.value
    )
    assert "Traceback" not in str(refused.value)
