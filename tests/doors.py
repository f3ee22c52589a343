"""One real round trip through each door of a running node: a message sent and received back by a real client
of that door's protocol (stomp.py, paho-mqtt, python-qpid-proton, the link client), or a request answered on an
HTTP port. Tests that throw bad input at a node use them to show that every door still serves."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import urllib.request
from typing import Any

import aiohttp
import stomp
from proton import Message
from proton.utils import BlockingConnection
from tests.integration.mqtt_clients import Paho

from tridentmq_amqp.protocol.types import Described, ULong, decode, encode
from tridentmq_shared.link.client import LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.message import new_message

WAIT = 10.0
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"


def unique(prefix: str) -> str:
    return f"{prefix}.{os.urandom(4).hex()}"


class _StompListener(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.bodies: list[str] = []
        self.received = threading.Event()

    def on_message(self, frame: Any) -> None:
        self.bodies.append(frame.body)
        self.received.set()


def stomp_round_trip(port: int, *, websocket: bool = False) -> None:
    """stomp.py (over TCP, or WebSocket without a subprotocol as it does) sends a message to itself."""
    hosts = [("127.0.0.1", port)]
    conn = stomp.WSConnection(hosts, ws_path="/stomp") if websocket else stomp.Connection12(hosts)
    listener = _StompListener()
    conn.set_listener("door", listener)
    conn.connect(wait=True)
    try:
        queue = f"/queue/{unique('door')}"
        conn.subscribe(queue, id="door", ack="auto")
        conn.send(queue, "still here")
        assert listener.received.wait(WAIT), "no MESSAGE came back"
        assert listener.bodies == ["still here"]
    finally:
        conn.disconnect()


def mqtt_round_trip(port: int, *, websocket: bool = False) -> None:
    """paho-mqtt (MQTT 5, over TCP or WebSocket) publishes at QoS 1 to its own subscription."""
    client = Paho(port, unique("door"), websocket=websocket)
    client.connect()
    try:
        topic = unique("door").replace(".", "/")
        client.subscribe(topic, 1)
        client.publish(topic, b"still here", 1)
        assert [m.payload for m in client.receive(1)] == [b"still here"]
    finally:
        client.disconnect()


def amqp_round_trip(port: int) -> None:
    """A proton client sends a message and receives it back."""
    address = unique("door")
    conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=WAIT)
    try:
        conn.create_sender(address).send(Message(body="still here"))
        receiver = conn.create_receiver(address)
        assert receiver.receive(timeout=WAIT).body == "still here"
        receiver.accept()
    finally:
        conn.close()


def amqp_frame(code: int, fields: list[Any]) -> bytes:
    body = encode(Described(ULong(code), fields))
    return struct.pack(">IBBH", 8 + len(body), 2, 0, 0) + body


async def _amqp_websocket_exchange(port: int) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(
            f"http://127.0.0.1:{port}/", protocols=("amqp",), timeout=aiohttp.ClientWSTimeout(ws_receive=WAIT)
        ) as ws,
    ):
        await ws.send_bytes(AMQP_HEADER + amqp_frame(0x10, ["door"]))  # OPEN
        received = b""
        codes: list[int] = []
        while 0x18 not in codes:  # the gateway's OPEN, then its answer to our CLOSE
            message = await ws.receive()
            assert message.type is aiohttp.WSMsgType.BINARY, message
            received += message.data
            if received.startswith(AMQP_HEADER):
                received = received[len(AMQP_HEADER) :]
            while len(received) >= 8 and len(received) >= int.from_bytes(received[:4], "big"):
                size = int.from_bytes(received[:4], "big")
                frame, received = received[:size], received[size:]
                if size > 8:
                    value, _ = decode(frame[frame[4] * 4 :])
                    codes.append(int(value.descriptor))
                    if codes == [0x10]:
                        await ws.send_bytes(amqp_frame(0x18, []))  # CLOSE
        assert codes == [0x10, 0x18], codes


def amqp_websocket_round_trip(port: int) -> None:
    """AMQP over WebSocket (no Python AMQP client speaks it): OPEN answered with OPEN, CLOSE with CLOSE."""
    asyncio.run(_amqp_websocket_exchange(port))


async def _link_exchange(port: int) -> None:
    async with LinkClient("127.0.0.1", port, reconnect=ReconnectPolicy(attempts=0)) as client:
        address = unique("door")
        await client.publish(new_message(address, b"still here"))
        consumer = await client.subscribe(address, auto_ack=True)
        delivery = await consumer.get(timeout=WAIT)
        assert delivery is not None
        assert delivery.body == b"still here"


def link_round_trip(port: int) -> None:
    """The link client publishes to the core and consumes the message back."""
    asyncio.run(_link_exchange(port))


def http_round_trip(port: int, path: str = "/healthz") -> None:
    """An HTTP GET answered with 200."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as response:
        assert response.status == 200
