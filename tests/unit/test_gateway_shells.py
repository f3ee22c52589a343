"""Each gateway's process shell in this process: its listener on a free port takes a real TCP client through to
its protocol session and a real core node, its HTTP server answers /readyz and /metrics with that client
counted, and a stop closes the client's connection (``gateway_harness``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.unit.gateway_harness import WAIT_S, core_settings, running_core

from tridentmq_amqp.server import AmqpGateway
from tridentmq_amqp.settings import AmqpSettings
from tridentmq_amqp.settings import CoreLinkSection as AmqpCore
from tridentmq_amqp.settings import HttpSection as AmqpHttp
from tridentmq_amqp.settings import ListenerSection as AmqpListener
from tridentmq_mqtt.protocol.packets import V311, Connack, Connect, PacketParser, encode
from tridentmq_mqtt.server import MqttGateway
from tridentmq_mqtt.settings import CoreLinkSection as MqttCore
from tridentmq_mqtt.settings import HttpSection as MqttHttp
from tridentmq_mqtt.settings import ListenerSection as MqttListener
from tridentmq_mqtt.settings import MqttSettings
from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_stomp.server import StompGateway
from tridentmq_stomp.settings import CoreLinkSection as StompCore
from tridentmq_stomp.settings import HttpSection as StompHttp
from tridentmq_stomp.settings import ListenerSection as StompListener
from tridentmq_stomp.settings import StompSettings

#: The AMQP protocol header of a client that starts with SASL, and the one of the SASL layer's answer.
SASL_HEADER = b"AMQP\x03\x01\x00\x00"


def stomp(port: int) -> tuple[StompGateway, bytes, Callable[[bytes], bool]]:
    settings = StompSettings(
        listener=StompListener(port=0, websocket_port=-1, tls_port=-1, websocket_tls_port=-1),
        http=StompHttp(port=0),
        core=StompCore(port=port),
    )
    connect = b"CONNECT\naccept-version:1.2\nhost:b\n\n\x00"
    return StompGateway(settings), connect, lambda got: got.startswith(b"CONNECTED\n") and got.endswith(b"\x00")


def mqtt(port: int) -> tuple[MqttGateway, bytes, Callable[[bytes], bool]]:
    settings = MqttSettings(
        listener=MqttListener(port=0, websocket_port=-1, tls_port=-1, websocket_tls_port=-1),
        http=MqttHttp(port=0),
        core=MqttCore(port=port),
    )
    connect = encode(Connect("shell-test", clean_start=True, keep_alive=60), V311)

    def connack(got: bytes) -> bool:
        packets = PacketParser(V311).feed(got)
        return bool(packets) and isinstance(packets[0], Connack) and packets[0].reason_code == 0

    return MqttGateway(settings), connect, connack


def amqp(port: int) -> tuple[AmqpGateway, bytes, Callable[[bytes], bool]]:
    settings = AmqpSettings(
        listener=AmqpListener(port=0, websocket_port=-1, tls_port=-1, websocket_tls_port=-1),
        http=AmqpHttp(port=0),
        core=AmqpCore(port=port),
    )
    # The SASL header is answered with the same header and the mechanisms the gateway offers.
    return AmqpGateway(settings), SASL_HEADER, lambda got: got.startswith(SASL_HEADER) and b"ANONYMOUS" in got


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        response = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def metric(text: str, name: str) -> float:
    """The value of the one sample of ``name`` in a Prometheus text page."""
    [value] = [line.split()[1] for line in text.splitlines() if line.split(" ", 1)[0] == name]
    return float(value)


@pytest.mark.parametrize(("protocol", "make"), [("stomp", stomp), ("mqtt", mqtt), ("amqp", amqp)])
async def test_a_gateway_serves_a_tcp_client_and_reports_it(tmp_path: Path, protocol: str, make: Any) -> None:
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        gateway, hello, answered = make(core.port)
        await gateway.start()
        stopped = False
        try:
            ports = gateway.ports
            assert set(ports) == {protocol, "http"}
            reader, writer = await asyncio.open_connection("127.0.0.1", ports[protocol])
            try:
                writer.write(hello)
                got = b""
                while not answered(got):
                    chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
                    assert chunk, f"the gateway closed the connection after {got!r}"
                    got += chunk
                status, body = await http_get(ports["http"], "/readyz")
                assert status == 200, body
                status, body = await http_get(ports["http"], "/metrics")
                assert status == 200
                metrics = body.decode()
                assert metric(metrics, f"tridentmq_{protocol}_connections") == 1, metrics
                assert metric(metrics, f"tridentmq_{protocol}_connections_total") == 1
                stopped = True
                await gateway.stop()
                # Up to the end of the stream: the stop closed the connection (a timeout fails the test).
                await asyncio.wait_for(reader.read(), WAIT_S)
                assert reader.at_eof()
            finally:
                writer.close()
                await writer.wait_closed()
        finally:
            if not stopped:
                await gateway.stop()
