"""The AMQP 1.0 gateway as a real process between python-qpid-proton's own clients and a real core."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from proton import Message
from proton.utils import BlockingConnection
from tests.conftest import CoreProcess, GatewayProcess, start_gateway

pytestmark = pytest.mark.integration

WAIT = 10.0


def url(gateway: GatewayProcess) -> str:
    return f"amqp://127.0.0.1:{gateway.port}"


def connect(gateway: GatewayProcess, **kwargs: object) -> BlockingConnection:
    return BlockingConnection(url(gateway), timeout=WAIT, **kwargs)


def unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def test_hello_world(amqp_gateway: GatewayProcess) -> None:
    queue = unique("hello")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        sender.send(Message(body="Hello World!"))
        receiver = conn.create_receiver(queue)
        message = receiver.receive(timeout=WAIT)
        receiver.accept()
        assert message.body == "Hello World!"
    finally:
        conn.close()


def test_messages_wait_in_the_queue_for_a_later_receiver(amqp_gateway: GatewayProcess) -> None:
    queue = unique("later")
    conn = connect(amqp_gateway)
    try:
        sender = conn.create_sender(queue)
        for i in range(20):
            sender.send(Message(body=f"m{i}", durable=True, properties={"n": i}))
        sender.close()
    finally:
        conn.close()
    conn = connect(amqp_gateway)
    try:
        receiver = conn.create_receiver(queue, credit=5)
        got = []
        for _ in range(20):
            message = receiver.receive(timeout=WAIT)
            got.append((message.body, message.properties["n"], message.durable))
            receiver.accept()
        assert got == [(f"m{i}", i, True) for i in range(20)]
    finally:
        conn.close()


def test_start_gateway_kind(tmp_path: Path, core: CoreProcess) -> None:
    gateway = start_gateway(tmp_path, core, "amqp", name="second")
    try:
        conn = connect(gateway)
        conn.close()
    finally:
        assert gateway.stop() == 0
