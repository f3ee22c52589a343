"""Each gateway's process shell in this process: its listener on a free port takes a real TCP client through to
its protocol session and a real core node, its HTTP server answers /readyz and /metrics with that client
counted, and a stop closes the client's connection (``gateway_harness``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.unit.gateway_harness import WAIT_S, core_settings, eventually, running_core

from tridentmq_amqp.protocol.types import Described, UByte, UInt, ULong
from tridentmq_amqp.protocol.types import encode as encode_amqp
from tridentmq_amqp.server import AmqpGateway
from tridentmq_amqp.settings import AmqpSettings
from tridentmq_amqp.settings import CoreLinkSection as AmqpCore
from tridentmq_amqp.settings import HttpSection as AmqpHttp
from tridentmq_amqp.settings import ListenerSection as AmqpListener
from tridentmq_mqtt.protocol.packets import (
    V311,
    Connack,
    Connect,
    PacketParser,
    Puback,
    Publish,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)
from tridentmq_mqtt.server import MqttGateway
from tridentmq_mqtt.settings import CoreLinkSection as MqttCore
from tridentmq_mqtt.settings import HttpSection as MqttHttp
from tridentmq_mqtt.settings import ListenerSection as MqttListener
from tridentmq_mqtt.settings import MqttSettings
from tridentmq_shared.core_links import CoreLinkSettings
from tridentmq_shared.turn_pacer import TurnPacer
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


# ------------------------------------------------------------------------------- ended sessions free themselves
async def _mqtt_device(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Connect, subscribe at QoS 1, publish to the subscription at QoS 1 and acknowledge the delivery."""
    parser = PacketParser(V311)
    got: list[Any] = []

    async def next_packet() -> Any:
        while not got:
            chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
            assert chunk, "the gateway closed the connection"
            got.extend(parser.feed(chunk))
        return got.pop(0)

    writer.write(encode(Connect("garbage-test", clean_start=True, keep_alive=0), V311))
    assert isinstance(await next_packet(), Connack)
    writer.write(encode(Subscribe(1, (Subscription("garbage/t", 1),)), V311))
    assert isinstance(await next_packet(), Suback)
    writer.write(encode(Publish("garbage/t", b"m", qos=1, packet_id=2), V311))
    delivered = None
    while delivered is None:
        packet = await next_packet()
        if isinstance(packet, Publish):
            delivered = packet
    assert delivered.packet_id is not None
    writer.write(encode(Puback(delivered.packet_id), V311))


async def _mqtt_unacknowledged(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A will; a delivery left unacknowledged by a subscription that ends before the connection; no DISCONNECT."""
    parser = PacketParser(V311)
    wanted = {Connack: 1, Suback: 1, Publish: 1, Unsuback: 1}
    will = Will("garbage/will", b"gone", qos=1)
    writer.write(encode(Connect("garbage-test", clean_start=True, keep_alive=0, will=will), V311))
    writer.write(encode(Subscribe(1, (Subscription("garbage/t", 1),)), V311))
    writer.write(encode(Publish("garbage/t", b"m", qos=1, packet_id=2), V311))
    while wanted[Publish]:
        chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
        assert chunk, "the gateway closed the connection"
        for packet in parser.feed(chunk):
            wanted[type(packet)] = wanted.get(type(packet), 0) - 1
    writer.write(encode(Unsubscribe(3, ("garbage/t",)), V311))
    while wanted[Unsuback]:
        chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
        assert chunk, "the gateway closed the connection"
        for packet in parser.feed(chunk):
            wanted[type(packet)] = wanted.get(type(packet), 0) - 1


async def _stomp_device(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Connect, subscribe with client acks, send to the subscription and acknowledge the message."""
    writer.write(b"CONNECT\naccept-version:1.2\nhost:b\nheart-beat:0,0\n\n\x00")
    writer.write(b"SUBSCRIBE\nid:0\ndestination:/topic/garbage\nack:client-individual\nreceipt:r\n\n\x00")
    writer.write(b"SEND\ndestination:/topic/garbage\n\nm\x00")
    got = b""
    while b"\x00MESSAGE\n" not in b"\x00" + got or not got.endswith(b"\x00"):
        chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
        assert chunk, f"the gateway closed the connection after {got!r}"
        got += chunk
    ack = got[got.index(b"\nack:") + 5 :].split(b"\n", 1)[0]
    writer.write(b"ACK\nid:" + ack + b"\n\n\x00")


async def _amqp_device(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Open (no SASL), begin and attach a receiver from a topic, with credit."""
    source = Described(ULong(0x28), ["topic://garbage"])
    writer.write(
        b"AMQP\x00\x01\x00\x00"
        + _amqp_frame(0x10, ["garbage-test", "localhost", UInt(65536)])
        + _amqp_frame(0x11, [None, UInt(0), UInt(100), UInt(100)])
        + _amqp_frame(0x12, ["r", UInt(0), True, UByte(0), UByte(0), source, Described(ULong(0x29), [])])
        + _amqp_frame(0x13, [UInt(0), UInt(100), UInt(0), UInt(100), UInt(0), UInt(0), UInt(10)])
    )
    got = b""
    while b"topic://garbage" not in got:  # the gateway's ATTACH names the source: the receiver is attached
        chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
        assert chunk, f"the gateway closed the connection after {got!r}"
        got += chunk


async def _until_closed(reader: asyncio.StreamReader) -> None:
    while await asyncio.wait_for(reader.read(4096), WAIT_S):
        pass


async def _mqtt_violation(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Connect, then a packet of the reserved type 15: the gateway closes the connection."""
    writer.write(encode(Connect("garbage-test", clean_start=True, keep_alive=0), V311) + b"\xf0\x00")
    await _until_closed(reader)


async def _stomp_violation(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Connect, then a header line without a colon: ERROR, and the gateway closes the connection."""
    writer.write(b"CONNECT\naccept-version:1.2\nhost:b\n\n\x00SEND\ndestination\n\nm\x00")
    await _until_closed(reader)


async def _amqp_violation(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Open, then a frame that says it is 4 bytes long (less than its own header): a framing error."""
    writer.write(b"AMQP\x00\x01\x00\x00" + _amqp_frame(0x10, ["garbage-test"]) + struct.pack(">IBBH", 4, 2, 0, 0))
    await _until_closed(reader)


def _amqp_frame(code: int, fields: list[Any]) -> bytes:
    body = encode_amqp(Described(ULong(code), fields))
    return struct.pack(">IBBH", 8 + len(body), 2, 0, 0) + body


class _Recorded(set[Any]):
    """The shell's set of open sessions, keeping a weak reference to each session it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[Any]] = []

    def add(self, session: Any) -> None:
        self.refs.append(weakref.ref(session))
        super().add(session)


@pytest.mark.parametrize(
    ("protocol", "make", "device"),
    [
        ("stomp", stomp, _stomp_device),
        ("mqtt", mqtt, _mqtt_device),
        ("mqtt", mqtt, _mqtt_unacknowledged),
        ("amqp", amqp, _amqp_device),
        ("stomp", stomp, _stomp_violation),
        ("mqtt", mqtt, _mqtt_violation),
        ("amqp", amqp, _amqp_violation),
    ],
)
async def test_an_ended_session_is_freed_without_the_cyclic_collector(
    tmp_path: Path, protocol: str, make: Any, device: Any
) -> None:
    """While a session's parts referred to one another, only a full collection freed what an ended session left,
    and one holds the event loop as long as it takes to look at every object (0.9 s at 19,000 connections):
    19,000 clients leaving at once stopped the gateway's heartbeat to its core for 4 s. The parts let go of one
    another as the session ends, so that refcounting frees it, its link and its consumers as its client leaves."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        gateway, _, _ = make(core.port)
        await gateway.start()
        gateway.shell.sessions = opened = _Recorded()
        gc.collect()  # what the start left (the gateway's first look at the cluster's members, say)
        gc.disable()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.ports[protocol])
            await device(reader, writer)
            writer.close()
            await writer.wait_closed()
            [freed] = opened.refs
            await eventually(lambda: freed() is None, "the session freed")
            await asyncio.sleep(0.1)  # its link's close, answered by the core
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            ours = ("tridentmq_shared", f"tridentmq_{protocol}")  # the gateway's, not the core's in this process
            left = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith(ours)})
            assert not left, f"left to the cyclic collector: {left}"
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
            await gateway.stop()


# ------------------------------------------------------------------------------- clients leaving together
class _WatchedPacer(TurnPacer):
    """The shell's pacer of clients' ends, noting the most that waited for a later turn."""

    def __init__(self, per_turn: int) -> None:
        super().__init__(per_turn, logging.getLogger("tridentmq.gateway"))
        self.most_queued = 0

    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        super().call_soon(callback, *args)
        self.most_queued = max(self.most_queued, self.queued)


async def _mqtt_subscribed(port: int, client_id: str) -> asyncio.StreamWriter:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode(Connect(client_id, clean_start=True, keep_alive=0), V311))
    writer.write(encode(Subscribe(1, (Subscription(f"leave/{client_id}", 1),)), V311))
    parser = PacketParser(V311)
    got: list[Any] = []
    while not any(isinstance(packet, Suback) for packet in got):
        chunk = await asyncio.wait_for(reader.read(4096), WAIT_S)
        assert chunk, "the gateway closed the connection"
        got.extend(parser.feed(chunk))
    return writer


async def test_clients_that_leave_together_all_end_a_turn_s_worth_at_a_time(tmp_path: Path) -> None:
    """15,000 clients that left at once ended in one turn of the gateway's event loop, and their clean-ups
    started in the next: the loop stood still for 0.6 s. Their ends are now handled so many per turn; each
    still ends, and the core lets go of each session's lock and subscription."""
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        gateway, _, _ = mqtt(core.port)
        await gateway.start()
        gateway.shell.departures = pacer = _WatchedPacer(per_turn=1)
        try:
            names = [f"leaver-{i}" for i in range(12)]
            writers = [await _mqtt_subscribed(gateway.ports["mqtt"], name) for name in names]
            broker = core.node.broker

            def held() -> list[str]:
                """What the core holds for the clients: their sessions and queues."""
                sessions = [s.client_name for s in broker.sessions.values() if s.client_name.startswith("mqtt leaver-")]
                return sessions + [name for name in broker.queues if "leaver-" in name]

            assert len(held()) >= 2 * len(names)  # a session and a subscription queue each, at least
            for writer in writers:
                writer.close()
            await eventually(lambda: not gateway.shell.sessions and not held(), "every client's session ended")
            assert pacer.most_queued >= len(names) // 2, "the ends were spread over turns"
        finally:
            await gateway.stop()


async def _stomp_frames(reader: asyncio.StreamReader, want: Callable[[list[bytes]], bool]) -> list[bytes]:
    """Frames (command and headers, body cut off) until ``want`` says enough."""
    frames: list[bytes] = []
    while not want(frames):
        frame = await asyncio.wait_for(reader.readuntil(b"\x00"), WAIT_S)
        frames.append(frame.lstrip(b"\n").split(b"\n\n", 1)[0])
    return frames


async def test_messages_waiting_for_a_client_whose_connection_resets_come_back_unflagged(tmp_path: Path) -> None:
    """A connection's loss is handled at once, unlike an end of stream (paced): its session must know that the
    socket is gone before what waited for the client to read runs, which the loss wakes up. Written into the
    closed socket, a waiting message would count as delivered and come back flagged as redelivered."""
    body = b"x" * (256 * 1024)
    count = 60  # 15 MiB: more than the sockets' buffers hold, so that the last ones wait in the gateway
    async with running_core(core_settings(tmp_path), lambda port: CoreLinkSettings(port=port)) as core:
        gateway = StompGateway(
            StompSettings(
                listener=StompListener(port=0, websocket_port=-1, tls_port=-1, websocket_tls_port=-1),
                http=StompHttp(port=0),
                core=StompCore(port=core.port, consumer_window_bytes=2 * count * len(body)),  # all to the gateway
            )
        )
        await gateway.start()
        try:
            port = gateway.ports["stomp"]
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # what the client's kernel takes
            sock.setblocking(False)  # noqa: FBT003 - the socket module's own signature
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(b"CONNECT\naccept-version:1.2\nhost:b\nheart-beat:0,0\n\n\x00")
            writer.write(b"SUBSCRIBE\nid:0\ndestination:/queue/reset\nack:client\nreceipt:r\n\n\x00")
            await _stomp_frames(reader, lambda frames: any(f.startswith(b"RECEIPT") for f in frames))
            [session] = gateway.shell.sessions
            producer_reader, producer = await asyncio.open_connection("127.0.0.1", port, limit=2 * len(body))
            producer.write(b"CONNECT\naccept-version:1.2\nhost:b\nheart-beat:0,0\n\n\x00")
            for n in range(count):
                producer.write(b"SEND\ndestination:/queue/reset\nreceipt:%d\n\n" % n + body + b"\x00")
            await _stomp_frames(producer_reader, lambda frames: sum(f.startswith(b"RECEIPT") for f in frames) == count)
            # The consumer reads nothing more: the gateway's writes to it pause, and deliveries wait.
            await eventually(lambda: not session.wire.writable(), "the gateway waiting for the client to read")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # a reset: no end of stream first
            await eventually(lambda: session not in gateway.shell.sessions, "the session ended")
            await session.wait_closed()
            producer.write(b"SUBSCRIBE\nid:1\ndestination:/queue/reset\nack:auto\n\n\x00")
            frames = await _stomp_frames(
                producer_reader, lambda frames: sum(f.startswith(b"MESSAGE") for f in frames) == count
            )
            redelivered = [b"\nredelivered:true" in f for f in frames if f.startswith(b"MESSAGE")]
            assert redelivered[-1] is False, "the last message, which never left the gateway, came back flagged"
            producer.close()
        finally:
            await gateway.stop()
